"""Online learning on Ray: W workers read their Kafka partitions, S store shards hold the rows,
steps are synchronous, and a checkpoint holds every partition's trained offset.

    python -m trainer.online --schema S --bootstrap-servers HOST:PORT --topic samples \\
        --group ctr-online --run-dir run/ --workers 2 --shards 2 [--ray-address HEAD:6379]

The run is the online loop of a single process (:mod:`trainer.online_loop`: cadence,
checkpoint-then-commit, exports, reports, the summary) over :class:`RayEngine`.
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
a record, not a rule: with ``--step-log`` the loop appends it to ``RUN_DIR/steps.jsonl``
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
(:meth:`RayEngine.guard`).

**Reports.** The driver reports what a single process reports, aggregated over the actors:
``RUN_DIR/status.json`` every second, Prometheus metrics (``--metrics-port``) and TensorBoard
scalars (``RUN_DIR/online``) with the same names (:mod:`trainer.online_report`); samples,
dead letters and progressive validation summed from every worker's step results, store
counters from every shard, the consumer lag over every partition dealt. **Expiry** runs on
the shards after a step's update, as in batch training; ``--expire-every N`` reschedules it
as in a single process (and the checkpoints keep that config).

**Warm start and serving.** ``--init-from RUN_DIR`` starts a new run from the model a batch
run kept, in process or on Ray (:func:`~trainer.distributed.manifest.run_checkpoint`), its
stores resharded into the S shards. ``--export-dir`` publishes, between steps as a
checkpoint is taken, a full export and then every ``--export-every`` s a version holding
every shard's delta and the dense weights (:func:`trainer.serving.export_increment`), which
``Predictor``, ``LiveModel`` and ``trainer.serve`` follow; every sample's delay from its
Kafka arrival to the export holding it goes to the summary (``delay_s``). After a rollback
the next export is a full one: the shards' deltas then follow the checkpoint, not what was
published.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import ray

import schemas
from compression import fs, kafka
from trainer.checkpoints import CheckpointManager
from trainer.config import TrainConfig
from trainer.distributed.driver import DistributedTrainer
from trainer.distributed.manifest import read_manifest, run_checkpoint
from trainer.distributed.online_worker import OnlineWorker
from trainer.distributed.recovery import failure_summary, retrying
from trainer.distributed.steps import StepScheduler
from trainer.distributed.worker import resolve_dense, unresolved_dense
from trainer.kafka_source import commit_offsets, consumer_lag, leaders_answer
from trainer.online_loop import (OnlineLoop, OnlineOptions, OnlineStep,  # noqa: F401
                                 STEP_LOG, OnlineUsageError, init_from, run_online,
                                 truncate_step_log)
from trainer.online_report import STATUS_FILE, TENSORBOARD_DIR

log = logging.getLogger("trainer.online")

# Seconds a worker waits for a poll's batch before it contributes nothing to a step: the
# longest one idle worker holds the others up.
POLL_TIMEOUT = 0.2


def assign_partitions(partitions: list[int], workers: int) -> list[list[int]]:
    """Each worker's partitions: the i-th partition (in order) goes to worker ``i % workers``."""
    ordered = sorted(partitions)
    return [ordered[w::workers] for w in range(workers)]


