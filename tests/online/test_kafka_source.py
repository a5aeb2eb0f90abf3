"""The Kafka sample source against a real broker, and atomic checkpoints."""

import json
import os

import pyarrow as pa
import pytest

import compression
import schemas
from compression.messages import DeadLetter
from kafka_broker import tansu_behind_proxy
from trainer.checkpoints import CheckpointManager
from trainer.kafka_source import KafkaSampleSource, group_id

SCHEMA = schemas.from_dict({"name": "t", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"}]},
    {"name": "ad", "key": ["sid"], "features": [{"name": "sid", "kind": "id"}]}]})


def _sample(uid, sid):
    return json.dumps({"uid": uid, "sid": sid, "click": 0.0}).encode()


def _drain(source, want, rounds=200):
    """Poll until ``want`` messages were consumed; return the Polled results."""
    out, seen = [], 0
    for _ in range(rounds):
        polled = source.poll(100, timeout=0.2)
        if polled.messages:
            out.append(polled)
            seen += polled.messages
        if seen >= want:
            break
    return out


def test_source_decodes_tracks_positions_and_dead_letters(kafka_broker):
    topic = kafka_broker.create_topic(partitions=2)
    good = [(str(i % 5).encode(), _sample(i % 5, i), None, None, i % 2) for i in range(40)]
    bad = [(b"x", b"{oops", None, None, 0), (b"y", b"z" * 3000, None, None, 1),
           # pyarrow.json.read_json crashed the process on this one (a segfault)
           (b"n", b" null ", None, None, 1),
           (b"t", None, None, None, 0)]  # a null value (a compaction tombstone)
    kafka_broker.produce(topic, good + bad)
    source = KafkaSampleSource(SCHEMA, kafka_broker.bootstrap, topic, group_id(),
                               max_message_bytes=2000)
    try:
        polls = _drain(source, 44)
        samples = sum(p.num_samples for p in polls)
        assert samples == 40 and sum(p.dead for p in polls) == 4
        sids = sorted(s for p in polls for s in p.samples.column("sid").to_pylist())
        assert sids == list(range(40))
        assert source.positions == {0: 22, 1: 22}
        assert all(len(p.timestamps_ms) == p.num_samples for p in polls)
        source.send_dead_letters([d for p in polls for d in p.dead_letters])  # as trained
        assert source.flush_dead_letters(10) and source.commit()
    finally:
        source.close()
    dead = kafka_broker.consume_all(f"{topic}.dlq")
    reasons = {(m.value() or b"")[:5]: dict(m.headers())["reason"].decode() for m in dead}
    assert reasons[b"{oops"].startswith("not a valid sample: not JSON")
    assert reasons[b"zzzzz"] == "oversized: 3000 bytes, the limit is 2000 (max_message_bytes)"
    assert reasons[b" null"].startswith("not a valid sample: expected a JSON object")
    assert reasons[b""] == "empty message; expected one JSON object"
    assert {dict(m.headers())["source.partition"] for m in dead} == {b"0", b"1"}


def test_a_dead_letter_whose_produce_is_retried_is_written_once():
    """A poll sets its dead letters aside and the caller sends them. The dead-letter producer
    is idempotent: when the broker's answer to its Produce is lost (the records written, the
    connection reset), the client sends the request again and the broker refuses the
    repeated sequence numbers instead of writing the records twice (Tansu, the test broker,
    as Kafka does)."""
    with tansu_behind_proxy() as (broker, proxy):
        topic = broker.create_topic()
        broker.produce(topic, [(b"k", _sample(1, 0)), (b"x", b"{oops"), (b"k", _sample(1, 1))])
        source = KafkaSampleSource(SCHEMA, broker.bootstrap, topic, group_id(),
                                   partitions=[0])
        try:
            polls = _drain(source, 3)
            letters = [letter for p in polls for letter in p.dead_letters]
            assert [(d.key, d.partition, d.offset) for d in letters] == [(b"x", 0, 1)]
            proxy.lose_produce_responses(1)
            source.send_dead_letters(letters)
            assert source.flush_dead_letters(30)
            # the first answer was lost, so the delivery was confirmed by the retry's
            assert proxy.lost_produce == 1 and source.dead_letters_failed == 0
        finally:
            source.close()
        dead = [DeadLetter.from_message(m.value(), m.headers(), m.key())
                for m in broker.consume_all(f"{topic}.dlq", idle_seconds=1.0)]
    assert dead == letters


def test_a_new_source_resumes_at_the_given_offsets_not_the_committed_ones(kafka_broker):
    topic = kafka_broker.create_topic()
    kafka_broker.produce(topic, [(b"k", _sample(1, i)) for i in range(30)])
    group = group_id()
    first = KafkaSampleSource(SCHEMA, kafka_broker.bootstrap, topic, group)
    try:
        _drain(first, 30)
        first.commit({0: 10})  # as if the checkpoint only covered the first 10
    finally:
        first.close()
    # a checkpoint that says 25 wins over the committed 10
    second = KafkaSampleSource(SCHEMA, kafka_broker.bootstrap, topic, group,
                               start_offsets={0: 25})
    try:
        polls = _drain(second, 5)
        assert sorted(s for p in polls for s in p.samples.column("sid").to_pylist()) == [
            25, 26, 27, 28, 29]
        assert polls[0].ranges == {0: (25, 30)}
    finally:
        second.close()
    # without a checkpoint, the committed offset is where a member of the group resumes
    third = KafkaSampleSource(SCHEMA, kafka_broker.bootstrap, topic, group)
    try:
        polls = _drain(third, 20)
        assert min(s for p in polls for s in p.samples.column("sid").to_pylist()) == 10
    finally:
        third.close()


