"""The streaming compression job: the IO-free windowing transform under TestStream, the JSON
decoding and dead letters, the whole job --bounded against a real Kafka broker (Tansu), and the
command's error path."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pytest
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
# Aliased: pytest would try to collect classes named Test*.
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.test_stream import TestStream as EventStream
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.transforms.window import TimestampedValue

import compression
import schemas
from compression.messages import DeadLetter
from pipelines import stream_compress as job
from sample_data import row_multiset, taobao_table

ROOT = Path(__file__).resolve().parents[2]
TAOBAO_PATH = str(ROOT / "schemas" / "examples" / "taobao_like.yaml")
TAOBAO = schemas.load(TAOBAO_PATH)
WINDOW = 10  # seconds


def _messages(table: pa.Table) -> list[bytes]:
    return [json.dumps(row).encode() for row in table.to_pylist()]


def _canonical(record) -> tuple:
    """(key, window_start, pane, sorted sample reprs) of one output message, checking that the
    message holds the trees of that key only."""
    key, value, headers = record
    headers = dict(headers)
    trees = compression.decode_trees(value)
    assert trees.schema.equals(TAOBAO.tree_arrow_schema())
    assert trees.schema.metadata[job.WINDOW_START_KEY] == headers["window_start"]
    assert {str(u).encode() for u in trees.column("user_id").to_pylist()} == {key}
    start = int(headers["window_start"])
    assert int(headers["window_end"]) == start + WINDOW * 1000
    return (key, start, headers["pane"].decode(),
            tuple(row_multiset(compression.flatten(trees, TAOBAO))))


def _expected(table: pa.Table, event_seconds: np.ndarray, pane: str = "ON_TIME") -> list:
    windows = (event_seconds // WINDOW) * WINDOW * 1000
    groups = defaultdict(list)
    for i, row in enumerate(table.to_pylist()):
        groups[(str(row["user_id"]).encode(), int(windows[i]))].append(i)
    return [(key, start, pane, tuple(row_multiset(table.take(rows))))
            for (key, start), rows in groups.items()]


def _streaming_pipeline():
    options = PipelineOptions()
    options.view_as(StandardOptions).streaming = True
    return BeamTestPipeline(options=options)


def test_windows_and_keys_under_test_stream():
    table = taobao_table(600, seed=11)  # ~30 users
    rng = np.random.default_rng(0)
    seconds = np.sort(rng.uniform(0, 3 * WINDOW, table.num_rows))  # three windows
    messages = _messages(table)
    stream = EventStream()
    for lo, hi in [(0, 10), (10, 20), (20, 30)]:
        chosen = np.flatnonzero((seconds >= lo) & (seconds < hi))
        stream = stream.add_elements([TimestampedValue(messages[i], float(seconds[i]))
                                      for i in chosen])
        stream = stream.advance_watermark_to(hi)
    stream = stream.advance_watermark_to_infinity()
    with _streaming_pipeline() as p:
        out = p | stream | job.CompressWindows(TAOBAO.to_yaml(), WINDOW, shards=3,
                                               decode_batch=64)
        assert_that(out["trees"] | beam.Map(_canonical), equal_to(_expected(table, seconds)),
                    label="trees")
        assert_that(out["dead_letter"], equal_to([]), label="no dead letters")
    assert len(_expected(table, seconds)) > 3 * 20  # many keys per window


def _late_stream(late_message: bytes):
    table = taobao_table(40, seed=2)
    messages = _messages(table)
    stream = (EventStream()
              .add_elements([TimestampedValue(m, 1.0 + i * 0.1) for i, m in
                             enumerate(messages[:20])])
              .advance_watermark_to(WINDOW)                  # closes [0, 10)
              .add_elements([TimestampedValue(m, 12.0) for m in messages[20:]])
              .advance_watermark_to(2 * WINDOW + 5)          # closes [10, 20)
              .add_elements([TimestampedValue(late_message, 3.0)])  # for [0, 10): late
              .advance_watermark_to_infinity())
    seconds = np.array([1.0 + i * 0.1 for i in range(20)] + [12.0] * 20)
    return table, seconds, stream


def test_late_samples_are_dropped_by_default():
    late = taobao_table(1, seed=99)
    table, seconds, stream = _late_stream(_messages(late)[0])
    with _streaming_pipeline() as p:
        out = p | stream | job.CompressWindows(TAOBAO.to_yaml(), WINDOW)
        assert_that(out["trees"] | beam.Map(_canonical), equal_to(_expected(table, seconds)))


def test_late_samples_within_the_allowed_lateness_come_in_a_late_pane():
    late = taobao_table(1, seed=99)
    table, seconds, stream = _late_stream(_messages(late)[0])
    expected = _expected(table, seconds) + _expected(late, np.array([3.0]), pane="LATE")
    with _streaming_pipeline() as p:
        out = p | stream | job.CompressWindows(TAOBAO.to_yaml(), WINDOW,
                                               allowed_lateness_seconds=60)
        assert_that(out["trees"] | beam.Map(_canonical), equal_to(expected))


LIMIT = 4000  # --max-message-bytes of these tests


def _bad_messages() -> list[tuple[bytes, str]]:
    row = taobao_table(1, seed=5).to_pylist()[0]
    no_key = {k: v for k, v in row.items() if k != "user_id"}
    oversized = json.dumps({**row, "pad": "x" * LIMIT}).encode()
    return [
        (b"not json", "not a valid sample: not JSON (invalid value at byte 0)"),
        (b"[1, 2]", "not a valid sample: expected a JSON object, got list"),
        (b"", "empty message; expected one JSON object"),
        # pyarrow.json.read_json, the job's former decoder, crashed the worker on this one
        (b"null", "not a valid sample: expected a JSON object, got null"),
        (json.dumps(row).encode()[:-5], "not a valid sample: not JSON (the message ends too "
                                        "early)"),
        (b"\x00\xff\xfe\x80garbage\xc3", "not a valid sample: not JSON (expected a value at "
                                         "byte 0)"),
        (oversized, f"oversized: {len(oversized)} bytes, the limit is {LIMIT} "
                    "(max_message_bytes)"),
        (json.dumps({**row, "user_id": "abc"}).encode(),
         "not a valid sample: field 'user_id': expected an integer (kind id, dtype int64), got "
         "a string"),
        (json.dumps({**row, "extra": 1}).encode(),
         "not a valid sample: unexpected field(s) 'extra'; the schema has no such column"),
        (json.dumps(no_key).encode(),
         "key column 'user_id': null value; every row needs a key"),
        (json.dumps({**row, "click": 3}).encode(),
         "label 'click': value out of range, labels must be in [0, 1]"),
        (json.dumps({**row, "price": [1.0, 2.0]}).encode(),
         "column 'price': dense value has the wrong number of floats, expected dim 1"),
    ]


def test_decoding_keeps_good_messages_and_gives_each_bad_one_its_reason():
    good = taobao_table(50, seed=6)
    messages = _messages(good)
    pretty = json.dumps(good.to_pylist()[0], indent=2).encode()  # newlines are whitespace
    bad = _bad_messages()
    mixed = messages[:20] + [m for m, _ in bad[:4]] + messages[20:] + [m for m, _ in bad[4:]]
    table, dead = compression.decode_json_samples(mixed + [pretty], TAOBAO,
                                                  max_message_bytes=LIMIT)
    assert row_multiset(table) == row_multiset(pa.concat_tables([good, good.slice(0, 1)]))
    assert sorted(dead) == sorted(bad)


def test_malformed_messages_go_to_the_dead_letter_output():
    table = taobao_table(30, seed=7)
    good = _messages(table)
    bad = _bad_messages()
    stream = (EventStream()
              .add_elements([TimestampedValue(m, 1.0) for m in good[:15]]
                            + [TimestampedValue(m, 2.0) for m, _ in bad]
                            + [TimestampedValue(m, 3.0) for m in good[15:]])
              .advance_watermark_to_infinity())
    with _streaming_pipeline() as p:
        out = p | stream | job.CompressWindows(TAOBAO.to_yaml(), WINDOW, decode_batch=7,
                                               max_message_bytes=LIMIT)
        # messages that did not come from Kafka have no topic, partition or offset
        assert_that(out["dead_letter"], equal_to([DeadLetter(m, r).record() for m, r in bad]),
                    label="dead letters")
        assert_that(out["trees"] | beam.FlatMap(lambda r: row_multiset(compression.flatten(
            compression.decode_trees(r[1]), TAOBAO))), equal_to(row_multiset(table)),
            label="good samples")


def test_dead_letters_for_a_writer_without_headers_carry_everything_in_the_value():
    record = DeadLetter(b"{oops\xff", "bad", b"k", "raw", 1, 42).record()
    key, value, headers = job._dead_letter_as_json(record)
    assert key == b"k" and headers == ()
    assert json.loads(value) == {"reason": "bad", "topic": "raw", "partition": 1, "offset": 42,
                                 "message": "{oops\ufffd"}


def test_root_key_bytes():
    assert job.root_key_bytes([42]) == b"42"
    assert job.root_key_bytes(["u7"]) == b"u7"
    assert job.root_key_bytes([42, "eu"]) == b'[42,"eu"]'


# -- the whole job against a real broker ----------------------------------------------------

def test_bounded_job_against_kafka(kafka_broker):
    raw = kafka_broker.create_topic(partitions=2)
    trees_topic = kafka_broker.create_topic()
    dlq = kafka_broker.create_topic()
    table = taobao_table(3000, seed=21)
    base_ms = 1_700_000_000_000
    # event times over three 10 s windows, slightly out of order
    rng = np.random.default_rng(3)
    times = base_ms + np.sort(rng.integers(0, 30_000, table.num_rows)) + rng.integers(
        0, 500, table.num_rows)
    good = [(str(r["user_id"]).encode(), json.dumps(r).encode(), None, int(t))
            for r, t in zip(table.to_pylist(), times)]
    bad = _bad_messages() + [(None, "empty message; expected one JSON object")]  # tombstone
    # on partition 1, between good samples, each with its own key
    messages = (good[:1000] + [(f"bad{i}".encode(), m, None, base_ms, 1)
                               for i, (m, _) in enumerate(bad)] + good[1000:])
    offsets = kafka_broker.produce(raw, messages)

    argv = ["--schema", TAOBAO_PATH, "--bootstrap-servers", kafka_broker.bootstrap,
            "--input-topic", raw, "--output-topic", trees_topic, "--dead-letter-topic", dlq,
            "--window-seconds", str(WINDOW), "--bounded", "--idle-timeout-seconds", "5",
            "--group-id", f"job-{raw}", "--runner=FnApiRunner", "-X", "client.id=prefixrec-test",
            "-X", "kafka.fetch.wait.max.ms=100", "--max-message-bytes", str(LIMIT)]
    job.run(argv)

    out = kafka_broker.consume_all(trees_topic, idle_seconds=2)
    samples = []
    windows = set()
    for msg in out:
        headers = dict(msg.headers())
        trees = compression.decode_trees(msg.value())
        flat = compression.flatten(trees, TAOBAO)
        assert set(flat.column("user_id").to_pylist()) == {int(msg.key())}
        start = int(headers["window_start"])
        windows.add(start)
        seconds = (times[np.isin(table.column("user_id").to_numpy(),
                                 [int(msg.key())])] // (WINDOW * 1000)) * WINDOW * 1000
        assert start in set(seconds.tolist())
        samples.append(flat)
    assert row_multiset(pa.concat_tables(samples)) == row_multiset(table)
    assert len(out) == len({(u, t) for u, t in zip(table.column("user_id").to_pylist(),
                                                    (times // (WINDOW * 1000)).tolist())})
    assert len(windows) >= 3

    dead = [DeadLetter.from_message(m.value(), m.headers(), m.key())
            for m in kafka_broker.consume_all(dlq, idle_seconds=1)]
    expected = [DeadLetter(m, r, f"bad{i}".encode(), raw, 1, offsets[1000 + i])
                for i, (m, r) in enumerate(bad)]
    assert sorted(dead, key=lambda d: d.offset) == expected  # a null value stays null

    # offsets were committed: a second bounded run finds nothing new and writes nothing
    job.run(argv[:argv.index("--idle-timeout-seconds")] + ["--idle-timeout-seconds", "1"]
            + argv[argv.index("--idle-timeout-seconds") + 2:])
    assert len(kafka_broker.consume_all(trees_topic, idle_seconds=1)) == len(out)


def test_stream_command_line_help():
    out = subprocess.run([sys.executable, "-m", "pipelines.stream_compress", "--help"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for flag in ("--bootstrap-servers", "--input-topic", "--output-topic", "--window-seconds",
                 "--kafka-io", "--bounded", "-X"):
        assert flag in out.stdout


def test_xlang_cannot_be_bounded():
    with pytest.raises(ValueError, match="--bounded works with --kafka-io python only"):
        job.run(["--schema", TAOBAO_PATH, "--bootstrap-servers", "127.0.0.1:1",
                 "--input-topic", "a", "--output-topic", "b", "--kafka-io", "xlang",
                 "--bounded"])


def _command(*argv):
    return subprocess.run([sys.executable, "-m", "pipelines.stream_compress", *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_an_unreachable_broker_ends_the_job_with_one_clear_line():
    out = _command("--schema", TAOBAO_PATH, "--bootstrap-servers", "127.0.0.1:1",
                   "--input-topic", "a", "--output-topic", "b", "--bounded",
                   "--broker-timeout", "2")
    assert out.returncode == 1
    assert "%3|" not in out.stderr and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "python -m pipelines.stream_compress: error: no Kafka broker at 127.0.0.1:1 answered "
        "within 2 s (Failed to get metadata: Local: Broker transport failure); check "
        "--bootstrap-servers and that the broker is up, or wait longer with --broker-timeout "
        "SECONDS"]


@pytest.mark.parametrize("argv,message", [
    (["-X", "security.protocol"], "argument -X: -X 'security.protocol': expected key=value (or "
                                  "kafka.key=value), e.g. -X security.protocol=SASL_SSL"),
    (["--shards", "0"], "--shards: expected a positive number, got 0"),
    (["--kafka-io", "xlang", "--bounded"], "--bounded works with --kafka-io python only"),
])
def test_usage_errors_give_one_line_and_exit_code_2(argv, message):
    out = _command("--schema", TAOBAO_PATH, "--bootstrap-servers", "127.0.0.1:1",
                   "--input-topic", "a", "--output-topic", "b", *argv)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr.strip().splitlines()[-1]
    assert "Traceback" not in out.stderr