class OnlineDistributedTrainer(DistributedTrainer):
    """A :class:`DistributedTrainer` whose workers read Kafka (:class:`OnlineWorker`): the
    same actors, step and checkpoints, an open-ended stream of steps instead of passes."""

    worker_class = OnlineWorker

    def __init__(self, schema, model=None, config: TrainConfig | None = None, *,
                 expire_every: int | None = None, memory_budget: int | None = None,
                 export_format: str | None = None, **kwargs):
        """``expire_every``: run every table's configured expiry every that many steps
        instead of its ``every_steps`` (``--expire-every``; a ConfigError when no table has
        one), in this run and in the config its checkpoints keep, as a single process does.
        ``memory_budget``: the whole model's (``--memory-budget``), instead of the config's
        or the checkpoint's budgets. The other arguments are :class:`DistributedTrainer`'s."""
        self.expire_every = expire_every
        self.export_format = export_format  # --export-format: every table's, over the config's
        self.memory_budget = memory_budget
        # a new run shifts the output biases on its first step (run_on_ray sets it as
        # trainer.online does for a run without a checkpoint or --init-from)
        self.calibrate = False
        super().__init__(schema, model, self.run_config(config or TrainConfig()), **kwargs)

    def run_config(self, saved: TrainConfig) -> TrainConfig:
        saved = saved.with_memory_budget(self.memory_budget).with_export_format(
            self.export_format)
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
        while self.calibrate:
            # A new run calibrates on the first step's union batch, as a single process does
            # on its first batch: every worker takes its first batch ahead, and until one of
            # them has one the rounds are yielded as paused steps that trained nothing (a
            # first poll that found nothing would otherwise leave the model uncalibrated).
            found = ray.get([w.first_dense_sample.remote([]) for w in self._workers])
            if any(sample is not None for sample, _ in found):
                break
            yield [{"n": 0, "consumed": consumed} for _, consumed in found], True
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


