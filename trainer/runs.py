"""What the trainer's commands share, so that no command imports another: the built-in model
names, loading TensorFlow quietly, stopping on a signal (:class:`StopOnSignal`,
:class:`Interrupted`) and holding one during start-up steps that must not be cut short
(:func:`signals_held`), the files of an interrupted run and ``--resume`` (``interrupted.json``,
the run's settings), and the result dict and line of a training run (in process or on Ray).

Imports neither TensorFlow nor Ray: ``--help`` and argument errors stay fast.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import sys
import threading

from compression import cli, fs

# the built-in models (trainer.models.MODELS, checked by a test): listed here so that --help
# and argument errors do not import TensorFlow
MODEL_NAMES = ("dcn", "deepfm", "dien", "din", "esmm", "mlp")


def load_tensorflow(debug: bool = False):
    """Import TensorFlow and Keras without their start-up lines on the console (TensorFlow
    writes its absl lines to file descriptor 2 before any setting reaches them); with
    ``debug`` they are shown. Called after the arguments are parsed."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # A signal is held until the import is done: a KeyboardInterrupt raised inside it leaves
    # TensorFlow half imported, and when it lands in code TensorFlow's extension runs through
    # PyRun_String, Python ends the process by SIGINT at exit whatever the command returned
    # (trainer.serve stopped during start-up then exited -2 instead of 0).
    with signals_held(), (contextlib.nullcontext() if debug or "tensorflow" in sys.modules
                          else cli.quiet_stderr()):
        import keras  # noqa: F401
        import tensorflow  # noqa: F401
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)
    logging.getLogger("tensorflow").setLevel(logging.ERROR)


DEFAULT_EPOCHS_WITH_EVAL = 10
# Evaluations without a better AUC before early stopping. With the rows' L2 the eval AUC keeps
# rising over 5-8 passes in steps of ~0.0005, with dips: on a 10% validation slice of 320k
# generated samples, patience 1 stopped two seeds of three at pass 2 (their eval AUC later
# rose by 0.003); see benchmarks/RESULTS.md ("Learning quality").
DEFAULT_PATIENCE = 3


class Interrupted(Exception):
    """Training stopped by a signal; the checkpoint is written. ``exit_code`` 130 or 143."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class StopOnSignal:
    """While active, SIGINT and SIGTERM ask training to stop after the current step
    (``fit(should_stop=lambda: stop.signum is not None)``); a second signal stops at once."""

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
        if self.signum is not None:  # the second signal: stop now, no checkpoint
            raise cli.Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: finishing the current step, then writing a "
              "checkpoint (send it again to stop at once)", file=sys.stderr, flush=True)


@contextlib.contextmanager
def signals_held():
    """SIGINT and SIGTERM that arrive in the block are held and delivered, when it ends (by an
    exception too), to the handlers in place then: for start-up steps that must not be cut
    short (TensorFlow's import; ``ray.init``, whose cluster, half started, is one its own
    shutdown does not know whole). A signal that is ignored stays ignored. In the main thread
    only, the one that runs Python's signal handlers; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []

    def hold(signum, frame):
        if signum not in held:
            held.append(signum)

    previous = {}
    for signum in StopOnSignal.SIGNALS:
        handler = signal.getsignal(signum)
        if handler is not None and handler is not signal.SIG_IGN:  # None: set outside Python
            previous[signum] = signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in held:
            signal.raise_signal(signum)  # its handler runs now, in this thread


