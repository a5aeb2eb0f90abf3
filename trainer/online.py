"""Online learning: train continuously from a Kafka topic, checkpoint with offsets, export deltas.

    python -m trainer.online --schema S --bootstrap-servers HOST:PORT --topic samples \\
        --group ctr-online --run-dir run/ [--export-dir export/ --export-every 10]

The loop, and why it is crash-exact:

1. A reader thread consumes up to a batch of messages, decodes them in bulk (malformed ones
   are set aside as dead letters), compresses the samples into trees and cuts them into
   TreeBatches. One such *unit* carries the consumer positions after its last message.
2. The main thread trains every batch of a unit (store lookups, TensorFlow step, store
   updates). Only then do the unit's positions become the *trained* positions, and its dead
   letters are sent to ``TOPIC.dlq``.
3. Every ``--checkpoint-every`` seconds, between units, it writes a checkpoint (dense weights,
   stores, step, the trained positions and the offset ranges trained since the previous
   checkpoint) atomically, once the dead letters sent so far are delivered, and only after
   that commits the same offsets to Kafka.
4. On start it restores the latest checkpoint and seeks every partition to its offsets.

So after a crash at any moment the restored model has trained exactly the messages before the
checkpoint's offsets, and training resumes right after them: nothing lost, nothing twice.
A malformed message's dead letter is written once when the run meets no crash (units polled
but not trained when it stops are read, and dead-lettered, by the next run); after a crash,
those of the units trained since the last checkpoint are written again.
With ``--workers W --shards S`` the same command trains on Ray, with the same guarantee
(:mod:`trainer.distributed.online`).
SIGTERM (or Ctrl-C) finishes the current unit, checkpoints, commits and exits 0; one that comes
while the command starts (TensorFlow, the broker, the model, Ray and its actors) ends it with
exit 0 and nothing trained. A checkpoint is written only when something changed since the
previous one (a trained batch or new offsets): an idle run does not rewrite the same checkpoint
every ``--checkpoint-every`` s.

``--idle-exit S`` stops the run (checkpoint, commit, exit 0) once the topic has been idle for S
seconds, where *idle* means: partitions are assigned, the broker answers, and the consumer has
nothing to read. Time without partitions (joining the group, a rebalance) and time while the
broker cannot be reached is not idle: an empty poll cannot tell "no new messages" from "no
broker", so whenever polls come back empty the reader asks the partitions' leaders for their
offsets (at most every ``PROBE_EVERY`` s); an unanswered request restarts the idle clock, and
the trainer keeps retrying, however long the outage lasts. Just before it stops, the reader
asks once more, so a run never gives up while the broker is away.

On an object store (``--run-dir s3://bucket/online``, ``gs://``...): the run works in a local copy
of the run directory (downloaded at start: the published checkpoints, so a restart resumes from
the store) and publishes it whole after every checkpoint, before the checkpoint's offsets are
committed, and once more at the end (final ``status.json``, TensorBoard logs): its files under a
hidden generation, ``_MANIFEST.json`` written last (:mod:`compression.fs`), so the store holds the
previous checkpoint or the new one, never a mix. ``--export-dir`` and ``--init-from`` may be on a
store too (see :func:`trainer.serving.export_increment`).

Progressive validation: every training step's probabilities are computed with the weights and
rows *before* that step's update, so each sample is scored by a model that has not trained on
it yet. Their AUC and log loss (of the model's first head), over the whole run and over the
window since the previous console line, go to the console, ``status.json``, the final summary
and TensorBoard (``pv/*``): the online counterpart of a held-out evaluation, at no extra cost.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import queue
import signal
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

import compression
import schemas
from compression import fs, kafka
from compression.messages import DEFAULT_MAX_MESSAGE_BYTES
from native.crash_points import crash_point
from compression.signal_points import signal_point
from compression import cli
from trainer.checkpoints import CheckpointManager
from trainer.config import ConfigError, TrainConfig
from trainer.kafka_source import DEFAULT_UNIT_BATCHES, KafkaSampleSource
from trainer.metrics import DelayHistogram, ProgressiveValidation, run_rates
from trainer.online_report import (STATUS_EVERY, STATUS_FILE, TENSORBOARD_DIR, report_scalars,
                                   serve_metrics, write_status)
from trainer.ray_address import check_ray_address
from trainer.runs import MODEL_NAMES, load_tensorflow

if TYPE_CHECKING:  # TensorFlow is imported once the arguments are parsed (a fast --help)
    from trainer.trainer import Trainer

PROG = "python -m trainer.online"

log = logging.getLogger("trainer.online")
DEFAULT_READER_NICE = 10
# While polls come back empty, the reader checks at most this often (seconds) that the
# partitions' leaders answer, waiting up to PROBE_TIMEOUT s: an outage is not idle time.
PROBE_EVERY = 1.0
PROBE_TIMEOUT = 2.0
_IDLE = object()  # the reader's last item when the topic was idle for --idle-exit seconds


def default_unit_samples(batch_size: int) -> int:
    """Samples a unit holds unless ``--unit-samples`` says otherwise."""
    return DEFAULT_UNIT_BATCHES * batch_size


@dataclass
class Unit:
    """Batches cut from one poll, and the consumer positions after it."""

    batches: list
    samples: int
    positions: dict
    ranges: dict
    timestamps_ms: np.ndarray
    dead_letters: list  # compression.DeadLetter each, sent once the unit is trained
    messages: int

    @property
    def dead(self) -> int:
        return len(self.dead_letters)


@dataclass
class OnlineStats:
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
    # the reader thread's busy seconds (the trainer's own are in Trainer.timings)
    reader_seconds: dict = field(default_factory=lambda: {"poll_decode": 0.0,
                                                         "compress_batch": 0.0})
    # seconds the training thread waited for the reader's next unit after the first unit
    # (above ~0 the reader, i.e. Kafka and decoding, limits the rate; else training does)
    trainer_waited: float = 0.0


class OnlineTrainer:
    """Owns the trainer, the Kafka source, checkpoints and exports of one online run."""

    def __init__(self, schema: schemas.Schema, trainer: Trainer, source: KafkaSampleSource,
                 checkpoints: CheckpointManager, checkpoint_every: float = 30.0,
                 export_dir: str | None = None, export_every: float = 10.0,
                 max_samples: int | None = None, idle_exit: float | None = None,
                 poll_timeout: float = 0.2, status_path: str | None = None,
                 on_export=None, log_dir: str | None = None, report_every: float = 10.0,
                 reader_nice: int = DEFAULT_READER_NICE, unit_samples: int | None = None,
                 record_predictions: bool = False, calibrate: bool = False):
        self.schema = schema
        # a new run's model: shift its output biases to the first batch's label rates first
        # (Trainer.calibrate_output), so it starts at the constant predictor, not at 0.5
        self.calibrate = calibrate
        self.trainer = trainer
        self.source = source
        self.checkpoints = checkpoints
        self.checkpoint_every = checkpoint_every
        self.export_dir = export_dir
        self.export_every = export_every
        self.max_samples = max_samples
        self.idle_exit = idle_exit
        self.poll_timeout = poll_timeout
        self.status_path = status_path
        self.on_export = on_export  # called with this OnlineTrainer after every export
        self.log_dir = log_dir        # TensorBoard scalars (None: none)
        self.report_every = report_every  # seconds between console lines and scalars
        self.reader_nice = reader_nice    # niceness added to the reader thread (0: none)
        self.reader_thread_id: int | None = None
        self.unit_samples = (unit_samples if unit_samples is not None
                             else default_unit_samples(trainer.config.batch_size))
        if self.unit_samples < 1:
            raise ValueError(f"unit_samples must be at least 1, got {self.unit_samples}")
        self._writer = None
        self._last_status = 0.0
        self._last_report = (time.monotonic(), 0, 0.0)  # (when, samples, trainer_waited then)
        self.last_lag: int | None = None
        self.last_delay: dict = {"p50": None, "p99": None}  # of the latest export
        # Kafka arrival time (Unix s) of the newest sample trained into the latest export
        self.newest_arrival: float | None = None
        self._trained_since_export = False
        self.snapshot: dict | None = None   # the latest summary (status.json, /metrics)
        self.metrics_url: str | None = None
        self.timing_observers: list = []    # called with ("checkpoint"|"export", seconds)
        self.stats = OnlineStats()
        # progressive validation of the first head: the whole run, and since the last report
        self.pv = ProgressiveValidation()
        self.pv_window = ProgressiveValidation()
        self.pv_label: str | None = None
        self.last_pv_window: dict | None = None  # the window of the latest report
        # (probabilities, labels) of every batch, in training order (for tests and analysis;
        # grows with the run, so off by default)
        self.predictions: list | None = [] if record_predictions else None
        # the idle clock, kept by the reader (see the module docstring)
        self.broker_reachable: bool | None = None  # the latest probe's answer
        self._idle_since: float | None = None
        self._assigned: list = []
        self._probed_at = float("-inf")
        self.trained_positions = dict(source.positions)
        # what the latest checkpoint (or the restored one) holds
        self._checkpointed = (trainer.step, dict(source.positions))
        self.ranges_since_checkpoint: dict[int, list] = {}
        self._pending_timestamps: list = []
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the consumer is used by the reader and by commits
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._reader_error: list = []

    def stop(self, *_):
        """Ask the loop to finish the current unit, checkpoint, commit and return."""
        self._stop.set()

    # -- the reader thread: consume, decode, compress, batch -------------------------------

    def _read(self):
        self.reader_thread_id = threading.get_native_id()
        if self.reader_nice > 0:
            # The training step runs on every core; a reader thread at the same priority takes
            # one of them mid-step and the step's other threads wait for it (measured: the step
            # took 2-3x longer). At a lower priority it fills the time the step leaves.
            try:
                os.setpriority(os.PRIO_PROCESS, self.reader_thread_id,
                               os.getpriority(os.PRIO_PROCESS, self.reader_thread_id)
                               + self.reader_nice)
            except OSError as e:
                log.warning("could not lower the reader thread's priority: %s", e)
        batch_size = self.trainer.config.batch_size
        # A unit holds about unit_samples samples whatever the format: a tree message holds
        # many, so ask for as many messages as the samples per message so far suggest.
        seen_samples = seen_messages = 0
        try:
            while not self._stop.is_set():
                if seen_samples:
                    ask = max(1, round(self.unit_samples * seen_messages / seen_samples))
                else:
                    ask = self.unit_samples if self.source.format == "json" else 1
                t0 = time.perf_counter()
                t0_monotonic = time.monotonic()
                with self._lock:
                    polled = self.source.poll(ask, self.poll_timeout)
                    positions = dict(self.source.positions)
                    # a copy for status.json: the rebalance callbacks change the set in place
                    self._assigned = sorted(self.source.assigned)
                t1 = time.perf_counter()
                if not polled.messages:
                    if self._idle_tick(t0_monotonic):
                        self._put(_IDLE)  # after every unit polled before: all are trained
                        return
                    self._put(None)  # an idle tick, so the trainer can checkpoint on time
                    continue
                self._idle_since = None
                self.broker_reachable = True
                seen_samples += polled.num_samples
                seen_messages += polled.messages
                batches = []
                if polled.num_samples:
                    trees = (compression.build_trees(polled.samples, self.schema, validate=False)
                             if polled.samples is not None else polled.trees)
                    # prepared here, off the training thread (numpy feed work and tensors)
                    batches = [self.trainer.prepare(b) for b in compression.iter_batches(
                        trees, self.schema, batch_size, self.trainer.config.split_trees)]
                self.stats.reader_seconds["poll_decode"] += t1 - t0
                self.stats.reader_seconds["compress_batch"] += time.perf_counter() - t1
                self._put(Unit(batches, polled.num_samples, positions, polled.ranges,
                               polled.timestamps_ms, polled.dead_letters, polled.messages))
        except BaseException as e:  # surfaced by the main loop
            self._reader_error.append(e)
            self._put(None)

    def _idle_tick(self, poll_started: float) -> bool:
        """After an empty poll that began at ``poll_started``: advance the idle clock; True when
        the run has been idle for ``idle_exit`` s and the broker answered just now.

        Idle counts only while partitions are assigned (joining the group or a rebalance is not
        the topic being idle) and the broker answers: an unanswered probe stops the clock, and
        it restarts from the next empty poll once the broker is back."""
        if not self.source.assigned:
            self._idle_since = None
            return False
        now = time.monotonic()
        expiring = (self.idle_exit is not None and self._idle_since is not None
                    and now - self._idle_since >= self.idle_exit)
        if expiring or now - self._probed_at >= PROBE_EVERY:
            with self._lock:
                reachable = self.source.reachable(PROBE_TIMEOUT)
            if not reachable:
                self._idle_since = None  # first: status.json never shows idle time unreachable
                self.broker_reachable = False
                return False
            self.broker_reachable = True
            self._probed_at = time.monotonic()
        if self._idle_since is None:
            self._idle_since = poll_started
            return False
        return expiring

    def idle_seconds(self) -> float:
        """How long the topic has been idle (see :meth:`_idle_tick`); 0 when it is not."""
        since = self._idle_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def _put(self, item):
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    # -- the main loop: train, expire, export, checkpoint ----------------------------------

    def run(self) -> dict:
        # Python's cyclic collector runs whenever enough objects were allocated (every poll
        # makes one per message) and, in a full pass, walks every object alive, TensorFlow's
        # hundreds of thousands included, holding the GIL the training step needs. Objects
        # alive at start-up live for the whole run: freeze them out of the collector's passes
        # (measured: 1.5 s of collection per 500k samples fell to 0.3 s).
        gc.freeze()
        reader = threading.Thread(target=self._read, name="online-reader", daemon=True)
        reader.start()
        last_checkpoint = last_export = last_report = time.monotonic()
        if self.log_dir:
            import tensorflow as tf

            self._writer = tf.summary.create_file_writer(self.log_dir)
        try:
            self.trainer.trace()  # while the reader joins the group and polls its first unit
            while not self._stop.is_set():
                waiting = time.monotonic()
                try:
                    unit = self._queue.get(timeout=0.5)
                except queue.Empty:
                    unit = None
                if self._reader_error:
                    raise self._reader_error[0]
                now = time.monotonic()
                if unit is _IDLE:  # idle for --idle-exit s (see _idle_tick)
                    break
                if unit is not None and self.stats.first_unit is not None:
                    self.stats.trainer_waited += now - waiting
                if unit is not None:
                    self._train(unit)
                if self.export_dir and now - last_export >= self.export_every:
                    self.export()
                    last_export = time.monotonic()
                if now - last_checkpoint >= self.checkpoint_every:
                    self.checkpoint()  # postponed (returns False) while dead letters wait
                    last_checkpoint = time.monotonic()
                if now - last_report >= self.report_every:
                    self.report()
                    last_report = time.monotonic()
                if self.status_path and time.monotonic() - self._last_status >= STATUS_EVERY:
                    self.write_status()  # also while idle or cut off: operators see why
                if self.max_samples is not None and self.stats.samples >= self.max_samples:
                    break
        finally:
            self._stop.set()
            reader.join(timeout=10)
        # Units the reader polled but we did not train are simply not in the checkpoint:
        # their offsets are after the trained positions, so the next run consumes them (and
        # sends their dead letters, which were not sent here).
        if self.export_dir:
            self.export()
        if not self.checkpoint(flush_timeout=60.0, final=True):
            raise RuntimeError(
                f"the final checkpoint was not written: dead letters to "
                f"{self.source.dlq_topic!r} could not be delivered within 60 s (is the broker "
                "reachable?); the run resumes from the previous checkpoint")
        self.report()
        if self._writer is not None:
            self._writer.close()
        if self.status_path:
            self.write_status()  # the final state, for scripts that read it after the run
        return self.summary()

    def _train(self, unit: Unit):
        self._trained_since_export = True
        for batch in unit.batches:
            if self.calibrate:
                self.calibrate = False
                for label, (rate, shift) in self.trainer.calibrate_output(batch).items():
                    log.info("new model: %s output bias shifted by %+.3f to the first "
                             "batch's rate %.4f", label, shift, rate)
            # the probabilities of the step, computed before its update: progressive validation
            _, probabilities, labels = self.trainer.train_batch(batch, predictions=True)
            if self.pv_label is None:
                self.pv_label = next(iter(probabilities))  # the model's first head
            p, y = probabilities[self.pv_label], labels[self.pv_label]
            self.pv.add(p, y)
            self.pv_window.add(p, y)
            if self.predictions is not None:
                self.predictions.append((p, y))
        self.trained_positions.update(unit.positions)
        self.source.send_dead_letters(unit.dead_letters)  # delivered before the checkpoint
        for p, (first, end) in unit.ranges.items():
            spans = self.ranges_since_checkpoint.setdefault(int(p), [])
            if spans and spans[-1][1] == first:
                spans[-1][1] = end
            else:
                spans.append([first, end])
        if len(unit.timestamps_ms):
            self._pending_timestamps.append(unit.timestamps_ms)
        if self.stats.first_unit is None:
            gc.freeze()  # and what the first step's tracing made
            self.stats.first_unit = time.monotonic()
            self.stats.first_unit_wall_ms = time.time() * 1000
            self.stats.first_unit_samples = unit.samples
        self.stats.last_unit = time.monotonic()
        self.stats.samples += unit.samples
        self.stats.messages += unit.messages
        self.stats.dead += unit.dead
        self.stats.units += 1

    def write_status(self):
        """Replace ``status.json`` in the run dir with the current summary (for operators and
        scripts: how far the run is, without reading logs)."""
        self.snapshot = self.summary()  # what the metrics endpoint reports
        write_status(self.status_path, self.snapshot)
        self._last_status = time.monotonic()

    def checkpoint(self, flush_timeout: float = 5.0, final: bool = False) -> bool:
        """Write a checkpoint holding the trained positions; then commit them to Kafka.

        The dead letters of the messages it covers are delivered first: if they cannot be
        within ``flush_timeout`` s, the checkpoint is postponed (returns False) and training
        goes on. The commit is only sent (``final``: sent and answered, see :meth:`_commit`);
        a failed commit is logged and made good by the next checkpoint's commit.

        Nothing is written when nothing changed since the latest checkpoint (no step trained,
        no offset moved): it would hold the same step and offsets again. Its offsets are
        committed again if their commit did not go through."""
        positions = dict(self.trained_positions)
        if (self.trainer.step, positions) == self._checkpointed:
            source = self.source
            uncommitted = any(source.committed.get(p) != o for p, o in positions.items()
                              if p in source.assigned)
            if uncommitted and (final or not source.commits_in_flight):
                self._commit(positions, final)
            return True
        if not self.source.flush_dead_letters(flush_timeout):
            log.warning("checkpoint postponed: dead letters are not delivered yet")
            return False
        state = {"step": self.trainer.step, "samples": self.trainer.samples,
                 "offsets": {str(p): o for p, o in sorted(positions.items())},
                 "trained_ranges": {str(p): spans for p, spans in
                                    sorted(self.ranges_since_checkpoint.items())},
                 "previous": (self.checkpoints.latest().path if self.checkpoints.latest()
                              else None),
                 "topic": self.source.topic, "time": time.time()}
        started = time.monotonic()
        self.checkpoints.save(lambda d: self.trainer.save(os.path.join(d, "model")), state)
        for observe in self.timing_observers:
            observe("checkpoint", time.monotonic() - started)
        self._checkpointed = (state["step"], positions)
        self._commit(positions, final)
        self.ranges_since_checkpoint = {}
        self.stats.checkpoints += 1
        return True

    def _commit(self, positions: dict, wait: bool) -> None:
        """Commit ``positions`` (held by a durable checkpoint). While the run goes on, only
        send the commit: a synchronous one waits as long as the broker is away, and the
        training thread with it (the reader too: they share the lock). The last one of a run
        waits for the broker's answer, so Kafka holds the final offsets when the run ends."""
        with self._lock:
            crash_point("offsets.commit")  # see native.crash_points
            self.source.commit(positions, asynchronous=not wait)
            crash_point("offsets.committed")

    def export(self):
        """Export store deltas (upserts and tombstones) and the dense weights for serving: a
        full export after the first unit, then a version whenever something was trained
        since the last export."""
        from trainer.serving import export_increment  # serving pieces live there

        if not self._trained_since_export:
            return  # nothing new (and before the first unit, nothing a server could use)
        self._trained_since_export = False

        if self._pending_timestamps:
            stamps = np.concatenate(self._pending_timestamps)
            if len(stamps):
                self.newest_arrival = max(self.newest_arrival or 0.0, float(stamps.max()) / 1000)
        started = time.monotonic()
        export_increment(self.trainer, self.export_dir, newest_sample_time=self.newest_arrival)
        for observe in self.timing_observers:
            observe("export", time.monotonic() - started)
        now_ms = time.time() * 1000
        if self._pending_timestamps:
            self._pending_timestamps = []
            delays = now_ms - stamps
            self.stats.delays.add(delays)
            self.stats.steady_delays.add(delays[stamps >= self.stats.first_unit_wall_ms])
            self.last_delay = {"p50": float(np.percentile(delays, 50)) / 1000,
                               "p99": float(np.percentile(delays, 99)) / 1000}
            if self._writer is not None:
                from trainer.fitting import write_scalars

                write_scalars(self._writer, self.trainer.step,
                              {"delay/p50_s": self.last_delay["p50"],
                               "delay/p99_s": self.last_delay["p99"]})
        self.stats.exports += 1
        if self.on_export is not None:
            self.on_export(self)

    def report(self):
        """One console line and TensorBoard scalars: samples/s since the last report, consumer
        lag, store rows admitted/rejected/expired, dead letters, the latest export's delay."""
        now = time.monotonic()
        then, samples_then, waited_then = self._last_report
        rate = (self.stats.samples - samples_then) / max(now - then, 1e-9)
        # the share of the time the training thread waited for input: near 0 while the topic
        # has a backlog means training is the bottleneck (more cores or more trainers)
        waited = (self.stats.trainer_waited - waited_then) / max(now - then, 1e-9)
        self._last_report = (now, self.stats.samples, self.stats.trainer_waited)
        with self._lock:
            self.last_lag = self.source.lag()
        store = self.trainer.store_stats()
        delay = {k: "n/a" if v is None else f"{v:.2f} s" for k, v in self.last_delay.items()}
        pv, window = self.pv.result(), self.pv_window.result()
        self.pv_window.reset()
        self.last_pv_window = window
        log.info("%s samples, %s samples/s (waited for input %.0f%%), lag %s messages, %s store "
                 "rows (admitted %s, rejected %s, expired %s), %d dead letters, export delay p50 "
                 "%s p99 %s, progressive validation AUC %s logloss %s (since the last line: AUC "
                 "%s logloss %s)", f"{self.stats.samples:,}", f"{rate:,.0f}", 100 * waited,
                 "n/a" if self.last_lag is None else f"{self.last_lag:,}",
                 f"{store.get('rows', 0):,}", f"{store.get('admitted', 0):,}",
                 f"{store.get('rejected', 0):,}", f"{store.get('expired', 0):,}",
                 self.stats.dead, delay["p50"], delay["p99"], _metric(pv["auc"]),
                 _metric(pv["logloss"]), _metric(window["auc"]), _metric(window["logloss"]))
        if self._writer is not None:
            from trainer.fitting import write_scalars

            write_scalars(self._writer, self.trainer.step, report_scalars(
                rate=rate, dead_letters=self.stats.dead, store=store, lag=self.last_lag,
                pv=pv, window=window, waited=waited))

    def summary(self) -> dict:
        now = time.monotonic()
        seconds = now - self.stats.started
        store = self.trainer.store_stats()
        return {"samples": self.stats.samples, "messages": self.stats.messages,
                "units": self.stats.units,
                "dead_letters": self.stats.dead, "steps": self.trainer.step,
                "seconds": round(seconds, 3),
                **run_rates(self.stats.samples, seconds, self.stats.units,
                            self.stats.first_unit, self.stats.last_unit,
                            self.stats.first_unit_samples),
                # progressive validation: the whole run, and the window the latest console
                # line reported (None before the first line)
                "pv": {**self.pv.result(), "label": self.pv_label,
                       "window": self.last_pv_window},
                "broker_reachable": self.broker_reachable,
                "idle_s": round(self.idle_seconds(), 3),
                "assigned": self._assigned,
                "since_last_unit_s": (round(now - self.stats.last_unit, 3)
                                      if self.stats.last_unit else None),
                "checkpoints": self.stats.checkpoints, "exports": self.stats.exports,
                "store_rows": store.get("rows", 0), "admitted": store.get("admitted", 0),
                "rejected": store.get("rejected", 0), "expired": store.get("expired", 0),
                "delay_s": self.stats.delays.percentiles(),
                "steady_delay_s": self.stats.steady_delays.percentiles(), "lag": self.last_lag,
                "busy_seconds": {**{k: round(v, 3) for k, v in self.stats.reader_seconds.items()},
                                 **{k: round(self.trainer.timings[k], 3)
                                    for k in ("lookup", "step", "update")}},
                "trainer_waited_s": round(self.stats.trainer_waited, 3),
                "offsets": {str(p): o for p, o in sorted(self.trained_positions.items())},
                "metrics_url": self.metrics_url}


