"""Online learning on Ray: W workers read their Kafka partitions, S store shards hold the rows,
steps are synchronous, and a checkpoint holds every partition's trained offset.

    python -m trainer.online --schema S --bootstrap-servers HOST:PORT --topic samples \\
        --group ctr-online --run-dir run/ --workers 2 --shards 2 [--ray-address HEAD:6379]

The actors are those of batch training (:mod:`trainer.distributed.driver`): the shards are
:class:`~trainer.distributed.shard.Shard`, the workers are
:class:`~trainer.distributed.online_worker.OnlineWorker` (a batch ``Worker`` whose batches come
from Kafka), and a step is the batch driver's step (gradients on the workers, one
``apply_gradients`` and one lookup per table on each shard, the dense update averaged in worker
order).

**Partitions.** The driver lists the topic's partitions at start and deals them to the workers
in turn (the i-th partition in order to worker ``i % W``), by explicit assignment: no consumer
group membership, so every worker knows exactly what it owns. At every checkpoint it lists
them again and deals the partitions added since. (A worker added or lost counts at the next
start: the checkpoint's offsets are per partition, whatever the assignment.)

**Steps.** Each worker polls *units* of at most its share of ``--unit-samples`` (default: about
10 of its batches, as a single process polls 10 batches), compressed into trees at once and cut
into batches of its share of the global batch (``worker_batch_size``). At every step each
worker contributes the next batch of its unit, or of its next unit, or nothing when no poll
came back within the poll timeout (``POLL_TIMEOUT``). Step ``k`` trains
the *union batch*: the workers' batches side by side in worker order, which is what the
shards and the dense update compute (see :mod:`trainer.distributed`): the rows, optimizer
state and dense weights after step ``k`` equal a single :class:`trainer.Trainer` that trained
the same union batches in the same order, up to float rounding. A step in which no worker
had a sample trains nothing and does not count. Which messages each step trained is therefore
a record, not a rule: with ``step_log`` the driver appends it to ``RUN_DIR/steps.jsonl``
(``{"step": k, "workers": [{"ranges": {partition: [first, next]}, "samples": n, "batch": [i,
m]}, ...]}``: ``batch`` says the worker trained the i-th of its unit's m batches, and
``ranges`` are the unit's, on the step that trained its last batch, else empty) at every
checkpoint, so a single-process replay of the log reproduces the model (the tests do: a unit's
messages in partition and offset order, compressed and cut into batches as the worker did).

**Exactly once.** A checkpoint is taken between steps, when no batch of the next step has been
looked up (the lookup admits ids) and no worker holds a partly trained unit (its offsets are
trained only with its last batch): when a checkpoint, an export or the end is due, the
workers start no new unit (``OnlineWorker.drain``) and the steps go on until every worker's
unit is trained (workers with nothing left contribute empty batches); then the dead letters of every worker are delivered first, then
:class:`~trainer.checkpoints.CheckpointManager` writes ``checkpoints/ckpt-N/model``, the
distributed checkpoint (every shard's snapshot, the dense weights, and ``manifest.json``
written last, whose ``online`` entry holds the topic, the group, the assignment and every
partition's trained offset), fsyncs it, renames it into place and points ``LATEST`` at it;
only then are the offsets committed to Kafka. A restart restores the latest checkpoint into
the actors and every worker seeks its partitions to the manifest's offsets. So after a driver
crash at any moment the restored model has trained exactly the messages before those offsets
and the run goes on right after them. When a worker or a shard dies instead, the driver does
the same without restarting: every actor goes back to the latest checkpoint
(:meth:`OnlineRun.run`).

**Reports.** The driver reports what a single process reports, aggregated over the actors:
``RUN_DIR/status.json`` every second, Prometheus metrics (``--metrics-port``) and TensorBoard
scalars (``RUN_DIR/online``) with the same names (:mod:`trainer.online_report`); samples,
dead letters and progressive validation summed from every worker's step results, store
counters from every shard, the consumer lag over every partition dealt. **Expiry** runs on
the shards after a step's update, as in batch training; ``--expire-every N`` reschedules it
as in a single process (and the checkpoints keep that config).

**Warm start and serving.** ``--init-from RUN_DIR`` starts a new run from the model a batch
run kept, in process or on Ray (:func:`~trainer.distributed.driver.run_checkpoint`), its
stores resharded into the S shards. ``--export-dir`` publishes, between steps as a
checkpoint is taken, a full export and then every ``--export-every`` s a version holding
every shard's delta and the dense weights (:func:`trainer.serving.export_increment`), which
``Predictor``, ``LiveModel`` and ``trainer.serve`` follow; every sample's delay from its
Kafka arrival to the export holding it goes to the summary (``delay_s``). After a rollback
the next export is a full one: the shards' deltas then follow the checkpoint, not what was
published.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import os
import time

import numpy as np
import ray

import schemas
from compression import cli, fs, kafka
from compression.signal_points import signal_point
from trainer.checkpoints import CheckpointDamagedError, CheckpointManager
from trainer.config import TrainConfig
from trainer.distributed.driver import (DistributedTrainer, failure_summary, is_actor_failure,
                                        run_checkpoint)
from trainer.distributed.manifest import read_manifest, schema_difference
from trainer.distributed.online_worker import OnlineWorker
from trainer.distributed.steps import StepScheduler
from trainer.distributed.worker import resolve_dense, unresolved_dense
from trainer.kafka_source import commit_offsets, consumer_lag
from trainer.metrics import DelayHistogram, ProgressiveValidation, run_rates
from trainer.online_report import (STATUS_EVERY, STATUS_FILE, TENSORBOARD_DIR, report_scalars,
                                   serve_metrics, write_status)
from trainer.runs import StopOnSignal

log = logging.getLogger("trainer.online")

# Seconds a worker waits for a poll's batch before it contributes nothing to a step: the
# longest one idle worker holds the others up.
POLL_TIMEOUT = 0.2
STEP_LOG = "steps.jsonl"


def assign_partitions(partitions: list[int], workers: int) -> list[list[int]]:
    """Each worker's partitions: the i-th partition (in order) goes to worker ``i % workers``."""
    ordered = sorted(partitions)
    return [ordered[w::workers] for w in range(workers)]