def write_interrupted(trainer, staged, signum: int, state: dict, keep_best: bool,
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
        kept = (f" (the best evaluation so far, AUC {format_auc(json_number(best['auc']))}"
                f" at step {best['step']:,}; where training stopped is in "
                f"{os.path.join(run_dir, 'latest')})")
    return Interrupted(
        f"{name}: stopped after step {trainer.step:,} ({trainer.samples:,} samples); "
        f"checkpoint written to {checkpoint}{kept}. {go_on}", 128 + signum)


def run_settings(args, schema, config, model_args: dict, train_files: list, eval_files: list,
              epochs: int) -> dict:
    """What decides a run's result, as JSON: a resumed run must have the same."""
    def files(paths):
        return [[os.path.abspath(p) if fs.is_local(p) else p, fs.size(p)] for p in paths]

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


def interrupted_run(out: str, settings: dict, distributed: dict | None = None) -> dict:
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


def link_tree(source: str, target: str, skip=()) -> None:
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


def fit_result(args, config, history: dict, stats: dict, keep_best: bool, epochs: int,
               extra: dict | None = None) -> dict:
    """The result of ``trainer.train`` (in process or on Ray), as written to ``result.json``
    and printed: the fit's ``history``, the stores' ``stats``, the kept evaluation and the
    settings; ``extra`` (Ray: workers, shards, bytes per step, recoveries) after the fit's
    numbers. Non-finite floats become None (JSON has no NaN)."""
    result = {"samples": history["samples"], "samples_per_sec": history["samples_per_sec"],
              "steps": history["steps"], "train_seconds": history["seconds"],
              "train_auc": history["train_auc"], "loss": history["loss"],
              "id_compression": history["id_compression"], **(extra or {})}
    if args.eval_data:
        evaluations = history["evaluations"]
        # the checkpoint's model: the best evaluation, or the last one with --patience 0
        evaluation = history["best"] if keep_best else evaluations[-1]
        result.update(auc=evaluation["auc"], logloss=evaluation["logloss"],
                      eval_samples=evaluation["samples"], checkpoint_epoch=evaluation["epoch"],
                      checkpoint_step=evaluation["step"],
                      stopped_early=history["stopped_early"],
                      evaluations=[{k: json_number(e[k]) for k in ("epoch", "step", "auc",
                                                                   "logloss")}
                                   for e in evaluations])
        result.update({k: v for k, v in evaluation.items() if k.startswith(("auc/", "logloss/"))})
    else:
        result.update(auc=None, logloss=None, eval_samples=0)
    result.update(store_rows=stats.get("rows", 0), admitted=stats.get("admitted", 0),
                  rejected=stats.get("rejected", 0), expired=stats.get("expired", 0),
                  model=args.model, compute=config.compute, batch_size=config.batch_size,
                  epochs=epochs, run_dir=os.path.abspath(args.out))
    if "tiers" in stats:  # tables with a memory budget: where their rows are, per table
        result["tiers"] = stats["tiers"]
    if getattr(args, "export_dir", None):
        result["export_dir"] = (os.path.abspath(args.export_dir)
                                if fs.is_local(args.export_dir) else args.export_dir)
    return {k: json_number(v) for k, v in result.items()}


def check_export_dir(export_dir: str, out: str, inputs) -> None:
    """``--export-dir``, before any work: missing, empty or an export (replaced whole at the
    end), and neither inside the run directory nor holding it or an input."""
    from compression.cli import UsageError

    if not fs.is_local(export_dir):
        _check_remote_export_dir(export_dir, out, inputs)
        return
    real, run = os.path.realpath(export_dir), os.path.realpath(out)
    for other, what in ((run, f"the run directory {out}"),
                        *((os.path.realpath(i), f"the input {i}") for i in inputs)):
        if real == other or real.startswith(other.rstrip(os.sep) + os.sep) or \
                other.startswith(real.rstrip(os.sep) + os.sep):
            raise UsageError(f"--export-dir {export_dir}: overlaps {what}; choose a directory "
                             "of its own")
    if os.path.lexists(export_dir) and not os.path.isdir(export_dir):
        raise UsageError(f"--export-dir {export_dir}: exists and is not a directory")
    if os.path.isdir(export_dir) and os.listdir(export_dir) and \
            not os.path.isfile(os.path.join(export_dir, "export.json")):
        raise UsageError(f"--export-dir {export_dir}: holds something other than an export "
                         "(no export.json); choose an empty or new directory")


def _check_remote_export_dir(export_dir: str, out: str, inputs) -> None:
    """``check_export_dir`` for an object-store directory: empty (leftovers of writers that
    died aside) or a published export (``_MANIFEST.json`` naming export.json)."""
    from compression.cli import UsageError

    base = export_dir.rstrip("/")
    for other, what in ((out, f"the run directory {out}"),
                        *((i, f"the input {i}") for i in inputs)):
        other = os.fspath(other).rstrip("/")
        if base == other or base.startswith(other + "/") or other.startswith(base + "/"):
            raise UsageError(f"--export-dir {export_dir}: overlaps {what}; choose a directory "
                             "of its own")
    fs.check_bucket(base)
    manifest = fs.published_manifest(base)
    if manifest is not None and "export.json" in manifest["files"]:
        return
    kept = [f for f in fs.list_files(base)
            if not f[len(base) + 1:].startswith(fs.GENERATION_PREFIX)]
    if kept:
        raise UsageError(f"--export-dir {export_dir}: holds something other than an export "
                         "(no _MANIFEST.json naming export.json); choose an empty or new "
                         "directory")


def result_line(result: dict) -> str:
    """The human summary of a training result (stderr), e.g. ``eval AUC 0.6758 (epoch 4, kept)
    | 290,114 samples/s | 2.95x fewer ids looked up than flat samples hold | 2,640 store rows``."""
    if result["eval_samples"]:  # an AUC is None (n/a) when the labels hold one class only
        auc = (f"eval AUC {format_auc(result['auc'])} (epoch {result['checkpoint_epoch']}, "
               "kept)")
    else:
        auc = f"train AUC {format_auc(result['train_auc'])}"
    batch = ""
    if result.get("workers", 1) > 1:  # --batch-size is the global batch, split over workers
        batch = (f" | batch {result['batch_size']:,} = {result['workers']} workers x "
                 f"{result['worker_batch_size']:,}")
    return (f"{auc} | {result['samples_per_sec']:,.0f} samples/s | "
            f"{result['id_compression']:.2f}x fewer ids looked up than flat samples hold | "
            f"{result['store_rows']:,} store rows{batch}"
            + (f" | serving export in {result['export_dir']}" if result.get("export_dir") else ""))


def json_number(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def format_auc(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"
