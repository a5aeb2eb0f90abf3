"""The one fit loop: passes, evaluations, the best checkpoint, early stopping, stops, resume.

``Trainer.fit`` (in process) and ``DistributedTrainer.fit`` (on Ray) are this loop over an
engine. The loop owns everything a fit means: its arguments' checks, which passes train the
dense network (``dense_optimizer.epochs``), the rows' L2 scale (1 / samples of a pass), the
evaluations (after every pass and every ``eval_every`` steps) with the best checkpoint and
early stopping, periodic checkpoints, stop requests, the progress bar, TensorBoard scalars,
the counters of a resumed fit and the result dict. An engine owns how steps run:

``engine.fit_passes(data, shuffle, carried)`` returns the passes of one fit, an object with

- ``samples``: samples in one pass when cheap to know (else None: counted in pass 1);
- ``first_epoch(state)``: the epoch a fit resumed from ``state`` goes on in (None: a new one);
- ``begin(epoch, continued)``: pass ``epoch`` starts (or, ``continued``, goes on);
- ``train(epoch, skip, dense, pause)``: the steps of pass ``epoch`` (``skip``: batches a
  resumed fit trained already), yielding a :class:`Step` after each; a step is ``pausable``
  when nothing of a later step has run (the loop evaluates, checkpoints or stops only there);
  ``pause(step)`` says whether the loop will want to pause after step ``step``;
- ``evaluate(data, log_dir)``: the model's evaluation dict on ``data``, now;
- ``guard(body, progress)``: ``body()``, rolled back and run again when the engine can recover
  from a failure in it (``progress.restore`` puts the loop back to the checkpoint's point);
- ``checkpoint(directory, snapshot)``: a checkpoint the engine may roll back to;
- ``result(steps, state)``: what the engine adds to the result dict.

and the engine itself has the counters ``step``, ``samples``, ``ids_fed``, ``leaf_ids``, a
writable ``row_l2_scale``, and ``save``, ``load``,
``store_rows()``, ``store_stats()``.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from trainer.metrics import StreamingAUC


@dataclass
class FitState:
    """Where a fit is, kept up to date after every step (``trainer.fit_state``) so an
    interrupted fit can be resumed exactly: ``fit(..., resume=state)`` on the trainer restored
    from the checkpoint of the same step.

    The pass in progress is ``epoch`` (1-based) with ``batches`` of its batches trained; pass
    k's tree order comes from (seed, k) alone, so resuming deals pass k again and skips those
    batches. The counters are this fit's totals so far, so the resumed fit reports the whole
    run. Exact with the defaults: lookups that wait for the previous update (no
    ``stale_lookups``) and no dropout (whose random state is not kept)."""

    epoch: int = 1
    batches: int = 0
    samples: int = 0
    steps: int = 0
    ids_fed: int = 0
    leaf_ids: int = 0
    seconds: float = 0.0
    loss: float = float("nan")
    evaluations: list = field(default_factory=list)
    best: int | None = None      # index of the best evaluation in ``evaluations``
    stale: int = 0               # evaluations since the best one
    train_auc: StreamingAUC = field(default_factory=StreamingAUC)
    pass_samples: int | None = None  # samples of one pass (the rows' L2 unit), once known

    def to_dict(self) -> dict:
        """JSON-ready (the train AUC histogram as its non-empty bins)."""
        out = {k: getattr(self, k) for k in ("epoch", "batches", "samples", "steps", "ids_fed",
                                             "leaf_ids", "seconds", "loss", "evaluations",
                                             "best", "stale", "pass_samples")}
        histogram = self.train_auc
        out["train_auc"] = {"bins": histogram.bins, **{
            name: {str(i): int(counts[i]) for i in np.flatnonzero(counts)}
            for name, counts in (("pos", histogram.pos), ("neg", histogram.neg))}}
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> "FitState":
        raw = dict(raw)
        histogram = raw.pop("train_auc")
        train_auc = StreamingAUC(histogram["bins"])
        for name in ("pos", "neg"):
            counts = getattr(train_auc, name)
            for i, n in histogram[name].items():
                counts[int(i)] = n
        return cls(**raw, train_auc=train_auc)


@dataclass
class Step:
    """One training step, as an engine's pass reports it."""

    loss: float                 # of the step's (union) batch
    samples: int                # leaves trained
    batches: int                # input batches taken (1 in process; per worker on Ray)
    predictions: list           # [(probabilities, labels)]: dicts per label, per batch
    callback_args: tuple        # what ``callback(engine, *callback_args)`` receives
    pausable: bool = True       # nothing of a later step has run yet