class OnlineDistributedTrainer(DistributedTrainer):
    """A :class:`DistributedTrainer` whose workers read Kafka (:class:`OnlineWorker`): the
    same actors, step and checkpoints, an open-ended stream of steps instead of passes."""

    worker_class = OnlineWorker

    def __init__(self, schema, model=None, config: TrainConfig | None = None, *,
                 expire_every: int | None = None, **kwargs):
        """``expire_every``: run every table's configured expiry every that many steps
        instead of its ``every_steps`` (``--expire-every``; a ConfigError when no table has
        one), in this run and in the config its checkpoints keep, as a single process does.
        The other arguments are :class:`DistributedTrainer`'s."""
        self.expire_every = expire_every
        # a new run shifts the output biases on its first step (run_cli sets it as
        # trainer.online does for a run without a checkpoint or --init-from)
        self.calibrate = False
        super().__init__(schema, model, self.run_config(config or TrainConfig()), **kwargs)

    def run_config(self, saved: TrainConfig) -> TrainConfig:
        if self.expire_every is None:
            return saved
        return saved.with_expire_every(self.expire_every)

    def open_sources(self, kafka_spec: dict, assignment: list[list[int]], offsets: dict,
                     poll_timeout: float = POLL_TIMEOUT, unit_samples: int | None = None
                     ) -> None:
        """Every worker reads its partitions of ``assignment`` from ``offsets``, in units of
        its share of ``unit_samples`` (None: 10 of its batches); units held before are
        dropped (read again from ``offsets``)."""
        ray.get([w.open.remote(kafka_spec, parts, {p: offsets[p] for p in parts
                                                   if p in offsets}, poll_timeout,
                               unit_samples)
                 for w, parts in zip(self._workers, assignment)])

    def close(self) -> None:
        if not self._closed and ray.is_initialized():
            try:  # deliver the dead letters and leave the brokers cleanly
                ray.get([w.close_source.remote() for w in getattr(self, "_workers", [])],
                        timeout=30)
            except Exception as e:  # noqa: BLE001 - the actors are killed next anyway
                log.warning("closing the workers' Kafka clients: %s", e)
        super().close()

    def flush_dead_letters(self, timeout: float) -> bool:
        """Whether every worker's dead letters were delivered within ``timeout`` s."""
        return all(ray.get([w.flush_dead_letters.remote(timeout) for w in self._workers]))

    def _calibrate(self, requests) -> None:
        """As a new single-process run does on its first batch (``Trainer.calibrate_output``):
        shift the output biases so that the model's mean probability on the first step's
        union batch (every worker's batch in worker order, rows looked up without admitting
        anything) equals that batch's label rate; every worker shifts its copy alike."""
        rows = self._lookup(requests, False)
        found = ray.get([
            worker.calibration_outputs.remote(*[rows[s][w] for s in range(self.shards)])
            for w, worker in enumerate(self._workers)])
        if not any(found):
            return
        outputs, labels = union_outputs(found)
        shifted = ray.get([w.shift_output_biases.remote(outputs, labels)
                           for w in self._workers])[0]
        for label, (rate, shift) in shifted.items():
            log.info("new model: %s output bias shifted by %+.3f to the first step's rate %.4f",
                     label, shift, rate)

    def online_steps(self, pause):
        """Synchronous steps for ever: yields ``(results, paused)`` per step, ``results``
        the workers' (``n``, ``loss``, ``probabilities``, ``labels``, ``consumed``, ``batch``).
        ``pause()`` is asked before each step is submitted. True first drains the workers'
        units: while a worker would hold a partly trained unit after the step, the workers
        start no new unit and the steps go on (``paused`` False). Then the step is paused:
        the shards apply it without looking the next batches up, so when it is yielded the
        actors hold exactly the steps trained, no unit is partly trained, and a checkpoint
        may be taken. Otherwise the shards look the workers' next batches up in the same call
        (the pipelining of batch training).

        A new run first resolves the dense features' statistics (``auto`` transforms,
        standardization) on the first step's union batch, as a single process does on its
        first batch: every worker takes its first batch ahead; until one of them has one,
        the rounds are yielded as paused steps that trained nothing (with what they
        consumed: only malformed messages)."""
        names = unresolved_dense(self.schema, self.config)
        while names:
            found = ray.get([w.first_dense_sample.remote(names) for w in self._workers])
            if any(sample for sample, _ in found):
                self.config = resolve_dense(self.schema, self.config,
                                            [sample for sample, _ in found])
                ray.get([w.set_config.remote(self.config.to_dict()) for w in self._workers])
                names = []
            if any(consumed for _, consumed in found) or names:
                # not a pause once resolved: no checkpoint may hold statistics resolved on
                # batches it has not trained (a restart could group them otherwise)
                yield [{"n": 0, "consumed": consumed} for _, consumed in found], bool(names)
        requests = [refs[1:] for refs in self._next("train")]
        if self.calibrate:
            self.calibrate = False
            self._calibrate(requests)
        rows = self._lookup(requests, True)
        # per worker, the batches of its unit left after the one the next step trains
        left = ray.get([w.left.remote() for w in self._workers])
        draining = False

        def paused(step: int) -> bool:
            """Whether step ``step`` pauses; while a worker would hold a partly trained unit
            after it, the workers drain instead (told before the step's train_step, in
            order)."""
            nonlocal draining
            wanted = bool(pause())
            now = wanted and not any(left)
            if draining != (wanted and not now):
                draining = not draining
                for worker in self._workers:
                    worker.drain.remote(draining)
            return now

        scheduler = StepScheduler(self, self._workers, self._shards,
                                  mean=self.config.row_gradients == "mean",
                                  dense=self._dense_trains, pass_end=False)
        for scheduled in scheduler.run(rows, paused):
            left = [r["left"] for r in scheduled.results]
            if scheduled.step is not None:
                self.losses.clear()  # an online run does not keep every step's loss
            yield scheduled.results, scheduled.paused


