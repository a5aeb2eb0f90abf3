"""Replay raw sample files into a Kafka topic as JSON, one sample per message.

    python -m pipelines.replay --schema S --input 'raw/*.parquet' \\
        --bootstrap-servers localhost:9092 --topic samples [--rate 50000]

For demos, tests and benchmarks of the streaming job and of online training. Rows are validated
against the schema first (a bad file stops the replay before anything is sent, naming the file
and row). Each message's key is the sample's root key (``user_id``), so one user's samples stay
in order on one partition. JSON is built a column at a time with Arrow string kernels, not with
``json.dumps`` per row.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import textwrap
import time
from typing import Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc

import compression
import schemas
from compression import cli, kafka

_CONTROL = r"[\x00-\x1f]"


def json_lines(table: pa.Table, schema: schemas.Schema) -> pa.Array:
    """One JSON object per row of a canonical raw table (``schema.raw_arrow_schema()``)."""
    pieces: list = []
    for i, name in enumerate(table.column_names):
        pieces.append(("{" if i == 0 else ",") + json.dumps(name) + ":")
        pieces.append(_json_values(table.column(name).combine_chunks(), name, schema))
    pieces.append("}")
    return pc.binary_join_element_wise(*pieces, "")


def message_keys(table: pa.Table, schema: schemas.Schema) -> pa.Array:
    """The root key of every row as text (``|``-joined when the key has several columns)."""
    parts = [table.column(k).combine_chunks().cast(pa.string()) for k in schema.root.key]
    return parts[0] if len(parts) == 1 else pc.binary_join_element_wise(*parts, "|")


def _json_values(column: pa.Array, name: str, schema: schemas.Schema) -> pa.Array:
    if name in schema.labels:
        return column.cast(pa.string())
    if name in schema.carried_names:
        return _json_carried(column, next(c for c in schema.carried if c.name == name))
    feature = schema.feature(name)
    if feature.kind == "id":
        return _json_strings(column) if feature.dtype == "string" else column.cast(pa.string())
    items = column.flatten()
    text = _json_strings(items) if feature.dtype == "string" else items.cast(pa.string())
    offsets = column.offsets
    if column.offset or offsets[0].as_py():
        offsets = pc.subtract(offsets, offsets[0])
    lists = pa.ListArray.from_arrays(offsets, text)
    return pc.binary_join_element_wise("[", pc.binary_join(lists, ","), "]", "")


def _json_carried(column: pa.Array, carried: schemas.Carried) -> pa.Array:
    """A carried column as JSON values: null for nulls, ISO-8601 strings for timestamps,
    NaN/Infinity for non-finite floats (as pyarrow's JSON reader reads them)."""
    if carried.dtype == "string":
        text = _json_strings(column.fill_null(""))
    elif carried.dtype == "timestamp":
        text = _json_strings(column.cast(pa.string()).fill_null(""))
    else:
        text = column.cast(pa.string())
        if carried.dtype == "float64":
            text = pc.if_else(pc.is_nan(column), "NaN", text)
            text = pc.if_else(pc.equal(column, float("inf")), "Infinity", text)
            text = pc.if_else(pc.equal(column, float("-inf")), "-Infinity", text)
    if column.null_count:
        text = pc.if_else(column.is_null(), "null", text)
    return text


def _json_strings(values: pa.Array) -> pa.Array:
    if len(values) and pc.any(pc.match_substring_regex(values, _CONTROL)).as_py():
        return pa.array([json.dumps(v) for v in values.to_pylist()], pa.string())
    escaped = pc.replace_substring(pc.replace_substring(values, "\\", "\\\\"), '"', '\\"')
    return pc.binary_join_element_wise('"', escaped, '"', "")


def iter_messages(paths: Iterable[str], schema: schemas.Schema, format: str | None = None,
                  limit: int | None = None) -> Iterator[tuple[pa.Array, pa.Array]]:
    """(keys, JSON values) chunks of the validated rows of the files, at most ``limit`` rows."""
    left = limit
    for path in paths:
        for chunk in compression.iter_raw_chunks(path, schema, format):
            if left is not None and left <= 0:
                return
            table = chunk.validate(schema, path)
            if left is not None:
                table = table.slice(0, left)
                left -= table.num_rows
            if table.num_rows:
                yield message_keys(table, schema), json_lines(table, schema)


def replay(schema: schemas.Schema, inputs, bootstrap_servers: str, topic: str,
           rate: float | None = None, limit: int | None = None, format: str | None = None,
           producer_config: dict | None = None, progress: bool = False,
           broker_timeout: float = kafka.DEFAULT_BROKER_TIMEOUT) -> dict:
    """Send every sample of the files to ``topic``; returns counts and the delivered offsets.

    ``rate`` caps the samples per second (None: as fast as the broker takes them).
    ``producer_config``: the user's librdkafka settings (``-X``). Raises
    ``compression.kafka.BrokerUnreachable`` when no broker answers within ``broker_timeout`` s.
    """
    paths = compression.expand_paths(inputs)  # a missing input fails before the broker wait
    config = kafka.producer_settings(bootstrap_servers, producer_config,
                                     queue_buffering_max_messages=500_000)
    kafka.check_reachable(config, broker_timeout)
    producer = kafka.producer(config)
    errors: list[str] = []
    last_offsets: dict[int, int] = {}

    def delivered(err, msg):
        if err is not None:
            errors.append(str(err))
        else:
            last_offsets[msg.partition()] = max(msg.offset(), last_offsets.get(msg.partition(),
                                                                               -1))

    bar = _progress(limit, progress)
    sent = 0
    started = time.monotonic()
    for keys, values in iter_messages(paths, schema, format, limit):
        for key, value in zip(keys.to_pylist(), values.to_pylist()):
            while True:
                try:
                    producer.produce(topic, value=value, key=key, on_delivery=delivered)
                    break
                except BufferError:  # local queue full: let deliveries drain
                    producer.poll(0.05)
            sent += 1
            if rate and sent % 100 == 0:
                ahead = sent / rate - (time.monotonic() - started)
                if ahead > 0:
                    producer.poll(0)
                    time.sleep(ahead)
        producer.poll(0)
        bar.update(len(values))
        if errors:
            break
    remaining = producer.flush(60)
    bar.close()
    if errors or remaining:
        raise RuntimeError(f"replay to {topic!r} failed: {remaining} messages undelivered, "
                           f"errors: {errors[:3]}")
    seconds = time.monotonic() - started
    return {"topic": topic, "samples": sent, "seconds": round(seconds, 3),
            "samples_per_sec": round(sent / max(seconds, 1e-9)),
            "end_offsets": {str(p): o + 1 for p, o in sorted(last_offsets.items())}}


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total, enabled):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="samples", unit_scale=True, file=sys.stderr)


