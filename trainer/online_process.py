"""The online loop's single-process engine: a reader thread polls, the main thread trains.

1. A reader thread consumes up to a unit of messages, decodes them in bulk (malformed ones are
   set aside as dead letters), compresses the samples into trees, cuts them into TreeBatches
   and prepares them (:func:`trainer.units.polled_batches`). One such *unit* carries the
   consumer positions after its last message. A poll that returns nothing is passed on as an
   empty step, so the loop keeps its cadence (and its idle clock) while the topic is quiet.
2. The main thread trains every batch of a unit (store lookups, TensorFlow step, store
   updates), the probabilities of each step computed before its update (progressive
   validation). Only then do the unit's positions become trained positions (the loop's), and
   its dead letters are sent to ``TOPIC.dlq``.
3. Between units the loop (:mod:`trainer.online_loop`) checkpoints, commits, exports and
   reports; a checkpoint here is ``CheckpointManager``'s ``ckpt-N/model`` (the Trainer's) with
   the offsets and the ranges trained since the previous one in its ``state.json``.

:class:`OnlineTrainer` is the loop over this engine, as ``python -m trainer.online`` runs it
without ``--workers``/``--shards`` (and as tests and benchmarks build it in process).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from trainer.kafka_source import DEFAULT_UNIT_BATCHES, KafkaSampleSource
from trainer.online_loop import (DEFAULT_READER_NICE, OnlineLoop, OnlineStep, OnlineUsageError,
                                 init_from, metric_text)
from trainer.units import polled_batches

if TYPE_CHECKING:
    from trainer.trainer import Trainer

log = logging.getLogger("trainer.online")


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
    # (probabilities, labels) of every batch, once trained
    predictions: list = field(default_factory=list)

    @property
    def dead(self) -> int:
        return len(self.dead_letters)


_EMPTY = object()  # the reader's item for a poll that returned nothing


class ProcessEngine:
    """The trainer, the Kafka source and the reader thread of an online run in one process."""

    kind = "process"
    recovers = False  # a crash is a restart from the latest checkpoint

    def __init__(self, schema, trainer: Trainer, source: KafkaSampleSource, *,
                 poll_timeout: float = 0.2, reader_nice: int = DEFAULT_READER_NICE,
                 unit_samples: int | None = None, calibrate: bool = False, train=None):
        """``calibrate``: a new run's model; its output biases are shifted to the first batch's
        label rates first (``Trainer.calibrate_output``), so it starts at the constant
        predictor, not at 0.5. ``train``: trains a :class:`Unit` (default
        :meth:`train_unit`)."""
        self.schema = schema
        self.trainer = trainer
        self.source = source
        self.poll_timeout = poll_timeout
        self.reader_nice = reader_nice    # niceness added to the reader thread (0: none)
        self.reader_thread_id: int | None = None
        self.unit_samples = (unit_samples if unit_samples is not None
                             else default_unit_samples(trainer.config.batch_size))
        if self.unit_samples < 1:
            raise ValueError(f"unit_samples must be at least 1, got {self.unit_samples}")
        self.calibrate = calibrate
        self.train = train or self.train_unit
        # the reader thread's busy seconds (the trainer's own are in Trainer.timings)
        self.reader_seconds = {"poll_decode": 0.0, "compress_batch": 0.0}
        self._assigned: list = []
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the consumer is used by the reader and by commits
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._reader_error: list = []
        self._reader: threading.Thread | None = None

    @property
    def step(self) -> int:
        return self.trainer.step

    # -- the reader thread: consume, decode, compress, batch ---------------------------------

    def begin(self, loop) -> None:
        self._reader = threading.Thread(target=self._read, name="online-reader", daemon=True)
        self._reader.start()
        self.trainer.trace()  # while the reader joins the group and polls its first unit

    def end_steps(self) -> None:
        self._stop.set()
        if self._reader is not None:
            self._reader.join(timeout=10)

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
        config = self.trainer.config
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
                with self._lock:
                    polled = self.source.poll(ask, self.poll_timeout)
                    positions = dict(self.source.positions)
                    # a copy for status.json: the rebalance callbacks change the set in place
                    self._assigned = sorted(self.source.assigned)
                t1 = time.perf_counter()
                if not polled.messages:
                    self._put(_EMPTY)  # so the loop checkpoints on time, and counts idle time
                    continue
                seen_samples += polled.num_samples
                seen_messages += polled.messages
                # prepared here, off the training thread (numpy feed work and tensors)
                batches = polled_batches(polled, self.schema, config.batch_size,
                                         config.split_trees, self.trainer.prepare)
                self.reader_seconds["poll_decode"] += t1 - t0
                self.reader_seconds["compress_batch"] += time.perf_counter() - t1
                self._put(Unit(batches, polled.num_samples, positions, polled.ranges,
                               polled.timestamps_ms, polled.dead_letters, polled.messages))
        except BaseException as e:  # surfaced by the main thread
            self._reader_error.append(e)
            self._put(None)

    def _put(self, item):
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    # -- the main thread: train ---------------------------------------------------------------

    def steps(self, loop, pause):
        """A step per unit the reader polled (every one pausable: units are trained whole),
        an empty one per empty poll, and one without news when nothing came in 0.5 s."""
        while True:
            waiting = time.monotonic()
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                item = None
            if self._reader_error:
                raise self._reader_error[0]
            if item is None:
                yield OnlineStep()
                continue
            if item is _EMPTY:
                yield OnlineStep(idle=True)
                continue
            waited = time.monotonic() - waiting
            unit = item
            # the step log's records: each batch a step, the unit's ranges on its last one
            m = len(unit.batches)
            log = [[{"ranges": unit.ranges if i == m - 1 else {},
                     "samples": int(batch.num_leaves), "batch": [i, m]}]
                   for i, batch in enumerate(unit.batches)]
            self.train(unit)
            yield OnlineStep(samples=unit.samples, messages=unit.messages, dead=unit.dead,
                             positions=unit.positions, ranges=unit.ranges,
                             arrivals_ms=unit.timestamps_ms, predictions=unit.predictions,
                             unit=True, read=True, waited=waited, log=log)

    def train_unit(self, unit: Unit) -> None:
        """Train every batch of ``unit`` (its predictions, made before each update, kept in
        ``unit.predictions``); then send its dead letters (delivered before the checkpoint
        that holds its offsets)."""
        for batch in unit.batches:
            if self.calibrate:
                self.calibrate = False
                for label, (rate, shift) in self.trainer.calibrate_output(batch).items():
                    log.info("new model: %s output bias shifted by %+.3f to the first "
                             "batch's rate %.4f", label, shift, rate)
            # the probabilities of the step, computed before its update: progressive validation
            _, probabilities, labels = self.trainer.train_batch(batch, predictions=True)
            unit.predictions.append((probabilities, labels))
        self.source.send_dead_letters(unit.dead_letters)

    def guard(self, body, loop):
        return body()

    def partitions_changed(self) -> bool:
        return False  # the consumer group deals partitions (rebalances) as they come

    # -- checkpoints, commits, exports ---------------------------------------------------------

    def flush_dead_letters(self, timeout: float) -> bool:
        return self.source.flush_dead_letters(timeout)

    def save_checkpoint(self, checkpoints, positions: dict, ranges: dict) -> None:
        latest = checkpoints.latest()
        state = {"step": self.trainer.step, "samples": self.trainer.samples,
                 "offsets": {str(p): o for p, o in sorted(positions.items())},
                 "trained_ranges": {str(p): spans for p, spans in sorted(ranges.items())},
                 "previous": latest.path if latest else None,
                 "topic": self.source.topic, "time": time.time()}
        checkpoints.save(lambda d: self.trainer.save(os.path.join(d, "model")), state)

    def commit_due(self, positions: dict, final: bool) -> bool:
        """Whether offsets a checkpoint holds are not committed (a commit failed or was never
        answered) and may be sent again (not while one is in flight, except the final)."""
        source = self.source
        uncommitted = any(source.committed.get(p) != o for p, o in positions.items()
                          if p in source.assigned)
        return uncommitted and (final or not source.commits_in_flight)

    def commit(self, positions: dict, wait: bool) -> None:
        """While the run goes on, only send the commit: a synchronous one waits as long as the
        broker is away, and the training thread with it (the reader too: they share the lock).
        The last one of a run (``wait``) waits for the broker's answer."""
        with self._lock:
            self.source.commit(positions, asynchronous=not wait)

    def export(self, directory: str, newest_sample_time: float | None) -> None:
        from trainer.serving import export_increment

        export_increment(self.trainer, directory, newest_sample_time=newest_sample_time)

    # -- what the loop reports ------------------------------------------------------------------

    def reachable(self, timeout: float) -> bool:
        with self._lock:
            return self.source.reachable(timeout)

    def assigned(self) -> list:
        return self._assigned

    def lag(self, positions: dict) -> int | None:
        with self._lock:
            return self.source.lag()

    def store_stats(self) -> dict:
        return self.trainer.store_stats()

    def report_line(self, loop, v: dict) -> tuple:
        store, pv, window = v["store"], v["pv"], v["window"]
        return ("%s samples, %s samples/s (waited for input %.0f%%), lag %s messages, %s store "
                "rows (admitted %s, rejected %s, expired %s), %d dead letters, export delay p50 "
                "%s p99 %s, progressive validation AUC %s logloss %s (since the last line: AUC "
                "%s logloss %s)", f"{loop.stats.samples:,}", f"{v['rate']:,.0f}",
                100 * v["waited"], "n/a" if loop.last_lag is None else f"{loop.last_lag:,}",
                f"{store.get('rows', 0):,}", f"{store.get('admitted', 0):,}",
                f"{store.get('rejected', 0):,}", f"{store.get('expired', 0):,}",
                loop.stats.dead, v["delay"]["p50"], v["delay"]["p99"], metric_text(pv["auc"]),
                metric_text(pv["logloss"]), metric_text(window["auc"]),
                metric_text(window["logloss"]))

    def snapshot(self) -> dict:
        return {}

    def restore_snapshot(self, snapshot: dict) -> None:
        pass

    def summary(self, loop, timings: bool) -> dict:
        """One process: no workers, shards or assignment of them (the consumer group assigns
        the partitions: ``assigned``), nothing moved between processes, no rollback (a crash
        is a restart); busy seconds of the reader thread and the trainer."""
        trainer_seconds = {k: round(v, 3) for k, v in self.trainer.timings.items()}
        reader = {k: round(v, 3) for k, v in self.reader_seconds.items()}
        return {"workers": None, "shards": None, "assignment": None,
                "bytes_per_step": {}, "recoveries": [],
                "busy_seconds": {**reader, **{k: trainer_seconds.get(k, 0.0)
                                              for k in ("lookup", "step", "update")}},
                "timings": {"reader": reader, "trainer": trainer_seconds}}