class OnlineRun:
    """One online run on Ray: the steps, the offsets they trained, checkpoints and commits."""

    def __init__(self, engine: OnlineDistributedTrainer, checkpoints: CheckpointManager,
                 kafka_spec: dict, offsets: dict, *, checkpoint_every: float = 30.0,
                 max_samples: int | None = None, idle_exit: float | None = None,
                 report_every: float = 10.0, step_log: str | None = None,
                 status_path: str | None = None, log_dir: str | None = None,
                 export_dir: str | None = None, export_every: float = 10.0,
                 unit_samples: int | None = None):
        """``status_path``: the status file, rewritten every ``STATUS_EVERY`` s with the
        summary so far (None: none); ``log_dir``: TensorBoard scalars at every report (None:
        none). Both as the single process writes them (:mod:`trainer.online_report`).
        ``export_dir``: serving exports every ``export_every`` s (:meth:`export`).
        ``unit_samples``: samples of a unit over all workers (``--unit-samples``; each worker
        polls its share; None: 10 batches)."""
        self.engine = engine
        self.checkpoints = checkpoints
        self.kafka_spec = kafka_spec
        self.checkpoint_every = checkpoint_every
        self.max_samples = max_samples
        self.idle_exit = idle_exit
        self.report_every = report_every
        self.step_log = step_log
        self.export_dir = export_dir
        self.export_every = export_every
        self.unit_samples = unit_samples
        self.positions = {int(p): int(o) for p, o in offsets.items()}  # next offset to train
        self.assignment: list[list[int]] = []
        self.settings = kafka.consumer_settings(kafka_spec["bootstrap_servers"],
                                                kafka_spec["group"], kafka_spec["options"])
        # commits offsets for the whole group (the workers never commit): it never subscribes
        self.committer = kafka.consumer(self.settings)
        self.pv = ProgressiveValidation()
        self.pv_window = ProgressiveValidation()  # since the latest report
        self.pv_label: str | None = None
        self.last_pv_window: dict | None = None  # the window of the latest report
        self.status_path = status_path
        self.log_dir = log_dir
        self._writer = None  # TensorBoard's, opened by run()
        self._last_status = float("-inf")
        self.snapshot: dict | None = None  # the latest summary (status.json, /metrics)
        self.metrics_url: str | None = None
        self.timing_observers: list = []  # called with ("checkpoint"|"export", seconds)
        self.lag: int | None = None  # messages behind the partitions' ends, at the latest report
        self.broker_reachable: bool | None = None
        # seconds in rounds after the first step in which no worker had a sample (each
        # waited the poll timeout): the driver waited for input, not for training
        self.waited = 0.0
        self.samples = self.messages = self.dead = self.checkpoints_written = 0
        self.steps = 0  # trained by this run
        self.first_step: float | None = None  # when this run's first and latest step ended
        self.last_step: float | None = None
        self.first_step_samples = 0
        self.first_step_wall_ms: float | None = None
        # serving exports: the arrival times (Unix ms) of the samples trained since the last
        # one, with their step; every sample's delay to the export holding it, the run's and
        # that of samples arrived after the first step (the steady state, without the
        # backlog of the start-up)
        self.exports = 0
        self._pending_arrivals: list[tuple[int, np.ndarray]] = []
        self._trained_since_export = False
        self.newest_arrival: float | None = None  # Unix s, of the latest export's newest
        self.delays, self.steady_delays = DelayHistogram(), DelayHistogram()
        self.started = time.monotonic()
        self._last_report = (self.started, 0, 0.0)  # (when, samples, waited then)
        self.recoveries: list[dict] = []  # one per rollback after an actor died
        # what the latest checkpoint holds (step, offsets, this run's counters and progressive
        # validation): where an actor's death rolls back to. None: the run has no checkpoint
        # yet (one is written before the first step)
        self._checkpointed: dict | None = (
            None if checkpoints.latest() is None else self._state(engine.step, self.positions))
        self._pending_log: list[str] = []
        self._idle_since: float | None = None
        self._finish = False  # max_samples reached or idle for idle_exit s

    def run(self, should_stop) -> dict:
        """Train until ``should_stop()``, ``max_samples`` or ``idle_exit``; then the final
        checkpoint and commit. Returns the summary.

        When an actor's process dies, Ray restarts it and every actor goes back to the latest
        checkpoint (the shards' rows, the dense weights, the step) and every partition to its
        offset there; the steps since are dropped (their offsets were never committed) and
        trained again from Kafka. The run ends with a ``RuntimeError`` only when an actor
        does not come back."""
        engine = self.engine
        partitions = kafka.list_partitions(self.settings, self.kafka_spec["topic"])
        self.assignment = assign_partitions(partitions, engine.workers)
        log.info("%d workers x %d shards, partitions per worker %s, from offsets %s, actor "
                 "processes %s", engine.workers, engine.shards, self.assignment,
                 self.positions, engine.actor_pids())
        if self.log_dir and self._writer is None:
            import tensorflow as tf

            self._writer = tf.summary.create_file_writer(self.log_dir)
        while True:
            try:
                if self._checkpointed is None:
                    self.checkpoint()  # what a death before the first checkpoint goes back to
                engine.open_sources(self.kafka_spec, self.assignment, self.positions,
                                    unit_samples=self.unit_samples)
                if self._train(should_stop):
                    continue  # the topic has new partitions: deal them, read on
                return self.finish()
            except ray.exceptions.RayError as error:
                if not is_actor_failure(error):
                    raise
                self._roll_back(error)

    def _train(self, should_stop) -> bool:
        """Steps until the run should finish (False) or the topic's partitions changed at a
        checkpoint (True: the workers' sources must be opened again)."""
        engine = self.engine
        last_checkpoint = last_export = last_report = time.monotonic()

        def due() -> bool:
            return time.monotonic() - last_checkpoint >= self.checkpoint_every

        def export_due() -> bool:
            return (self.export_dir is not None
                    and time.monotonic() - last_export >= self.export_every)

        def pause() -> bool:
            return self._finish or should_stop() or due() or export_due()

        resumed = time.monotonic()  # when the driver last asked for a step
        for results, paused in engine.online_steps(pause):
            if self.first_step is not None and not any(r["n"] for r in results):
                self.waited += time.monotonic() - resumed
            self._account(results)
            if time.monotonic() - last_report >= self.report_every:
                self.report()
                last_report = time.monotonic()
            if self.status_path and time.monotonic() - self._last_status >= STATUS_EVERY:
                self.write_status()  # also while idle: operators see that it is
            if paused:
                if self._finish or should_stop():
                    return False
                if export_due():  # between steps, nothing looked up ahead: as a checkpoint
                    self.export()
                    last_export = time.monotonic()
                if due():
                    # postponed (False) while dead letters wait: retried later
                    written = self.checkpoint()
                    last_checkpoint = time.monotonic()
                    if written and self._deal_new_partitions():
                        return True
            resumed = time.monotonic()
        raise AssertionError("online_steps never ends")

    def _deal_new_partitions(self) -> bool:
        """Whether partitions were added to the topic since they were dealt; if so they are
        dealt now (the i-th partition to worker ``i % W``: partitions are numbered on, so
        those already dealt stay with their worker) and start at the group's committed
        offset, else at their beginning. Asked at checkpoints, when the actors are between
        steps and the offsets trained are durable."""
        try:
            partitions = kafka.list_partitions(self.settings, self.kafka_spec["topic"],
                                               timeout=5.0)
        except kafka.BrokerUnreachable as e:  # asked again at the next checkpoint
            log.warning("listing the topic's partitions: %s", e)
            return False
        dealt = {p for parts in self.assignment for p in parts}
        added = sorted(set(partitions) - dealt)
        if not added:
            return False
        self.assignment = assign_partitions(sorted(dealt | set(added)), self.engine.workers)
        log.info("partitions %s were added to topic %r: partitions per worker now %s", added,
                 self.kafka_spec["topic"], self.assignment)
        return True

    def _state(self, step: int, positions: dict) -> dict:
        return {"step": step, "positions": dict(positions), "samples": self.samples,
                "messages": self.messages, "dead": self.dead, "steps": self.steps,
                "pv": copy.deepcopy(self.pv), "bytes": dict(self.engine.bytes)}

    def _roll_back(self, error: BaseException) -> None:
        """Every actor and partition back to the latest checkpoint after an actor's death."""
        engine = self.engine
        latest = self.checkpoints.latest()
        summary, failed_step = failure_summary(error), engine.step
        try:
            if latest is None:
                raise RuntimeError("no checkpoint was written yet")
            directory = os.path.join(latest.path, "model")
            engine.roll_back(directory, error)
            state = self._checkpointed
            offsets = read_manifest(directory)["online"]["offsets"]
            if (engine.step, {int(p): o for p, o in offsets.items()}) != (
                    state["step"], state["positions"]):
                raise RuntimeError(f"{latest.path} is not the checkpoint this run wrote last")
        except Exception as e:  # noqa: BLE001 - one line naming where a rerun resumes
            raise RuntimeError(
                f"an actor of the run died ({summary}) and the run could not roll back ({e}); "
                f"the steps since the last checkpoint are dropped and their offsets were not "
                f"committed: run the same command again to resume from "
                f"{latest.path if latest else 'the start'}") from e
        self.positions = dict(state["positions"])
        self.samples, self.messages, self.dead = (state["samples"], state["messages"],
                                                  state["dead"])
        self.steps, self.pv = state["steps"], copy.deepcopy(state["pv"])
        self.pv_window.reset()
        self._last_report = (time.monotonic(), self.samples, self.waited)
        engine.bytes.clear()
        engine.bytes.update(state["bytes"])
        engine.losses.clear()
        self._pending_log = []  # steps after the checkpoint: trained again
        self._pending_arrivals = [(step, stamps) for step, stamps in self._pending_arrivals
                                  if step <= engine.step]
        if self.export_dir is not None:
            # the shards' deltas now follow the checkpoint, not what was published: the next
            # export is a full one (a new lineage), of the model rolled back to
            from trainer.serving import restart_lineage

            restart_lineage(engine)
            self._trained_since_export = True
        if self.step_log:  # lines a checkpoint wrote before the actor died in it
            truncate_step_log(self.step_log, engine.step)
        self._finish, self._idle_since = False, None
        self.recoveries.append({"error": summary, "failed_at_step": failed_step,
                                "rolled_back_to_step": engine.step})
        log.warning("an actor died at step %d (%s); Ray restarted it and every actor rolled "
                    "back to the checkpoint of step %d (%s), every partition to its offset "
                    "there %s; actor processes %s", failed_step, summary, engine.step,
                    latest.path, self.positions, engine.actor_pids())

    def finish(self) -> dict:
        if self.export_dir is not None:
            self.export()
        if not self.checkpoint(flush_timeout=60.0, final=True):
            raise RuntimeError("the final checkpoint was not written: dead letters could not be "
                               "delivered within 60 s (is the broker reachable?); the run "
                               "resumes from the previous checkpoint")
        self.report()
        summary = self.summary()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.status_path:
            self.write_status(summary)  # the final state, for scripts that read it after
        return summary

    def write_status(self, summary: dict | None = None) -> None:
        """Replace the status file with ``summary`` (default: the summary now, without the
        actors' timings: asking every worker would wait for its poll)."""
        self.snapshot = summary if summary is not None else self.summary(timings=False)
        write_status(self.status_path, self.snapshot)
        self._last_status = time.monotonic()

    def _account(self, results) -> None:
        """The offsets, counts and predictions of a step's ``results``; the idle clock."""
        consumed_any = False
        step_record = []
        for r in results:
            if self.export_dir is not None and r.get("arrivals_ms") is not None:
                # a unit's, on the step of its last batch; kept until the export holding it
                self._pending_arrivals.append((self.engine.step, r["arrivals_ms"]))
            consumed = r.get("consumed")
            step_record.append({"ranges": {} if consumed is None else consumed["ranges"],
                                "samples": r["n"], "batch": r.get("batch")})
            if consumed is not None:  # a unit ended: its offsets are trained
                self.messages += consumed["messages"]
                self.dead += consumed["dead"]
                for p, (_, end) in consumed["ranges"].items():
                    self.positions[int(p)] = max(self.positions.get(int(p), 0), int(end))
            if consumed is not None or r["n"]:
                consumed_any = True
                self.broker_reachable = True  # the worker read from it
            if r["n"]:
                if self.pv_label is None:
                    self.pv_label = next(iter(r["probabilities"]))  # the model's first head
                p, y = r["probabilities"][self.pv_label], r["labels"][self.pv_label]
                self.pv.add(p, y)
                self.pv_window.add(p, y)
        trained = sum(r["n"] for r in results)
        if trained:
            self.samples += trained
            self.steps += 1
            self.last_step = time.monotonic()
            if self.first_step is None:
                self.first_step, self.first_step_samples = self.last_step, trained
                self.first_step_wall_ms = time.time() * 1000
                # as trainer.online does: what is alive after the first step (TensorFlow,
                # loaded here for TensorBoard, and Ray) lives for the run; out of the cyclic
                # collector's full passes, which every step's allocations trigger
                gc.freeze()
            self._trained_since_export = True
            if self.step_log:
                self._pending_log.append(json.dumps({"step": self.engine.step,
                                                     "workers": step_record}))
        if self.max_samples is not None and self.samples >= self.max_samples:
            self._finish = True
        now = time.monotonic()
        if consumed_any:
            self._idle_since = None
        elif self._idle_since is None:  # kept without idle_exit too: status.json's idle_s
            self._idle_since = now
        elif self.idle_exit is not None and now - self._idle_since >= self.idle_exit:
            try:  # an empty poll cannot tell "nothing new" from "no broker": ask it
                kafka.check_reachable(self.settings, timeout=2.0)
                self._finish = True
            except kafka.BrokerUnreachable:
                self._idle_since = None  # an outage is not idle time

    def checkpoint(self, flush_timeout: float = 5.0, final: bool = False) -> bool:
        """Write a checkpoint holding every partition's trained offset (the actors must be
        between steps, with nothing looked up ahead), then commit those offsets. Nothing is
        written when nothing changed since the latest one."""
        engine = self.engine
        positions = dict(self.positions)
        if self._checkpointed is not None and (engine.step, positions) == (
                self._checkpointed["step"], self._checkpointed["positions"]):
            if final:
                self._commit(positions)
            return True
        if not engine.flush_dead_letters(flush_timeout):
            log.warning("checkpoint postponed: dead letters are not delivered yet")
            return False
        latest = self.checkpoints.latest()
        online = {"topic": self.kafka_spec["topic"], "group": self.kafka_spec["group"],
                  "offsets": {str(p): o for p, o in sorted(positions.items())},
                  "assignment": self.assignment,
                  "previous": None if latest is None else os.path.basename(latest.path)}
        self._write_step_log()
        started = time.monotonic()
        self.checkpoints.save(
            lambda d: engine.save(os.path.join(d, "model"), extra={"online": online}),
            {"step": engine.step, "samples": engine.samples, "kind": "ray-online",
             "time": time.time()})
        for observe in self.timing_observers:
            observe("checkpoint", time.monotonic() - started)
        self.checkpoints_written += 1
        self._checkpointed = self._state(engine.step, positions)
        self._commit(positions)
        return True

    def _commit(self, positions: dict) -> None:
        """After the checkpoint holding ``positions`` is durable. A failed commit is made
        good by the next checkpoint's (the checkpoint, not Kafka, is where a restart
        resumes)."""
        commit_offsets(self.committer, self.kafka_spec["topic"], positions)

    def export(self) -> None:
        """Publish a version for serving when a step was trained since the last one
        (:meth:`DistributedTrainer.export_increment`: a full export first, then every shard's
        delta of every table and the dense weights), the actors between steps with nothing
        looked up ahead. Every sample trained into it counts its delay from its Kafka arrival
        to now, when the version is published."""
        if not self._trained_since_export:
            return
        pending = [stamps for _, stamps in self._pending_arrivals]
        stamps = np.concatenate(pending) if pending else np.zeros(0, np.int64)
        if len(stamps):
            self.newest_arrival = max(self.newest_arrival or 0.0, float(stamps.max()) / 1000)
        started = time.monotonic()
        self.engine.export_increment(self.export_dir, newest_sample_time=self.newest_arrival)
        published_ms = time.time() * 1000
        for observe in self.timing_observers:
            observe("export", time.monotonic() - started)
        self._trained_since_export = False
        self._pending_arrivals = []
        self.exports += 1
        if len(stamps):
            delays = published_ms - stamps
            self.delays.add(delays)
            self.steady_delays.add(delays[stamps >= self.first_step_wall_ms])

    def _write_step_log(self) -> None:
        if not self.step_log or not self._pending_log:
            return
        with open(self.step_log, "a") as f:
            f.write("".join(line + "\n" for line in self._pending_log))
            f.flush()
            os.fsync(f.fileno())
        self._pending_log = []

    def report(self) -> None:
        """One console line and TensorBoard scalars (the single process's tags): samples/s
        since the previous report, the share of that time no worker had input, consumer lag
        over every partition dealt, store counters summed over the shards, dead letters and
        progressive validation over every worker's predictions."""
        now = time.monotonic()
        then, samples_then, waited_then = self._last_report
        interval = max(now - then, 1e-9)
        rate = (self.samples - samples_then) / interval
        waited = (self.waited - waited_then) / interval
        self._last_report = (now, self.samples, self.waited)
        self.lag = consumer_lag(self.committer, self.kafka_spec["topic"],
                                [p for parts in self.assignment for p in parts], self.positions)
        self.broker_reachable = self.lag is not None  # every partition's leader answered
        store = self.engine.store_stats()
        pv, window = self.pv.result(), self.pv_window.result()
        self.pv_window.reset()
        self.last_pv_window = window
        log.info("%s samples (%s samples/s), step %d, %d dead letters, %d checkpoints, "
                 "progressive validation AUC %s (since the last line: %s), offsets %s, lag %s "
                 "messages, %s store rows (expired %s)", f"{self.samples:,}", f"{rate:,.0f}",
                 self.engine.step, self.dead, self.checkpoints_written, pv["auc"],
                 window["auc"], self.positions, "n/a" if self.lag is None else f"{self.lag:,}",
                 f"{store.get('rows', 0):,}", f"{store.get('expired', 0):,}")
        if self._writer is not None:
            from trainer.fitting import write_scalars

            write_scalars(self._writer, self.engine.step, report_scalars(
                rate=rate, dead_letters=self.dead, store=store, lag=self.lag, pv=pv,
                window=window, waited=waited))

    def summary(self, timings: bool = True) -> dict:
        """The single process's summary keys (``units`` are steps here; its reader's
        ``busy_seconds`` are the actors' ``timings``, left out with ``timings=False``), plus
        workers, shards, the assignment and what a step moves."""
        now = time.monotonic()
        seconds = now - self.started
        stats = self.engine.store_stats()
        summary = {
            "samples": self.samples, "messages": self.messages, "units": self.steps,
            "dead_letters": self.dead, "steps": self.engine.step, "seconds": round(seconds, 3),
            # a step is the unit: the steady rate leaves the actors' start-up out
            **run_rates(self.samples, seconds, self.steps, self.first_step,
                        self.last_step, self.first_step_samples),
            # the whole run, and the window the latest report covered
            "pv": {**self.pv.result(), "label": self.pv_label,
                   "window": self.last_pv_window},
            "broker_reachable": self.broker_reachable,
            "idle_s": round(0.0 if self._idle_since is None
                            else max(0.0, now - self._idle_since), 3),
            "assigned": sorted(p for parts in self.assignment for p in parts),
            "since_last_unit_s": (round(now - self.last_step, 3) if self.last_step
                                  else None),
            "checkpoints": self.checkpoints_written, "exports": self.exports,
            "delay_s": self.delays.percentiles(),
            "steady_delay_s": self.steady_delays.percentiles(), "lag": self.lag,
            "trainer_waited_s": round(self.waited, 3),
            "store_rows": stats.get("rows", 0), "store_bytes": stats.get("bytes", 0),
            "admitted": stats.get("admitted", 0), "rejected": stats.get("rejected", 0),
            "expired": stats.get("expired", 0), "recoveries": self.recoveries,
            # what a step costs (the on-paper scaling of benchmarks.online): bytes moved
            # between actors (trainer.distributed.driver counts them) and each actor's
            # seconds per part of the steps, over this run
            "bytes_per_step": {k: round(v / max(self.steps, 1)) for k, v in
                               sorted(self.engine.bytes.items())},
            "workers": self.engine.workers,
            "shards": self.engine.shards, "assignment": self.assignment,
            "offsets": {str(p): o for p, o in sorted(self.positions.items())},
            "metrics_url": self.metrics_url}
        if timings:
            summary["timings"] = self.engine.timings()
        return summary

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.committer.close()