def _metric(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=textwrap.fill(
            "Train continuously from a Kafka topic of samples with crash-exact "
            "recovery: checkpoints hold the consumed offsets, which are committed to "
            "Kafka only after the checkpoint is durable."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=cli.epilog(
            f"{PROG} --schema schemas/examples/taobao_like.yaml --bootstrap-servers "
            "localhost:9092 --topic samples --group ctr-online --run-dir runs/online "
            "--export-dir export/ --export-every 10",
            notes="SIGINT and SIGTERM stop a run cleanly: the last unit is trained, a checkpoint "
                  "written, its offsets committed, and the command exits 0; starting it again "
                  "with the same --run-dir resumes from that checkpoint.",
            exit_codes=cli.SERVICE_EXIT_CODES))
    cli.add_debug_flag(parser)
    parser.add_argument("--schema", required=True, help="schema YAML")
    parser.add_argument("--bootstrap-servers", required=True, help="Kafka HOST:PORT[,...]")
    parser.add_argument("--topic", required=True, help="topic of samples")
    parser.add_argument("--format", choices=["json", "trees"], default="json",
                        help="json: one raw sample per message; trees: Arrow IPC tree batches "
                             "from pipelines.stream_compress (default json)")
    parser.add_argument("--group", required=True, help="consumer group id")
    parser.add_argument("--run-dir", required=True,
                        help="checkpoints and TensorBoard logs; restored from on start. On "
                             "an object store (s3://...): a local working copy published "
                             "there after every checkpoint")
    parser.add_argument("--config", help="trainer YAML (see trainer/examples/mlp.yaml)")
    parser.add_argument("--model", choices=sorted(MODEL_NAMES),
                        help="built-in model for a new run (default mlp)")
    parser.add_argument("--init-from", metavar="RUN_DIR",
                        help="start a new run from the model a trainer.train run kept (in "
                             "process or on Ray): its dense weights, every embedding row with "
                             "its optimizer state and counters, the entry filters' state, its "
                             "step and config; what the batch run saw counts as seen. Ignored "
                             "once --run-dir holds a checkpoint of its own")
    parser.add_argument("--export-dir", help="write store deltas and dense weights here "
                                             "(a local directory or s3://..., gs://...)")
    parser.add_argument("--export-every", type=float, default=10.0,
                        help="seconds between exports (default 10)")
    parser.add_argument("--checkpoint-every", type=float, default=30.0,
                        help="seconds between checkpoints (default 30)")
    parser.add_argument("--expire-every", type=int, metavar="N",
                        help="run the config's expiry (idle steps/seconds or its "
                             "module:function) every N steps instead of its every_steps")
    parser.add_argument("--report-every", type=float, default=10.0,
                        help="seconds between console lines and TensorBoard points "
                             "(samples/s, lag, store rows, delay; default 10)")
    parser.add_argument("--max-samples", type=int,
                        help="stop (checkpoint, commit, exit 0) after this many samples")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve Prometheus metrics on http://HOST:PORT/metrics (0: a free "
                             "port; the address goes to the log and to status.json)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address of the metrics endpoint (default 127.0.0.1)")
    parser.add_argument("--idle-exit", type=float, metavar="S",
                        help="stop (checkpoint, commit, exit 0) after S idle seconds: seconds "
                             "in which partitions were assigned, the broker answered and there "
                             "was nothing to read. Joining the group, a rebalance and a broker "
                             "outage are not idle: the trainer keeps retrying through them")
    parser.add_argument("--reader-nice", type=int, default=DEFAULT_READER_NICE, metavar="N",
                        help="lower the priority of the thread that consumes, decodes and "
                             "batches by N (0-19) so the training step keeps the cores "
                             f"(default {DEFAULT_READER_NICE}; 0 to leave it)")
    parser.add_argument("--unit-samples", type=int, metavar="N",
                        help="samples polled, compressed into trees and trained as one unit "
                             "when the topic has them (more of a user's samples share one "
                             f"tree; default {DEFAULT_UNIT_BATCHES} batches; with --workers W, "
                             "each worker polls its share: 1/W of it)")
    parser.add_argument("--dead-letter-topic",
                        help="topic for malformed messages (default: TOPIC.dlq)")
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                        help="larger messages go to the dead-letter topic "
                             f"(default {DEFAULT_MAX_MESSAGE_BYTES})")
    ray = parser.add_argument_group("online learning on Ray (see the README)")
    ray.add_argument("--workers", type=int, metavar="W",
                     help="online workers (Ray actors), each reading its share of the topic's "
                          "partitions; with --shards, the embedding tables are sharded over S "
                          "store actors (default: one process, no Ray)")
    ray.add_argument("--shards", type=int, metavar="S", help="store shards (Ray actors)")
    ray.add_argument("--ray-address", metavar="HOST:PORT",
                     help="a running Ray cluster's head (default with --workers/--shards: a "
                          "local cluster started for the run)")
    ray.add_argument("--step-log", action="store_true",
                     help="with --workers/--shards: append which messages every step trained "
                          "to RUN_DIR/steps.jsonl at each checkpoint (a single-process replay "
                          "of it gives the same model)")
    kafka.add_options(parser, clients="consumer and the dead-letter producer")
    return parser


