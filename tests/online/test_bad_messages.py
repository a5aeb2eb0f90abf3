"""Bad messages in the online trainer: every kind goes to the dead-letter topic as one
``compression.DeadLetter`` record (value and key unchanged, reason, topic, partition, offset)
while every good sample around it is trained; the trainer's Kafka start-up and ``-X`` options."""

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
import yaml
from commands import in_process

import compression
import native
import schemas
from compression.messages import DeadLetter
from pipelines.generate import generate_tables
from pipelines.replay import json_lines
from trainer import TrainConfig, Trainer, models
from trainer.checkpoints import CheckpointManager
from trainer.kafka_source import KafkaSampleSource, group_id
from trainer.online import OnlineTrainer, build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA_DICT = {"name": "bad_messages", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"}]},
    {"name": "sample", "key": ["sid"], "features": [{"name": "sid", "kind": "id"}]}]}
SCHEMA = schemas.from_dict(SCHEMA_DICT)
CONFIG = {"batch_size": 50, "seed": 3, "threads": 1,
          "embedding": {"dim": 4, "optimizer": {"name": "sgd", "lr": 0.1}}}
LIMIT = 2000  # --max-message-bytes of these tests


def _good(sid: int) -> tuple[bytes, bytes]:
    value = {"uid": sid % 7, "sid": sid, "click": float(sid % 5 == 0)}
    return str(sid % 7).encode(), json.dumps(value).encode()


TRUNCATED = _good(10_000)[1][:-6]
OVERSIZED = json.dumps({"uid": 1, "sid": 1, "click": 0.0, "pad": "x" * 3000}).encode()
# (key, value, the reason its dead letter must give)
BAD = {
    "null": (b"null", b"null", "not a valid sample: expected a JSON object, got null"),
    "empty": (b"empty", b"", "empty message; expected one JSON object"),
    "tombstone": (b"tombstone", None, "empty message; expected one JSON object"),
    "truncated": (b"truncated", TRUNCATED,
                  "not a valid sample: not JSON (the message ends too early)"),
    "binary": (b"binary", b"\x00\xff\xfe\x80garbage\xc3",
               "not a valid sample: not JSON (expected a value at byte 0)"),
    "oversized": (b"oversized", OVERSIZED,
                  f"oversized: {len(OVERSIZED)} bytes, the limit is {LIMIT} "
                  "(max_message_bytes)"),
}


def _produce_with_bad(kafka_broker, topic, kinds, good_count):
    """Good samples 0..good_count-1 with the bad messages of ``kinds`` spread between them;
    returns {kind: offset} from the delivery reports."""
    good = [_good(i) for i in range(good_count)]
    step = good_count // (len(kinds) + 1)
    messages, where = [], {}
    for i, message in enumerate(good):
        messages.append(message)
        if (i + 1) % step == 0 and len(where) < len(kinds):
            kind = kinds[len(where)]
            where[kind] = len(messages)
            messages.append(BAD[kind][:2])
    offsets = kafka_broker.produce(topic, messages)
    return {kind: offsets[i] for kind, i in where.items()}


def _check_dead_letters(kafka_broker, topic, kinds, offsets, dlq=None):
    dead = [DeadLetter.from_message(m.value(), m.headers(), m.key())
            for m in kafka_broker.consume_all(dlq or f"{topic}.dlq", idle_seconds=1.5)]
    expected = [DeadLetter(BAD[kind][1], BAD[kind][2], BAD[kind][0], topic, 0, offsets[kind])
                for kind in kinds]
    assert sorted(dead, key=lambda d: d.offset) == expected  # a null value stays null


def _trained_sids(run_dir):
    latest = CheckpointManager(run_dir).latest()
    store = native.EmbeddingStore.load(os.path.join(latest.path, "model", "stores", "sid"))
    return latest, store


@pytest.mark.parametrize("kind", sorted(BAD))
def test_each_bad_message_is_dead_lettered_and_its_neighbours_trained(kafka_broker, tmp_path,
                                                                      kind):
    topic = kafka_broker.create_topic()
    offsets = _produce_with_bad(kafka_broker, topic, [kind], 200)
    source = KafkaSampleSource(SCHEMA, kafka_broker.bootstrap, topic, group_id(),
                               max_message_bytes=LIMIT)
    trainer = Trainer(SCHEMA, models.MLP(hidden=(8,)), TrainConfig.from_dict(CONFIG))
    online = OnlineTrainer(SCHEMA, trainer, source, CheckpointManager(str(tmp_path / "run")),
                           checkpoint_every=1000, max_samples=200, poll_timeout=0.05,
                           unit_samples=50, record_predictions=True, reader_nice=0)
    try:
        summary = online.run()  # stops at max_samples: every message before it was consumed
    finally:
        source.close()
    assert summary["samples"] == 200 and summary["dead_letters"] == 1
    assert summary["messages"] == 201 and summary["offsets"] == {"0": 201}
    assert sum(len(y) for _, y in online.predictions) == 200
    _, store = _trained_sids(str(tmp_path / "run"))
    assert len(store) == 200  # every good sample's id trained, once each
    _check_dead_letters(kafka_broker, topic, [kind], offsets)


