"""A Kafka topic of samples as a source of training micro-batches, with explicit offsets.

Offsets are never committed automatically. The caller trains what :meth:`poll` returned,
writes a checkpoint holding :attr:`KafkaSampleSource.positions`, and only then calls
:meth:`commit`. On start, partitions are sought to the offsets of the restored checkpoint, so
after a crash training resumes exactly after the last checkpointed sample: nothing is lost and
nothing is trained twice relative to the restored model.

Malformed messages (bad JSON, ``null``, empty, missing or mistyped fields, a wrong tree schema,
oversized) go to the dead-letter topic (``TOPIC.dlq`` unless given) as
``compression.DeadLetter`` records: the message unchanged, headers ``reason``,
``source.topic``, ``source.partition`` and ``source.offset``; they count as consumed. A poll
only sets them aside (:attr:`Polled.dead_letters`): the caller sends them
(:meth:`KafkaSampleSource.send_dead_letters`) when it trains the poll's offsets, so a
message polled again after a poll was dropped untrained (a stop, a re-deal of partitions)
is dead-lettered once, as it is trained once.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

import compression
from compression import kafka
from compression.kafka import KafkaError, KafkaException, TopicPartition
from compression.messages import (DEFAULT_MAX_MESSAGE_BYTES,  # one limit for both formats
                                  MESSAGE_INDEX, DeadLetter, dead_letter_topic,
                                  decode_json_samples, oversized_reason)
from schemas import Schema

log = logging.getLogger(__name__)


# A unit (one poll, compressed and batched together: trainer.online, and every worker of online
# learning on Ray) holds up to this many batches of samples: a bigger poll puts more of a
# user's samples into one tree, so its batches share more and the step costs less per sample.
# Below that load a poll returns what arrived within its timeout.
DEFAULT_UNIT_BATCHES = 10


def _partition_of(message) -> int:
    return message.partition() if message.error() is None else -1


@dataclass
class Polled:
    """What one :meth:`KafkaSampleSource.poll` consumed."""

    samples: pa.Table | None = None          # format json: flat rows in canonical types
    trees: list = field(default_factory=list)  # format trees: decoded tree tables
    num_samples: int = 0
    messages: int = 0
    # the malformed messages' records, sent by whoever trains this poll's offsets
    dead_letters: list[DeadLetter] = field(default_factory=list)
    ranges: dict = field(default_factory=dict)  # partition -> (first offset, next offset)
    timestamps_ms: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def dead(self) -> int:
        return len(self.dead_letters)


class KafkaSampleSource:
    """Consumes ``topic`` in group ``group``; ``format`` is ``json`` (one raw sample per
    message) or ``trees`` (one Arrow IPC tree table per message, from the streaming job).

    ``partitions``: read exactly these partitions (explicit assignment, no group membership:
    the caller decides who reads what, e.g. the driver of online learning on Ray); each starts
    at its ``start_offsets`` entry, else at the group's committed offset, else at the
    beginning. Without it the source joins the group and the group assigns partitions.

    ``config``: the user's librdkafka settings (``-X``), for the consumer and the dead-letter
    producer (see ``compression.kafka``)."""

    def __init__(self, schema: Schema, bootstrap_servers: str, topic: str, group: str,
                 format: str = "json", start_offsets: dict[int, int] | None = None,
                 dlq_topic: str | None = None, config: dict | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 partitions: list[int] | None = None):
        if format not in ("json", "trees"):
            raise ValueError(f"format must be json or trees, got {format!r}")
        self.schema = schema
        self.topic = topic
        self.format = format
        self.dlq_topic = dead_letter_topic(topic, dlq_topic)
        self.max_message_bytes = max_message_bytes
        self.start_offsets = {int(p): int(o) for p, o in (start_offsets or {}).items()}
        # partition -> next offset to train; starts at the restored checkpoint's offsets
        self.positions: dict[int, int] = dict(self.start_offsets)
        self.assigned: set[int] = set()
        self.rebalances = 0
        # partition -> offset the broker confirmed as committed (by this source's commits)
        self.committed: dict[int, int] = {}
        self.commits_in_flight = 0  # asynchronous commits not answered yet
        self._decode_tree = compression.TreeMessageDecoder(schema.tree_arrow_schema(),
                                                           schema.name)
        self.consumer = kafka.consumer(kafka.consumer_settings(
            bootstrap_servers, group, config, overrides={"on_commit": self._on_commit}))
        # The dead-letter producer is idempotent (enable.idempotence=true, acks from all
        # replicas): a produce retried after its answer was lost (a slow ack, a dropped
        # connection) is written once, the broker refusing the repeated sequence numbers and
        # librdkafka counting that answer as delivered. Tansu 0.6.0, the test broker, does
        # this too: it answers InitProducerId and checks sequences per partition (tested by
        # losing a produce's answer). The user's -X still wins, as for every setting (for a
        # broker without idempotence, at the price of repeats on retries).
        self.producer = kafka.producer(kafka.producer_settings(
            bootstrap_servers, config, linger_ms=5, overrides={"enable.idempotence": True,
                                                               "acks": "all"}))
        self.dead_letters_failed = 0  # dead letters the broker never took (logged)
        if partitions is None:
            self.consumer.subscribe([topic], on_assign=self._on_assign,
                                    on_revoke=self._on_revoke)
        else:
            # TopicPartition's default offset means "the committed one, else auto.offset.reset"
            self.consumer.assign([TopicPartition(topic, p, self.positions[p])
                                  if p in self.positions else TopicPartition(topic, p)
                                  for p in sorted(partitions)])
            self.assigned = set(partitions)

    # -- group membership ----------------------------------------------------------------

    def _on_assign(self, consumer, partitions):
        self.rebalances += 1
        for tp in partitions:
            if tp.partition in self.positions:
                tp.offset = self.positions[tp.partition]  # resume after the last trained sample
        consumer.assign(partitions)
        self.assigned = {tp.partition for tp in partitions}
        log.info("assigned partitions %s of %s", sorted(self.assigned), self.topic)

    def _on_revoke(self, consumer, partitions):
        self.rebalances += 1
        self.assigned -= {tp.partition for tp in partitions}
        log.info("revoked partitions %s of %s", sorted(tp.partition for tp in partitions),
                 self.topic)

    # -- consuming -----------------------------------------------------------------------

    def poll(self, max_messages: int, timeout: float, by_partition: bool = False) -> Polled:
        """Consume up to ``max_messages`` (waiting at most ``timeout`` s), decode them in bulk,
        set malformed ones aside as dead letters (:attr:`Polled.dead_letters`, for
        :meth:`send_dead_letters`), and advance :attr:`positions`.
        ``by_partition``: the samples in partition order, then offset (else as consumed), an
        order a replay of the offset ranges can rebuild."""
        # One pass over the messages (this loop runs for every sample at 100k/s, holding the
        # GIL the training thread also needs); the offset bookkeeping is done in numpy.
        consumed = self.consumer.consume(num_messages=max_messages, timeout=timeout)
        if by_partition:  # stable: a partition's messages come in offset order
            consumed.sort(key=_partition_of)
        # after consume: its rebalance callbacks replace self.assigned
        assigned, limit = self.assigned, self.max_message_bytes
        messages, values, partitions, offsets = [], [], [], []
        polled = Polled()
        for msg in consumed:
            error = msg.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    if error.fatal():
                        raise KafkaException(error)
                    log.warning("consume %s: %s", self.topic, error)  # librdkafka retries
                continue
            partition = msg.partition()
            if partition not in assigned:  # a leftover of a revoked partition
                continue
            partitions.append(partition)
            offsets.append(msg.offset())
            value = msg.value()
            if value is not None and len(value) > limit:
                self._dead(polled, msg, oversized_reason(len(value), limit))
                continue
            messages.append(msg)
            values.append(value)
        polled.messages = len(partitions)
        if not partitions:
            return polled
        if self.format == "json":
            self._decode_json_messages(messages, values, polled)
        else:
            self._decode_tree_messages(messages, polled)
        partitions = np.asarray(partitions, np.int64)
        offsets = np.asarray(offsets, np.int64)
        for p in np.unique(partitions).tolist():
            of_p = offsets[partitions == p]
            first, end = int(of_p.min()), int(of_p.max()) + 1
            polled.ranges[p] = (first, end)
            self.positions[p] = max(self.positions.get(p, 0), end)
        return polled

    def _decode_json_messages(self, messages, values, polled: Polled):
        table, dead = decode_json_samples(values, self.schema, with_index=True,
                                          max_message_bytes=self.max_message_bytes)
        for index, reason in dead:
            self._dead(polled, messages[index], reason)
        kept = table.column(MESSAGE_INDEX).to_numpy()
        polled.samples = table.drop_columns([MESSAGE_INDEX])
        polled.num_samples = polled.samples.num_rows
        polled.timestamps_ms = np.fromiter((m.timestamp()[1] for m in messages), np.int64,
                                           len(messages))[kept]

    def _decode_tree_messages(self, messages, polled: Polled):
        """Decode tree messages into one table for the whole poll (batching one table is much
        cheaper than batching many small ones), with a timestamp per leaf."""
        good = self._sift([(m.value(), m) for m in messages], self._decode_tree, polled)
        if not good:
            return
        try:
            table = pa.concat_tables([trees for trees, _ in good])
            leaves = _leaves_per_root(table, self.schema)
        except (ValueError, pa.ArrowException):  # a malformed tree: find it message by message
            def well_formed(trees):
                _leaves_per_root(trees, self.schema)  # raises on a malformed tree
                return trees

            good = self._sift(good, well_formed, polled)
            if not good:
                return
            table = pa.concat_tables([trees for trees, _ in good])
            leaves = _leaves_per_root(table, self.schema)
        tables, kept = zip(*good)
        leaves_before = np.r_[0, np.cumsum(leaves)]  # leaves before each root
        root_bounds = np.r_[0, np.cumsum([t.num_rows for t in tables])]
        per_message = leaves_before[root_bounds[1:]] - leaves_before[root_bounds[:-1]]
        polled.trees = [table]
        polled.num_samples = int(per_message.sum())
        polled.timestamps_ms = np.repeat(
            np.array([m.timestamp()[1] for m in kept], np.int64), per_message)

    def _sift(self, items, check, polled: Polled) -> list:
        """``(check(value), msg)`` of the ``(value, msg)`` items ``check`` accepts; the others'
        messages are set aside as dead letters."""
        kept = []
        for value, msg in items:
            try:
                kept.append((check(value), msg))
            except (ValueError, pa.ArrowException) as e:
                self._dead(polled, msg, f"not a tree message: {e}")
        return kept

    def _dead(self, polled: Polled, msg, reason: str):
        polled.dead_letters.append(DeadLetter(msg.value(), reason, msg.key(), self.topic,
                                              msg.partition(), msg.offset()))

    # -- dead letters and committing -----------------------------------------------------

    def send_dead_letters(self, letters: list[DeadLetter]) -> None:
        """Send ``letters`` (a poll's :attr:`Polled.dead_letters`) to the dead-letter topic.
        Call it when the poll's offsets are trained, before the checkpoint that holds them
        (:meth:`flush_dead_letters` waits for their delivery): a poll dropped untrained is
        read again, and only then are its dead letters sent."""
        for letter in letters:
            while True:
                try:
                    self.producer.produce(self.dlq_topic, value=letter.value, key=letter.key,
                                          headers=list(letter.headers()),
                                          on_delivery=self._on_delivery(letter))
                    break
                except BufferError:
                    self.producer.poll(0.1)
        self.producer.poll(0)

    def _on_delivery(self, letter: DeadLetter):
        def delivered(err, _msg):
            if err is not None:
                self.dead_letters_failed += 1
                log.error("the dead letter of %s partition %s offset %s was not written to %s "
                          "(%s); its reason: %s", letter.topic, letter.partition, letter.offset,
                          self.dlq_topic, err, letter.reason)
        return delivered

    def flush_dead_letters(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until every dead letter sent so far is delivered; False if
        some are not (e.g. the broker is unreachable). A checkpoint must not cover messages
        whose dead letters could still be lost."""
        remaining = self.producer.flush(timeout)
        if remaining:
            log.warning("%d dead letters to %s not delivered yet", remaining, self.dlq_topic)
        return remaining == 0

    def commit(self, offsets: dict[int, int] | None = None, asynchronous: bool = False) -> bool:
        """Commit ``offsets`` (default: :attr:`positions`) of the partitions this member owns.

        Call it only once a checkpoint holding these offsets is on disk. Returns False when the
        commit failed (broker unreachable, a rebalance in progress): the checkpoint, not Kafka,
        is where a restart resumes, so the next checkpoint simply commits again. Offsets of
        partitions another member took over are not committed, so its commits stand.

        A synchronous commit can wait for as long as the group coordinator is unreachable
        (measured: minutes, until the broker came back). ``asynchronous=True`` only sends it:
        the broker's answer arrives in a later :meth:`poll` and updates :attr:`committed`
        (``commits_in_flight`` counts the unanswered ones)."""
        offsets = self.positions if offsets is None else offsets
        owned = {p: o for p, o in offsets.items() if p in self.assigned}
        sent = commit_offsets(self.consumer, self.topic, owned, asynchronous)
        if sent and owned and asynchronous:
            self.commits_in_flight += 1
        return sent

    def _on_commit(self, err, partitions):
        """The broker's answer to a commit (served by ``consume``, or by the commit call)."""
        self.commits_in_flight = max(0, self.commits_in_flight - 1)
        if err is not None:
            log.warning("commit of %s offsets failed, retrying at the next checkpoint: %s",
                        self.topic, err)
            return
        for tp in partitions:
            if tp.topic == self.topic and tp.error is None and tp.offset >= 0:
                self.committed[tp.partition] = tp.offset

    def reachable(self, timeout: float) -> bool:
        """Whether the leader of every assigned partition answers a request within ``timeout``
        s (a ListOffsets round trip each; a metadata answer from some other broker would not
        show that these partitions can be read). False with no partition assigned.

        An empty :meth:`poll` cannot tell "nothing to read" from "the broker is gone": the
        client retries unreachable brokers silently. This is what tells them apart."""
        return leaders_answer(self.consumer, self.topic, self.assigned, timeout)

    def lag(self) -> int | None:
        """Messages behind the end of the assigned partitions (None when unknown).

        Uses the broker's high watermark, which some brokers under-report; a metric only."""
        return consumer_lag(self.consumer, self.topic, self.assigned, self.positions)

    def close(self):
        try:
            self.producer.flush(10)
        finally:
            self.consumer.close()


def leaders_answer(consumer, topic: str, partitions, timeout: float) -> bool:
    """Whether the leader of every one of ``topic``'s ``partitions`` answers ``consumer``
    within ``timeout`` s (a ListOffsets round trip each); False without partitions."""
    if not partitions:
        return False
    for p in sorted(partitions):
        try:
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout,
                                           cached=False)
        except KafkaException:
            return False
    return True