class _Progress:
    """What a fit accumulates besides the engine's counters; copied at every checkpoint so
    that a rollback forgets the steps it replays."""

    def __init__(self, state: FitState):
        self.state = state
        self.window_auc = StreamingAUC()
        self.label = None

    def snapshot(self) -> dict:
        return copy.deepcopy(self.__dict__)

    def restore(self, snapshot: dict) -> None:
        self.__dict__.update(copy.deepcopy(snapshot))


def check_fit_arguments(epochs, eval_data, eval_every, patience, best_dir, checkpoint_dir,
                        checkpoint_every) -> None:
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs: expected a positive integer, got {epochs!r}")
    for key, value in (("eval_every", eval_every), ("patience", patience),
                       ("checkpoint_every", checkpoint_every)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{key}: expected a positive integer or None, got {value!r}")
    if (eval_every or patience or best_dir) and eval_data is None:
        raise ValueError("eval_every, patience and best_dir need eval_data")
    if checkpoint_every and not checkpoint_dir:
        raise ValueError("checkpoint_every needs checkpoint_dir")
    if checkpoint_dir and best_dir and os.path.abspath(os.fspath(checkpoint_dir)) == \
            os.path.abspath(os.fspath(best_dir)):
        raise ValueError("checkpoint_dir and best_dir must be different directories")


def fit(engine, data, epochs: int = 1, *, progress: bool = False, log_dir: str | None = None,
        callback=None, eval_data=None, eval_every: int | None = None,
        patience: int | None = None, best_dir: str | None = None, shuffle: bool = True,
        checkpoint_dir: str | None = None, checkpoint_every: int | None = None,
        should_stop=None, resume: FitState | None = None, carried: dict | None = None) -> dict:
    """Train ``engine`` up to ``epochs`` passes over ``data`` (see ``Trainer.fit`` for the
    arguments); returns the result dict. ``engine.fit_state`` is the :class:`FitState` after
    every step. ``carried``: what the engine kept of the fit ``resume`` continues (it reads it in
    ``fit_passes``)."""
    check_fit_arguments(epochs, eval_data, eval_every, patience, best_dir, checkpoint_dir,
                        checkpoint_every)
    passes = engine.fit_passes(data, shuffle, carried or {})
    state = engine.fit_state = resume if resume is not None else FitState()
    if state.pass_samples is None and passes.samples:
        state.pass_samples = passes.samples
    run = _Progress(state)
    bar = progress_bar(progress, None if passes.samples is None else passes.samples * epochs,
                       "train")
    if state.samples:
        bar.update(state.samples)
    writer = scalar_writer(log_dir, "train")
    started = time.perf_counter() - state.seconds
    # this fit's counters start where the interrupted fit's started
    samples0, steps0 = engine.samples - state.samples, engine.step - state.steps
    ids0, leaf_ids0 = engine.ids_fed - state.ids_fed, engine.leaf_ids - state.leaf_ids
    marks = {"time": time.perf_counter(), "samples": engine.samples, "step": engine.step}
    stop_asked = False
    dense_epochs = engine.config.dense_optimizer.epochs

    def stop_requested() -> bool:
        """Whether should_stop asked to stop, once or since (a stop is not taken back)."""
        nonlocal stop_asked
        stop_asked = stop_asked or (should_stop is not None and bool(should_stop()))
        return stop_asked

    def due(every) -> bool:
        return every is not None and engine.step % every == 0

    def pause(step: int) -> bool:
        """Whether the loop pauses after step ``step`` (evaluation, checkpoint or stop)."""
        return any(every is not None and step % every == 0
                   for every in (eval_every, checkpoint_every)) or stop_requested()

    def evaluated_now() -> bool:
        s = run.state
        return bool(s.evaluations) and s.evaluations[-1]["step"] == engine.step

    def evaluate(epoch: int) -> bool:
        """Evaluate now (between steps); True when training should stop."""
        s = run.state
        result = passes.evaluate(eval_data, log_dir)
        result.update(epoch=epoch, step=engine.step, samples_trained=engine.samples - samples0)
        s.evaluations.append(result)
        if progress:
            bar.write(f"eval after epoch {epoch} (step {engine.step}): AUC {result['auc']:.4f}"
                      f" logloss {result['logloss']:.5f}", file=sys.stderr)
        if s.best is None or result["auc"] > s.evaluations[s.best]["auc"]:
            s.best, s.stale = len(s.evaluations) - 1, 0
            if best_dir:
                engine.save(best_dir)
        else:
            s.stale += 1
        return patience is not None and s.stale >= patience

    def checkpoint() -> None:
        passes.checkpoint(checkpoint_dir, run.snapshot())

    def log_scalars() -> None:
        now = time.perf_counter()
        rate = (engine.samples - marks["samples"]) / max(now - marks["time"], 1e-9)
        marks.update(time=now, samples=engine.samples, step=engine.step)
        window = run.window_auc.result()
        bar.set_postfix(loss=f"{run.state.loss:.4f}", auc=f"{window:.4f}",
                        rows=engine.store_rows(), refresh=False)
        if writer is not None:
            stats = engine.store_stats()
            scalars = {"loss": run.state.loss, "samples_per_sec": rate,
                       **{f"store/{k}": stats.get(k, 0)
                          for k in ("rows", "admitted", "rejected", "expired")}}
            if np.isfinite(window):
                scalars["auc"] = window
            write_scalars(writer, engine.step, scalars)
        run.window_auc.reset()

    def after_step(step: Step) -> None:
        s = run.state
        for probabilities, labels in step.predictions:
            run.label = run.label or next(iter(probabilities))
            s.train_auc.add(probabilities[run.label], labels[run.label])
            run.window_auc.add(probabilities[run.label], labels[run.label])
        bar.update(step.samples)
        s.batches += step.batches
        s.samples, s.steps = engine.samples - samples0, engine.step - steps0
        s.ids_fed, s.leaf_ids = engine.ids_fed - ids0, engine.leaf_ids - leaf_ids0
        s.seconds, s.loss = time.perf_counter() - started, step.loss
        if callback is not None:
            callback(engine, *step.callback_args)
        if engine.step % engine.config.log_every == 0:
            log_scalars()

    def one_pass(epoch: int, continued: bool, dense: bool) -> bool:
        """The rest of pass ``epoch``, its evaluation and checkpoint; True to stop training.
        Run again after a rollback."""
        s = run.state
        if continued and eval_every and s.batches and due(eval_every) and not evaluated_now():
            # the resumed fit stopped right after the step this evaluation follows
            if stop_requested() or evaluate(epoch):
                return True
        with contextlib.closing(passes.train(epoch, s.batches if continued else 0, dense,
                                             pause)) as steps:
            for step in steps:
                after_step(step)
                if not step.pausable:
                    continue
                if stop_requested():
                    return True
                if due(eval_every) and evaluate(epoch):
                    return True
                if due(checkpoint_every):
                    checkpoint()
        if epoch == 1 and not run.state.pass_samples:
            run.state.pass_samples = run.state.samples  # the data's size, counted
        if stop_requested():  # the pass is trained; its evaluation is not waited for
            return True
        stop = False
        if eval_data is not None and not evaluated_now():
            stop = evaluate(epoch)
        if checkpoint_dir:
            checkpoint()
        return stop

    stopped = completed = False
    # a resumed fit goes on in the pass it stopped in: its rest, or the evaluation it did not
    # wait for (None: the engine cannot, the fit starts a pass)
    first = passes.first_epoch(state) if resume is not None else None
    epoch, continued = (first - 1, True) if first is not None else (0, False)
    try:
        if checkpoint_dir:
            passes.guard(checkpoint, run)  # the state before this fit: roll back to it
        # a stop request is honoured after a step (or when a pass's steps end, before its
        # evaluation), never before this fit's first step: "finishing the current step"
        while epoch < epochs and not stopped:
            epoch += 1
            if not continued:
                run.state.batches = 0
            run.state.epoch = epoch
            # The dense network trains in this fit's first ``dense_epochs`` passes; later
            # passes train the rows only. (Per fit: a fit on new data trains it again.)
            dense = dense_epochs is None or epoch <= dense_epochs
            # the rows' L2 once a pass's samples are known (from the data, or pass 1)
            pass_samples = run.state.pass_samples
            engine.row_l2_scale = 1.0 / pass_samples if pass_samples else 0.0
            passes.begin(epoch, continued)
            stopped = passes.guard(
                lambda c=continued, e=epoch, d=dense: one_pass(e, c, d), run)
            continued = False
        completed = True
    finally:
        engine.row_l2_scale = 0.0
        try:
            if engine.step != marks["step"]:
                # the last step's scalars, so a run shorter than log_every has some too
                try:
                    log_scalars()
                except Exception:
                    if completed:
                        raise  # otherwise the error that stopped training is the one shown
        finally:
            close_bar(bar, completed and not stop_asked)
            if writer is not None:
                writer.flush()
                writer.close()
    state = run.state
    engine.fit_state = state
    seconds = time.perf_counter() - started
    samples, steps = engine.samples - samples0, engine.step - steps0
    out = {"samples": samples, "steps": steps, "seconds": seconds,
           "id_compression": (engine.leaf_ids - leaf_ids0) / max(engine.ids_fed - ids0, 1),
           "samples_per_sec": samples / max(seconds, 1e-9), "loss": state.loss,
           "train_auc": state.train_auc.result(), "store_rows": engine.store_rows()}
    evaluations = state.evaluations
    best = None if state.best is None else evaluations[state.best]
    if eval_data is not None:
        out.update(evaluations=evaluations, best=best,
                   stopped_early=(stopped and not stop_asked) or (
                       patience is not None and state.stale >= patience))
        if best_dir and best is not None and state.best != len(evaluations) - 1 \
                and not stop_asked:
            engine.load(best_dir)  # back to the best model
    out["interrupted"] = stop_asked
    state.seconds = seconds
    out.update(passes.result(steps, state))
    return out


# -- progress bar and TensorBoard scalars (TensorFlow imported only when a log is written) ----

class _NoBar:
    def update(self, n):
        pass

    def set_postfix(self, **kwargs):
        pass

    def write(self, text, file=None):
        print(text, file=file or sys.stderr)

    def close(self):
        pass


def progress_bar(enabled: bool, total, desc: str):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="samples", unit_scale=True, dynamic_ncols=True,
                mininterval=0.5)


