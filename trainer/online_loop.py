"""The one online loop: train from Kafka for ever, checkpoint then commit, export, report.

``python -m trainer.online`` runs it over one of two engines, siblings as the local and the Ray
engine of :mod:`trainer.fitting` are: :class:`trainer.online_process.ProcessEngine` (one
process: a reader thread polls, the main thread trains) and
:class:`trainer.distributed.online.RayEngine` (W online workers and S store shards on Ray).
The loop owns what an online run means, whichever engine trains:

- **cadence**: checkpoints every ``checkpoint_every`` s, exports every ``export_every`` s,
  console lines and TensorBoard points every ``report_every`` s, ``status.json`` every
  ``STATUS_EVERY`` s, the end at ``max_samples``, after ``idle_exit`` idle seconds or when
  asked to stop; all of them between steps an engine calls *pausable* (nothing of a later
  step has run, no unit is partly trained);
- **units**: the counters of the units (in process, a poll's batches; on Ray, a step) and of
  the messages, dead letters and offsets they consumed;
- **checkpoint-then-commit**: the dead letters of what a checkpoint covers are delivered first,
  the checkpoint is written, and only then are its offsets committed to Kafka, between the
  crash points ``offsets.commit`` and ``offsets.committed`` (:mod:`native.crash_points`);
- **progressive validation** of the model's first head, the whole run and the window since the
  previous console line;
- **the idle clock**: idle time is time in which partitions are assigned, the broker answers
  and nothing is read. An empty poll cannot tell "no new messages" from "no broker", so while
  steps come back empty the loop asks the engine whether the partitions' leaders answer (at
  most every ``PROBE_EVERY`` s, and once more before an idle run ends): an unanswered probe
  restarts the clock (``broker_reachable`` False), a step that read something sets it True;
- **exports** for serving with every sample's arrival-to-export delay;
- **status.json, Prometheus metrics and TensorBoard** (:mod:`trainer.online_report`);
- **the summary**, with the same keys from both engines.

An engine owns how steps run and what a checkpoint holds (:class:`OnlineEngine`). The command
(:mod:`trainer.online`) parses its flags into :class:`OnlineOptions`; what an engine cannot
use raises :class:`OnlineUsageError`, which the command reports as a usage error (exit 2).
TensorFlow and Ray are not imported here.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import numpy as np

from compression.messages import DEFAULT_MAX_MESSAGE_BYTES
from native.crash_points import crash_point
from trainer.metrics import DelayHistogram, ProgressiveValidation, run_rates
from trainer.online_report import STATUS_EVERY, report_scalars, write_status

log = logging.getLogger("trainer.online")

# While steps come back empty, the loop checks at most this often (seconds) that the
# partitions' leaders answer, waiting up to PROBE_TIMEOUT s: an outage is not idle time.
PROBE_EVERY = 1.0
PROBE_TIMEOUT = 2.0
DEFAULT_READER_NICE = 10
STEP_LOG = "steps.jsonl"  # under the run directory, with --step-log (see truncate_step_log)


class OnlineUsageError(ValueError):
    """What an online run was given cannot be used: the command reports it as a usage error
    (its usage line, the message, exit code 2)."""


class OnlineServiceError(ValueError):
    """The run cannot offer a service it was asked for (the metrics endpoint cannot listen):
    the command's error line and exit code 2, without the usage line."""


