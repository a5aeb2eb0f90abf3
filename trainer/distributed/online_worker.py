"""The online worker actor: a data-parallel worker whose batches come from its Kafka partitions.

A reader thread polls the partitions the driver assigned (explicit assignment, no group
membership), at most the worker's share of ``unit_samples`` per poll (about 10 of its batches
by default, as a single process polls), and turns each poll into one *unit*: its samples in
partition order (then offset: what a replay of the step log can rebuild), compressed into
trees at once (a bigger poll shares more tree prefixes), cut into batches of the worker's
share of the global batch, with the offset ranges it consumed. Each synchronous step trains
the next batch of the current unit, else the first of the next unit, waiting at most the poll
timeout for one: a worker with nothing to read contributes an empty batch and holds the others
up for no longer than that. A unit's ranges are reported by the step that trains its last
batch (its offsets are trained then, not before); a poll whose messages were all malformed
holds no batch but still moves the offsets (its messages go to the dead-letter topic), so
the step that takes it reports them. A unit's dead letters are sent by the step that reports
its offsets, not by the poll: units polled ahead and dropped untrained (a re-deal of
partitions, the end of the run) are read again from the trained offsets, and their malformed
messages are dead-lettered once.

While the driver drains (:meth:`OnlineWorker.drain`) a worker starts no new unit: it trains
what is left of its current one, then contributes empty batches, so that a checkpoint, which
holds per partition *trained* offsets, is taken when no worker holds a partly trained unit.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import numpy as np

from trainer.distributed.worker import Worker, dense_sample, worker_batch_size
from trainer.kafka_source import DEFAULT_UNIT_BATCHES, KafkaSampleSource
from trainer.units import polled_batches


@dataclass
class Consumed:
    """What one poll of a worker consumed (a unit), and the batches made of it."""

    batches: list            # TreeBatch each; empty: the poll's messages were all malformed
    ranges: dict             # partition -> [first offset, next offset]
    messages: int
    dead_letters: list       # compression.DeadLetter each, sent when the offsets are reported
    # per batch: prepared and split by shard (None until the dense stats are known)
    splits: list | None = None
    # the Kafka arrival time (Unix ms) of every sample of the unit: the run's export delay
    # (reported with the unit's last batch, when all of them are trained)
    arrivals_ms: np.ndarray | None = None
    taken: int = 0  # batches taken for a step so far

    def report(self) -> dict:
        """What the driver records of it: offsets, messages and dead letters."""
        return {"ranges": self.ranges, "messages": self.messages,
                "dead": len(self.dead_letters)}

    @property
    def left(self) -> int:
        """Batches not taken for a step yet."""
        return len(self.batches) - self.taken


_NOTHING = "nothing"  # held for the next step: an empty contribution


def worker_unit_samples(batch_size: int, unit_samples: int | None, worker: int,
                        workers: int) -> int:
    """Samples worker ``worker`` polls as one unit: its share of ``unit_samples`` (the run's
    ``--unit-samples``), or with ``unit_samples`` None the single process's default for its
    share of ``batch_size`` (``DEFAULT_UNIT_BATCHES`` of its batches)."""
    if unit_samples is None:
        return DEFAULT_UNIT_BATCHES * worker_batch_size(batch_size, worker, workers)
    return worker_batch_size(unit_samples, worker, workers)


class OnlineWorker(Worker):
    """A :class:`~trainer.distributed.worker.Worker` fed by Kafka instead of files: the
    driver calls :meth:`open` with this worker's partitions and their offsets, then runs the
    same ``next_step``/``train_step``/``apply_dense`` calls as in batch training; every
    ``train_step`` result also says what the trained batch consumed (``consumed``)."""

    source: KafkaSampleSource | None = None

    def open(self, kafka_spec: dict, partitions: list[int], offsets: dict,
             poll_timeout: float, unit_samples: int | None = None) -> list[int]:
        """Read ``partitions`` of ``kafka_spec["topic"]`` from ``offsets`` (partition -> next
        offset; a partition without one starts at the group's committed offset, else at the
        beginning), in units of this worker's share of ``unit_samples`` samples (the whole
        run's, as ``batch_size``; None: ``DEFAULT_UNIT_BATCHES`` of this worker's batches).
        ``kafka_spec``: bootstrap_servers, topic, group, options (``-X``), dlq_topic,
        max_message_bytes, format (``json``, the default, or ``trees``: messages of
        compressed trees, a unit then being as many messages as hold about its samples),
        arrivals (default True; False: a step's result holds no ``arrivals_ms``, which only
        the export delay needs).
        Held units of a previous open are dropped."""
        self.close_source()
        self.source_spec = kafka_spec
        self.source = KafkaSampleSource(
            self.schema, kafka_spec["bootstrap_servers"], kafka_spec["topic"],
            kafka_spec["group"], format=kafka_spec.get("format", "json"),
            start_offsets={int(p): int(o) for p, o in offsets.items()},
            dlq_topic=kafka_spec["dlq_topic"], config=kafka_spec["options"],
            max_message_bytes=kafka_spec["max_message_bytes"], partitions=list(partitions))
        self.poll_timeout = poll_timeout
        self.unit_samples = worker_unit_samples(self.core.config.batch_size, unit_samples,
                                                self.index, self.workers)
        self._items: queue.Queue = queue.Queue(max(self.core.config.pipeline_depth, 1))
        self._stop_reading = threading.Event()
        self._held = None      # an item taken ahead for the next step (first_dense_sample)
        self._unit = None      # the unit whose batches the steps train
        self._draining = False
        self._consumed = None  # the unit whose offsets the current step trains
        self._arrivals = None  # and its samples' arrival times
        self._batch = None     # [index in its unit, batches of the unit] of the current step
        self._reader = threading.Thread(
            target=self._read_kafka, args=(self.source, self._stop_reading, self._items),
            daemon=True, name=f"online-worker{self.index}")
        self._reader.start()
        return sorted(partitions)

    def close_source(self) -> None:
        if self.source is None:
            return
        self._stop_reading.set()
        self._reader.join()
        self.source.close()
        self.source = None

    def _read_kafka(self, source: KafkaSampleSource, stop: threading.Event, items: queue.Queue):
        batch_size = worker_batch_size(self.core.config.batch_size, self.index, self.workers)
        # as a single process: a tree message holds many samples, so a unit asks for as many
        # messages as the samples per message so far suggest (one at first)
        seen_samples = seen_messages = 0
        try:
            while not stop.is_set():
                if source.format == "json":
                    ask = self.unit_samples
                elif seen_samples:
                    ask = max(1, round(self.unit_samples * seen_messages / seen_samples))
                else:
                    ask = 1
                polled = source.poll(ask, self.poll_timeout, by_partition=True)
                if not polled.messages:
                    continue
                seen_samples += polled.num_samples
                seen_messages += polled.messages
                item = Consumed(polled_batches(polled, self.schema, batch_size,
                                               self.core.config.split_trees),
                                {int(p): [int(a), int(b)]
                                 for p, (a, b) in sorted(polled.ranges.items())},
                                polled.messages, polled.dead_letters)
                if polled.num_samples:
                    if self.source_spec.get("arrivals", True):
                        item.arrivals_ms = polled.timestamps_ms
                    if self.core.dense_resolved:  # else prepared once the driver resolved them
                        item.splits = [self._split(self.core.prepare_numpy(b))
                                       for b in item.batches]
                while not stop.is_set():
                    try:
                        items.put(item, timeout=0.05)
                        break
                    except queue.Full:
                        pass
        except BaseException as e:  # raised in the driver's next step call
            items.put(e)

    def _next_unit(self) -> Consumed | None:
        """The next unit, waiting at most the poll timeout (None: nothing to train)."""
        if self._held is not None:
            item, self._held = self._held, None
            return None if item is _NOTHING else item
        try:
            item = self._items.get(timeout=self.poll_timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def _take(self) -> tuple[Consumed, int | None] | None:
        """The next step's batch: ``(its unit, its index there)``, the index None for a unit
        without batches (only malformed messages); None: nothing to train (nothing read
        within the poll timeout, or draining with the current unit trained)."""
        unit = self._unit
        if unit is None or not unit.left:
            if self._draining:
                return None
            unit = self._unit = self._next_unit()
            if unit is None:
                return None
            if not unit.batches:
                self._unit = None
                return unit, None
        unit.taken += 1
        return unit, unit.taken - 1

    def drain(self, draining: bool) -> None:
        """While ``draining``, start no new unit: the steps train what is left of the current
        one, then nothing (the driver then takes a checkpoint)."""
        self._draining = bool(draining)

    def left(self) -> int:
        """Batches of the current unit that no step has taken yet."""
        return 0 if self._unit is None else self._unit.left

    def first_dense_sample(self, names) -> tuple[dict | None, dict | None]:
        """Take the next item now and return ``(its batch's dense values and leaf weights,
        what it consumed)``: the driver resolves the dense statistics on the first step's
        union batch, as a single process does on its first batch. A batch is held for the
        next step; without one (nothing polled, or only malformed messages) this worker
        contributes nothing to the next step."""
        if self._held is _NOTHING:  # the previous round's: there was no step since
            self._held = None
        item = self._next_unit()
        if item is None or not item.batches:
            self._held = _NOTHING
            return None, None if item is None else self._report(item)
        self._held = item
        return dense_sample(item.batches[0], self.schema, names), None

    def next_step(self, stream: str = "train", dense_messages: int = 0, *messages):
        """As :meth:`Worker.next_step`, the batch taken from Kafka (``stream`` is always the
        training one)."""
        self._check()
        if dense_messages:
            self.apply_dense(*messages)
        taken = self._take()
        self._consumed = self._arrivals = self._batch = None
        if taken is None or taken[1] is None:
            self._consumed = None if taken is None else taken[0]
            self._current["train"] = None
            return ({"n": 0},) + tuple({} for _ in range(self.shards))
        unit, index = taken
        last = index == len(unit.batches) - 1
        if last:  # the unit's offsets are trained with its last batch
            self._consumed, self._arrivals = unit, unit.arrivals_ms
        self._batch = [index, len(unit.batches)]
        if unit.splits is None:
            unit.splits = [None] * len(unit.batches)
        split = unit.splits[index]
        if split is None:
            split = self._split(self.core.prepare_numpy(unit.batches[index]))
        unit.splits[index] = unit.batches[index] = None  # not kept once taken
        prepared, tables, requests, meta = split
        self._current["train"] = (prepared, tables, meta)
        return (meta,) + tuple(requests)

    def train_step(self, *shard_rows, dense_messages: int = 0, dense: bool = True):
        """As :meth:`Worker.train_step`; the result also holds ``consumed``: the offset
        ranges, messages and dead letters of the unit whose last batch was just trained (None:
        the unit goes on, or nothing), ``arrivals_ms``: that unit's samples' Kafka arrival
        times (Unix ms; None: no unit ended), ``batch``: ``[index in its unit, batches of the
        unit]`` of the batch trained (None: no batch), and ``left``: the batches of the
        current unit left after the one taken for the next step (0: after the next step no
        unit is partly trained, a checkpoint may follow it)."""
        if dense_messages:
            self.apply_dense(*shard_rows[:dense_messages])
            shard_rows = shard_rows[dense_messages:]
        consumed, arrivals, batch = self._consumed, self._arrivals, self._batch
        result, message, *to_shards = self._gradient_messages(shard_rows, dense)
        _, *requests = self.next_step()
        return ({**result, "consumed": None if consumed is None else self._report(consumed),
                 "arrivals_ms": arrivals, "batch": batch, "left": self.left()},
                message) + tuple(
            (n, grads, request) for (n, grads), request in zip(to_shards, requests))

    def _report(self, unit: Consumed) -> dict:
        """``unit.report()`` for the driver, which now records its offsets as trained: its
        dead letters are sent now (delivered before the checkpoint that holds them)."""
        self.source.send_dead_letters(unit.dead_letters)
        return unit.report()

    def flush_dead_letters(self, timeout: float) -> bool:
        """Whether every dead letter sent so far was delivered within ``timeout`` s."""
        return self.source is None or self.source.flush_dead_letters(timeout)
