"""pipelines.replay against a real broker: every sample arrives once, as JSON that decodes back
to the same row; the command's error path (an unreachable broker, bad -X options)."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import compression
import schemas
from pipelines.replay import json_lines, message_keys, replay
from sample_data import row_multiset, taobao_table

EXAMPLE = "schemas/examples/taobao_like.yaml"


def test_json_lines_decode_back_to_the_same_rows():
    schema = schemas.from_dict({"name": "t", "labels": ["click"], "layers": [
        {"name": "user", "key": ["uid"], "features": [
            {"name": "uid", "kind": "id", "dtype": "string"},
            {"name": "hist", "kind": "ids", "dtype": "string"},
            {"name": "nums", "kind": "ids"}]},
        {"name": "ad", "key": ["aid"], "features": [
            {"name": "aid", "kind": "id"}, {"name": "price", "kind": "dense", "dim": 2}]}]})
    rows = [
        {"uid": 'quote"back\\slash', "hist": ["é", "", "tab\there"], "nums": [-(2 ** 63), 0],
         "aid": 2 ** 62, "price": [0.1, -0.0], "click": 1.0},
        {"uid": "u2", "hist": [], "nums": [], "aid": -1, "price": [3.4028235e38, 1e-8],
         "click": 0.25},
    ]
    table = pa.Table.from_pylist(rows, schema=schema.raw_arrow_schema())
    lines = json_lines(table, schema).to_pylist()
    assert [json.loads(line)["uid"] for line in lines] == ['quote"back\\slash', "u2"]
    decoded, dead = compression.decode_json_samples([line.encode() for line in lines], schema)
    assert dead == []
    assert row_multiset(decoded) == row_multiset(table)
    assert message_keys(table, schema).to_pylist() == ['quote"back\\slash', "u2"]


def test_replay_sends_every_sample_once(kafka_broker, tmp_path):
    schema = schemas.load(EXAMPLE)
    table = taobao_table(1500, seed=4)
    pq.write_table(table, tmp_path / "raw.parquet")
    topic = kafka_broker.create_topic(partitions=3)
    result = replay(schema, str(tmp_path / "raw.parquet"), kafka_broker.bootstrap, topic)
    assert result["samples"] == 1500
    assert sum(result["end_offsets"].values()) == 1500
    messages = kafka_broker.consume_all(topic)
    assert len(messages) == 1500
    decoded, dead = compression.decode_json_samples([m.value() for m in messages], schema)
    assert dead == []
    assert row_multiset(decoded) == row_multiset(table)
    # one user's samples share a key, hence a partition
    partitions = {}
    for m in messages:
        partitions.setdefault(m.key(), set()).add(m.partition())
    assert all(len(p) == 1 for p in partitions.values())


def test_replay_command_with_limit_and_rate(kafka_broker, tmp_path):
    table = taobao_table(300, seed=5)
    pq.write_table(table, tmp_path / "raw.parquet")
    topic = kafka_broker.create_topic()
    out = subprocess.run(
        [sys.executable, "-m", "pipelines.replay", "--schema", EXAMPLE, "--input",
         str(tmp_path / "raw.parquet"), "--bootstrap-servers", kafka_broker.bootstrap,
         "--topic", topic, "--limit", "120", "--rate", "100000", "--no-progress",
         "-X", "kafka.linger.ms=5", "-X", "client.id=replay-test"],
        capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["samples"] == 120
    assert len(kafka_broker.consume_all(topic)) == 120


def test_replay_refuses_a_bad_file_before_sending(kafka_broker, tmp_path):
    schema = schemas.load(EXAMPLE)
    table = taobao_table(50).drop_columns(["price"])
    pq.write_table(table, tmp_path / "bad.parquet")
    topic = kafka_broker.create_topic()
    with pytest.raises(compression.RawDataError, match=r"bad.parquet: missing column\(s\) "
                                                       r"'price'"):
        replay(schema, str(tmp_path / "bad.parquet"), kafka_broker.bootstrap, topic)
    assert kafka_broker.consume_all(topic, idle_seconds=1.0) == []


def _replay_command(tmp_path, *argv):
    pq.write_table(taobao_table(20, seed=6), tmp_path / "raw.parquet")
    return subprocess.run(
        [sys.executable, "-m", "pipelines.replay", "--schema", EXAMPLE, "--input",
         str(tmp_path / "raw.parquet"), "--topic", "t", "--no-progress", *argv],
        capture_output=True, text=True, timeout=120)


def test_an_unreachable_broker_ends_the_replay_with_one_clear_line(tmp_path):
    # librdkafka logged a %3|...|FAIL| line per connection attempt and the command never ended
    out = _replay_command(tmp_path, "--bootstrap-servers", "127.0.0.1:1", "--broker-timeout",
                          "2")
    assert out.returncode == 1
    assert "%3|" not in out.stderr and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "python -m pipelines.replay: error: no Kafka broker at 127.0.0.1:1 answered within 2 s "
        "(Failed to get metadata: Local: Broker transport failure); check --bootstrap-servers "
        "and that the broker is up, or wait longer with --broker-timeout SECONDS"]


def test_a_malformed_x_option_is_a_usage_error(tmp_path):
    out = _replay_command(tmp_path, "--bootstrap-servers", "127.0.0.1:1", "-X", "=5")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "python -m pipelines.replay: error: argument -X: -X '=5': expected key=value (or "
        "kafka.key=value), e.g. -X security.protocol=SASL_SSL")


def test_replay_reads_a_glob_on_s3_as_local_files(kafka_broker, s3_bucket, tmp_path):
    """--input on an object store (through compression/fs.py, as every reader): the same
    messages as the same files on disk."""
    from compression import fs

    schema = schemas.load(EXAMPLE)
    table = taobao_table(600, seed=8)
    for i, part in enumerate((table.slice(0, 250), table.slice(250))):
        pq.write_table(part, tmp_path / f"part-{i}.parquet")
        fs.write_bytes(f"{s3_bucket}/raw/part-{i}.parquet",
                       (tmp_path / f"part-{i}.parquet").read_bytes())
    topics = {}
    for where, inputs in (("local", str(tmp_path / "part-*.parquet")),
                          ("s3", f"{s3_bucket}/raw/part-*.parquet")):
        topics[where] = kafka_broker.create_topic()
        result = replay(schema, inputs, kafka_broker.bootstrap, topics[where])
        assert result["samples"] == 600
    local, remote = (sorted((m.key(), m.value()) for m in kafka_broker.consume_all(topics[w]))
                     for w in ("local", "s3"))
    assert remote == local and len(remote) == 600