@dataclass
class OnlineOptions:
    """An online run's options, as ``python -m trainer.online`` parses them (see its
    ``--help`` for each)."""

    schema: str
    bootstrap_servers: str
    topic: str
    group: str
    run_dir: str
    format: str = "json"
    config: str | None = None
    model: str | None = None
    init_from: str | None = None
    export_dir: str | None = None
    export_every: float = 10.0
    export_format: str | None = None
    checkpoint_every: float = 30.0
    expire_every: int | None = None
    report_every: float = 10.0
    max_samples: int | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    idle_exit: float | None = None
    reader_nice: int = DEFAULT_READER_NICE
    unit_samples: int | None = None
    dead_letter_topic: str | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    workers: int | None = None
    shards: int | None = None
    ray_address: str | None = None
    step_log: bool = False
    kafka_options: dict = field(default_factory=dict)
    broker_timeout: float | None = None  # None: compression.kafka's default
    debug: bool = False
    memory_budget: str | None = None  # --memory-budget as given (a size: 2GiB, bytes...)
    tier_dir: str | None = None

    @property
    def memory_budget_bytes(self) -> int | None:
        from trainer import tiers

        return (None if self.memory_budget is None
                else tiers.parse_size(self.memory_budget, "--memory-budget"))

    @property
    def on_ray(self) -> bool:
        return (self.workers is not None or self.shards is not None
                or bool(self.ray_address))

    def check(self) -> None:
        """OnlineUsageError for values no engine can use."""
        if not 0 <= self.reader_nice <= 19:
            raise OnlineUsageError(f"--reader-nice: expected 0 to 19, got {self.reader_nice}")
        if self.unit_samples is not None and self.unit_samples < 1:
            raise OnlineUsageError(
                f"--unit-samples: expected at least 1, got {self.unit_samples}")
        if self.max_message_bytes < 1:
            raise OnlineUsageError(
                f"--max-message-bytes: expected at least 1, got {self.max_message_bytes}")
        if self.init_from and (self.config or self.model):
            raise OnlineUsageError("--init-from takes the batch run's config and model; drop "
                                   "--config and --model")
        from trainer import tiers

        if self.tier_dir is not None and self.memory_budget is None:
            raise OnlineUsageError("--tier-dir holds the rows beyond --memory-budget; give "
                                   "--memory-budget too (or set tier_dir in the config)")
        try:
            self.memory_budget_bytes  # noqa: B018 - parsed to be checked
            if self.tier_dir is not None:
                self.tier_dir = tiers.check_tier_dir(self.tier_dir, "--tier-dir")
        except tiers.BudgetError as e:
            raise OnlineUsageError(str(e)) from None


@dataclass
class OnlineStep:
    """What an engine reports after a step (in process: a unit trained, or an empty poll)."""

    samples: int = 0        # samples trained
    messages: int = 0       # messages whose offsets are now trained (malformed ones too)
    dead: int = 0           # dead letters of those messages (sent by the engine)
    positions: dict = field(default_factory=dict)  # partition -> next offset trained
    ranges: dict = field(default_factory=dict)     # partition -> (first, next) trained now
    arrivals_ms: np.ndarray | None = None  # Kafka arrival times of the samples trained now
    predictions: list = field(default_factory=list)  # [(probabilities, labels)] per batch
    unit: bool = False      # counts as a unit (the rates' unit; something new to export)
    read: bool = False      # something was read from the broker (it answers)
    idle: bool = False      # nothing was read: the polls came back empty
    pausable: bool = True   # nothing of a later step has run: checkpoints and exports may
    waited: float = 0.0     # seconds the step waited for input
    # per step trained (the last len(log) steps of the model), every worker's record for the
    # step log: {"ranges": the unit's, on the step of its last batch, "samples", "batch"}
    log: list = field(default_factory=list)