def consumer_lag(consumer, topic: str, partitions, positions: dict,
                 timeout: float = 1.0) -> int | None:
    """Messages of ``topic``'s ``partitions`` at or after ``positions`` (partition -> next
    offset to read; 0 when absent), from the leaders' high watermarks as ``consumer`` gets
    them; None when a leader does not answer within ``timeout`` s. Some brokers under-report
    the watermark (docs/architecture.md): a metric only."""
    total = 0
    for p in sorted(partitions):
        try:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout,
                                                     cached=False)
        except KafkaException:
            return None
        total += max(0, high - positions.get(p, 0))
    return total


def commit_offsets(consumer, topic: str, offsets: dict[int, int],
                   asynchronous: bool = False) -> bool:
    """Commit ``offsets`` (partition -> next offset to read) of ``topic`` with ``consumer``
    (a member of the group, or any consumer of the group when no member subscribes: explicit
    assignment). False when the commit failed and the caller should retry at its next
    checkpoint; a fatal client error is raised. ``asynchronous`` only sends it."""
    owned = [TopicPartition(topic, p, o) for p, o in sorted(offsets.items())]
    if not owned:
        return True
    try:
        consumer.commit(offsets=owned, asynchronous=asynchronous)
    except KafkaException as e:
        error = e.args[0] if e.args else e
        if isinstance(error, KafkaError) and error.fatal():
            raise
        log.warning("commit of %s offsets failed, retrying at the next checkpoint: %s",
                    topic, error)
        return False
    return True


def _leaves_per_root(trees: pa.Table, schema: Schema) -> np.ndarray:
    """How many samples (leaves) each root node of a tree table holds."""
    layers = compression.flat_layers(trees, schema)
    if len(layers) == 1:
        return np.ones(trees.num_rows, np.int64)
    root = layers[-1].parent
    for layer in reversed(layers[1:-1]):
        root = layer.parent[root]
    return np.bincount(root, minlength=trees.num_rows).astype(np.int64)


def group_id() -> str:
    """A fresh consumer group name (for tests and one-off runs)."""
    return f"prefixrec-{uuid.uuid4().hex[:10]}"

