"""The one fit loop: passes, evaluations, the best checkpoint, early stopping, stops, resume.

``Trainer.fit`` (in process) and ``DistributedTrainer.fit`` (on Ray) are this loop over an
engine. The loop owns everything a fit means: its arguments' checks, which passes train the
dense network (``dense_optimizer.epochs``), the rows' L2 scale (1 / samples of a pass), the
evaluations (after every pass and every ``eval_every`` steps) with the best checkpoint and
early stopping, periodic checkpoints, stop requests, the progress bar, TensorBoard scalars,
the counters of a resumed fit and the result dict: :class:`FitLoop`. An engine owns how steps
run: the loop knows it as a :class:`FitEngine`, whose ``fit_passes(data, shuffle, carried)``
returns the passes of one fit, a :class:`FitPasses` (each engine's adapter calls only its
trainer's public methods).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

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


class FitProgress:
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


class FitPasses(Protocol):
    """The passes of one fit, as an engine runs them (what ``engine.fit_passes`` returns)."""

    samples: int | None  # samples in one pass when cheap to know (else None: counted in pass 1)

    def first_epoch(self, state: FitState) -> int | None:
        """The epoch a fit resumed from ``state`` goes on in (None: a new one)."""

    def begin(self, epoch: int, continued: bool) -> None:
        """Pass ``epoch`` starts (or, ``continued``, goes on)."""

    def train(self, epoch: int, skip: int, dense: bool,
              pause: Callable[[int], bool]) -> Iterator[Step]:
        """The steps of pass ``epoch`` (``skip``: batches a resumed fit trained already), a
        :class:`Step` after each; a step is ``pausable`` when nothing of a later step has run
        (the loop evaluates, checkpoints or stops only there); ``pause(step)`` says whether
        the loop will want to pause after step ``step``."""

    def evaluate(self, data, log_dir: str | None) -> dict:
        """The model's evaluation dict on ``data``, now."""

    def guard(self, body: Callable[[], bool], progress: "FitProgress") -> bool:
        """``body()``, rolled back and run again when the engine can recover from a failure
        in it (``progress.restore`` puts the loop back to the checkpoint's point)."""

    def checkpoint(self, directory, snapshot: dict) -> None:
        """A checkpoint the engine may roll back to (``snapshot``: the loop's progress)."""

    def result(self, steps: int, state: FitState) -> dict:
        """What the engine adds to the result dict."""


class FitEngine(Protocol):
    """What the fit loop needs of an engine (``Trainer`` in process, ``DistributedTrainer``
    on Ray): its counters, a writable ``row_l2_scale``, where the latest fit is
    (``fit_state``), and these methods."""

    config: Any
    step: int
    samples: int
    ids_fed: int
    leaf_ids: int
    row_l2_scale: float
    fit_state: FitState | None

    def fit_passes(self, data, shuffle: bool, carried: dict) -> FitPasses:
        """The passes of one fit over ``data``; ``carried``: what the engine kept of the fit a
        resumed one continues."""

    def save(self, directory) -> str: ...

    def load(self, directory) -> None: ...

    def store_rows(self) -> int: ...

    def store_stats(self) -> dict: ...


