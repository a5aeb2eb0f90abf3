"""The streaming compression job: Kafka raw samples -> event-time windows -> trees -> Kafka.

    python -m pipelines.stream_compress --schema schemas/examples/taobao_like.yaml \\
        --bootstrap-servers localhost:9092 --input-topic raw --output-topic trees \\
        --window-seconds 60 [--kafka-io python|xlang] [--bounded] [-X key=value ...]

Each input message is one raw sample as a JSON object, its Kafka timestamp the event time.
Each output message is the trees of one root key (a user) in one window: an Arrow IPC stream of
a tree table (``compression.decode_trees`` reads it), the message key the root key, headers
``window_start`` and ``window_end`` (epoch milliseconds) and ``pane`` (``ON_TIME``, or
``LATE`` for samples that arrived after the window closed, when lateness is allowed). Messages
of one key and window are additive: a late pane holds only the late samples. Malformed messages
(not JSON, not a valid sample, ``null``, empty, over ``--max-message-bytes``) go to the
dead-letter topic unchanged, as ``compression.DeadLetter`` records: headers ``reason``,
``source.topic``, ``source.partition``, ``source.offset``. Beam's Java writer (xlang) writes no
headers, so the window start is also in the IPC schema metadata
(``prefixrec.window_start_ms``), and with xlang a dead letter's value is its JSON form
(``DeadLetter.json_value``: ``{"reason", "topic", "partition", "offset", "message"}``).

The windowing and tree building is :class:`CompressWindows`, which does no IO. Late data:
with ``--allowed-lateness-seconds 0`` (the default) samples behind the watermark are dropped by
the runner; with more, each late sample comes out in a ``LATE`` pane.

Locally no runner executes a Kafka source with live window firing (Beam 2.77, no Prism binary
offline; see docs/architecture.md): use ``--bounded``, which reads to the end offsets taken at
start (or until the input is idle) and then finishes, on the in-process FnApiRunner (the
default when no ``--runner`` is given). Unbounded runs need a streaming runner: Dataflow, or
Flink, with ``--kafka-io xlang`` (Java KafkaIO) or the Python IO.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import textwrap
import time
from typing import Tuple

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import yaml
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.transforms import trigger
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.timestamp import Duration, Timestamp
from apache_beam.utils.windowed_value import WindowedValue

import compression
import schemas
from compression import cli, kafka
from compression.messages import (DEFAULT_MAX_MESSAGE_BYTES, MESSAGE_INDEX, DeadLetter,
                                  dead_letter_topic)
from pipelines._runner import with_default_runner
from pipelines import _coders  # noqa: F401  (registers the Arrow table coder)
from pipelines import kafka_io
from pipelines._shards import split_by_shard

log = logging.getLogger(__name__)

DEFAULT_SHARDS = 4
DEFAULT_DECODE_BATCH = 10_000
WINDOW_START_KEY = b"prefixrec.window_start_ms"
_METRICS = "prefixrec.stream"


def _load_schema(schema_yaml: str) -> schemas.Schema:
    return schemas.from_dict(yaml.safe_load(schema_yaml))


def _millis(t) -> int:
    return int(t.micros // 1000)


class _SplitByWindowFn(beam.DoFn):
    """Message batches -> :class:`kafka_io.MessageBatch` parts that fall in one window,
    timestamped inside it.

    A single ``bytes`` message keeps its element timestamp. A :class:`kafka_io.MessageBatch`
    is split by each message's own event time; a part's timestamp is its latest message's,
    never earlier than the batch's, so the watermark still holds it.
    """

    def __init__(self, window_seconds: float):
        self._size_us = Duration(seconds=window_seconds).micros

    def process(self, element):
        if element is None or isinstance(element, (bytes, bytearray)):
            value = None if element is None else bytes(element)
            yield kafka_io.MessageBatch([value], [0])  # timestamps are not used past here
            return
        stamps = np.asarray(element.timestamps_ms, np.int64) * 1000
        window = stamps // self._size_us
        if len(window) and window.min() == window.max():
            yield TimestampedValue(element, Timestamp(micros=int(stamps.max())))
            return
        order = np.argsort(window, kind="stable")
        bounds = np.flatnonzero(np.diff(window[order])) + 1
        for part in np.split(order, bounds):
            yield TimestampedValue(element.take(part.tolist()),
                                   Timestamp(micros=int(stamps[part].max())))


@beam.typehints.with_output_types(Tuple[int, pa.Table])
class _DecodeFn(beam.DoFn):
    """Message batches -> (shard, samples) tables, in the same window.

    Messages are buffered per window until ``batch`` of them (or the bundle's end), so the
    native decoder takes many at once. Rejected messages go to the dead-letter output as
    ``DeadLetter.record()``: ``(key, value, headers)`` with the reason and where the message
    was read.
    """

    DEAD_LETTER = "dead_letter"

    def __init__(self, schema_yaml: str, shards: int, batch: int,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self._schema_yaml = schema_yaml
        self._shards = shards
        self._batch = batch
        self._max_message_bytes = max_message_bytes
        self._good = beam.metrics.Metrics.counter(_METRICS, "samples_decoded")
        self._bad = beam.metrics.Metrics.counter(_METRICS, "messages_rejected")

    def setup(self):
        self._schema = _load_schema(self._schema_yaml)

    def start_bundle(self):
        self._buffers: dict = {}

    def process(self, batch, window=beam.DoFn.WindowParam):
        buffer = self._buffers.setdefault(window, [[], 0])
        buffer[0].append(batch)
        buffer[1] += len(batch)
        if buffer[1] >= self._batch:
            del self._buffers[window]
            yield from self._decode(buffer[0], window)

    def finish_bundle(self):
        buffers, self._buffers = self._buffers, {}
        for window, (batches, _) in buffers.items():
            yield from self._decode(batches, window)

    def _decode(self, batches, window):
        values = [v for batch in batches for v in batch.values]
        good, dead = compression.decode_json_samples(
            values, self._schema, with_index=True, max_message_bytes=self._max_message_bytes)
        good = good.drop_columns([MESSAGE_INDEX])
        self._good.inc(good.num_rows)
        if dead:
            self._bad.inc(len(dead))
        at = window.max_timestamp()
        starts = np.cumsum([0] + [len(batch) for batch in batches])
        for index, reason in dead:
            b = int(np.searchsorted(starts, index, side="right")) - 1
            letter = batches[b].dead_letter(index - int(starts[b]), reason)
            yield beam.pvalue.TaggedOutput(self.DEAD_LETTER,
                                           WindowedValue(letter.record(), at, [window]))
        for shard_rows in split_by_shard(good, self._schema, self._shards):
            yield WindowedValue(shard_rows, at, [window])


class _BuildWindowTreesFn(beam.DoFn):
    """All samples of one shard in one window (pane) -> one message per root key."""

    def __init__(self, schema_yaml: str):
        self._schema_yaml = schema_yaml
        self._messages = beam.metrics.Metrics.counter(_METRICS, "tree_messages")

    def setup(self):
        self._schema = _load_schema(self._schema_yaml)

    def process(self, element, window=beam.DoFn.WindowParam, pane=beam.DoFn.PaneInfoParam):
        _, tables = element
        tables = [t for t in tables if t.num_rows]
        if not tables:
            return
        trees = compression.build_trees(pa.concat_tables(tables), self._schema, validate=False)
        start, end = _millis(window.start), _millis(window.end)
        timing = {0: "EARLY", 1: "ON_TIME", 2: "LATE"}.get(int(pane.timing), "UNKNOWN")
        headers = (("window_start", str(start).encode()), ("window_end", str(end).encode()),
                   ("pane", timing.encode()))
        metadata = dict(trees.schema.metadata or {})
        metadata[WINDOW_START_KEY] = str(start).encode()
        trees = trees.replace_schema_metadata(metadata)
        for key, tree_rows in _split_by_root_key(trees, self._schema):
            self._messages.inc()
            yield key, compression.encode_trees(tree_rows), headers


def root_key_bytes(values: list) -> bytes:
    """The Kafka message key of a root key: the value as text for one key column
    (``b"42"``, ``b"u7"``), a JSON array for several (``b'[42,"eu"]'``)."""
    if len(values) == 1:
        return str(values[0]).encode()
    return json.dumps(values, separators=(",", ":")).encode()


def _split_by_root_key(trees: pa.Table, schema: schemas.Schema):
    """(key bytes, tree rows of that key); a key has several roots when its features changed."""
    codes = np.zeros(trees.num_rows, np.int64)
    for name in schema.root.key:
        encoded = pc.dictionary_encode(trees.column(name).combine_chunks())
        codes = codes * len(encoded.dictionary) + encoded.indices.to_numpy(zero_copy_only=False)
    order = np.argsort(codes, kind="stable")
    ordered = trees.take(pa.array(order))
    sorted_codes = codes[order]
    bounds = np.flatnonzero(np.diff(sorted_codes)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [len(order)]])
    key_columns = [ordered.column(name).to_pylist() for name in schema.root.key]
    for start, end in zip(starts.tolist(), ends.tolist()):
        yield (root_key_bytes([column[start] for column in key_columns]),
               ordered.slice(start, end - start))


class CompressWindows(beam.PTransform):
    """Raw JSON samples -> Kafka-ready ``(key, value, headers)`` tree messages, one per root
    key and window pane; tagged output ``dead_letter``: rejected messages as
    ``compression.DeadLetter.record()`` (their key and value, headers ``reason`` and, for
    messages read from Kafka, ``source.topic``, ``source.partition``, ``source.offset``).

    Input elements are either one message value (``bytes``, event time = the element's
    timestamp) or a :class:`kafka_io.MessageBatch` (each value with its own event time).

    No IO: test it with ``TestStream``. ``shards`` bounds the parallelism of tree building
    within a window (samples are grouped by a hash of the root key, then split per key).
    """

    DEAD_LETTER = _DecodeFn.DEAD_LETTER

    def __init__(self, schema_yaml: str, window_seconds: float,
                 allowed_lateness_seconds: float = 0, shards: int = DEFAULT_SHARDS,
                 decode_batch: int = DEFAULT_DECODE_BATCH,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        super().__init__()
        if window_seconds <= 0:
            raise ValueError(f"window_seconds: expected a positive duration, got "
                             f"{window_seconds}")
        self._schema_yaml = schema_yaml
        self._window_seconds = window_seconds
        self._lateness = allowed_lateness_seconds
        self._shards = shards
        self._decode_batch = decode_batch
        self._max_message_bytes = max_message_bytes

    def expand(self, messages):
        values = messages | "SplitByWindow" >> beam.ParDo(
            _SplitByWindowFn(self._window_seconds))
        if self._lateness:
            windowed = values | "Window" >> beam.WindowInto(
                beam.window.FixedWindows(self._window_seconds),
                trigger=trigger.AfterWatermark(late=trigger.AfterCount(1)),
                accumulation_mode=trigger.AccumulationMode.DISCARDING,
                allowed_lateness=self._lateness)
        else:
            windowed = values | "Window" >> beam.WindowInto(
                beam.window.FixedWindows(self._window_seconds))
        decoded = (windowed
                   | "Decode" >> beam.ParDo(_DecodeFn(self._schema_yaml, self._shards,
                                                      self._decode_batch,
                                                      self._max_message_bytes))
                   .with_outputs(self.DEAD_LETTER, main="samples"))
        trees = (decoded.samples
                 | "GroupByShard" >> beam.GroupByKey()
                 | "BuildTrees" >> beam.ParDo(_BuildWindowTreesFn(self._schema_yaml)))
        return {"trees": trees, self.DEAD_LETTER: decoded[self.DEAD_LETTER]}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.stream_compress",
        description=textwrap.fill(
            "Compress raw samples from Kafka (one JSON object per message) into "
            "multi-prefix trees per root key and event-time window, written to Kafka "
            "as Arrow IPC messages. Flags not listed here are Beam pipeline options; "
            "without --runner the job runs locally on the FnApiRunner, where only "
            "--bounded runs produce output."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=cli.epilog("python -m pipelines.stream_compress "
                          "--schema schemas/examples/taobao_like.yaml --bootstrap-servers "
                          "localhost:9092 --input-topic raw --output-topic trees "
                          "--window-seconds 60 --bounded"))
    p.add_argument("--schema", required=True, help="schema YAML file")
    p.add_argument("--bootstrap-servers", required=True, help="Kafka brokers, HOST:PORT[,...]")
    p.add_argument("--input-topic", required=True, help="topic of raw JSON samples")
    p.add_argument("--output-topic", required=True, help="topic for the tree messages")
    p.add_argument("--dead-letter-topic",
                   help="topic for malformed messages (default: INPUT_TOPIC.dlq)")
    p.add_argument("--window-seconds", type=float, default=60.0,
                   help="length of the event-time fixed windows (default 60)")
    p.add_argument("--allowed-lateness-seconds", type=float, default=0.0,
                   help="how long after a window closes late samples still count; they come "
                        "out in LATE panes (default 0: late samples are dropped)")
    p.add_argument("--max-out-of-orderness-seconds", type=float, default=5.0,
                   help="Python IO: the watermark trails the newest event time by this much "
                        "(default 5)")
    p.add_argument("--kafka-io", choices=["python", "xlang"], default="python",
                   help="python: confluent-kafka reader/writer (works offline); xlang: Beam's "
                        "Java ReadFromKafka/WriteToKafka for Dataflow and Flink (needs Java and "
                        "the expansion service jar)")
    p.add_argument("--expansion-service",
                   help="xlang: HOST:PORT of a running Java expansion service (default: Beam "
                        "starts one from the jar it downloads)")
    p.add_argument("--bounded", action="store_true",
                   help="python IO: stop at the end offsets taken at start (or when no message "
                        "arrived for --idle-timeout-seconds), finish the windows, commit the "
                        "offsets after every output message was acknowledged, exit")
    p.add_argument("--idle-timeout-seconds", type=float, default=10.0,
                   help="--bounded: stop reading a partition after this long without a "
                        "message (default 10)")
    p.add_argument("--group-id", default="prefixrec-stream-compress",
                   help="consumer group whose committed offsets the job starts from and "
                        "advances (default prefixrec-stream-compress)")
    p.add_argument("--shards", type=int, default=DEFAULT_SHARDS,
                   help=f"tree-building parallelism per window (default {DEFAULT_SHARDS})")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="larger messages go to the dead-letter topic "
                        f"(default {DEFAULT_MAX_MESSAGE_BYTES})")
    kafka.add_options(p)
    cli.add_debug_flag(p)
    return p


def _dead_letter_as_json(record):
    """A dead letter for a writer without headers: everything moves into the value."""
    key, value, headers = record
    return key, DeadLetter.from_message(value, headers, key).json_value(), ()


def build(p: beam.Pipeline, args, schema: schemas.Schema):
    """The job's graph on ``p``: read, CompressWindows, write trees and dead letters."""
    options = dict(args.kafka_options)
    consumer = kafka.consumer_settings(args.bootstrap_servers, args.group_id, options)
    producer = kafka.producer_settings(args.bootstrap_servers, options)
    dead_topic = dead_letter_topic(args.input_topic, args.dead_letter_topic)
    if args.kafka_io == "python":  # the partitions are listed now, so the broker must answer
        kafka.check_reachable(consumer, args.broker_timeout)
    if args.kafka_io == "xlang":
        values = p | "ReadKafka" >> kafka_io.xlang_read(consumer, args.input_topic,
                                                        args.expansion_service)
        offsets = None
    else:
        read = p | "ReadKafka" >> kafka_io.ReadKafkaPython(
            consumer, args.input_topic, bounded=args.bounded,
            idle_timeout=args.idle_timeout_seconds,
            max_out_of_orderness=args.max_out_of_orderness_seconds)
        values, offsets = read.values, read[kafka_io._ReadPartitionFn.OFFSETS]
    out = values | "Compress" >> CompressWindows(
        schema.to_yaml(), args.window_seconds, args.allowed_lateness_seconds, args.shards,
        max_message_bytes=args.max_message_bytes)
    if args.kafka_io == "xlang":
        out["trees"] | "WriteTrees" >> kafka_io.xlang_write(producer, args.output_topic,
                                                            args.expansion_service)
        (out[CompressWindows.DEAD_LETTER]
         | "ReasonInValue" >> beam.Map(_dead_letter_as_json)
         | "WriteDeadLetters" >> kafka_io.xlang_write(producer, dead_topic,
                                                      args.expansion_service))
        return
    trees_acked = out["trees"] | "WriteTrees" >> kafka_io.WriteKafkaPython(producer,
                                                                          args.output_topic)
    dead_acked = out[CompressWindows.DEAD_LETTER] | "WriteDeadLetters" >> (
        kafka_io.WriteKafkaPython(producer, dead_topic))
    if args.bounded:
        _ = p | "CommitOffsets" >> kafka_io.CommitOffsets(consumer, offsets, trees_acked,
                                                          dead_acked)


def run(argv=None) -> None:
    """Build and run the job; returns when it finishes (``--bounded``) or is cancelled."""
    args, beam_args = _parser().parse_known_args(argv)
    if args.kafka_io == "xlang" and args.bounded:
        raise cli.UsageError("--bounded works with --kafka-io python only; the Java reader "
                             "(xlang) is for unbounded runs on Dataflow or Flink")
    if args.shards < 1:
        raise cli.UsageError(f"--shards: expected a positive number, got {args.shards}")
    if args.max_message_bytes < 1:
        raise cli.UsageError(f"--max-message-bytes: expected a positive number, got "
                             f"{args.max_message_bytes}")
    schema = schemas.load(args.schema)
    options = PipelineOptions(with_default_runner(beam_args))
    if not args.bounded:
        options.view_as(StandardOptions).streaming = True
        if options.view_as(StandardOptions).runner in ("FnApiRunner", "DirectRunner", None):
            log.warning("an unbounded run on the local runner reads but never fires a window "
                        "(no local streaming runner offline); use --bounded locally")
    started = time.perf_counter()
    p = beam.Pipeline(options=options)
    try:
        build(p, args, schema)
    except RuntimeError as e:
        if args.kafka_io != "xlang":
            raise
        # Expansion happens while the graph is built: no Java, no jar, no network.
        raise ValueError(
            f"--kafka-io xlang: Beam could not expand its Java KafkaIO ({e}). It needs Java "
            "and the beam-sdks-java-io-expansion-service jar (downloaded from Maven Central, "
            "or staged in ~/.apache_beam/cache/jars/), or --expansion-service HOST:PORT; "
            "offline, use --kafka-io python") from e
    p.run().wait_until_finish()
    log.info("finished in %.1f s", time.perf_counter() - started)


PROG = "python -m pipelines.stream_compress"


def main(argv=None) -> int:
    return cli.run_command(PROG, _main, argv)


def _main(argv) -> int:
    # force: importing Beam has already given the root logger a handler.
    logging.basicConfig(level=logging.WARNING, format="%(message)s", force=True)
    log.setLevel(logging.INFO)
    logging.getLogger("pipelines.kafka_io").setLevel(logging.INFO)
    if "--debug" not in argv:
        cli.hide_logged_tracebacks("apache_beam")  # the error is reported once, by run_command
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
