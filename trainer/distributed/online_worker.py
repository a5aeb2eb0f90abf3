"""The online worker actor: a data-parallel worker whose batches come from its Kafka partitions.

A reader thread polls the partitions the driver assigned (explicit assignment, no group
membership), at most the worker's share of the global batch per poll, and turns each poll into
one *item*: one TreeBatch (a poll of at most ``worker_batch_size`` samples is one batch) and
the offset ranges it consumed. Each synchronous step takes one item, waiting at most the poll
timeout: a worker with nothing to read contributes an empty batch and holds the others up for
no longer than that. A poll whose messages were all malformed holds no batch but still moves
the offsets (its messages went to the dead-letter topic), so the step reports them.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import numpy as np

import compression
from compression import TreeBatch
from trainer.distributed.worker import Worker, dense_sample, worker_batch_size
from trainer.kafka_source import KafkaSampleSource


@dataclass
class Consumed:
    """What one poll of a worker consumed, and the batch made of it."""

    batch: TreeBatch | None  # None: the poll's messages were all malformed
    ranges: dict             # partition -> [first offset, next offset]
    messages: int
    dead: int
    split: tuple | None = None  # prepared and split by shard (once the dense stats are known)
    # the Kafka arrival time (Unix ms) of every sample of the batch: the run's export delay
    arrivals_ms: np.ndarray | None = None

    def report(self) -> dict:
        """What the driver records of it: offsets, messages and dead letters."""
        return {"ranges": self.ranges, "messages": self.messages, "dead": self.dead}


_NOTHING = "nothing"  # held for the next step: an empty contribution


class OnlineWorker(Worker):
    """A :class:`~trainer.distributed.worker.Worker` fed by Kafka instead of files: the
    driver calls :meth:`open` with this worker's partitions and their offsets, then runs the
    same ``next_step``/``train_step``/``apply_dense`` calls as in batch training; every
    ``train_step`` result also says what the trained batch consumed (``consumed``)."""

    source: KafkaSampleSource | None = None

    def open(self, kafka_spec: dict, partitions: list[int], offsets: dict,
             poll_timeout: float) -> list[int]:
        """Read ``partitions`` of ``kafka_spec["topic"]`` from ``offsets`` (partition -> next
        offset; a partition without one starts at the group's committed offset, else at the
        beginning). ``kafka_spec``: bootstrap_servers, topic, group, options (``-X``),
        dlq_topic, max_message_bytes."""
        self.close_source()
        self.source = KafkaSampleSource(
            self.schema, kafka_spec["bootstrap_servers"], kafka_spec["topic"],
            kafka_spec["group"], start_offsets={int(p): int(o) for p, o in offsets.items()},
            dlq_topic=kafka_spec["dlq_topic"], config=kafka_spec["options"],
            max_message_bytes=kafka_spec["max_message_bytes"], partitions=list(partitions))
        self.poll_timeout = poll_timeout
        self._items: queue.Queue = queue.Queue(max(self.core.config.pipeline_depth, 1))
        self._stop_reading = threading.Event()
        self._held = None      # an item taken ahead for the next step (first_dense_sample)
        self._consumed = None  # what the batch of the current step consumed
        self._arrivals = None  # and its samples' arrival times
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
        ask = worker_batch_size(self.core.config.batch_size, self.index, self.workers)
        try:
            while not stop.is_set():
                polled = source.poll(ask, self.poll_timeout)
                if not polled.messages:
                    continue
                item = Consumed(None, {int(p): [int(a), int(b)]
                                       for p, (a, b) in polled.ranges.items()},
                                polled.messages, polled.dead)
                if polled.num_samples:
                    trees = compression.build_trees(polled.samples, self.schema, validate=False)
                    batches = list(compression.iter_batches(trees, self.schema, ask,
                                                            self.core.config.split_trees))
                    if len(batches) != 1:  # the grouping's promise: one poll, one batch
                        raise RuntimeError(f"worker {self.index}: a poll of "
                                           f"{polled.num_samples} samples made {len(batches)} "
                                           f"batches of {ask}")
                    item.batch = batches[0]
                    item.arrivals_ms = polled.timestamps_ms
                    if self.core.dense_resolved:  # else prepared once the driver resolved them
                        item.split = self._split(self.core.prepare_numpy(item.batch))
                while not stop.is_set():
                    try:
                        items.put(item, timeout=0.05)
                        break
                    except queue.Full:
                        pass
        except BaseException as e:  # raised in the driver's next step call
            items.put(e)

    def _take(self) -> Consumed | None:
        """The next item, waiting at most the poll timeout (None: nothing to train)."""
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

    def first_dense_sample(self, names) -> tuple[dict | None, dict | None]:
        """Take the next item now and return ``(its batch's dense values and leaf weights,
        what it consumed)``: the driver resolves the dense statistics on the first step's
        union batch, as a single process does on its first batch. A batch is held for the
        next step; without one (nothing polled, or only malformed messages) this worker
        contributes nothing to the next step."""
        if self._held is _NOTHING:  # the previous round's: there was no step since
            self._held = None
        item = self._take()
        if item is None or item.batch is None:
            self._held = _NOTHING
            return None, None if item is None else item.report()
        self._held = item
        return dense_sample(item.batch, self.schema, names), None

    def next_step(self, stream: str = "train", dense_messages: int = 0, *messages):
        """As :meth:`Worker.next_step`, the batch taken from Kafka (``stream`` is always the
        training one)."""
        self._check()
        if dense_messages:
            self.apply_dense(*messages)
        item = self._take()
        self._consumed = None if item is None else item.report()
        self._arrivals = None if item is None else item.arrivals_ms
        if item is None or item.batch is None:
            self._current["train"] = None
            return ({"n": 0},) + tuple({} for _ in range(self.shards))
        if item.split is None:
            item.split = self._split(self.core.prepare_numpy(item.batch))
        prepared, tables, requests, meta = item.split
        self._current["train"] = (prepared, tables, meta)
        return (meta,) + tuple(requests)

    def train_step(self, *shard_rows, dense_messages: int = 0):
        """As :meth:`Worker.train_step`; the result also holds ``consumed``: the offset
        ranges, messages and dead letters of the batch just trained (None: nothing), and
        ``arrivals_ms``: its samples' Kafka arrival times (Unix ms; None: no batch)."""
        if dense_messages:
            self.apply_dense(*shard_rows[:dense_messages])
            shard_rows = shard_rows[dense_messages:]
        consumed, arrivals = self._consumed, self._arrivals
        result, dense, *to_shards = self._gradient_messages(shard_rows)
        _, *requests = self.next_step()
        return ({**result, "consumed": consumed, "arrivals_ms": arrivals}, dense) + tuple(
            (n, grads, request) for (n, grads), request in zip(to_shards, requests))

    def flush_dead_letters(self, timeout: float) -> bool:
        """Whether every dead letter sent so far was delivered within ``timeout`` s."""
        return self.source is None or self.source.flush_dead_letters(timeout)