def test_tree_messages_are_decoded_and_wrong_ones_dead_lettered(kafka_broker):
    topic = kafka_broker.create_topic()
    table = pa.table({"uid": [1, 1, 2], "sid": [5, 6, 7], "click": [0.0, 1.0, 0.0]}
                     ).cast(SCHEMA.raw_arrow_schema())
    trees = compression.build_trees(table, SCHEMA)
    other = schemas.from_dict({"name": "o", "labels": ["y"], "layers": [
        {"name": "s", "key": ["a"], "features": [{"name": "a", "kind": "id"}]}]})
    wrong = compression.build_trees(pa.table({"a": [1], "y": [1.0]}).cast(
        other.raw_arrow_schema()), other)
    # the right schema, but user 2's list of ads is null: not a tree
    broken = trees.slice(1, 1).set_column(1, "ad", pa.array([None], trees.schema.field("ad").type))
    encoded = compression.encode_trees(trees)
    kafka_broker.produce(topic, [(b"1", encoded, None, 1000),
                                 (b"2", compression.encode_trees(wrong)), (b"3", b"junk"),
                                 (b"4", compression.encode_trees(broken)),
                                 (b"5", compression.encode_trees(trees.slice(1, 1)), None,
                                  2000),
                                 # cut short: pyarrow raises OSError, not ArrowInvalid
                                 (b"6", encoded[:-9])])
    source = KafkaSampleSource(SCHEMA, kafka_broker.bootstrap, topic, group_id(),
                               format="trees")
    try:
        polls = _drain(source, 6)
        assert sum(p.num_samples for p in polls) == 3 + 1
        assert sum(p.dead for p in polls) == 4
        got = pa.concat_tables([t for p in polls for t in p.trees])
        assert got.equals(pa.concat_tables([trees, trees.slice(1, 1)]))
        # a timestamp per sample, its message's
        assert [t for p in polls for t in p.timestamps_ms.tolist()] == [1000] * 3 + [2000]
        source.send_dead_letters([d for p in polls for d in p.dead_letters])  # as trained
        assert source.flush_dead_letters(10) and source.commit()
    finally:
        source.close()
    reasons = sorted(dict(m.headers())["reason"].decode()
                     for m in kafka_broker.consume_all(f"{topic}.dlq"))
    truncated = f"not a tree message: not an Arrow IPC tree message ({len(encoded) - 9} bytes)"
    cut = [r for r in reasons if r.startswith(truncated)]
    assert len(cut) == 1
    reasons.remove(cut[0])
    assert reasons[0].startswith("not a tree message: not an Arrow IPC tree message (4 bytes)")
    assert reasons[1].startswith("not a tree message: tree schema does not match schema 't'")
    assert reasons[2] == ("not a tree message: tree table: 1 null 'ad' lists under layer "
                          "'user'; a node's children list cannot be null")


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    manager = CheckpointManager(str(tmp_path), keep=2)
    assert manager.latest() is None

    def write(payload):
        def fill(directory):
            with open(os.path.join(directory, "weights.bin"), "w") as f:
                f.write(payload)
        return fill

    for step in (10, 20, 30):
        manager.save(write(f"w{step}"), {"step": step, "offsets": {"0": step * 2}})
    latest = manager.latest()
    assert latest.step == 30 and latest.state["offsets"] == {"0": 60}
    assert open(os.path.join(latest.path, "weights.bin")).read() == "w30"
    assert [c.step for c in manager.all()] == [20, 30]

    def crash(directory):
        write("partial")(directory)
        raise KeyboardInterrupt  # dies while writing

    with pytest.raises(KeyboardInterrupt):
        manager.save(crash, {"step": 40})
    assert manager.latest().step == 30  # the half-written checkpoint never became LATEST
    assert not any(n.startswith(".tmp-") for n in os.listdir(manager.directory))


def test_a_reader_removes_a_dead_writers_leftovers_never_a_live_writers(tmp_path):
    """A manager made while another one saves (a reader, or a second process on the run
    directory) leaves that save's temporary directory alone; a dead writer's is cleaned."""
    import subprocess
    import sys

    manager = CheckpointManager(str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    for name in (f".tmp-{int(dead.stdout)}-0ab", ".tmp-0123abcd"):  # a dead pid; no pid
        os.makedirs(os.path.join(manager.directory, name, "model"))
    seen = []

    def write(directory):
        open(os.path.join(directory, "w"), "w").write("1")
        reader = CheckpointManager(str(tmp_path))  # while this save is under way
        seen.append((reader.latest(), sorted(os.listdir(reader.directory))))

    saved = manager.save(write, {"step": 1})
    assert open(os.path.join(saved.path, "w")).read() == "1"
    (latest, names), = seen
    assert latest is None and len(names) == 1 and names[0].startswith(f".tmp-{os.getpid()}-")
    assert [c.step for c in CheckpointManager(str(tmp_path)).all()] == [1]