class RayEngine:
    """The online loop's engine on Ray (:class:`~trainer.online_loop.OnlineEngine`): an
    :class:`OnlineDistributedTrainer`'s steps, the partitions dealt to its workers, a
    committer for the group, the step log, and the rollback to the latest checkpoint after an
    actor died."""

    kind = "ray"
    recovers = True  # a checkpoint is written before the first step: what a death goes back to

    def __init__(self, trainer: OnlineDistributedTrainer, kafka_spec: dict, *,
                 unit_samples: int | None = None):
        """``kafka_spec``: as :meth:`OnlineWorker.open` takes it; ``unit_samples``: samples
        of a unit over all workers (``--unit-samples``; each worker polls its share; None: 10
        batches)."""
        self.trainer = trainer
        self.kafka_spec = kafka_spec
        self.unit_samples = unit_samples
        self.assignment: list[list[int]] = []
        self.settings = kafka.consumer_settings(kafka_spec["bootstrap_servers"],
                                                kafka_spec["group"], kafka_spec["options"])
        # commits offsets for the whole group (the workers never commit): it never subscribes
        self.committer = kafka.consumer(self.settings)
        self.recoveries: list[dict] = []  # one per rollback after an actor died

    @property
    def step(self) -> int:
        return self.trainer.step

    def close(self) -> None:
        self.committer.close()

    # -- steps -----------------------------------------------------------------------------

    def begin(self, loop) -> None:
        trainer = self.trainer
        partitions = kafka.list_partitions(self.settings, self.kafka_spec["topic"])
        self.assignment = assign_partitions(partitions, trainer.workers)
        log.info("%d workers x %d shards, partitions per worker %s, from offsets %s, actor "
                 "processes %s", trainer.workers, trainer.shards, self.assignment,
                 loop.positions, trainer.actor_pids())

    def steps(self, loop, pause):
        """Every worker reads its partitions from the loop's trained positions, then the
        synchronous steps (:meth:`OnlineDistributedTrainer.online_steps`); a step is pausable
        when no worker holds a partly trained unit and nothing is looked up ahead."""
        trainer = self.trainer
        trainer.open_sources(self.kafka_spec, self.assignment, loop.positions,
                             unit_samples=self.unit_samples)
        resumed = time.monotonic()  # when the loop last asked for a step
        for results, paused in trainer.online_steps(pause):
            step = OnlineStep(pausable=paused)
            step_record = []
            arrivals = []
            for r in results:
                if r.get("arrivals_ms") is not None:
                    # a unit's, on the step of its last batch
                    arrivals.append(r["arrivals_ms"])
                consumed = r.get("consumed")
                step_record.append({"ranges": {} if consumed is None else consumed["ranges"],
                                    "samples": r["n"], "batch": r.get("batch")})
                if consumed is not None:  # a unit ended: its offsets are trained
                    step.messages += consumed["messages"]
                    step.dead += consumed["dead"]
                    for p, (first, end) in consumed["ranges"].items():
                        step.ranges[int(p)] = (int(first), int(end))
                        step.positions[int(p)] = int(end)
                if consumed is not None or r["n"]:
                    step.read = True  # the worker read from the broker
                if r["n"]:
                    step.samples += r["n"]
                    step.predictions.append((r["probabilities"], r["labels"]))
            step.idle = not step.read
            if arrivals:
                step.arrivals_ms = np.concatenate(arrivals)
            if step.samples:
                step.unit = True  # a step is the unit: the rates leave the start-up out
                step.log = [step_record]
            else:  # every worker waited its poll timeout: the loop waited for input
                step.waited = time.monotonic() - resumed
            yield step
            resumed = time.monotonic()
        raise AssertionError("online_steps never ends")

    def end_steps(self) -> None:
        pass  # the workers' readers stop when their sources are opened again or closed

    def partitions_changed(self) -> bool:
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
        self.assignment = assign_partitions(sorted(dealt | set(added)), self.trainer.workers)
        log.info("partitions %s were added to topic %r: partitions per worker now %s", added,
                 self.kafka_spec["topic"], self.assignment)
        return True

    # -- failures ----------------------------------------------------------------------------

    def guard(self, body, loop):
        """``body()``; when an actor's process dies, Ray restarts it and every actor goes back
        to the latest checkpoint (the shards' rows, the dense weights, the step) and every
        partition to its offset there; the steps since are dropped (their offsets were never
        committed) and trained again from Kafka. A ``RuntimeError`` only when an actor does
        not come back."""
        return retrying(body, lambda error: self._roll_back(error, loop))

    def _roll_back(self, error: BaseException, loop) -> None:
        """Every actor and partition back to the latest checkpoint after an actor's death."""
        trainer = self.trainer
        latest = loop.checkpoints.latest()
        summary, failed_step = failure_summary(error), trainer.step
        try:
            if latest is None:
                raise RuntimeError("no checkpoint was written yet")
            directory = os.path.join(latest.path, "model")
            trainer.roll_back(directory, error)
            state = loop.checkpointed
            offsets = read_manifest(directory)["online"]["offsets"]
            if (trainer.step, {int(p): o for p, o in offsets.items()}) != (
                    state["step"], state["positions"]):
                raise RuntimeError(f"{latest.path} is not the checkpoint this run wrote last")
        except Exception as e:  # noqa: BLE001 - one line naming where a rerun resumes
            raise RuntimeError(
                f"an actor of the run died ({summary}) and the run could not roll back ({e}); "
                f"the steps since the last checkpoint are dropped and their offsets were not "
                f"committed: run the same command again to resume from "
                f"{latest.path if latest else 'the start'}") from e
        trainer.losses.clear()
        loop.restore()
        if loop.export_dir is not None:
            # the shards' deltas now follow the checkpoint, not what was published: the next
            # export is a full one (a new lineage), of the model rolled back to
            from trainer.serving import restart_lineage

            restart_lineage(trainer)
        self.recoveries.append({"error": summary, "failed_at_step": failed_step,
                                "rolled_back_to_step": trainer.step})
        log.warning("an actor died at step %d (%s); Ray restarted it and every actor rolled "
                    "back to the checkpoint of step %d (%s), every partition to its offset "
                    "there %s; actor processes %s", failed_step, summary, trainer.step,
                    latest.path, loop.positions, trainer.actor_pids())

    def snapshot(self) -> dict:
        return {"bytes": dict(self.trainer.bytes)}

    def restore_snapshot(self, snapshot: dict) -> None:
        self.trainer.bytes.clear()
        self.trainer.bytes.update(snapshot["bytes"])

    # -- checkpoints, commits, exports -----------------------------------------------------

    def flush_dead_letters(self, timeout: float) -> bool:
        return self.trainer.flush_dead_letters(timeout)

    def save_checkpoint(self, checkpoints, positions: dict, ranges: dict) -> None:
        """``checkpoints/ckpt-N/model``: the distributed checkpoint, whose manifest's
        ``online`` entry holds the topic, the group, the assignment and every partition's
        trained offset (the actors between steps, nothing looked up ahead)."""
        trainer = self.trainer
        latest = checkpoints.latest()
        online = {"topic": self.kafka_spec["topic"], "group": self.kafka_spec["group"],
                  "offsets": {str(p): o for p, o in sorted(positions.items())},
                  "assignment": self.assignment,
                  "previous": None if latest is None else os.path.basename(latest.path)}
        checkpoints.save(
            lambda d: trainer.save(os.path.join(d, "model"), extra={"online": online}),
            {"step": trainer.step, "samples": trainer.samples, "kind": "ray-online",
             "time": time.time()})

    def commit_due(self, positions: dict, final: bool) -> bool:
        return final  # the run's last commit is sent again, answered

    def commit(self, positions: dict, wait: bool) -> None:
        """A synchronous commit by the committer. A failed commit is made good by the next
        checkpoint's."""
        commit_offsets(self.committer, self.kafka_spec["topic"], positions)

    def export(self, directory: str, newest_sample_time: float | None) -> None:
        """A full export first, then every shard's delta of every table and the dense weights
        (:meth:`DistributedTrainer.export_increment`), the actors between steps with nothing
        looked up ahead."""
        self.trainer.export_increment(directory, newest_sample_time=newest_sample_time)

    # -- what the loop reports -------------------------------------------------------------

    def assigned(self) -> list:
        return sorted(p for parts in self.assignment for p in parts)

    def reachable(self, timeout: float) -> bool:
        return leaders_answer(self.committer, self.kafka_spec["topic"], self.assigned(),
                              timeout)

    def lag(self, positions: dict) -> int | None:
        return consumer_lag(self.committer, self.kafka_spec["topic"], self.assigned(),
                            positions)

    def store_stats(self) -> dict:
        return self.trainer.store_stats()

    def report_line(self, loop, v: dict) -> tuple:
        store, pv, window = v["store"], v["pv"], v["window"]
        return ("%s samples (%s samples/s), step %d, %d dead letters, %d checkpoints, "
                "progressive validation AUC %s (since the last line: %s), offsets %s, lag %s "
                "messages, %s store rows (expired %s)", f"{loop.stats.samples:,}",
                f"{v['rate']:,.0f}", self.trainer.step, loop.stats.dead,
                loop.stats.checkpoints, pv["auc"], window["auc"], loop.positions,
                "n/a" if loop.last_lag is None else f"{loop.last_lag:,}",
                f"{store.get('rows', 0):,}", f"{store.get('expired', 0):,}")

    def summary(self, loop, timings: bool) -> dict:
        """Workers, shards, the assignment, what a step costs (the on-paper scaling of
        benchmarks.online): bytes moved between actors per step of this run
        (trainer.distributed.driver counts them), the rollbacks, and with ``timings`` each
        actor's seconds per part of the steps and their sums (``busy_seconds``); without,
        None: asking every worker would wait for its poll."""
        trainer = self.trainer
        steps = max(loop.stats.units, 1)
        actors = trainer.timings() if timings else None
        busy = None
        if actors is not None:
            busy = {f"{kind[:-1]}_{k}": round(sum(t.get(k, 0.0) for t in actors[kind]), 3)
                    for kind in ("workers", "shards")
                    for k in sorted({k for t in actors[kind] for k in t})}
        return {"workers": trainer.workers, "shards": trainer.shards,
                "assignment": self.assignment,
                "bytes_per_step": {k: round(v / steps) for k, v in sorted(trainer.bytes.items())},
                "recoveries": self.recoveries, "busy_seconds": busy, "timings": actors}