class OnlineTrainer(OnlineLoop):
    """The online loop over one process's trainer and Kafka source (see the module
    docstring)."""

    def __init__(self, schema, trainer: Trainer, source: KafkaSampleSource, checkpoints,
                 checkpoint_every: float = 30.0, export_dir: str | None = None,
                 export_every: float = 10.0, max_samples: int | None = None,
                 idle_exit: float | None = None, poll_timeout: float = 0.2,
                 status_path: str | None = None, on_export=None, log_dir: str | None = None,
                 report_every: float = 10.0, reader_nice: int = DEFAULT_READER_NICE,
                 unit_samples: int | None = None, record_predictions: bool = False,
                 calibrate: bool = False, step_log: str | None = None):
        engine = ProcessEngine(schema, trainer, source, poll_timeout=poll_timeout,
                               reader_nice=reader_nice, unit_samples=unit_samples,
                               calibrate=calibrate, train=lambda unit: self._train(unit))
        super().__init__(engine, checkpoints, positions=source.positions,
                         checkpoint_every=checkpoint_every, export_dir=export_dir,
                         export_every=export_every, max_samples=max_samples,
                         idle_exit=idle_exit, status_path=status_path, log_dir=log_dir,
                         report_every=report_every, on_export=on_export,
                         record_predictions=record_predictions, step_log=step_log)
        self.schema = schema

    @property
    def trainer(self) -> Trainer:
        return self.engine.trainer

    @property
    def source(self) -> KafkaSampleSource:
        return self.engine.source

    @property
    def reader_thread_id(self) -> int | None:
        return self.engine.reader_thread_id

    @property
    def unit_samples(self) -> int:
        return self.engine.unit_samples

    def _train(self, unit: Unit) -> None:
        self.engine.train_unit(unit)


