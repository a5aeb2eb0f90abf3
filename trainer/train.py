"""The training command: fit a model on tree or raw sample files, evaluate, checkpoint.

    python -m trainer.train --schema schemas/examples/taobao_like.yaml \\
        --train-data 'trees/*.parquet' --eval-data 'test/*.parquet' --model mlp \\
        --compute structured --batch-size 5000 --epochs 1 --out runs/mlp

Shows a progress bar on stderr, writes TensorBoard scalars (loss, AUC, samples/s, store rows,
admitted/rejected/expired) to ``RUN_DIR/train`` and ``RUN_DIR/eval``, the checkpoint to
``RUN_DIR/checkpoint`` and the result to ``RUN_DIR/result.json``, and prints the result as one
JSON line on stdout (``id_compression``: ids the samples hold expanded to the leaves over ids
looked up, i.e. what the tree structure saved the trainer).

Ctrl-C or SIGTERM stops after the current step with the checkpoint and ``RUN_DIR/
interrupted.json`` (the settings and where the fit stopped) in place; the same command plus
``--resume`` continues the run to the result an uninterrupted run has (the same pass order,
evaluations and early-stopping state; exact with the defaults: no dropout, no stale lookups).
With ``--workers``/``--shards`` (Ray) the run directory, a signal and ``--resume`` are handled
alike (the pipeline drains first; resumed with the same ``--workers`` and ``--shards``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import shutil
import signal
import sys
import threading

import compression  # noqa: F401
import schemas
from compression import cli
from trainer.config import ConfigError, TrainConfig

PROG = "python -m trainer.train"
# the built-in models (trainer.models.MODELS, checked by a test): listed here so that --help
# and argument errors do not import TensorFlow
MODEL_NAMES = ("dcn", "deepfm", "din", "esmm", "mlp")


def load_tensorflow(debug: bool = False):
    """Import TensorFlow and Keras without their start-up lines on the console (TensorFlow
    writes its absl lines to file descriptor 2 before any setting reaches them); with
    ``debug`` they are shown. Called after the arguments are parsed."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if "tensorflow" not in sys.modules and not debug:
        with cli.quiet_stderr():
            import keras  # noqa: F401
            import tensorflow  # noqa: F401
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)
    logging.getLogger("tensorflow").setLevel(logging.ERROR)


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
                        "interrupted one is continued with --resume")
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


