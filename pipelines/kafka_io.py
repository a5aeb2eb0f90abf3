"""Kafka reading and writing for the streaming jobs, on confluent-kafka (pure Python) or Beam's
cross-language Java KafkaIO.

Python IO (``ReadKafkaPython`` / ``WriteKafkaPython``), works offline and on any runner:

* one splittable DoFn element per partition; its restriction is an offset range from the
  group's committed offset (or the partition's first offset) on; each poll's messages become one
  :class:`MessageBatch` element, claimed by the poll's last offset, each message keeping its
  Kafka timestamp as event time, its key and where it was read (for dead letters);
* unbounded: after 0.5 s without messages, or 5 s of reading, the DoFn defers the rest of the
  range and sets the watermark (max event time seen minus ``max_out_of_orderness``, or
  processing time minus it when idle); offsets are committed in bundle finalization, after the
  runner has made the bundle's output durable (at least once);
* bounded (``bounded=True``): a partition ends when it has reached the end offset taken when
  reading started and nothing more arrived for 0.5 s, or when nothing arrived for
  ``idle_timeout`` seconds (for a broker that over-reports, or a stalled one). Messages past the
  end offset that arrive while the partition is read are taken too: Tansu 0.6 under-reports the
  end offset (base offset of the last record batch + 1), and the rest of that batch comes in the
  same fetch. The job commits the offsets it read only after every output message was
  acknowledged (:class:`CommitOffsets`);
* the writer produces with ``enable.idempotence`` and flushes at the end of every bundle, so a
  bundle only succeeds once the broker has acknowledged all of its messages (a retried bundle
  may write its messages again: consumers see at-least-once delivery).

Cross-language IO (``xlang_read`` / ``xlang_write``): Beam's ``ReadFromKafka`` and
``WriteToKafka``, expanded by the Java expansion service (needs Java and the
``beam-sdks-java-io-expansion-service`` jar, which Beam downloads from Maven Central, or
``expansion_service='host:port'``); what Dataflow and Flink run natively.

Clients and their settings come from ``compression.kafka`` (the one module that imports the
Kafka client); the DoFns hold plain settings dicts and build their clients in ``setup``.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Tuple

import apache_beam as beam
from apache_beam.io.restriction_trackers import OffsetRange, OffsetRestrictionTracker
from apache_beam.io.watermark_estimators import ManualWatermarkEstimator
from apache_beam.transforms.core import RestrictionProvider
from apache_beam.utils.timestamp import Duration, Timestamp
from apache_beam.utils.windowed_value import WindowedValue

from compression import kafka
from compression import messages as kafka_messages

log = logging.getLogger(__name__)

# (key, value, headers): what the writers take. headers: tuple of (name, bytes value).
KafkaRecord = Tuple[bytes, bytes, tuple]
_METRICS = "prefixrec.kafka"
# consume() waits the whole timeout unless it fills the batch, so the timeout is short and
# "nothing more" is judged over _EOF_GRACE seconds of empty polls.
_POLL_SECONDS = 0.05
_POLL_MESSAGES = 5000
_EOF_GRACE = 0.5
# Unbounded reads return to the runner this often, so output and offsets keep moving.
_MAX_BUNDLE_SECONDS = 5.0


class MessageBatch:
    """Messages read by one poll: values, Kafka timestamps (epoch milliseconds), keys, and
    where they were read (``topic``, ``partition``, one offset per message), so that a
    rejected message's dead letter can say where it came from.

    One Beam element per poll instead of one per message: per-element overhead in the Python
    SDK (~50-100 us) would otherwise cost more than decoding. The element's own timestamp is
    the earliest of its messages, so it never runs ahead of the watermark;
    ``CompressWindows`` splits a batch by window before windowing.
    """

    __slots__ = ("values", "timestamps_ms", "keys", "topic", "partition", "offsets")

    def __init__(self, values: list[bytes], timestamps_ms: list[int],
                 keys: list | None = None, topic: str | None = None,
                 partition: int | None = None, offsets: list | None = None):
        self.values = values
        self.timestamps_ms = timestamps_ms
        self.keys = keys if keys is not None else [None] * len(values)
        self.topic = topic
        self.partition = partition
        self.offsets = offsets if offsets is not None else [None] * len(values)

    def take(self, indices) -> "MessageBatch":
        """The messages at ``indices``, in that order."""
        return MessageBatch([self.values[i] for i in indices],
                            [self.timestamps_ms[i] for i in indices],
                            [self.keys[i] for i in indices], self.topic, self.partition,
                            [self.offsets[i] for i in indices])

    def dead_letter(self, index: int, reason: str) -> kafka_messages.DeadLetter:
        """The dead letter of message ``index``."""
        return kafka_messages.DeadLetter(self.values[index], reason, self.keys[index],
                                         self.topic, self.partition, self.offsets[index])

    def min_timestamp(self) -> Timestamp:
        return Timestamp(micros=min(self.timestamps_ms) * 1000)

    def max_timestamp(self) -> Timestamp:
        return Timestamp(micros=max(self.timestamps_ms) * 1000)

    def __len__(self):
        return len(self.values)

    def __reduce__(self):
        return MessageBatch, (self.values, self.timestamps_ms, self.keys, self.topic,
                              self.partition, self.offsets)


class _ReadPartitionFn(beam.DoFn, RestrictionProvider):
    """Reads one partition (element ``(topic, partition)``) as timestamped message values.

    It is its own restriction provider: offset ranges [first unread offset, end of time).
    """

    OFFSETS = "offsets"

    def __init__(self, config: dict, bounded: bool, idle_timeout: float,
                 max_out_of_orderness: float):
        self._config = config
        self._bounded = bounded
        self._idle_timeout = idle_timeout
        self._skew = Duration(seconds=max_out_of_orderness)
        self._messages = beam.metrics.Metrics.counter(_METRICS, "messages_read")

    def setup(self):
        self._consumer = kafka.consumer(self._config)

    def teardown(self):
        consumer = getattr(self, "_consumer", None)
        if consumer is not None:
            consumer.close()

    # -- restrictions --

    def initial_restriction(self, element):
        topic, partition = element
        consumer = kafka.consumer(self._config)
        try:
            committed = consumer.committed([kafka.TopicPartition(topic, partition)],
                                           timeout=30)[0]
            low, _ = consumer.get_watermark_offsets(kafka.TopicPartition(topic, partition),
                                                    timeout=30)
        finally:
            consumer.close()
        start = committed.offset if committed.offset >= 0 else low
        return OffsetRange(max(start, 0), sys.maxsize)

    def create_tracker(self, restriction):
        return OffsetRestrictionTracker(restriction)

    def restriction_size(self, element, restriction):
        # The end is open, so the size is unknown; a constant keeps runners from splitting
        # a partition on size.
        return 1

    def split(self, element, restriction):
        yield restriction  # one reader per partition keeps Kafka's order within it

    # -- reading --

    def _end_offset(self, topic: str, partition: int) -> int:
        return self._consumer.get_watermark_offsets(kafka.TopicPartition(topic, partition),
                                                    timeout=30)[1]

    # Beam passes the bundle finalizer positionally: it must come before the tracker.
    def process(self, element, finalizer=beam.DoFn.BundleFinalizerParam,
                tracker=beam.DoFn.RestrictionParam(),
                watermark=beam.DoFn.WatermarkEstimatorParam(
                    ManualWatermarkEstimator.default_provider())):
        topic, partition = element
        start = tracker.current_restriction().start
        self._consumer.assign([kafka.TopicPartition(topic, partition, start)])
        end_at_start = self._end_offset(topic, partition) if self._bounded else None
        next_offset = start
        began = last_message = time.monotonic()
        try:
            while True:
                values, stamps, keys, offsets, last_offset = [], [], [], [], None
                for msg in self._consumer.consume(_POLL_MESSAGES, timeout=_POLL_SECONDS):
                    if msg.error():
                        log.warning("kafka %s[%d]: %s", topic, partition, msg.error())
                        continue
                    kind, ms = msg.timestamp()
                    values.append(msg.value())
                    stamps.append(ms if kind and ms >= 0 else int(time.time() * 1000))
                    keys.append(msg.key())
                    last_offset = msg.offset()
                    offsets.append(last_offset)
                now = time.monotonic()
                if values:
                    # Claiming the last offset claims the whole poll (offsets only increase).
                    if not tracker.try_claim(last_offset):
                        return
                    next_offset = last_offset + 1
                    last_message = now
                    self._messages.inc(len(values))
                    batch = MessageBatch(values, stamps, keys, topic, partition, offsets)
                    yield beam.window.TimestampedValue(batch, batch.min_timestamp())
                    _advance(watermark, batch.max_timestamp() - self._skew)
                quiet = now - last_message
                if self._bounded:
                    reached = next_offset >= end_at_start
                    if (reached and quiet >= _EOF_GRACE) or quiet > self._idle_timeout:
                        if not reached:
                            log.warning("kafka %s[%d]: stopped at offset %d after %.0f s idle, "
                                        "before the end offset %d the broker reported",
                                        topic, partition, next_offset, self._idle_timeout,
                                        end_at_start)
                        log.info("kafka %s[%d]: read offsets %d..%d (end offset at start %d)",
                                 topic, partition, start, next_offset, end_at_start)
                        tracker.try_claim(tracker.current_restriction().stop)
                        yield beam.pvalue.TaggedOutput(self.OFFSETS,
                                                       (topic, partition, next_offset))
                        return
                elif quiet >= _EOF_GRACE or now - began >= _MAX_BUNDLE_SECONDS:
                    # Hand the rest back to the runner: it checkpoints, commits this bundle's
                    # output (then the offsets), and calls again, sooner if data is flowing.
                    if quiet >= _EOF_GRACE:
                        _advance(watermark, Timestamp.now() - self._skew)
                    self._commit_when_durable(finalizer, topic, partition, next_offset, start)
                    tracker.defer_remainder(Duration(seconds=1 if quiet >= _EOF_GRACE else 0))
                    return
        finally:
            self._consumer.unassign()

    def _commit_when_durable(self, finalizer, topic, partition, next_offset, start):
        if next_offset == start:
            return
        config = self._config

        def commit():
            consumer = kafka.consumer(config)
            try:
                consumer.commit(offsets=[kafka.TopicPartition(topic, partition, next_offset)],
                                asynchronous=False)
            finally:
                consumer.close()

        finalizer.register(commit)


def _advance(watermark, to: Timestamp):
    """Move a ManualWatermarkEstimator forward only (it starts unset)."""
    current = watermark.current_watermark()
    if current is None or to > current:
        watermark.set_watermark(to)


class _UnboundedReadPartitionFn(_ReadPartitionFn):
    @beam.DoFn.unbounded_per_element()
    def process(self, element, finalizer=beam.DoFn.BundleFinalizerParam,
                tracker=beam.DoFn.RestrictionParam(),
                watermark=beam.DoFn.WatermarkEstimatorParam(
                    ManualWatermarkEstimator.default_provider())):
        yield from super().process(element, finalizer, tracker, watermark)


class ReadKafkaPython(beam.PTransform):
    """Messages of ``topic`` as :class:`MessageBatch` elements (values with their Kafka
    timestamps as event times).

    The tagged output ``offsets`` (bounded only) holds ``(topic, partition, next offset)`` per
    partition once it is read, for :class:`CommitOffsets`. Partitions are listed when the
    pipeline is built, so the broker must be reachable from where the job is launched.
    """

    def __init__(self, config: dict, topic: str, bounded: bool = False,
                 idle_timeout: float = 10.0, max_out_of_orderness: float = 0.0):
        super().__init__()
        self._config = config
        self._topic = topic
        self._bounded = bounded
        self._idle_timeout = idle_timeout
        self._skew = max_out_of_orderness

    def expand(self, pbegin):
        partitions = kafka.list_partitions(self._config, self._topic)
        fn_class = _ReadPartitionFn if self._bounded else _UnboundedReadPartitionFn
        fn = fn_class(self._config, self._bounded, self._idle_timeout, self._skew)
        return (pbegin
                | "Partitions" >> beam.Create([(self._topic, p) for p in partitions])
                | "Spread" >> beam.Reshuffle()
                | "ReadPartitions" >> beam.ParDo(fn).with_outputs(
                    _ReadPartitionFn.OFFSETS, main="values"))


class _WriteFn(beam.DoFn):
    def __init__(self, config: dict, topic: str):
        self._config = config
        self._topic = topic
        self._written = beam.metrics.Metrics.counter(_METRICS, f"messages_written.{topic}")

    def setup(self):
        self._producer = kafka.producer(self._config)

    def start_bundle(self):
        self._errors = []
        self._count = 0
        self._per_window = {}

    def _report(self, err, msg):
        if err is not None:
            self._errors.append(err)

    def process(self, record: KafkaRecord, window=beam.DoFn.WindowParam):
        key, value, headers = record
        while True:
            try:
                self._producer.produce(self._topic, value=value, key=key,
                                       headers=list(headers) or None, on_delivery=self._report)
                break
            except BufferError:  # local queue full: let deliveries drain
                self._producer.poll(0.1)
        self._producer.poll(0)
        self._count += 1
        self._per_window[window] = self._per_window.get(window, 0) + 1

    def finish_bundle(self):
        remaining = self._producer.flush(60)
        if remaining or self._errors:
            raise RuntimeError(f"kafka topic {self._topic!r}: {remaining} message(s) not "
                               f"delivered, errors: {self._errors[:3]}; the bundle is retried")
        self._written.inc(self._count)
        # Only now, with every message acknowledged, do the counts go downstream.
        for window, count in self._per_window.items():
            yield WindowedValue(count, window.max_timestamp(), [window])

    def teardown(self):
        producer = getattr(self, "_producer", None)
        if producer is not None:
            producer.flush(10)


class WriteKafkaPython(beam.PTransform):
    """Writes ``(key, value, headers)`` records to ``topic``; outputs the number of messages
    acknowledged per bundle and window, which :class:`CommitOffsets` waits for."""

    def __init__(self, config: dict, topic: str):
        super().__init__()
        self._config = config
        self._topic = topic

    def expand(self, records):
        return records | "Produce" >> beam.ParDo(_WriteFn(self._config, self._topic))


class _CommitFn(beam.DoFn):
    def __init__(self, config: dict):
        self._config = config

    def process(self, _, offsets, acknowledged):
        if not offsets:
            return
        consumer = kafka.consumer(self._config)
        try:
            consumer.commit(offsets=[kafka.TopicPartition(t, p, o) for t, p, o in offsets],
                            asynchronous=False)
        finally:
            consumer.close()
        log.info("committed %s after %d acknowledged message(s)",
                 ", ".join(f"{t}[{p}]@{o}" for t, p, o in offsets), sum(acknowledged))
        yield len(offsets)


class CommitOffsets(beam.PTransform):
    """Bounded jobs: commit the read offsets once every writer's output is acknowledged.

    The writers' acknowledgement counts are side inputs, so this step cannot start before all
    writing bundles have finished (and flushed).
    """

    def __init__(self, config: dict, offsets, *acknowledged):
        super().__init__()
        self._config = config
        self._offsets = offsets
        self._acknowledged = acknowledged

    def expand(self, pbegin):
        acknowledged = (self._acknowledged
                        | "AllWriters" >> beam.Flatten()
                        | "Window" >> beam.WindowInto(beam.window.GlobalWindows()))
        return (pbegin
                | "Once" >> beam.Create([None])
                | "Commit" >> beam.ParDo(_CommitFn(self._config),
                                         offsets=beam.pvalue.AsList(self._offsets),
                                         acknowledged=beam.pvalue.AsList(acknowledged)))


# -- cross-language (Java) KafkaIO ----------------------------------------------------------

def xlang_read(config: dict, topic: str, expansion_service: str | None = None):
    """Beam's Java ``ReadFromKafka`` of ``topic`` -> message values with create-time event
    timestamps; offsets committed when bundles finalize."""
    from apache_beam.io.kafka import ReadFromKafka

    kwargs = {"expansion_service": expansion_service} if expansion_service else {}
    java_config = kafka.for_java(config)

    class _XlangRead(beam.PTransform):
        def expand(self, pbegin):
            return (pbegin
                    | "ReadFromKafka" >> ReadFromKafka(
                        consumer_config=java_config, topics=[topic],
                        commit_offset_in_finalize=True,
                        timestamp_policy=ReadFromKafka.create_time_policy, **kwargs)
                    | "Values" >> beam.Map(lambda kv: kv[1]))

    return _XlangRead()


def xlang_write(config: dict, topic: str, expansion_service: str | None = None):
    """Beam's Java ``WriteToKafka`` of ``(key, value, headers)`` records. The Python wrapper
    writes no headers: what a header carries must also be in the value."""
    from apache_beam.io.kafka import WriteToKafka

    kwargs = {"expansion_service": expansion_service} if expansion_service else {}
    java_config = kafka.for_java(config)

    class _XlangWrite(beam.PTransform):
        def expand(self, records):
            return (records
                    | "KeyValue" >> beam.Map(lambda r: (r[0] or b"", r[1]))
                    .with_output_types(Tuple[bytes, bytes])
                    | "WriteToKafka" >> WriteToKafka(producer_config=java_config, topic=topic,
                                                     **kwargs))

    return _XlangWrite()

