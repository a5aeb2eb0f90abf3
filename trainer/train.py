"""The training command: fit a model on tree or raw sample files, evaluate, checkpoint.

    python -m trainer.train --schema schemas/examples/taobao_like.yaml \\
        --train-data 'trees/*.parquet' --eval-data 'test/*.parquet' --model mlp \\
        --compute structured --batch-size 5000 --epochs 1 --out runs/mlp

Shows a progress bar on stderr, writes TensorBoard scalars (loss, AUC, samples/s, store rows,
admitted/rejected/expired) to ``RUN_DIR/train`` and ``RUN_DIR/eval``, the checkpoint to
``RUN_DIR/checkpoint`` (with ``--export-dir``, a serving export of the kept model too) and the
result to ``RUN_DIR/result.json``, and prints the result as one
JSON line on stdout (``id_compression``: ids the samples hold expanded to the leaves over ids
looked up, i.e. what the tree structure saved the trainer).

Ctrl-C or SIGTERM stops after the current step with the checkpoint and ``RUN_DIR/
interrupted.json`` (the settings and where the fit stopped) in place; the same command plus
``--resume`` continues the run to the result an uninterrupted run has (the same pass order,
evaluations and early-stopping state; exact with the defaults: no dropout, no stale lookups).
With ``--workers``/``--shards`` (Ray) the run directory, a signal and ``--resume`` are handled
alike (the pipeline drains first; resumed with the same ``--workers`` and ``--shards``). A
signal before the first step (inputs checked, TensorFlow loaded, Ray and its actors started)
ends the command with 130/143 and no run directory (a ``--resume``: the interrupted one as it
was).

``--out`` may be on an object store (``s3://bucket/runs/mlp``): the run then works in a local
temporary directory (a ``--resume`` first downloads the published run into it), and at the end,
or on an interrupt, that directory is published to ``--out`` all or nothing
(:func:`compression.fs.publish_directory`: its files under a hidden generation, the manifest
written last). A failed run publishes nothing; what was published before stays as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile

import compression  # noqa: F401
import schemas
from compression import cli, fs
from compression.signal_points import signal_point
from trainer import tiers
from trainer.config import EXPORT_FORMATS, ConfigError, TrainConfig
from trainer.runs import (DEFAULT_EPOCHS_WITH_EVAL, DEFAULT_PATIENCE, MODEL_NAMES, Interrupted,
                          StopOnSignal, check_export_dir, fit_result, interrupted_run, link_tree,
                          load_tensorflow, result_line, run_settings, write_interrupted)
from trainer.train_options import OptionError, TrainOptions

PROG = "python -m trainer.train"
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=cli.epilog(
            f"{PROG} --schema schemas/examples/taobao_like.yaml --train-data 'trees/*.parquet' "
            "--eval-data test.parquet --out runs/mlp",
            f"{PROG} ... --out runs/mlp --resume    # continue an interrupted run",
            "Ctrl-C (SIGINT) or SIGTERM: the current step finishes, RUN_DIR/checkpoint and "
            "RUN_DIR/interrupted.json are written, exit 130/143; the same command plus "
            "--resume continues the run exactly where it stopped"))
    p.add_argument("--schema", required=True, help="schema YAML file")
    p.add_argument("--train-data", required=True,
                   help="training files: tree Parquet or raw Parquet/CSV/JSON lines; a path, "
                        "directory or glob")
    p.add_argument("--eval-data", help="evaluation files, same kinds as --train-data")
    p.add_argument("--config", help="TrainConfig YAML (see trainer/examples/mlp.yaml)")
    p.add_argument("--model", choices=MODEL_NAMES, default="mlp",
                   help="the dense network (default mlp, the paper's 200-80-1)")
    p.add_argument("--hidden", help="hidden layer sizes, e.g. 200,80 (default: the model's)")
    p.add_argument("--compute", choices=["structured", "flat"],
                   help="overrides the config's compute mode")
    p.add_argument("--batch-size", type=int, help="overrides the config's batch_size")
    p.add_argument("--epochs", type=_positive, default=None,
                   help="passes over the training data at most; default 1, or with --eval-data "
                        f"{DEFAULT_EPOCHS_WITH_EVAL}: the model is evaluated after every pass "
                        "and training stops once the eval AUC has not improved for --patience "
                        "evaluations (the dense network trains in the first pass, the rows in "
                        "every pass)")
    p.add_argument("--patience", type=_non_negative, default=DEFAULT_PATIENCE,
                   help="with --eval-data: evaluations without a better AUC before training "
                        f"stops and the best checkpoint is kept (default {DEFAULT_PATIENCE}; 0 "
                        "trains every epoch and keeps the last model)")
    p.add_argument("--eval-every", type=_positive, default=None, metavar="STEPS",
                   help="with --eval-data: also evaluate every STEPS steps")
    p.add_argument("--seed", type=int, help="overrides the config's seed")
    p.add_argument("--out", required=True,
                   help="run directory; written through a temporary directory next to it and "
                        "renamed into place at the end (or on an interrupt, with the "
                        "checkpoint); a directory holding another run is refused, an "
                        "interrupted one is continued with --resume. On an object store "
                        "(s3://...): a local working directory published there by a "
                        "manifest at the end or on an interrupt")
    p.add_argument("--export-dir", metavar="DIR",
                   help="also write a serving export of the kept model here at the end "
                        "(SavedModel + embedding snapshots: trainer.serving.Predictor reads "
                        "it); a directory holding an export is replaced atomically")
    p.add_argument("--export-format", choices=EXPORT_FORMATS, default=None,
                   help="how --export-dir writes every embedding table (overrides the "
                        "config's per-table export_format): float32 (default: the stores' "
                        "own files), float16, int8 or int4 (a scale and a bias a row); "
                        "training stays float32, the served rows stay quantized (README, "
                        "\"Smaller exports\")")
    cli.add_overwrite_flag(p, "the run directory")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in --out (same arguments otherwise): "
                        "it ends with the same result as a run that was never interrupted")
    cli.add_debug_flag(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--workers", type=_positive, default=1,
                   help="data-parallel workers on Ray (default 1: in process, no Ray)")
    p.add_argument("--shards", type=_positive, default=1,
                   help="embedding store shards on Ray (default 1: in process, no Ray)")
    p.add_argument("--ray-address", metavar="HOST:PORT",
                   help="a running Ray cluster's head (default with --workers/--shards: a local "
                        "cluster started and stopped by this run)")
    return p


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    return 0 if text.strip() == "0" else _positive(text)


def run(argv=None) -> dict:
    parser = _parser()
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    options = TrainOptions.from_parsed(vars(parser.parse_args(argv)))
    if options.resume and options.overwrite:
        parser.error("--resume continues the run in --out and --overwrite replaces it; pass "
                     "one of them")
    signal_point("args.parsed")
    if not fs.is_local(options.out):
        return _run_with_out_on_store(argv, options)
    try:
        schema = schemas.load(options.schema)
        config = TrainConfig.load(options.config) if options.config else TrainConfig()
        overrides = {k: v for k, v in (("compute", options.compute),
                                       ("batch_size", options.batch_size),
                                       ("seed", options.seed)) if v is not None}
        config = config.replace(**overrides).with_export_format(options.export_format)
        tables = config.check(schema)  # against the schema, before TensorFlow is imported
        if options.distributed:  # each store shard its share of a table's budget
            config.table_budgets(tables, options.shards)
        if config.tier_dir is not None:
            tiers.check_tier_dir(config.tier_dir, "tier_dir")
    except (schemas.SchemaError, ConfigError, tiers.BudgetError) as e:
        parser.error(str(e))
    # Budgeted tables keep their rows beyond memory in tier_dir, by default in a directory
    # next to the run directory (same disk), removed when the command ends.
    tier_dir = None
    if config.budgeted and config.tier_dir is None:
        parent, name = os.path.split(os.path.abspath(options.out))
        try:
            tier_dir = tiers.temporary_tier_dir(parent, prefix=f".{name}.tiers-")
        except tiers.BudgetError as e:
            parser.error(f"{e}; set tier_dir in the config")
    try:
        return _run(parser, argv, options, schema, config, tier_dir)
    finally:
        if tier_dir is not None:
            shutil.rmtree(tier_dir, ignore_errors=True)


def _run(parser, argv, options, schema, config, tier_dir) -> dict:
    model_args = {}
    if options.hidden:
        try:
            model_args["hidden"] = tuple(int(x) for x in options.hidden.split(","))
        except ValueError:
            parser.error(f"--hidden: expected sizes like 200,80, got {options.hidden!r}")
    if options.eval_every and not options.eval_data:
        parser.error("--eval-every needs --eval-data")
    # Every input and the run directory are checked before any work (and before TensorFlow
    # is imported): globs that match nothing, unreadable or empty files, another run.
    train_files = cli.check_inputs(options.train_data, "--train-data")
    eval_files = (cli.check_inputs(options.eval_data, "--eval-data") if options.eval_data
                  else [])
    inputs = train_files + eval_files
    distributed_run = options.distributed
    epochs = options.epochs or (DEFAULT_EPOCHS_WITH_EVAL if options.eval_data else 1)
    settings = run_settings(options, schema, config, model_args, train_files, eval_files,
                            epochs)
    interrupted = None
    if options.resume:
        cli.check_output(options.out, True, "--out", inputs)
        interrupted = interrupted_run(options.out, settings, {
            "workers": options.workers, "shards": options.shards} if distributed_run else None)
    else:
        cli.check_output(options.out, options.overwrite, "--out", inputs)
    if options.export_dir:
        check_export_dir(options.export_dir, options.out, inputs)
    if options.ray_address:
        # before TensorFlow is imported (~10 s): an address where nothing answers is told now
        from trainer.ray_address import check_ray_address

        try:
            check_ray_address(options.ray_address)
        except (ConnectionError, ValueError) as e:
            parser.error(str(e))
    signal_point("config.loaded")
    load_tensorflow(options.debug)
    from trainer import models
    from trainer.fitting import FitState
    from trainer.trainer import Trainer

    signal_point("tensorflow.loaded")

    again = argv if "--resume" in argv else [*argv, "--resume"]
    go_on = ("continue the run where it stopped with the same command plus --resume: "
             f"{PROG} {shlex.join(again)}")
    if distributed_run:
        from trainer.distributed.train_run import run_training

        # as in process: a failed run leaves no run directory, --overwrite replaces one whole,
        # an interrupted one is put in place with its checkpoint (it raises Interrupted),
        # a resumed one starts as a copy of the interrupted one (which a failure or a second
        # interrupt leaves as it was)
        with cli.StagedOutput(options.out, options.overwrite or options.resume, "--out",
                              inputs) as staged:
            if interrupted is not None:
                link_tree(staged.path, staged.tmp, skip=("interrupted.json", "latest"))
            try:
                result = run_training(options, schema, config,
                                      models.MODELS[options.model](**model_args), staged,
                                      settings, resume=interrupted,
                                      go_on=go_on[0].upper() + go_on[1:], tier_dir=tier_dir)
            except OptionError as e:
                parser.error(str(e))
            with open(os.path.join(staged.tmp, "result.json"), "w") as f:
                json.dump(result, f, indent=1)
            staged.commit()
        return result
    try:
        trainer = Trainer(schema, models.MODELS[options.model](**model_args), config,
                          tier_dir=tier_dir)
    except (ConfigError, ValueError) as e:
        parser.error(str(e))
    progress = not options.no_progress
    keep_best = bool(options.eval_data) and options.patience > 0
    # Written through a temporary directory next to --out, renamed into place at the end: a
    # failed run leaves no run directory. The best checkpoint is kept there during training.
    # A resumed run starts that directory as a copy of the interrupted one, so a failure or a
    # second interrupt leaves the interrupted run directory as it was, resumable again.
    with cli.StagedOutput(options.out, options.overwrite or options.resume, "--out",
                          inputs) as staged, StopOnSignal() as stop:
        run_dir = staged.tmp
        checkpoint = os.path.join(run_dir, "checkpoint")
        resume = None
        if interrupted is not None:
            link_tree(staged.path, run_dir, skip=("interrupted.json", "latest"))
            trainer.load(os.path.join(staged.path, interrupted["checkpoint"]))
            resume = FitState.from_dict(interrupted["fit"])
        signal_point("run.started")
        history = trainer.fit(train_files, epochs=epochs, progress=progress,
                              log_dir=run_dir, should_stop=lambda: stop.signum is not None,
                              eval_data=eval_files or None, eval_every=options.eval_every,
                              patience=options.patience if keep_best else None,
                              best_dir=checkpoint if keep_best else None, resume=resume)
        if history["interrupted"]:
            raise write_interrupted(
                trainer, staged, stop.signum, {"settings": settings,
                                               "fit": trainer.fit_state.to_dict()},
                keep_best, history.get("best"),
                f"Score it with python -m trainer.evaluate --run {staged.path} --data DATA; "
                f"{go_on}") from None
        if not keep_best:
            trainer.save(checkpoint)
        if options.export_dir:
            trainer.export(options.export_dir)  # the kept model: fit went back to the best
        result = fit_result(options, config, history, trainer.store_stats(), keep_best, epochs)
        with open(os.path.join(run_dir, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
        staged.commit()
    return result


def _run_with_out_on_store(argv: list[str], options: TrainOptions) -> dict:
    """The run with ``--out`` on an object store: in a local working directory (the published
    run downloaded into it for ``--resume``), published to ``--out`` at the end or on an
    interrupt. Messages name ``--out``, never the working directory."""
    out = options.out.rstrip("/")
    inputs = [*options.train_data, *(options.eval_data or [])]
    if options.export_dir:
        check_export_dir(options.export_dir, out, [])
    if options.resume:
        if fs.published_manifest(out) is None:
            fs.check_bucket(out)
            raise cli.UsageError(f"--out {options.out}: no interrupted run to resume (nothing "
                                 "published there); run without --resume to start one")
    else:  # the bucket, the output policy and the inputs, before any work
        fs.StagedObjectOutput(out, options.overwrite, "--out", inputs)
    work = tempfile.mkdtemp(prefix="prefixrec-run-")
    local = os.path.join(work, "run")
    try:
        if options.resume:
            fs.download_published(out, local)
        local_argv, i = [], 0
        while i < len(argv):  # --out URI -> --out LOCAL; --overwrite: the local one is new
            if argv[i] == "--out":
                local_argv += ["--out", local]
                i += 2
                continue
            if argv[i].startswith("--out="):
                local_argv.append(f"--out={local}")
            elif argv[i] != "--overwrite":
                local_argv.append(argv[i])
            i += 1
        try:
            result = run(local_argv)
        except Interrupted as e:
            fs.publish_directory(local, out, flag="--out")
            e.args = (str(e).replace(local, out),)
            raise
        except cli.UsageError as e:
            e.args = (str(e).replace(local, out),)
            raise
        if "run_dir" in result:
            result["run_dir"] = out
        fs.publish_directory(local, out, flag="--out")
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    return cli.run_command(PROG, _main, argv)


def _main(argv) -> int:
    try:
        result = run(argv)
    except Interrupted as e:
        print(str(e), file=sys.stderr, flush=True)
        return e.exit_code
    print(result_line(result), file=sys.stderr, flush=True)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