DEFAULT_EPOCHS_WITH_EVAL = 10
# Evaluations without a better AUC before early stopping. With the rows' L2 the eval AUC keeps
# rising over 5-8 passes in steps of ~0.0005, with dips: on a 10% validation slice of 320k
# generated samples, patience 1 stopped two seeds of three at pass 2 (their eval AUC later
# rose by 0.003); see benchmarks/RESULTS.md ("Learning quality").
DEFAULT_PATIENCE = 3


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
    args = parser.parse_args(argv)
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --out and --overwrite replaces it; pass "
                     "one of them")
    try:
        schema = schemas.load(args.schema)
        config = TrainConfig.load(args.config) if args.config else TrainConfig()
        overrides = {k: v for k, v in (("compute", args.compute), ("batch_size", args.batch_size),
                                       ("seed", args.seed)) if v is not None}
        config = config.replace(**overrides)
        config.check(schema)  # the config against the schema, before TensorFlow is imported
    except (schemas.SchemaError, ConfigError) as e:
        parser.error(str(e))
    model_args = {}
    if args.hidden:
        try:
            model_args["hidden"] = tuple(int(x) for x in args.hidden.split(","))
        except ValueError:
            parser.error(f"--hidden: expected sizes like 200,80, got {args.hidden!r}")
    if args.eval_every and not args.eval_data:
        parser.error("--eval-every needs --eval-data")
    # Every input and the run directory are checked before any work (and before TensorFlow
    # is imported): globs that match nothing, unreadable or empty files, another run.
    train_files = cli.check_inputs(args.train_data, "--train-data")
    eval_files = cli.check_inputs(args.eval_data, "--eval-data") if args.eval_data else []
    inputs = train_files + eval_files
    distributed_run = args.workers > 1 or args.shards > 1 or args.ray_address
    epochs = args.epochs or (DEFAULT_EPOCHS_WITH_EVAL if args.eval_data else 1)
    settings = _settings(args, schema, config, model_args, train_files, eval_files, epochs)
    interrupted = None
    if args.resume:
        cli.check_output(args.out, True, "--out", inputs)
        interrupted = _interrupted_run(args.out, settings, {
            "workers": args.workers, "shards": args.shards} if distributed_run else None)
    else:
        cli.check_output(args.out, args.overwrite, "--out", inputs)
    if args.ray_address:
        # before TensorFlow is imported (~10 s): an address where nothing answers is told now
        from trainer.ray_address import check_ray_address

        try:
            check_ray_address(args.ray_address)
        except (ConnectionError, ValueError) as e:
            parser.error(str(e))
    load_tensorflow(args.debug)
    from trainer import models
    from trainer.trainer import FitState, Trainer

    again = argv if "--resume" in argv else [*argv, "--resume"]
    go_on = ("continue the run where it stopped with the same command plus --resume: "
             f"{PROG} {shlex.join(again)}")
    if distributed_run:
        from trainer import distributed

        # as in process: a failed run leaves no run directory, --overwrite replaces one whole,
        # an interrupted one is put in place with its checkpoint (run_cli raises Interrupted),
        # a resumed one starts as a copy of the interrupted one (which a failure or a second
        # interrupt leaves as it was)
        with cli.StagedOutput(args.out, args.overwrite or args.resume, "--out",
                              inputs) as staged:
            if interrupted is not None:
                _link_tree(staged.path, staged.tmp, skip=("interrupted.json", "latest"))
            result = distributed.run_cli(args, parser, schema, config,
                                         models.MODELS[args.model](**model_args), staged,
                                         settings, resume=interrupted,
                                         go_on=go_on[0].upper() + go_on[1:])
            result = {k: _json_number(v) for k, v in result.items()}
            with open(os.path.join(staged.tmp, "result.json"), "w") as f:
                json.dump(result, f, indent=1)
            staged.commit()
        return result
    try:
        trainer = Trainer(schema, models.MODELS[args.model](**model_args), config)
    except (ConfigError, ValueError) as e:
        parser.error(str(e))
    progress = not args.no_progress
    keep_best = bool(args.eval_data) and args.patience > 0
    # Written through a temporary directory next to --out, renamed into place at the end: a
    # failed run leaves no run directory. The best checkpoint is kept there during training.
    # A resumed run starts that directory as a copy of the interrupted one, so a failure or a
    # second interrupt leaves the interrupted run directory as it was, resumable again.
    with cli.StagedOutput(args.out, args.overwrite or args.resume, "--out", inputs) as staged, \
            _StopOnSignal() as stop:
        run_dir = staged.tmp
        checkpoint = os.path.join(run_dir, "checkpoint")
        resume = None
        if interrupted is not None:
            _link_tree(staged.path, run_dir, skip=("interrupted.json", "latest"))
            trainer.load(os.path.join(staged.path, interrupted["checkpoint"]))
            resume = FitState.from_dict(interrupted["fit"])
        try:
            history = trainer.fit(train_files, epochs=epochs, progress=progress,
                                  log_dir=run_dir, callback=stop.after_step,
                                  eval_data=eval_files or None, eval_every=args.eval_every,
                                  patience=args.patience if keep_best else None,
                                  best_dir=checkpoint if keep_best else None, resume=resume)
        except _Stop as e:
            state = trainer.fit_state
            best = None if state.best is None else state.evaluations[state.best]
            raise _interrupted(
                trainer, staged, e.signum, {"settings": settings, "fit": state.to_dict()},
                keep_best, best,
                f"Score it with python -m trainer.evaluate --run {staged.path} --data DATA; "
                f"{go_on}") from None
        if not keep_best:
            trainer.save(checkpoint)
        result = _result(args, config, trainer, history, keep_best, epochs)
        with open(os.path.join(run_dir, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
        staged.commit()
    return result


class _Stop(Exception):
    """Raised after a training step once SIGINT or SIGTERM arrived."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Interrupted(Exception):
    """Training stopped by a signal; the checkpoint is written. ``exit_code`` 130 or 143."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class _StopOnSignal:
    """While active, SIGINT and SIGTERM ask training to stop after the current step
    (:meth:`after_step` is ``fit``'s callback); a second signal stops at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt  # the second signal: stop now, no checkpoint
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: finishing the current step, then writing a "
              "checkpoint (send it again to stop at once)", file=sys.stderr, flush=True)

    def after_step(self, *_):
        if self.signum is not None:
            raise _Stop(self.signum)


def _interrupted(trainer, staged, signum: int, state: dict, keep_best: bool,
                 best: dict | None, go_on: str) -> Interrupted:
    """Write the checkpoint and the state of an interrupted run (in process or distributed:
    ``trainer`` has ``save``, ``step`` and ``samples``), put the run directory in place.

    ``RUN_DIR/checkpoint`` is the model to score: where training stopped, or with early
    stopping the best evaluation so far (``best``; then where training stopped goes to
    ``RUN_DIR/latest``). ``RUN_DIR/interrupted.json`` holds the signal, the step and ``state``
    (the run's settings and where the fit stopped, :class:`trainer.trainer.FitState`, for
    ``--resume``; on Ray also the workers and shards). ``go_on`` ends the message: how to go
    on from here."""
    name = signal.Signals(signum).name
    checkpoint = os.path.join(staged.tmp, "checkpoint")
    latest = "latest" if keep_best else "checkpoint"
    trainer.save(os.path.join(staged.tmp, latest))
    if not os.path.isdir(checkpoint):  # no evaluation yet: the model to score is the latest
        trainer.save(checkpoint)
    state = {"signal": name, "step": trainer.step, "samples": trainer.samples,
             "checkpoint": latest, **state}
    with open(os.path.join(staged.tmp, "interrupted.json"), "w") as f:
        json.dump(state, f, indent=1, default=float)
    run_dir = staged.commit()
    checkpoint = os.path.join(run_dir, "checkpoint")
    kept = ""
    if keep_best and best is not None:
        kept = (f" (the best evaluation so far, AUC {_format_auc(_json_number(best['auc']))}"
                f" at step {best['step']:,}; where training stopped is in "
                f"{os.path.join(run_dir, 'latest')})")
    return Interrupted(
        f"{name}: stopped after step {trainer.step:,} ({trainer.samples:,} samples); "
        f"checkpoint written to {checkpoint}{kept}. {go_on}", 128 + signum)


def _settings(args, schema, config, model_args: dict, train_files: list, eval_files: list,
              epochs: int) -> dict:
    """What decides a run's result, as JSON: a resumed run must have the same."""
    def files(paths):
        return [[os.path.abspath(p), os.path.getsize(p)] for p in paths]

    settings = {"schema": schema.to_dict(), "config": config.to_dict(), "model": args.model,
                "model_args": model_args, "train_data": files(train_files),
                "eval_data": files(eval_files), "epochs": epochs,
                "patience": args.patience if eval_files else None,
                "eval_every": args.eval_every}
    return json.loads(json.dumps(settings, default=float))  # tuples as lists, as stored


_SETTING_NAMES = {"schema": "--schema", "config": "--config (or --compute, --batch-size, "
                  "--seed)", "model": "--model", "model_args": "--hidden",
                  "train_data": "--train-data", "eval_data": "--eval-data",
                  "epochs": "--epochs", "patience": "--patience", "eval_every": "--eval-every"}


def _ray_setting(distributed: dict | None) -> str:
    return ("in process" if distributed is None else
            f"--workers {distributed['workers']} --shards {distributed['shards']}")


def _interrupted_run(out: str, settings: dict, distributed: dict | None = None) -> dict:
    """The state of the interrupted run in ``out`` if this command continues it; otherwise a
    :class:`cli.UsageError` that says why not. ``distributed``: this command's workers and
    shards on Ray (None: in process); a run resumes with the same."""
    path = os.path.join(out, "interrupted.json")
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(out, "result.json")):
            raise cli.UsageError(
                f"--out {out}: the run there finished (result.json, no interrupted.json); "
                "--resume continues an interrupted run only. Start a new run in another "
                "directory, or replace this one with --overwrite")
        raise cli.UsageError(f"--out {out}: no interrupted run to resume (no interrupted.json "
                             "in it); run without --resume to start one")
    try:
        with open(path) as f:
            state = json.load(f)
        stored = state["settings"]
        # written by a version with --resume (of Ray runs too)
        state["fit"]["epoch"], state["checkpoint"]  # noqa: B018
        ray_run = state.get("distributed")
        ray_run = None if ray_run is None else {"workers": int(ray_run["workers"]),
                                                 "shards": int(ray_run["shards"])}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise cli.UsageError(f"{path}: not the state of a resumable run (written by an older "
                             "version, or damaged); start a new run with --overwrite") from None
    differ = [key for key in _SETTING_NAMES if stored.get(key) != settings.get(key)]
    if differ or ray_run != distributed:
        details = []
        if ray_run != distributed:
            details.append(f"--workers/--shards: {_ray_setting(ray_run)} then, "
                           f"{_ray_setting(distributed)} now")
        for key in differ:
            if key in ("train_data", "eval_data", "epochs", "patience", "eval_every", "model",
                       "model_args"):
                details.append(f"{_SETTING_NAMES[key]} {_shown(stored.get(key))} then, "
                               f"{_shown(settings.get(key))} now")
            else:
                details.append(f"{_SETTING_NAMES[key]} differs")
        raise cli.UsageError(
            f"--out {out}: this command is not the interrupted run's: {'; '.join(details)}. "
            "Resume with the same arguments plus --resume (the files unchanged), or start a "
            "new run in another directory")
    return state


def _shown(value) -> str:
    if isinstance(value, list) and value and isinstance(value[0], list):  # [[path, bytes]...]
        return "[" + ", ".join(f"{os.path.basename(p)} ({n:,} bytes)" for p, n in value) + "]"
    return json.dumps(value)


def _link_tree(source: str, target: str, skip=()) -> None:
    """Fill the empty directory ``target`` with the contents of ``source`` as hard links
    (copies where the file system has none). Safe because nothing in a run directory is
    rewritten in place: checkpoints are replaced whole, event and JSON files are new files."""
    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    for name in os.listdir(source):
        if name in skip:
            continue
        src, dst = os.path.join(source, name), os.path.join(target, name)
        if os.path.isdir(src):
            shutil.copytree(src, dst, copy_function=link)
        else:
            link(src, dst)


def _result(args, config, trainer, history, keep_best: bool, epochs: int) -> dict:
    stats = trainer.store_stats()
    result = {"samples": history["samples"], "samples_per_sec": history["samples_per_sec"],
              "steps": history["steps"], "train_seconds": history["seconds"],
              "train_auc": history["train_auc"], "loss": history["loss"],
              "id_compression": history["id_compression"]}
    if args.eval_data:
        evaluations = history["evaluations"]
        # the checkpoint's model: the best evaluation, or the last one with --patience 0
        evaluation = history["best"] if keep_best else evaluations[-1]
        result.update(auc=evaluation["auc"], logloss=evaluation["logloss"],
                      eval_samples=evaluation["samples"], checkpoint_epoch=evaluation["epoch"],
                      checkpoint_step=evaluation["step"],
                      stopped_early=history["stopped_early"],
                      evaluations=[{k: _json_number(e[k]) for k in ("epoch", "step", "auc",
                                                                    "logloss")}
                                   for e in evaluations])
        result.update({k: v for k, v in evaluation.items() if k.startswith(("auc/", "logloss/"))})
    else:
        result.update(auc=None, logloss=None, eval_samples=0)
    result.update(store_rows=stats.get("rows", 0), admitted=stats.get("admitted", 0),
                  rejected=stats.get("rejected", 0), expired=stats.get("expired", 0),
                  model=args.model, compute=config.compute, batch_size=config.batch_size,
                  epochs=epochs, run_dir=os.path.abspath(args.out))
    return {k: _json_number(v) for k, v in result.items()}


def _json_number(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _format_auc(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def main(argv=None) -> int:
    return cli.run_command(PROG, _main, argv)


def _main(argv) -> int:
    try:
        result = run(argv)
    except Interrupted as e:
        print(str(e), file=sys.stderr, flush=True)
        return e.exit_code
    if result["eval_samples"]:  # an AUC is None (n/a) when the labels hold one class only
        auc = (f"eval AUC {_format_auc(result['auc'])} (epoch {result['checkpoint_epoch']}, "
               "kept)")
    else:
        auc = f"train AUC {_format_auc(result['train_auc'])}"
    print(f"{auc} | "
          f"{result['samples_per_sec']:,.0f} samples/s | {result['id_compression']:.2f}x fewer "
          f"ids looked up than flat samples hold | {result['store_rows']:,} store rows",
          file=sys.stderr, flush=True)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    # run as the module trainer.train, not as its copy named __main__: trainer.distributed
    # raises this module's Interrupted, which _main must recognise
    from trainer.train import main as _module_main

    sys.exit(_module_main())