class OnlineEngine(Protocol):
    """What the loop needs of an engine (see the module docstring)."""

    kind: str            # "process" or "ray": the summary's ``engine``
    recovers: bool       # rolls back to the latest checkpoint: needs one before its first step
    step: int            # steps trained (the model's)

    def begin(self, loop: "OnlineLoop") -> None:
        """The run starts (readers, partitions, tracing)."""

    def steps(self, loop: "OnlineLoop", pause: Callable[[], bool]) -> Iterator[OnlineStep]:
        """Steps for ever; ``pause()`` says the loop wants a pausable step soon."""

    def end_steps(self) -> None:
        """No step follows (readers stopped); called again after a failure: idempotent."""

    def guard(self, body: Callable[[], dict], loop: "OnlineLoop") -> dict:
        """``body()``, run again after the engine rolled back to the latest checkpoint
        (``loop.restore``) when it can recover from a failure in it."""

    def partitions_changed(self) -> bool:
        """After a checkpoint: the topic's partitions were dealt anew (steps restart)."""

    def flush_dead_letters(self, timeout: float) -> bool:
        """Whether every dead letter sent so far was delivered within ``timeout`` s."""

    def save_checkpoint(self, checkpoints, positions: dict, ranges: dict) -> None:
        """Write a checkpoint of the model and ``positions`` (and the engine's own format)."""

    def commit_due(self, positions: dict, final: bool) -> bool:
        """When nothing changed since the latest checkpoint: whether to commit again."""

    def commit(self, positions: dict, wait: bool) -> None:
        """Commit ``positions`` to Kafka (``wait``: for the broker's answer)."""

    def export(self, directory: str, newest_sample_time: float | None) -> None:
        """Publish a version for serving (:func:`trainer.serving.export_increment`)."""

    def reachable(self, timeout: float) -> bool:
        """Whether the leaders of the partitions read answer within ``timeout`` s."""

    def assigned(self) -> list:
        """The partitions read now (none while joining the group or in a rebalance)."""

    def lag(self, positions: dict) -> int | None:
        """Messages behind the partitions' ends (None: a leader did not answer)."""

    def store_stats(self) -> dict:
        """The stores' counters summed: rows, bytes, admitted, rejected, expired."""

    def report_line(self, loop: "OnlineLoop", values: dict) -> tuple:
        """The console line (a logging format and its arguments) of a report's ``values``:
        each engine's line as it was (scripts and tests read them)."""

    def snapshot(self) -> dict:
        """The engine's counters a checkpoint holds (what :meth:`restore_snapshot` takes)."""

    def restore_snapshot(self, snapshot: dict) -> None:
        """The counters back to ``snapshot`` (a rollback)."""

    def summary(self, loop: "OnlineLoop", timings: bool) -> dict:
        """The engine's summary keys: workers, shards, assignment, bytes_per_step,
        recoveries, busy_seconds, timings (``timings`` False: the last two may be None)."""


@dataclass
class OnlineStats:
    """The counters of a run (``units``: the rates' unit, a poll's batches in process, a step
    on Ray)."""

    samples: int = 0
    messages: int = 0
    dead: int = 0
    units: int = 0
    checkpoints: int = 0
    exports: int = 0
    delays: DelayHistogram = field(default_factory=DelayHistogram)
    # the same for samples that arrived after the first unit was trained: the steady state,
    # without the backlog that piles up while the trainer starts and joins the group
    steady_delays: DelayHistogram = field(default_factory=DelayHistogram)
    first_unit_wall_ms: float | None = None
    started: float = field(default_factory=time.monotonic)
    first_unit: float | None = None  # when the first unit was trained (after start-up/join)
    last_unit: float | None = None   # when the latest unit was trained
    first_unit_samples: int = 0
    # seconds the loop waited for the next unit after the first unit (above ~0 the input,
    # i.e. Kafka and decoding, limits the rate; else training does)
    trainer_waited: float = 0.0