class FitLoop:
    """One fit of ``engine`` up to ``epochs`` passes over ``data`` (see ``Trainer.fit`` for
    the arguments): :meth:`run` trains and returns the result dict. ``engine.fit_state`` is
    the :class:`FitState` after every step. ``carried``: what the engine kept of the fit
    ``resume`` continues (it reads it in ``fit_passes``)."""

    def __init__(self, engine: FitEngine, data, epochs: int = 1, *, progress: bool = False,
                 log_dir: str | None = None, callback=None, eval_data=None,
                 eval_every: int | None = None, patience: int | None = None,
                 best_dir: str | None = None, shuffle: bool = True,
                 checkpoint_dir: str | None = None, checkpoint_every: int | None = None,
                 should_stop=None, resume: FitState | None = None,
                 carried: dict | None = None):
        check_fit_arguments(epochs, eval_data, eval_every, patience, best_dir, checkpoint_dir,
                            checkpoint_every)
        self.engine, self.epochs, self.resume = engine, epochs, resume
        self.progress, self.log_dir, self.callback = progress, log_dir, callback
        self.eval_data, self.eval_every, self.patience = eval_data, eval_every, patience
        self.best_dir, self.should_stop = best_dir, should_stop
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        self.passes = engine.fit_passes(data, shuffle, carried or {})
        state = engine.fit_state = resume if resume is not None else FitState()
        if state.pass_samples is None and self.passes.samples:
            state.pass_samples = self.passes.samples
        self.run_progress = FitProgress(state)
        self.bar = progress_bar(progress, None if self.passes.samples is None
                                else self.passes.samples * epochs, "train")
        if state.samples:
            self.bar.update(state.samples)
        self.writer = scalar_writer(log_dir, "train")
        self.started = time.perf_counter() - state.seconds
        # this fit's counters start where the interrupted fit's started
        self.samples0, self.steps0 = engine.samples - state.samples, engine.step - state.steps
        self.ids0 = engine.ids_fed - state.ids_fed
        self.leaf_ids0 = engine.leaf_ids - state.leaf_ids
        self.marks = {"time": time.perf_counter(), "samples": engine.samples,
                      "step": engine.step}
        self.stop_asked = False
        self.dense_epochs = engine.config.dense_optimizer.epochs

    @property
    def state(self) -> FitState:
        return self.run_progress.state

    def stop_requested(self) -> bool:
        """Whether should_stop asked to stop, once or since (a stop is not taken back)."""
        self.stop_asked = self.stop_asked or (self.should_stop is not None
                                              and bool(self.should_stop()))
        return self.stop_asked

    def due(self, every) -> bool:
        return every is not None and self.engine.step % every == 0

    def pause(self, step: int) -> bool:
        """Whether the loop pauses after step ``step`` (evaluation, checkpoint or stop)."""
        return any(every is not None and step % every == 0
                   for every in (self.eval_every, self.checkpoint_every)) or \
            self.stop_requested()

    def evaluated_now(self) -> bool:
        s = self.state
        return bool(s.evaluations) and s.evaluations[-1]["step"] == self.engine.step

    def evaluate(self, epoch: int) -> bool:
        """Evaluate now (between steps); True when training should stop."""
        s, engine = self.state, self.engine
        result = self.passes.evaluate(self.eval_data, self.log_dir)
        result.update(epoch=epoch, step=engine.step,
                      samples_trained=engine.samples - self.samples0)
        s.evaluations.append(result)
        if self.progress:
            self.bar.write(f"eval after epoch {epoch} (step {engine.step}): AUC "
                           f"{result['auc']:.4f} logloss {result['logloss']:.5f}",
                           file=sys.stderr)
        if s.best is None or result["auc"] > s.evaluations[s.best]["auc"]:
            s.best, s.stale = len(s.evaluations) - 1, 0
            if self.best_dir:
                engine.save(self.best_dir)
        else:
            s.stale += 1
        return self.patience is not None and s.stale >= self.patience

    def checkpoint(self) -> None:
        self.passes.checkpoint(self.checkpoint_dir, self.run_progress.snapshot())

    def log_scalars(self) -> None:
        engine, run, marks = self.engine, self.run_progress, self.marks
        now = time.perf_counter()
        rate = (engine.samples - marks["samples"]) / max(now - marks["time"], 1e-9)
        marks.update(time=now, samples=engine.samples, step=engine.step)
        window = run.window_auc.result()
        self.bar.set_postfix(loss=f"{run.state.loss:.4f}", auc=f"{window:.4f}",
                             rows=engine.store_rows(), refresh=False)
        if self.writer is not None:
            stats = engine.store_stats()
            scalars = {"loss": run.state.loss, "samples_per_sec": rate,
                       **{f"store/{k}": stats.get(k, 0)
                          for k in ("rows", "admitted", "rejected", "expired")}}
            if np.isfinite(window):
                scalars["auc"] = window
            write_scalars(self.writer, engine.step, scalars)
        run.window_auc.reset()

    def after_step(self, step: Step) -> None:
        engine, run = self.engine, self.run_progress
        s = run.state
        for probabilities, labels in step.predictions:
            run.label = run.label or next(iter(probabilities))
            s.train_auc.add(probabilities[run.label], labels[run.label])
            run.window_auc.add(probabilities[run.label], labels[run.label])
        self.bar.update(step.samples)
        s.batches += step.batches
        s.samples, s.steps = engine.samples - self.samples0, engine.step - self.steps0
        s.ids_fed, s.leaf_ids = engine.ids_fed - self.ids0, engine.leaf_ids - self.leaf_ids0
        s.seconds, s.loss = time.perf_counter() - self.started, step.loss
        if self.callback is not None:
            self.callback(engine, *step.callback_args)
        if engine.step % engine.config.log_every == 0:
            self.log_scalars()

    def one_pass(self, epoch: int, continued: bool, dense: bool) -> bool:
        """The rest of pass ``epoch``, its evaluation and checkpoint; True to stop training.
        Run again after a rollback."""
        s = self.state
        if continued and self.eval_every and s.batches and self.due(self.eval_every) and \
                not self.evaluated_now():
            # the resumed fit stopped right after the step this evaluation follows
            if self.stop_requested() or self.evaluate(epoch):
                return True
        with contextlib.closing(self.passes.train(epoch, s.batches if continued else 0, dense,
                                                  self.pause)) as steps:
            for step in steps:
                self.after_step(step)
                if not step.pausable:
                    continue
                if self.stop_requested():
                    return True
                if self.due(self.eval_every) and self.evaluate(epoch):
                    return True
                if self.due(self.checkpoint_every):
                    self.checkpoint()
        if epoch == 1 and not self.state.pass_samples:
            self.state.pass_samples = self.state.samples  # the data's size, counted
        if self.stop_requested():  # the pass is trained; its evaluation is not waited for
            return True
        stop = False
        if self.eval_data is not None and not self.evaluated_now():
            stop = self.evaluate(epoch)
        if self.checkpoint_dir:
            self.checkpoint()
        return stop

    def train(self) -> bool:
        """Every pass of the fit; whether training stopped before ``epochs`` passes."""
        engine, passes, run = self.engine, self.passes, self.run_progress
        stopped = False
        # a resumed fit goes on in the pass it stopped in: its rest, or the evaluation it did
        # not wait for (None: the engine cannot, the fit starts a pass)
        first = passes.first_epoch(self.state) if self.resume is not None else None
        epoch, continued = (first - 1, True) if first is not None else (0, False)
        if self.checkpoint_dir:
            passes.guard(self.checkpoint, run)  # the state before this fit: roll back to it
        # a stop request is honoured after a step (or when a pass's steps end, before its
        # evaluation), never before this fit's first step: "finishing the current step"
        while epoch < self.epochs and not stopped:
            epoch += 1
            if not continued:
                run.state.batches = 0
            run.state.epoch = epoch
            # The dense network trains in this fit's first ``dense_epochs`` passes; later
            # passes train the rows only. (Per fit: a fit on new data trains it again.)
            dense = self.dense_epochs is None or epoch <= self.dense_epochs
            # the rows' L2 once a pass's samples are known (from the data, or pass 1)
            pass_samples = run.state.pass_samples
            engine.row_l2_scale = 1.0 / pass_samples if pass_samples else 0.0
            passes.begin(epoch, continued)
            stopped = passes.guard(
                lambda c=continued, e=epoch, d=dense: self.one_pass(e, c, d), run)
            continued = False
        return stopped

    def run(self) -> dict:
        """Train; the result dict."""
        engine = self.engine
        stopped = completed = False
        try:
            stopped = self.train()
            completed = True
        finally:
            engine.row_l2_scale = 0.0
            try:
                if engine.step != self.marks["step"]:
                    # the last step's scalars, so a run shorter than log_every has some too
                    try:
                        self.log_scalars()
                    except Exception:
                        if completed:
                            raise  # otherwise the error that stopped training is the one shown
            finally:
                close_bar(self.bar, completed and not self.stop_asked)
                if self.writer is not None:
                    self.writer.flush()
                    self.writer.close()
        return self.result(stopped)

    def result(self, stopped: bool) -> dict:
        engine, state = self.engine, self.state
        engine.fit_state = state
        seconds = time.perf_counter() - self.started
        samples, steps = engine.samples - self.samples0, engine.step - self.steps0
        out = {"samples": samples, "steps": steps, "seconds": seconds,
               "id_compression": ((engine.leaf_ids - self.leaf_ids0)
                                  / max(engine.ids_fed - self.ids0, 1)),
               "samples_per_sec": samples / max(seconds, 1e-9), "loss": state.loss,
               "train_auc": state.train_auc.result(), "store_rows": engine.store_rows()}
        evaluations = state.evaluations
        best = None if state.best is None else evaluations[state.best]
        if self.eval_data is not None:
            out.update(evaluations=evaluations, best=best,
                       stopped_early=(stopped and not self.stop_asked) or (
                           self.patience is not None and state.stale >= self.patience))
            if self.best_dir and best is not None and state.best != len(evaluations) - 1 \
                    and not self.stop_asked:
                engine.load(self.best_dir)  # back to the best model
        out["interrupted"] = self.stop_asked
        state.seconds = seconds
        out.update(self.passes.result(steps, state))
        return out


def fit(engine: FitEngine, data, epochs: int = 1, **options) -> dict:
    """Train ``engine`` up to ``epochs`` passes over ``data``: :class:`FitLoop`'s result
    (``options``: its keyword arguments)."""
    return FitLoop(engine, data, epochs, **options).run()


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
