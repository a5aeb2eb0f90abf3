"""Online learning against a real broker: crash-exact recovery, SIGTERM, dead letters."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import yaml
from confluent_kafka import Consumer, TopicPartition

import native
from trainer.checkpoints import CheckpointManager

SCHEMA = {"name": "online_test", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"},
                                                   {"name": "age", "kind": "id"}]},
    {"name": "sample", "key": ["sid"], "features": [{"name": "sid", "kind": "id"}]}]}
CONFIG = {"batch_size": 200, "seed": 3, "threads": 1,
          "embedding": {"dim": 4, "optimizer": {"name": "sgd", "lr": 0.1},
                        "initializer": {"name": "normal", "stddev": 0.01}}}


@pytest.fixture
def files(tmp_path):
    schema_path = tmp_path / "schema.yaml"
    schema_path.write_text(yaml.safe_dump(SCHEMA))
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(CONFIG))
    return str(schema_path), str(config_path)


def _sample(sid: int) -> tuple[bytes, bytes]:
    uid = sid % 37
    value = {"uid": uid, "age": uid % 5, "sid": sid, "click": float(sid % 11 == 0)}
    return str(uid).encode(), json.dumps(value).encode()


def _online(schema_path, config_path, broker, topic, group, run_dir, *extra):
    # A killed member never rejoins: a short max.poll.interval.ms (the rebalance timeout) lets
    # the next run take the partitions over in seconds instead of the default 5 minutes.
    return [sys.executable, "-m", "trainer.online", "--schema", schema_path, "--config",
            config_path, "--bootstrap-servers", broker.bootstrap, "--topic", topic, "--group",
            group, "--run-dir", run_dir, "--model", "mlp", "-X", "max.poll.interval.ms=8000",
            *extra]


def _final_store(run_dir, table):
    latest = CheckpointManager(run_dir).latest()
    return latest, native.EmbeddingStore.load(
        os.path.join(latest.path, "model", "stores", table))


def test_kill_9_at_random_moments_trains_every_sample_exactly_once(kafka_broker, files,
                                                                   tmp_path):
    schema_path, config_path = files
    topic = kafka_broker.create_topic(partitions=2)
    run_dir = str(tmp_path / "run")
    produced = []
    streaming = threading.Event()
    streaming.set()

    def stream():  # a producer streams unique ids for as long as the trainer is being killed
        while streaming.is_set():
            start = len(produced)
            kafka_broker.produce(topic, [_sample(i) for i in range(start, start + 300)])
            produced.extend(range(start, start + 300))
            time.sleep(0.3)

    producer = threading.Thread(target=stream)
    producer.start()
    rng = random.Random(11)
    command = _online(schema_path, config_path, kafka_broker, topic, "g-kill", run_dir,
                      "--checkpoint-every", "0.3")
    status = os.path.join(run_dir, "status.json")
    steps_seen = []
    try:
        for _ in range(3):
            if os.path.exists(status):
                os.remove(status)
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
            while process.poll() is None:  # until this run trains
                if os.path.exists(status) and json.load(open(status))["samples"] > 0:
                    break
                time.sleep(0.1)
            assert process.poll() is None, "the trainer exited before it was killed"
            time.sleep(rng.uniform(0.1, 2.5))  # then at a random moment of training
            process.kill()                     # SIGKILL: no chance to checkpoint or commit
            process.wait()
            latest = CheckpointManager(run_dir).latest()
            steps_seen.append(latest.step if latest else 0)
    finally:
        streaming.clear()
        producer.join()
    total = len(produced)
    final = subprocess.run(command + ["--idle-exit", "5"], capture_output=True, text=True,
                           timeout=300)
    assert final.returncode == 0, final.stderr[-3000:]
    summary = json.loads(final.stdout.strip().splitlines()[-1])
    assert steps_seen[-1] > 0, "no kill happened after a checkpoint had been written"

    latest, store = _final_store(run_dir, "sid")
    rows = store.to_numpy()
    # Every sample's unique id has a row, updated exactly once: trained exactly once by the
    # restored model's lineage, whatever the kills threw away.
    assert sorted(rows["ids"].tolist()) == list(range(total))
    assert set(rows["update_counts"].tolist()) == {1}
    assert latest.state["offsets"] == {k: v for k, v in summary["offsets"].items()}
    assert sum(latest.state["offsets"].values()) == total
    # Kafka's committed offsets equal the checkpoint's
    consumer = Consumer({"bootstrap.servers": kafka_broker.bootstrap, "group.id": "g-kill"})
    committed = consumer.committed([TopicPartition(topic, p) for p in (0, 1)], timeout=10)
    consumer.close()
    assert {str(tp.partition): tp.offset for tp in committed} == latest.state["offsets"]


def test_restored_store_equals_the_checkpointed_one_bit_for_bit(kafka_broker, files,
                                                                tmp_path):
    from trainer.trainer import Trainer

    schema_path, config_path = files
    topic = kafka_broker.create_topic()
    kafka_broker.produce(topic, [_sample(i) for i in range(700)])
    run_dir = str(tmp_path / "run")
    command = _online(schema_path, config_path, kafka_broker, topic, "g-restore", run_dir,
                      "--max-samples", "700")
    subprocess.run(command, capture_output=True, text=True, check=True, timeout=300)
    latest = CheckpointManager(run_dir).latest()
    restored = Trainer.restore(os.path.join(latest.path, "model"))
    for table, store in restored.stores.items():
        saved = native.EmbeddingStore.load(os.path.join(latest.path, "model", "stores", table))
        a, b = store.to_numpy(), saved.to_numpy()
        order_a, order_b = np.argsort(a["ids"]), np.argsort(b["ids"])
        for key in a:
            assert np.array_equal(a[key][order_a], b[key][order_b]), (table, key)
    assert restored.step == latest.step


def test_sigterm_finishes_checkpoints_commits_and_exits_0(kafka_broker, files, tmp_path):
    schema_path, config_path = files
    topic = kafka_broker.create_topic()
    offsets = kafka_broker.produce(topic, [_sample(i) for i in range(3000)])
    run_dir = str(tmp_path / "run")
    process = subprocess.Popen(_online(schema_path, config_path, kafka_broker, topic,
                                       "g-term", run_dir, "--checkpoint-every", "1000"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    status = os.path.join(run_dir, "status.json")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:  # past start-up, training
        if os.path.exists(status) and json.load(open(status))["samples"] > 0:
            break
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    latest = CheckpointManager(run_dir).latest()
    assert latest is not None and latest.state["offsets"] == summary["offsets"]
    consumer = Consumer({"bootstrap.servers": kafka_broker.bootstrap, "group.id": "g-term"})
    committed = consumer.committed([TopicPartition(topic, 0)], timeout=10)
    consumer.close()
    assert committed[0].offset == int(summary["offsets"]["0"])
    assert 0 < committed[0].offset <= offsets[-1] + 1


def test_malformed_messages_go_to_the_dead_letter_topic_while_good_ones_train(
        kafka_broker, files, tmp_path):
    schema_path, config_path = files
    topic = kafka_broker.create_topic()
    good = [_sample(i) for i in range(400)]
    bad = [(b"b1", b"{broken"), (b"b2", json.dumps({"uid": 1, "age": 2, "sid": "x",
                                                    "click": 0}).encode()),
           (b"b3", json.dumps({"uid": 1, "age": 2, "sid": 5, "click": 9}).encode())]
    kafka_broker.produce(topic, good[:200] + bad + good[200:])
    run_dir = str(tmp_path / "run")
    result = subprocess.run(_online(schema_path, config_path, kafka_broker, topic, "g-dlq",
                                    run_dir, "--max-samples", "400"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 400 and summary["dead_letters"] == 3
    dead = {m.key(): dict(m.headers())["reason"].decode()
            for m in kafka_broker.consume_all(f"{topic}.dlq")}
    assert set(dead) == {b"b1", b"b2", b"b3"}
    assert dead[b"b1"].startswith("not a valid sample: not JSON")
    assert dead[b"b3"] == "label 'click': value out of range, labels must be in [0, 1]"
    _, store = _final_store(run_dir, "sid")
    assert len(store) == 400