def restore_process_trainer(options, schema, latest, models):
    """The run's Trainer: restored from ``latest`` (the run directory's checkpoint), else from
    the batch run ``options.init_from``, else a new ``options.model`` with ``options.config``;
    and the offsets to start from. OnlineUsageError for what cannot be used."""
    from trainer.config import TrainConfig
    from trainer.trainer import Trainer

    budget = {"memory_budget": options.memory_budget_bytes, "tier_dir": options.tier_dir}
    if latest is not None:
        trainer = Trainer.restore(os.path.join(latest.path, "model"), **budget)
        offsets = {int(p): o for p, o in latest.state["offsets"].items()}
        log.info("restored %s: step %d, offsets %s", latest.path, trainer.step, offsets)
        if options.init_from:
            log.info("--init-from %s ignored: %s holds a checkpoint of its own",
                     options.init_from, options.run_dir)
    elif options.init_from:
        trainer = init_from(options.init_from, schema,
                            lambda run_dir: _restore_batch_run(run_dir, **budget))
        log.info("initialised from %s: step %d, %d store rows", options.init_from,
                 trainer.step, trainer.store_rows())
        offsets = {}
    else:
        config = TrainConfig.load(options.config) if options.config else TrainConfig()
        config = config.with_memory_budget(budget["memory_budget"])
        trainer = Trainer(schema, models[options.model or "mlp"](), config,
                          tier_dir=options.tier_dir)
        offsets = {}
    if options.expire_every is not None:
        trainer.config = trainer.config.with_expire_every(options.expire_every)
    trainer.config = trainer.config.with_export_format(options.export_format)
    return trainer, offsets


def _restore_batch_run(run_dir: str, **budget):
    """The Trainer a batch run kept (in process or on Ray), and its schema; ``budget``:
    ``memory_budget`` and ``tier_dir`` as ``Trainer.restore_run`` takes them."""
    from compression import fs
    from trainer.checkpoints import CheckpointDamagedError
    from trainer.trainer import Trainer

    if fs.is_local(run_dir):
        trainer = Trainer.restore_run(run_dir, **budget)
    else:  # the published run, restored from a local copy
        with fs.working_copy(run_dir) as local:
            try:
                trainer = Trainer.restore_run(local, **budget)
            except (FileNotFoundError, ValueError, CheckpointDamagedError) as e:
                raise type(e)(str(e).replace(local, run_dir)) from None
    return trainer, trainer.schema.to_dict()


__all__ = ["OnlineTrainer", "ProcessEngine", "Unit", "default_unit_samples",
           "OnlineUsageError", "restore_process_trainer"]
