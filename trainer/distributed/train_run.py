"""``python -m trainer.train --workers W --shards S``: a batch training run on Ray, from the
command's typed options (:class:`~trainer.train_options.TrainOptions`) to its result."""

from __future__ import annotations

import os
import shutil
import sys

from compression.signal_points import signal_point
from schemas import Schema
from trainer import runs
from trainer.config import ConfigError, TrainConfig
from trainer.distributed.driver import MAX_SHARDS, DistributedTrainer
from trainer.distributed.worker import worker_batch_size
from trainer.train_options import OptionError, TrainOptions


def run_training(options: TrainOptions, schema: Schema, config: TrainConfig, model,
                 staged, settings: dict, resume: dict | None = None,
                 go_on: str = "", tier_dir: str | None = None) -> dict:
    """``python -m trainer.train ... --workers W --shards S [--ray-address ADDR]`` (its
    ``options``): train on Ray, evaluate, checkpoint to ``OUT/checkpoint``; returns the
    result dict train.py prints and writes. ``staged``: the run directory (a
    :class:`compression.cli.StagedOutput`; this writes into ``staged.tmp``, train.py commits
    it).
    As in process: with ``--eval-data`` the model is evaluated after every pass (and every
    ``--eval-every`` steps), training stops after ``--patience`` evaluations without a better
    AUC and ``OUT/checkpoint`` holds the best model. A shard or worker whose process dies is
    restarted by Ray and the run rolls back to its last checkpoint (``OUT/checkpoint`` or,
    while the best one is kept there, ``OUT/rollback``: written before the first step and
    after every pass).

    SIGINT or SIGTERM (``settings``: train.py's, for ``interrupted.json``) stops as in
    process: the pipeline drains, ``OUT/checkpoint`` (and with early stopping ``OUT/latest``)
    and ``OUT/interrupted.json`` (with the fit's state) are written, the run directory is put
    in place and ``trainer.runs.Interrupted`` is raised (exit 130/143; its message ends with
    ``go_on``); a second signal stops at once. ``resume``: that ``interrupted.json`` (checked
    by train.py against this command): the trainer is restored from the interrupted run's
    checkpoint and its fit goes on to the result of an uninterrupted run (the run directory
    ``staged.tmp`` then starts as a copy of the interrupted one).

    Options this cannot run with (workers, shards, a cluster that cannot hold the actors, a
    config the trainer refuses) raise :class:`~trainer.train_options.OptionError` before
    any work."""
    for name in ("workers", "shards"):
        value = getattr(options, name)
        if value < 1:
            raise OptionError(f"--{name}: expected a number >= 1, got {value}")
    if options.shards > MAX_SHARDS:
        raise OptionError(f"--shards {options.shards}: more than {MAX_SHARDS} shards is not "
                          "sensible (each shard is a process holding a part of every table)")
    try:
        if resume is None:
            trainer = DistributedTrainer(schema, model, config, workers=options.workers,
                                         shards=options.shards,
                                         ray_address=options.ray_address, tier_dir=tier_dir)
        else:  # the interrupted run's checkpoint: its step, stores, input positions
            trainer = DistributedTrainer.restore(
                os.path.join(staged.path, resume["checkpoint"]), model,
                workers=options.workers, shards=options.shards,
                ray_address=options.ray_address, tier_dir=tier_dir)
    except (ConnectionError, ValueError, ConfigError) as e:
        raise OptionError(str(e)) from e
    try:
        epochs = options.epochs or (runs.DEFAULT_EPOCHS_WITH_EVAL if options.eval_data
                                    else 1)
        keep_best = bool(options.eval_data) and options.patience > 0
        checkpoint = os.path.join(staged.tmp, "checkpoint")
        rollback = os.path.join(staged.tmp, "rollback") if keep_best else checkpoint
        # a signal from here on finishes the step and writes the checkpoint; before, it ends
        # the command with nothing written (start_ray holds one that comes during ray.init)
        with runs.StopOnSignal() as stop:
            signal_point("run.started")
            history = trainer.fit(options.train_data, epochs=epochs,
                                  progress=not options.no_progress, log_dir=staged.tmp,
                                  eval_data=options.eval_data, eval_every=options.eval_every,
                                  patience=options.patience if keep_best else None,
                                  best_dir=checkpoint if keep_best else None,
                                  checkpoint_dir=rollback,
                                  should_stop=lambda: stop.signum is not None,
                                  resume=None if resume is None else resume["fit"])
            if keep_best:
                shutil.rmtree(rollback, ignore_errors=True)
            if history["interrupted"]:
                raise runs.write_interrupted(
                    trainer, staged, stop.signum,
                    {"settings": settings, "fit": history["fit_state"],
                     "distributed": {"workers": options.workers, "shards": options.shards}},
                    keep_best, history.get("best"), go_on)
            if not keep_best:
                trainer.save(checkpoint)
        if options.export_dir:
            trainer.export(options.export_dir)  # the kept model: fit went back to the best
        stats = trainer.store_stats()
        rows = stats.get("rows", 0)
        if history["samples"] and rows and options.shards > rows:
            print(f"warning: {options.shards} shards for {rows} rows: most shards hold "
                  "nothing; use fewer shards", file=sys.stderr)
        return runs.fit_result(options, config, history, stats, keep_best, epochs, extra={
            "workers": options.workers, "shards": options.shards,
            "worker_batch_size": worker_batch_size(config.batch_size, 0, options.workers),
            "bytes_per_step": history["bytes_per_step"],
            "recoveries": len(history["recoveries"])})
    finally:
        trainer.close()