PROG = "python -m pipelines.replay"


def main(argv=None) -> int:
    return cli.run_command(PROG, _main, argv)


def _main(argv) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=textwrap.fill(
            "Replay raw sample files (Parquet, CSV, JSON lines) into a Kafka topic as "
            "JSON, one sample per message, keyed by the root key."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=cli.epilog("python -m pipelines.replay --schema "
                          "schemas/examples/taobao_like.yaml --input 'raw/*.parquet' "
                          "--bootstrap-servers localhost:9092 --topic samples --rate 50000"))
    parser.add_argument("--schema", required=True, help="schema YAML")
    parser.add_argument("--input", required=True, help="raw files: path, directory or glob")
    parser.add_argument("--bootstrap-servers", required=True, help="Kafka HOST:PORT[,...]")
    parser.add_argument("--topic", required=True, help="topic to write")
    parser.add_argument("--rate", type=float, help="samples per second (default: unlimited)")
    parser.add_argument("--limit", type=int, help="stop after this many samples")
    parser.add_argument("--format", choices=["parquet", "csv", "json"],
                        help="input format (default: from the file extension)")
    kafka.add_options(parser, clients="producer")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    cli.add_debug_flag(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.rate is not None and args.rate <= 0:
        parser.error(f"--rate must be positive, got {args.rate}")
    schema = schemas.load(args.schema)
    files = cli.check_inputs(args.input, "--input", args.format)  # before the broker wait
    result = replay(schema, files, args.bootstrap_servers, args.topic, rate=args.rate,
                    limit=args.limit, format=args.format,
                    producer_config=dict(args.kafka_options), progress=not args.no_progress,
                    broker_timeout=args.broker_timeout)
    print(f"replayed {result['samples']:,} samples to {args.topic!r} in {result['seconds']} s "
          f"({result['samples_per_sec']:,} samples/s)", file=sys.stderr)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