def union_outputs(found: list) -> tuple[dict, dict]:
    """The union batch's ``(outputs, labels)`` from every worker's
    ``Worker.calibration_outputs`` (None: a worker without a batch), in worker order, as the
    union batch of a step puts the workers' batches."""
    found = [f for f in found if f is not None]
    return ({k: np.concatenate([o[k] for o, _ in found]) for k in found[0][0]},
            {k: np.concatenate([y[k] for _, y in found]) for k in found[0][1]})


def run_on_ray(options: OnlineOptions, schema: schemas.Schema, config: TrainConfig,
               model) -> dict:
    """``python -m trainer.online ... --workers W --shards S``: restore the latest checkpoint
    of ``--run-dir`` (or start from the batch run ``--init-from``, resharded, or a new
    ``model`` with ``config``) into W workers x S shards and run the online loop over them;
    returns its summary. OnlineUsageError for what cannot be used."""
    if options.init_from and not fs.is_local(options.init_from):
        raise OnlineUsageError(
            f"--init-from {options.init_from}: on an object store only without "
            "--workers/--shards for now; give the Ray run a local or shared copy")
    workers, shards = options.workers or 1, options.shards or 1
    run_dir = options.run_dir
    checkpoints = CheckpointManager(run_dir)
    latest = checkpoints.latest()
    step_log = os.path.join(run_dir, STEP_LOG) if options.step_log else None
    actors = {"workers": workers, "shards": shards, "ray_address": options.ray_address,
              "expire_every": options.expire_every, "export_format": options.export_format,
              "memory_budget": options.memory_budget_bytes, "tier_dir": options.tier_dir}
    offsets = {}
    try:
        if latest is None and options.init_from:
            checkpoint, manifest = init_from(options.init_from, schema, _read_batch_run)
            trainer = OnlineDistributedTrainer.restore(checkpoint, manifest=manifest, **actors)
            log.info("initialised from %s: step %d, %d store rows, %d workers x %d shards",
                     options.init_from, trainer.step, trainer.store_rows(), workers, shards)
        elif latest is None:
            trainer = OnlineDistributedTrainer(schema, model, config, **actors)
            # a new run shifts the output biases on its first step, as trainer.online does
            # for a run without a checkpoint or --init-from
            trainer.calibrate = True
        else:
            directory = os.path.join(latest.path, "model")
            online = read_manifest(directory).get("online")
            if online is None:
                raise OnlineUsageError(
                    f"{latest.path}: not a checkpoint of online learning on Ray (a "
                    "single-process run's? start it without --workers/--shards)")
            if online["topic"] != options.topic:
                raise OnlineUsageError(f"--topic {options.topic}: {run_dir} trained topic "
                                       f"{online['topic']!r}")
            offsets = {int(p): o for p, o in online["offsets"].items()}
            trainer = OnlineDistributedTrainer.restore(directory, **actors)
            log.info("restored %s: step %d, offsets %s", latest.path, trainer.step, offsets)
            if options.init_from:
                log.info("--init-from %s ignored: %s holds a checkpoint of its own",
                         options.init_from, run_dir)
    except OnlineUsageError:
        raise
    except (ConnectionError, ValueError) as e:  # Ray's address; the config's expiry
        raise OnlineUsageError(str(e)) from None
    engine = None
    try:  # a signal before the loop runs ends the command here (exit 0, nothing trained)
        kafka_spec = {"bootstrap_servers": options.bootstrap_servers, "topic": options.topic,
                      "group": options.group, "options": dict(options.kafka_options),
                      "format": options.format,
                      # the samples' arrival times serve the export delay only
                      "arrivals": options.export_dir is not None,
                      "dlq_topic": options.dead_letter_topic,
                      "max_message_bytes": options.max_message_bytes}
        engine = RayEngine(trainer, kafka_spec, unit_samples=options.unit_samples)
        loop = OnlineLoop(engine, checkpoints, positions=offsets,
                          checkpoint_every=options.checkpoint_every,
                          export_dir=options.export_dir, export_every=options.export_every,
                          max_samples=options.max_samples, idle_exit=options.idle_exit,
                          status_path=os.path.join(run_dir, STATUS_FILE),
                          log_dir=os.path.join(run_dir, TENSORBOARD_DIR),
                          report_every=options.report_every, step_log=step_log)
        return run_online(loop, options.metrics_host, options.metrics_port)
    finally:
        if engine is not None:
            engine.close()
        trainer.close()


def _read_batch_run(run_dir: str):
    """The checkpoint a batch run kept (in process or on Ray) and its manifest, and the
    schema it was trained on."""
    checkpoint, manifest = run_checkpoint(run_dir)
    return (checkpoint, manifest), manifest["schema"]