def close_bar(bar, completed: bool) -> None:
    """Close a progress bar; after a pass that completed, first make its total what it counted
    (training that stopped early, before ``samples x epochs``, ends the bar at 100%)."""
    if completed and getattr(bar, "total", None) is not None and bar.n != bar.total:
        bar.total = bar.n
        bar.refresh()
    bar.close()


def scalar_writer(log_dir: str | None, name: str):
    """A TensorBoard event writer for ``log_dir/name``, or None without ``log_dir``."""
    if not log_dir:
        return None
    import tensorflow as tf

    return tf.summary.create_file_writer(os.path.join(log_dir, name))


_SCALAR_METADATA = None


def _scalar(name: str, value) -> None:
    """A TensorBoard scalar through TensorFlow's own summary op: ``tf.summary.scalar`` lives in
    the tensorboard package, which the trainer does not need in order to write event files."""
    global _SCALAR_METADATA
    import tensorflow as tf

    if _SCALAR_METADATA is None:
        from tensorflow.core.framework import summary_pb2

        _SCALAR_METADATA = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
    tf.summary.write(name, tf.constant(float(value), tf.float32), metadata=_SCALAR_METADATA)


def write_scalars(writer, step: int, scalars: dict) -> None:
    """TensorBoard scalars ``{name: value}`` at ``step`` through ``writer``."""
    with writer.as_default(step=step):
        for name, value in scalars.items():
            _scalar(name, value)


def write_eval_scalars(log_dir: str | None, step: int, result: dict) -> None:
    """An evaluation's auc, logloss and loss under ``log_dir/eval``."""
    writer = scalar_writer(log_dir, "eval")
    if writer is None:
        return
    write_scalars(writer, step, {key: result[key] for key in ("auc", "logloss", "loss")})
    writer.close()