class OnlineLoop:
    """One online run over an engine: its steps, counters, checkpoints, commits and exports."""

    def __init__(self, engine: OnlineEngine, checkpoints, *, positions: dict,
                 checkpoint_every: float = 30.0, export_dir: str | None = None,
                 export_every: float = 10.0, max_samples: int | None = None,
                 idle_exit: float | None = None, status_path: str | None = None,
                 log_dir: str | None = None, report_every: float = 10.0, on_export=None,
                 record_predictions: bool = False, step_log: str | None = None):
        """``positions``: partition -> next offset to train (the restored checkpoint's);
        ``status_path``: the status file (None: none); ``log_dir``: TensorBoard scalars
        (None: none); ``on_export``: called with the loop after every export; ``step_log``:
        the step log's path (None: none; see :func:`truncate_step_log`)."""
        self.engine = engine
        self.checkpoints = checkpoints
        self.checkpoint_every = checkpoint_every
        self.export_dir = export_dir
        self.export_every = export_every
        self.max_samples = max_samples
        self.idle_exit = idle_exit
        self.status_path = status_path
        self.log_dir = log_dir
        self.report_every = report_every
        self.on_export = on_export
        self.step_log = step_log
        self._pending_log: list[str] = []
        self.positions = {int(p): int(o) for p, o in positions.items()}
        self.ranges_since_checkpoint: dict[int, list] = {}
        self.stats = OnlineStats()
        self.pv = ProgressiveValidation()
        self.pv_window = ProgressiveValidation()  # since the latest report
        self.pv_label: str | None = None
        self.last_pv_window: dict | None = None  # the window of the latest report
        # (probabilities, labels) of every batch, in training order (for tests and analysis;
        # grows with the run, so off by default)
        self.predictions: list | None = [] if record_predictions else None
        self.snapshot: dict | None = None   # the latest summary (status.json, /metrics)
        self.metrics_url: str | None = None
        self.timing_observers: list = []    # called with ("checkpoint"|"export", seconds)
        self.last_lag: int | None = None
        self.last_delay: dict = {"p50": None, "p99": None}  # of the latest export
        # Kafka arrival time (Unix s) of the newest sample trained into the latest export
        self.newest_arrival: float | None = None
        self._pending_arrivals: list[tuple[int, np.ndarray]] = []  # (step, Unix ms)
        self._trained_since_export = False
        self.broker_reachable: bool | None = None
        self._idle_since: float | None = None
        self._probed_at = float("-inf")
        self._writer = None
        self._last_status = float("-inf")
        self._last_report = (self.stats.started, 0, 0.0)  # (when, samples, waited then)
        self._finish = False  # max_samples reached or idle for idle_exit s
        self._stop = threading.Event()
        self._should_stop: Callable[[], bool] = self._stop.is_set
        # what the latest checkpoint holds (step, offsets, the counters): where an engine that
        # recovers rolls back to. None: a checkpoint is due before the first step
        self._checkpointed: dict | None = (
            self._state() if checkpoints.latest() is not None or not engine.recovers
            else None)

    def stop(self, *_):
        """Ask the run to finish the current step, checkpoint, commit and return."""
        self._stop.set()

    @property
    def trained_positions(self) -> dict:
        return self.positions

    # -- the run -----------------------------------------------------------------------------

    def run(self, should_stop: Callable[[], bool] | None = None) -> dict:
        """Train until ``should_stop()`` (or :meth:`stop`), ``max_samples`` or ``idle_exit``;
        then the final export, checkpoint and commit. Returns the summary."""
        if self.step_log:  # lines of steps after the checkpoint restored: trained again
            truncate_step_log(self.step_log, self.engine.step)
        if should_stop is not None:
            self._should_stop = lambda: self._stop.is_set() or should_stop()
        # Python's cyclic collector runs whenever enough objects were allocated (every poll
        # makes one per message) and, in a full pass, walks every object alive, TensorFlow's
        # hundreds of thousands included, holding the GIL the training step needs. Objects
        # alive at start-up live for the whole run: freeze them out of the collector's passes
        # (measured: 1.5 s of collection per 500k samples fell to 0.3 s).
        gc.freeze()
        if self.log_dir and self._writer is None:
            import tensorflow as tf

            self._writer = tf.summary.create_file_writer(self.log_dir)
        try:
            self.engine.begin(self)
            return self.engine.guard(self._body, self)
        finally:
            self.engine.end_steps()
            self.close()

    def _body(self) -> dict:
        try:
            if self._checkpointed is None:
                self.checkpoint()  # what a failure before the first checkpoint goes back to
            while self._steps():
                pass  # the topic has new partitions: dealt, read on
        finally:
            # Units polled but not trained are not in the checkpoint: their offsets are after
            # the trained positions, so the next run consumes them (and sends their dead
            # letters, which were not sent here).
            self.engine.end_steps()
        return self._final()

    def _steps(self) -> bool:
        """Steps until the run should finish (False) or the topic's partitions changed at a
        checkpoint (True: the engine's steps start again)."""
        last_checkpoint = last_export = last_report = time.monotonic()

        def due() -> bool:
            return time.monotonic() - last_checkpoint >= self.checkpoint_every

        def export_due() -> bool:
            return (self.export_dir is not None
                    and time.monotonic() - last_export >= self.export_every)

        def pause() -> bool:
            return self._finish or self._should_stop() or due() or export_due()

        if self._finish or self._should_stop():  # asked before any step: none is taken
            return False
        for step in self.engine.steps(self, pause):
            self._account(step)
            if time.monotonic() - last_report >= self.report_every:
                self.report()
                last_report = time.monotonic()
            if self.status_path and time.monotonic() - self._last_status >= STATUS_EVERY:
                self.write_status()  # also while idle or cut off: operators see why
            if not step.pausable:
                continue
            if self._finish or self._should_stop():
                return False
            if export_due():
                self.export()
                last_export = time.monotonic()
            if due():
                written = self.checkpoint()  # postponed (False) while dead letters wait
                last_checkpoint = time.monotonic()
                if written and self.engine.partitions_changed():
                    return True
        return False

    def _final(self) -> dict:
        if self.export_dir is not None:
            self.export()
        if not self.checkpoint(flush_timeout=60.0, final=True):
            raise RuntimeError(
                "the final checkpoint was not written: dead letters could not be delivered "
                "within 60 s (is the broker reachable?); the run resumes from the previous "
                "checkpoint")
        self.report()
        summary = self.summary()
        if self.status_path:
            self.write_status(summary)  # the final state, for scripts that read it after
        return summary

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # -- accounting --------------------------------------------------------------------------

    def _account(self, step: OnlineStep) -> None:
        """A step's counters, offsets, predictions and arrival times; the idle clock."""
        stats = self.stats
        if stats.first_unit is not None:
            stats.trainer_waited += step.waited
        for probabilities, labels in step.predictions:
            if self.pv_label is None:
                self.pv_label = next(iter(probabilities))  # the model's first head
            p, y = probabilities[self.pv_label], labels[self.pv_label]
            self.pv.add(p, y)
            self.pv_window.add(p, y)
            if self.predictions is not None:
                self.predictions.append((p, y))
        self.positions.update({int(p): int(o) for p, o in step.positions.items()})
        for p, (first, end) in step.ranges.items():
            spans = self.ranges_since_checkpoint.setdefault(int(p), [])
            if spans and spans[-1][1] == first:
                spans[-1][1] = int(end)
            else:
                spans.append([int(first), int(end)])
        if (self.export_dir is not None and step.arrivals_ms is not None
                and len(step.arrivals_ms)):
            # kept until the export holding them, with their step (a rollback drops later ones)
            self._pending_arrivals.append((self.engine.step, step.arrivals_ms))
        if self.step_log and step.log:
            first = self.engine.step - len(step.log) + 1
            self._pending_log += [json.dumps({"step": first + i, "workers": workers})
                                  for i, workers in enumerate(step.log)]
        stats.samples += step.samples
        stats.messages += step.messages
        stats.dead += step.dead
        if step.unit:
            self._trained_since_export = True
            stats.units += 1
            stats.last_unit = time.monotonic()
            if stats.first_unit is None:
                stats.first_unit, stats.first_unit_samples = stats.last_unit, step.samples
                stats.first_unit_wall_ms = time.time() * 1000
                # what the first step made alive (its tracing, Ray's clients) lives for the
                # run: out of the cyclic collector's full passes
                gc.freeze()
        if self.max_samples is not None and stats.samples >= self.max_samples:
            self._finish = True
        if step.read:
            self._idle_since = None
            self.broker_reachable = True  # it answered
        elif step.idle:
            self._idle_tick()

    def _idle_tick(self) -> None:
        """After a step that read nothing: advance the idle clock; ``_finish`` once the run
        has been idle for ``idle_exit`` s and the broker answered just now.

        Idle counts only while partitions are assigned (joining the group or a rebalance is not
        the topic being idle) and the broker answers: an unanswered probe stops the clock, and
        it restarts from the next empty step once the broker is back."""
        if not self.engine.assigned():
            self._idle_since = None
            return
        now = time.monotonic()
        expiring = (self.idle_exit is not None and self._idle_since is not None
                    and now - self._idle_since >= self.idle_exit)
        if expiring or now - self._probed_at >= PROBE_EVERY:
            if not self.engine.reachable(PROBE_TIMEOUT):
                self._idle_since = None  # first: status.json never shows idle time unreachable
                self.broker_reachable = False
                return
            self.broker_reachable = True
            self._probed_at = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif expiring:
            self._finish = True

    def idle_seconds(self) -> float:
        """How long the topic has been idle (see :meth:`_idle_tick`); 0 when it is not."""
        since = self._idle_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def _state(self) -> dict:
        """What a checkpoint holds of the run, to roll back to."""
        stats = self.stats
        return {"step": self.engine.step, "positions": dict(self.positions),
                "samples": stats.samples, "messages": stats.messages, "dead": stats.dead,
                "units": stats.units, "pv": copy.deepcopy(self.pv),
                "engine": self.engine.snapshot()}

    @property
    def checkpointed(self) -> dict | None:
        """What the latest checkpoint this run wrote (or restored) holds."""
        return self._checkpointed

    def restore(self) -> None:
        """The run back to its latest checkpoint (the engine's model rolled back there): the
        steps since are trained again."""
        state = self._checkpointed
        stats = self.stats
        self.positions = dict(state["positions"])
        stats.samples, stats.messages, stats.dead, stats.units = (
            state["samples"], state["messages"], state["dead"], state["units"])
        self.pv = copy.deepcopy(state["pv"])
        self.pv_window.reset()
        self.engine.restore_snapshot(state["engine"])
        self._last_report = (time.monotonic(), stats.samples, stats.trainer_waited)
        self.ranges_since_checkpoint = {}
        self._pending_arrivals = [(step, stamps) for step, stamps in self._pending_arrivals
                                  if step <= self.engine.step]
        if self.export_dir is not None:
            self._trained_since_export = True  # the next export is of the model rolled back
        self._pending_log = []  # steps after the checkpoint: trained again
        if self.step_log:  # lines a checkpoint wrote before the failure in it
            truncate_step_log(self.step_log, self.engine.step)
        self._finish, self._idle_since = False, None

    # -- checkpoint, then commit -------------------------------------------------------------

    def checkpoint(self, flush_timeout: float = 5.0, final: bool = False) -> bool:
        """Write a checkpoint holding the trained positions; then commit them to Kafka.

        The dead letters of the messages it covers are delivered first: if they cannot be
        within ``flush_timeout`` s, the checkpoint is postponed (returns False) and training
        goes on. A failed commit is logged and made good by the next checkpoint's commit
        (the checkpoint, not Kafka, is where a restart resumes); ``final``: the last one of
        the run, which waits for the broker's answer.

        Nothing is written when nothing changed since the latest checkpoint (no step trained,
        no offset moved): it would hold the same step and offsets again. Its offsets are
        committed again if the engine says their commit did not go through."""
        engine = self.engine
        positions = dict(self.positions)
        latest = self._checkpointed
        if latest is not None and (engine.step, positions) == (latest["step"],
                                                               latest["positions"]):
            if engine.commit_due(positions, final):
                self._commit(positions, final)
            return True
        if not engine.flush_dead_letters(flush_timeout):
            log.warning("checkpoint postponed: dead letters are not delivered yet")
            return False
        self._write_step_log()
        started = time.monotonic()
        engine.save_checkpoint(self.checkpoints, positions, self.ranges_since_checkpoint)
        for observe in self.timing_observers:
            observe("checkpoint", time.monotonic() - started)
        self.stats.checkpoints += 1
        self._checkpointed = self._state()
        self._commit(positions, final)
        self.ranges_since_checkpoint = {}
        return True

    def _write_step_log(self) -> None:
        """The steps trained since the previous checkpoint, appended to the step log (before
        the checkpoint that holds them)."""
        if not self.step_log or not self._pending_log:
            return
        with open(self.step_log, "a") as f:
            f.write("".join(line + "\n" for line in self._pending_log))
            f.flush()
            os.fsync(f.fileno())
        self._pending_log = []

    def _commit(self, positions: dict, wait: bool) -> None:
        """Commit ``positions`` (held by a durable checkpoint); ``wait``: for the broker's
        answer (the last commit of a run), else it may only be sent."""
        crash_point("offsets.commit")  # see native.crash_points
        self.engine.commit(positions, wait)
        crash_point("offsets.committed")

    # -- exports -----------------------------------------------------------------------------

    def export(self) -> None:
        """Export store deltas (upserts and tombstones) and the dense weights for serving: a
        full export after the first unit, then a version whenever something was trained
        since the last export. Every sample trained into it counts its delay from its Kafka
        arrival to now, when the version is published."""
        if not self._trained_since_export:
            return  # nothing new (and before the first unit, nothing a server could use)
        pending = [stamps for _, stamps in self._pending_arrivals]
        stamps = np.concatenate(pending) if pending else np.zeros(0, np.int64)
        if len(stamps):
            self.newest_arrival = max(self.newest_arrival or 0.0, float(stamps.max()) / 1000)
        started = time.monotonic()
        self.engine.export(self.export_dir, self.newest_arrival)
        published_ms = time.time() * 1000
        for observe in self.timing_observers:
            observe("export", time.monotonic() - started)
        self._trained_since_export = False
        self._pending_arrivals = []
        self.stats.exports += 1
        if len(stamps):
            delays = published_ms - stamps
            self.stats.delays.add(delays)
            self.stats.steady_delays.add(delays[stamps >= self.stats.first_unit_wall_ms])
            self.last_delay = {"p50": float(np.percentile(delays, 50)) / 1000,
                               "p99": float(np.percentile(delays, 99)) / 1000}
            if self._writer is not None:
                from trainer.fitting import write_scalars

                write_scalars(self._writer, self.engine.step,
                              {"delay/p50_s": self.last_delay["p50"],
                               "delay/p99_s": self.last_delay["p99"]})
        if self.on_export is not None:
            self.on_export(self)

    # -- reports -----------------------------------------------------------------------------

    def report(self) -> None:
        """One console line and TensorBoard scalars: samples/s since the last report, the
        share of that time spent waiting for input, consumer lag, store rows
        admitted/rejected/expired, dead letters, progressive validation, the latest export's
        delay."""
        now = time.monotonic()
        then, samples_then, waited_then = self._last_report
        interval = max(now - then, 1e-9)
        rate = (self.stats.samples - samples_then) / interval
        # near 0 while the topic has a backlog: training is the bottleneck
        waited = (self.stats.trainer_waited - waited_then) / interval
        self._last_report = (now, self.stats.samples, self.stats.trainer_waited)
        self.last_lag = self.engine.lag(self.positions)
        store = self.engine.store_stats()
        pv, window = self.pv.result(), self.pv_window.result()
        self.pv_window.reset()
        self.last_pv_window = window
        log.info(*self.engine.report_line(self, {
            "rate": rate, "waited": waited, "store": store, "pv": pv, "window": window,
            "delay": {k: "n/a" if v is None else f"{v:.2f} s"
                      for k, v in self.last_delay.items()}}))
        if self._writer is not None:
            from trainer.fitting import write_scalars

            write_scalars(self._writer, self.engine.step, report_scalars(
                rate=rate, dead_letters=self.stats.dead, store=store, lag=self.last_lag,
                pv=pv, window=window, waited=waited))

    def write_status(self, summary: dict | None = None) -> None:
        """Replace ``status.json`` with ``summary`` (default: the summary now, without what
        the engine would have to ask its actors for) for operators and scripts: how far the
        run is, without reading logs."""
        self.snapshot = summary if summary is not None else self.summary(timings=False)
        write_status(self.status_path, self.snapshot)
        self._last_status = time.monotonic()

    def summary(self, timings: bool = True) -> dict:
        """The run so far; the same keys from every engine. ``units`` are polls trained in
        process and steps on Ray; ``timings`` False: the engine's ``timings`` and
        ``busy_seconds`` may be None (on Ray, asking every worker would wait for its poll)."""
        now = time.monotonic()
        stats = self.stats
        seconds = now - stats.started
        store = self.engine.store_stats()
        return {
            "engine": self.engine.kind,
            "samples": stats.samples, "messages": stats.messages, "units": stats.units,
            "dead_letters": stats.dead, "steps": self.engine.step,
            "seconds": round(seconds, 3),
            **run_rates(stats.samples, seconds, stats.units, stats.first_unit,
                        stats.last_unit, stats.first_unit_samples),
            # progressive validation: the whole run, and the window the latest console
            # line reported (None before the first line)
            "pv": {**self.pv.result(), "label": self.pv_label, "window": self.last_pv_window},
            "broker_reachable": self.broker_reachable,
            "idle_s": round(self.idle_seconds(), 3),
            "assigned": sorted(self.engine.assigned()),
            "since_last_unit_s": (round(now - stats.last_unit, 3) if stats.last_unit
                                  else None),
            "checkpoints": stats.checkpoints, "exports": stats.exports,
            "store_rows": store.get("rows", 0), "store_bytes": store.get("bytes", 0),
            "admitted": store.get("admitted", 0), "rejected": store.get("rejected", 0),
            "expired": store.get("expired", 0),
            "delay_s": stats.delays.percentiles(),
            "steady_delay_s": stats.steady_delays.percentiles(), "lag": self.last_lag,
            "trainer_waited_s": round(stats.trainer_waited, 3),
            "offsets": {str(p): o for p, o in sorted(self.positions.items())},
            "metrics_url": self.metrics_url,
            # tables with a memory budget: rows and bytes in memory and on disk, hit rate...
            **({"tiers": store["tiers"]} if "tiers" in store else {}),
            # workers, shards, assignment, bytes_per_step, recoveries, busy_seconds, timings
            **self.engine.summary(self, timings)}