def test_a_run_stopped_with_polls_untrained_and_its_restart_dead_letter_each_message_once(
        kafka_broker, tmp_path):
    """A run that stops (--max-samples here; SIGTERM alike) leaves the polls its reader took
    ahead untrained, outside its final checkpoint; the next run of the same run directory
    reads them again. Every malformed message reaches the dead-letter topic exactly once
    over both runs: its record is sent when its poll is trained, not when it is read."""
    topic = kafka_broker.create_topic(partitions=2)
    kinds = sorted(BAD)
    messages = []
    for sid in range(600):  # 300 samples a partition, 30 malformed messages among them
        if sid % 10 == 5:
            kind = kinds[(sid // 10) % len(kinds)]
            messages.append((BAD[kind][0], BAD[kind][1], None, None, (sid // 10) % 2))
        messages.append((*_good(sid), None, None, sid % 2))
    offsets = kafka_broker.produce(topic, messages)
    malformed = sorted((m[4], o) for m, o in zip(messages, offsets)
                       if m[0] in {BAD[k][0] for k in kinds})
    run_dir, group = str(tmp_path / "run"), group_id()
    # one model for both runs: the second resumes with what the first one's final checkpoint
    # holds (a restore of it gives the same; this saves tracing the step again)
    trainer = Trainer(SCHEMA, models.MLP(hidden=(8,)), TrainConfig.from_dict(CONFIG))

    def run(max_samples: int) -> dict:
        checkpoints = CheckpointManager(run_dir)
        latest = checkpoints.latest()
        start = ({} if latest is None
                 else {int(p): o for p, o in latest.state["offsets"].items()})
        # both partitions assigned, not joined as a group member: a join takes seconds here
        source = KafkaSampleSource(SCHEMA, kafka_broker.bootstrap, topic, group,
                                   start_offsets=start, max_message_bytes=LIMIT,
                                   partitions=[0, 1])
        online = OnlineTrainer(SCHEMA, trainer, source, checkpoints, checkpoint_every=1000,
                               max_samples=max_samples, poll_timeout=0.05, unit_samples=50,
                               reader_nice=0)
        try:
            return online.run()
        finally:
            source.close()

    first = run(max_samples=100)  # its reader polls ahead while its first units train
    second = run(max_samples=600 - first["samples"])
    assert first["samples"] + second["samples"] == 600
    assert second["offsets"] == {"0": 330, "1": 330}
    assert first["dead_letters"] + second["dead_letters"] == len(malformed) == 60
    letters = [DeadLetter.from_message(m.value(), m.headers(), m.key())
               for m in kafka_broker.consume_all(f"{topic}.dlq", idle_seconds=1.0)]
    assert sorted((d.partition, d.offset) for d in letters) == malformed  # each once
    assert {d.topic for d in letters} == {topic}


def test_the_online_command_dead_letters_every_kind_and_trains_the_rest(kafka_broker,
                                                                         tmp_path):
    schema_path, config_path = tmp_path / "schema.yaml", tmp_path / "config.yaml"
    schema_path.write_text(yaml.safe_dump(SCHEMA_DICT))
    config_path.write_text(yaml.safe_dump(CONFIG))
    topic, dlq = kafka_broker.create_topic(), kafka_broker.create_topic()
    kinds = sorted(BAD)
    offsets = _produce_with_bad(kafka_broker, topic, kinds, 420)
    run_dir = str(tmp_path / "run")
    result = in_process(
        "trainer.online", "--schema", schema_path, "--config", config_path,
        "--bootstrap-servers", kafka_broker.bootstrap, "--topic", topic, "--group", group_id(),
        "--run-dir", run_dir, "--max-samples", "420", "--max-message-bytes", LIMIT,
        "--dead-letter-topic", dlq, "-X", "kafka.client.id=bad-messages-test",
        "-X", "fetch.wait.max.ms=100")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 420 and summary["dead_letters"] == len(kinds)
    assert summary["offsets"] == {"0": 420 + len(kinds)}
    _, store = _trained_sids(run_dir)
    assert len(store) == 420
    _check_dead_letters(kafka_broker, topic, kinds, offsets, dlq=dlq)


def test_online_start_against_an_unreachable_broker_fails_with_one_clear_line(tmp_path):
    schema_path = tmp_path / "schema.yaml"
    schema_path.write_text(yaml.safe_dump(SCHEMA_DICT))
    result = subprocess.run(
        [sys.executable, "-m", "trainer.online", "--schema", str(schema_path),
         "--bootstrap-servers", "127.0.0.1:1", "--topic", "t", "--group", "g",
         "--run-dir", str(tmp_path / "run"), "--broker-timeout", "2"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 1
    assert "%3|" not in result.stderr and "FAIL" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors == [
        "python -m trainer.online: error: no Kafka broker at 127.0.0.1:1 answered within 2 s "
        "(Failed to get metadata: Local: Broker transport failure); check --bootstrap-servers "
        "and that the broker is up, or wait longer with --broker-timeout SECONDS"]
    assert not os.path.exists(tmp_path / "run")


def test_online_takes_x_options_with_and_without_the_kafka_prefix(capsys):
    parser = build_parser()
    base = ["--schema", "s", "--bootstrap-servers", "b", "--topic", "t", "--group", "g",
            "--run-dir", "r"]
    args = parser.parse_args(base + ["-X", "kafka.security.protocol=SSL", "-X",
                                     "client.id=a=b"])
    assert dict(args.kafka_options) == {"security.protocol": "SSL", "client.id": "a=b"}
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(base + ["-X", "no-equals-sign"])
    assert stop.value.code == 2
    assert ("argument -X: -X 'no-equals-sign': expected key=value (or kafka.key=value)"
            in capsys.readouterr().err)


# -- carried columns through the online path --------------------------------------------------

WITH_ROW_IDS = schemas.load(os.path.join(ROOT, "schemas", "examples", "with_row_ids.yaml"))


def _messages(schema, samples, seed):
    out = []
    for table in generate_tables(schema, samples, seed=seed):
        out += [v.as_py().encode() for v in json_lines(table, schema)]
    return out


def test_decoded_samples_with_carried_columns_train_and_keep_their_row_ids():
    # What trainer.online does with a poll of JSON messages: decode, build trees, batch, train.
    messages = _messages(WITH_ROW_IDS, 600, seed=8)
    messages[5] = messages[5].replace(b'"row_id":5', b'"row_id":null')
    messages.insert(9, messages[9].replace(b'"row_id":9', b'"row_id":"nine"'))
    table, dead = compression.decode_json_samples(messages, WITH_ROW_IDS, with_index=True)
    assert [i for i, _ in dead] == [9] and "'row_id'" in dead[0][1]
    samples = table.drop_columns(["__message"])
    trees = compression.build_trees(samples, WITH_ROW_IDS, validate=False)
    trainer = Trainer(WITH_ROW_IDS, models.MLP(hidden=(8,)),
                      TrainConfig.from_dict({"batch_size": 200, "embedding": {"dim": 4}}))
    batches = list(compression.iter_batches(trees, WITH_ROW_IDS, 200))
    losses = [float(trainer.train_batch(b)) for b in batches]
    assert len(losses) == 3 and all(np.isfinite(losses))
    row_ids = pa.concat_arrays([b.carried["row_id"] for b in batches])
    assert sorted(row_ids.drop_null().to_pylist()) == sorted(set(range(600)) - {5})
    assert row_ids.null_count == 1
    times = pa.concat_arrays([b.carried["event_time"] for b in batches])
    assert times.type == pa.timestamp("us", tz="UTC") and times.null_count == 0


@pytest.mark.slow
def test_online_training_from_json_with_carried_columns(kafka_broker, tmp_path):
    # trainer.online on a topic of samples with carried fields (some null or missing): it
    # trains them all and dead-letters only the wrong-typed carried values, naming the column.
    schema_path = tmp_path / "schema.yaml"
    schema_path.write_text(yaml.safe_dump(WITH_ROW_IDS.to_dict()))
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump({"batch_size": 100, "seed": 3, "threads": 1,
                                           "embedding": {"dim": 4}}))
    messages = _messages(WITH_ROW_IDS, 300, seed=9)
    messages[3] = messages[3].replace(b',"request_id":"3"', b"")
    good = [(str(i).encode(), m) for i, m in enumerate(messages)]
    bad = [(b"b1", messages[0].replace(b'"row_id":0', b'"row_id":"zero"')),
           (b"b2", messages[0].replace(b'"2024-01-01 00:00:00.000000Z"', b'"yesterday"'))]
    topic = kafka_broker.create_topic()
    kafka_broker.produce(topic, good[:150] + bad + good[150:])
    result = in_process(
        "trainer.online", "--schema", schema_path, "--config", config_path,
        "--bootstrap-servers", kafka_broker.bootstrap, "--topic", topic, "--group", "g-carried",
        "--run-dir", tmp_path / "run", "--model", "mlp", "--max-samples", "300")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 300 and summary["dead_letters"] == 2
    dead = {m.key(): dict(m.headers())["reason"].decode()
            for m in kafka_broker.consume_all(f"{topic}.dlq")}
    assert dead[b"b1"].startswith("not a valid sample: field 'row_id': ")
    assert dead[b"b2"].startswith("not a valid sample: field 'event_time': ")