def run(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.reader_nice <= 19:
        parser.error(f"--reader-nice: expected 0 to 19, got {args.reader_nice}")
    if args.unit_samples is not None and args.unit_samples < 1:
        parser.error(f"--unit-samples: expected at least 1, got {args.unit_samples}")
    if args.max_message_bytes < 1:
        parser.error(f"--max-message-bytes: expected at least 1, got {args.max_message_bytes}")
    if args.init_from and (args.config or args.model):
        parser.error("--init-from takes the batch run's config and model; drop --config and "
                     "--model")
    signal_point("args.parsed")
    on_ray = args.workers is not None or args.shards is not None or args.ray_address
    for name in ("workers", "shards"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name}: expected at least 1, got {getattr(args, name)}")
    if args.ray_address:  # before TensorFlow is imported: an address where nothing answers
        try:
            check_ray_address(args.ray_address)
        except (ConnectionError, ValueError) as e:
            parser.error(str(e))
    if on_ray and not fs.is_local(args.run_dir):
        parser.error(f"--run-dir {args.run_dir}: on an object store only without --workers/"
                     "--shards for now; give the Ray run a local or shared --run-dir")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if fs.is_local(args.run_dir):
        return _run(parser, args, on_ray, args.run_dir)
    fs.check_bucket(args.run_dir)  # a working copy of the published run, published at each
    with fs.working_copy(args.run_dir) as local:  # checkpoint (CheckpointManager.publish_to)
        return _run(parser, args, on_ray, local, publish_to=args.run_dir.rstrip("/"))


def _run(parser, args, on_ray: bool, run_dir: str, publish_to: str | None = None) -> dict:
    """The run, in the local run directory ``run_dir`` (a working copy of ``publish_to``)."""
    load_tensorflow(args.debug)
    from trainer.models import MODELS
    from trainer.trainer import Trainer

    signal_point("tensorflow.loaded")
    options = dict(args.kafka_options)
    try:  # at start only: once running, the trainer retries through outages
        kafka.check_reachable(kafka.consumer_settings(args.bootstrap_servers, args.group,
                                                      options), args.broker_timeout)
    except kafka.BrokerUnreachable as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    signal_point("broker.reached")
    if on_ray:
        from trainer.distributed.online import run_cli

        try:
            schema = schemas.load(args.schema)
            config = TrainConfig.load(args.config) if args.config else TrainConfig()
        except (schemas.SchemaError, ConfigError) as e:
            parser.error(str(e))
        signal_point("config.loaded")
        return print_summary(run_cli(args, parser, schema, config,
                                     MODELS[args.model or "mlp"]()), args.topic)
    checkpoints = CheckpointManager(run_dir, publish_to=publish_to)
    latest = checkpoints.latest()
    try:
        schema = schemas.load(args.schema)
        if latest is not None:
            trainer = Trainer.restore(os.path.join(latest.path, "model"))
            offsets = {int(p): o for p, o in latest.state["offsets"].items()}
            log.info("restored %s: step %d, offsets %s", latest.path, trainer.step, offsets)
            if args.init_from:
                log.info("--init-from %s ignored: %s holds a checkpoint of its own",
                         args.init_from, args.run_dir)
        elif args.init_from:
            trainer = _init_from(parser, args.init_from, schema)
            offsets = {}
        else:
            config = TrainConfig.load(args.config) if args.config else TrainConfig()
            trainer = Trainer(schema, MODELS[args.model or "mlp"](), config)
            offsets = {}
        if args.expire_every is not None:
            trainer.config = trainer.config.with_expire_every(args.expire_every)
    except (schemas.SchemaError, ConfigError) as e:
        parser.error(str(e))
    signal_point("config.loaded")
    source = KafkaSampleSource(schema, args.bootstrap_servers, args.topic, args.group,
                               format=args.format, start_offsets=offsets,
                               dlq_topic=args.dead_letter_topic, config=options,
                               max_message_bytes=args.max_message_bytes)
    metrics = None
    previous = {}
    try:  # a signal before online.run() ends the command here (exit 0, nothing trained)
        online = OnlineTrainer(
            schema, trainer, source, checkpoints, checkpoint_every=args.checkpoint_every,
            export_dir=args.export_dir, export_every=args.export_every,
            max_samples=args.max_samples, idle_exit=args.idle_exit,
            status_path=os.path.join(run_dir, STATUS_FILE),
            log_dir=os.path.join(run_dir, TENSORBOARD_DIR), report_every=args.report_every,
            reader_nice=args.reader_nice, unit_samples=args.unit_samples,
            calibrate=latest is None and not args.init_from)
        if args.metrics_port is not None:
            try:
                metrics = serve_metrics(online, args.metrics_host, args.metrics_port)
            except OSError as e:
                raise cli.UsageError(f"--metrics-port {args.metrics_port}: cannot listen on "
                                     f"{args.metrics_host}: {e.strerror}") from None
            online.metrics_url = f"http://{args.metrics_host}:{metrics.server_port}/metrics"
            log.info("metrics on %s", online.metrics_url)
        signal_point("source.opened")
        # SIGTERM and SIGINT stop the run at the next step; the caller's handlers come back
        # after it (run() is also called in process, by tests and scripts)
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous[signum] = signal.signal(signum, online.stop)
        signal_point("run.started")
        summary = online.run()
        checkpoints.publish()  # on a store: the final status and logs too
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        source.close()
        if metrics is not None:
            metrics.shutdown()
    return print_summary(summary, args.topic)


def print_summary(summary: dict, topic: str) -> dict:
    """The run's result line and its summary as one JSON line (what scripts read)."""
    delay = {k: "n/a" if v is None else f"{v:.2f}" for k, v in summary["delay_s"].items()}
    rate, pv = summary["rate"], summary["pv"]
    rate_text = ("steady, after start-up" if rate["over"] == "steady"
                 else "over the whole run, start-up included")
    where = (f" on {summary['workers']} workers x {summary['shards']} shards"
             if "workers" in summary else "")
    print(f"trained {summary['samples']:,} samples from {topic!r}{where} "
          f"({rate['samples_per_sec']:,.0f} samples/s {rate_text}), "
          f"progressive validation AUC {_metric(pv['auc'])} logloss {_metric(pv['logloss'])}, "
          f"{summary['dead_letters']} dead letters, {summary['checkpoints']} checkpoints, "
          f"{summary['exports']} exports (arrival-to-export delay p50 {delay['p50']} s, "
          f"p99 {delay['p99']} s), {summary['store_rows']:,} store rows", flush=True)
    print(json.dumps(summary, sort_keys=True), flush=True)
    return summary


def _init_from(parser, run_dir: str, schema: schemas.Schema) -> Trainer:
    """The model a batch run kept, checked against this run's schema."""
    from trainer.checkpoints import CheckpointDamagedError
    from trainer.distributed.manifest import schema_difference
    from trainer.trainer import Trainer

    try:
        if fs.is_local(run_dir):
            trainer = Trainer.restore_run(run_dir)
        else:  # the published run, restored from a local copy
            with fs.working_copy(run_dir) as local:
                try:
                    trainer = Trainer.restore_run(local)
                except (FileNotFoundError, ValueError, CheckpointDamagedError) as e:
                    raise type(e)(str(e).replace(local, run_dir)) from None
    except (FileNotFoundError, ValueError, CheckpointDamagedError) as e:
        parser.error(f"--init-from {run_dir}: {e}")
    if trainer.schema.to_dict() != schema.to_dict():
        parser.error(f"--init-from {run_dir}: the batch run was trained on another schema "
                     f"({schema_difference(trainer.schema.to_dict(), schema.to_dict())})")
    log.info("initialised from %s: step %d, %d store rows", run_dir, trainer.step,
             trainer.store_rows())
    return trainer


def main(argv=None) -> int:
    return cli.run_command(PROG, lambda a: run(a) and 0, argv, service=True)


if __name__ == "__main__":
    sys.exit(main())