def truncate_step_log(path: str, step: int) -> None:
    """Drop the lines of steps after ``step`` from the step log ``path`` (written before a
    checkpoint that was never finished: those steps are trained again after the restart).

    The step log (``--step-log``, ``RUN_DIR/steps.jsonl``) says which messages every step
    trained, one line a step: ``{"step": k, "workers": [{"ranges": {partition: [first,
    next]}, "samples": n, "batch": [i, m]}, ...]}``: ``batch`` says the worker (in process:
    the one) trained the i-th of its unit's m batches, and ``ranges`` are the unit's, on the
    step that trained its last batch, else empty. Lines are appended at every checkpoint, so
    a single-process replay of the log reproduces the checkpoint's model."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def init_from(run_dir: str, schema, load: Callable):
    """``--init-from RUN_DIR``: what ``load(run_dir)`` returns first of ``(model, the schema
    dict it was trained on)``, the model a batch run (in process or on Ray) kept.
    OnlineUsageError when it cannot be read or was trained on another schema than
    ``schema``."""
    from trainer.checkpoints import CheckpointDamagedError
    from trainer.distributed.manifest import schema_difference

    try:
        kept, kept_schema = load(run_dir)
    except (FileNotFoundError, ValueError, CheckpointDamagedError) as e:
        raise OnlineUsageError(f"--init-from {run_dir}: {e}") from None
    if kept_schema != schema.to_dict():
        raise OnlineUsageError(
            f"--init-from {run_dir}: the batch run was trained on another schema "
            f"({schema_difference(kept_schema, schema.to_dict())})")
    return kept


def metric_text(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def run_online(loop: OnlineLoop, metrics_host: str, metrics_port: int | None) -> dict:
    """The command's run of ``loop``: Prometheus metrics on ``metrics_host:metrics_port``
    (None: none), SIGINT and SIGTERM finishing the run cleanly (a second one stops it at
    once), the loop's summary."""
    from trainer.online_report import serve_metrics
    from trainer.runs import StopOnSignal
    from compression.signal_points import signal_point

    metrics = None
    try:
        if metrics_port is not None:
            try:  # served from the summary the loop refreshes (its status.json)
                metrics = serve_metrics(loop, metrics_host, metrics_port)
            except OSError as e:
                raise OnlineServiceError(f"--metrics-port {metrics_port}: cannot listen on "
                                       f"{metrics_host}: {e.strerror}") from None
            loop.metrics_url = f"http://{metrics_host}:{metrics.server_port}/metrics"
            log.info("metrics on %s", loop.metrics_url)
        if loop.engine.kind == "process":  # (on Ray, the actors' points came before)
            signal_point("source.opened")
        with StopOnSignal() as stop:  # from here a signal finishes the run cleanly
            signal_point("run.started")
            return loop.run(lambda: stop.signum is not None)
    finally:
        if metrics is not None:
            metrics.shutdown()