def union_outputs(found: list) -> tuple[dict, dict]:
    """The union batch's ``(outputs, labels)`` from every worker's
    ``Worker.calibration_outputs`` (None: a worker without a batch), in worker order, as the
    union batch of a step puts the workers' batches."""
    found = [f for f in found if f is not None]
    return ({k: np.concatenate([o[k] for o, _ in found]) for k in found[0][0]},
            {k: np.concatenate([y[k] for _, y in found]) for k in found[0][1]})


def truncate_step_log(path: str, step: int) -> None:
    """Drop the lines of steps after ``step`` (written before a checkpoint that was never
    finished: those steps are trained again after the restart)."""
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


def run_cli(args, parser, schema: schemas.Schema, config: TrainConfig, model) -> dict:
    """``python -m trainer.online ... --workers W --shards S``: restore the latest checkpoint
    of ``--run-dir`` (or start from the batch run ``--init-from``, resharded, or a new
    ``model`` with ``config``), train, checkpoint, commit, and with ``--export-dir`` publish
    a version for serving every ``--export-every`` s; returns the run's summary (the keys of
    the single-process one that apply, plus workers, shards and the assignment)."""
    if args.init_from and not fs.is_local(args.init_from):
        parser.error(f"--init-from {args.init_from}: on an object store only without "
                     "--workers/--shards for now; give the Ray run a local or shared copy")
    workers, shards = args.workers or 1, args.shards or 1
    checkpoints = CheckpointManager(args.run_dir)
    latest = checkpoints.latest()
    step_log = os.path.join(args.run_dir, STEP_LOG) if args.step_log else None
    offsets = {}
    try:
        if latest is None and args.init_from:
            engine = _init_from(parser, args, schema, workers, shards)
        elif latest is None:
            engine = OnlineDistributedTrainer(schema, model, config, workers=workers,
                                              shards=shards, ray_address=args.ray_address,
                                              expire_every=args.expire_every)
            engine.calibrate = True
        else:
            directory = os.path.join(latest.path, "model")
            online = read_manifest(directory).get("online")
            if online is None:
                parser.error(f"{latest.path}: not a checkpoint of online learning on Ray (a "
                             "single-process run's? start it without --workers/--shards)")
            if online["topic"] != args.topic:
                parser.error(f"--topic {args.topic}: {args.run_dir} trained topic "
                             f"{online['topic']!r}")
            offsets = {int(p): o for p, o in online["offsets"].items()}
            engine = OnlineDistributedTrainer.restore(directory, workers=workers,
                                                      shards=shards,
                                                      ray_address=args.ray_address,
                                                      expire_every=args.expire_every)
            log.info("restored %s: step %d, offsets %s", latest.path, engine.step, offsets)
            if args.init_from:
                log.info("--init-from %s ignored: %s holds a checkpoint of its own",
                         args.init_from, args.run_dir)
    except (ConnectionError, ValueError) as e:
        parser.error(str(e))
    run = metrics = None
    try:  # a signal before run.run() ends the command here (exit 0, nothing trained)
        if step_log:
            truncate_step_log(step_log, engine.step)
        kafka_spec = {"bootstrap_servers": args.bootstrap_servers, "topic": args.topic,
                      "group": args.group, "options": dict(args.kafka_options),
                      "format": args.format,
                      # the samples' arrival times serve the export delay only
                      "arrivals": args.export_dir is not None,
                      "dlq_topic": args.dead_letter_topic,
                      "max_message_bytes": args.max_message_bytes}
        run = OnlineRun(engine, checkpoints, kafka_spec, offsets,
                        checkpoint_every=args.checkpoint_every, max_samples=args.max_samples,
                        idle_exit=args.idle_exit, report_every=args.report_every,
                        step_log=step_log, status_path=os.path.join(args.run_dir, STATUS_FILE),
                        log_dir=os.path.join(args.run_dir, TENSORBOARD_DIR),
                        export_dir=args.export_dir, export_every=args.export_every,
                        unit_samples=args.unit_samples)
        if args.metrics_port is not None:
            try:  # served by the driver, from the summary it aggregates over the actors
                metrics = serve_metrics(run, args.metrics_host, args.metrics_port)
            except OSError as e:
                raise cli.UsageError(f"--metrics-port {args.metrics_port}: cannot listen on "
                                     f"{args.metrics_host}: {e.strerror}") from None
            run.metrics_url = f"http://{args.metrics_host}:{metrics.server_port}/metrics"
            log.info("metrics on %s", run.metrics_url)
        with StopOnSignal() as stop:  # from here a signal finishes the run cleanly
            signal_point("run.started")
            summary = run.run(lambda: stop.signum is not None)
    finally:
        if metrics is not None:
            metrics.shutdown()
        if run is not None:
            run.close()
        engine.close()
    return summary


def _init_from(parser, args, schema: schemas.Schema, workers: int,
               shards: int) -> OnlineDistributedTrainer:
    """The model the batch run ``--init-from`` kept (in process or on Ray), checked against
    this run's schema, in ``workers`` x ``shards`` actors (its stores resharded)."""
    try:
        checkpoint, manifest = run_checkpoint(args.init_from)
    except (FileNotFoundError, ValueError, CheckpointDamagedError) as e:
        parser.error(f"--init-from {args.init_from}: {e}")
    if manifest["schema"] != schema.to_dict():
        parser.error(f"--init-from {args.init_from}: the batch run was trained on another "
                     f"schema ({schema_difference(manifest['schema'], schema.to_dict())})")
    engine = OnlineDistributedTrainer.restore(checkpoint, manifest=manifest, workers=workers,
                                              shards=shards, ray_address=args.ray_address,
                                              expire_every=args.expire_every)
    log.info("initialised from %s: step %d, %d store rows, %d workers x %d shards",
             args.init_from, engine.step, engine.store_rows(), workers, shards)
    return engine
