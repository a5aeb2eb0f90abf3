"""Online learning against a real broker: crash-exact recovery, SIGTERM, dead letters."""

import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import yaml
from commands import in_process
from confluent_kafka import Consumer, TopicPartition

import native
from kafka_broker import KafkaBroker, group_settings_for_tansu
from pipelines import local_broker
from tcp_proxy import TcpProxy
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
    producer = _Stream(kafka_broker, topic)  # for as long as the trainer is being killed
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
        total = producer.stop()
    final = in_process("trainer.online", *command[3:], "--idle-exit", "5")  # no kill now
    assert final.returncode == 0, final.stderr[-3000:]
    assert steps_seen[-1] > 0, "no kill happened after a checkpoint had been written"
    _assert_trained_exactly_once(kafka_broker, topic, "g-kill", run_dir, final.stdout, total)


class _Stream:
    """A producer thread streaming unique sample ids (0, 1, 2, ...) to both partitions until
    :meth:`stop`, which returns how many it produced (every chunk is delivered before the next
    one starts). :meth:`hold` parks it between two delivered chunks; :meth:`resume` restarts
    it."""

    def __init__(self, broker, topic, chunk=300, pause=0.3):
        self.produced = 0
        self._running = threading.Event()
        self._running.set()
        self._go = threading.Event()
        self._go.set()
        self._parked = threading.Event()
        self._errors = []

        def stream():
            try:
                while self._running.is_set():
                    if not self._go.is_set():
                        self._parked.set()
                        self._go.wait()
                        self._parked.clear()
                        continue
                    start = self.produced
                    broker.produce(topic, [_sample(i) for i in range(start, start + chunk)])
                    self.produced += chunk
                    time.sleep(pause)  # the stream's pace
            except BaseException as e:  # surfaced by stop()
                self._errors.append(e)

        self._thread = threading.Thread(target=stream)
        self._thread.start()

    def hold(self) -> int:
        """Park the thread once its current chunk is delivered; returns how many it produced."""
        self._go.clear()
        while not self._parked.wait(timeout=0.1):
            assert self._thread.is_alive(), f"the producer died: {self._errors}"
        return self.produced

    def resume(self):
        self._go.set()

    def stop(self) -> int:
        self._running.clear()
        self._go.set()
        self._thread.join()
        assert not self._errors, f"the producer failed: {self._errors}"
        return self.produced


def _run_while_streaming(broker, files, tmp_path, group, *extra, idle_exit="8"):
    """A fresh 2-partition topic with a producer streaming into it, and a trainer process on
    it that checkpoints every 0.5 s and exits after ``idle_exit`` idle seconds."""
    schema_path, config_path = files
    topic = broker.create_topic(partitions=2)
    run_dir = str(tmp_path / "run")
    producer = _Stream(broker, topic)
    process = subprocess.Popen(
        _online(schema_path, config_path, broker, topic, group, run_dir, "--checkpoint-every",
                "0.5", "--idle-exit", idle_exit, *extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return topic, run_dir, producer, process


def _status(run_dir) -> dict | None:
    """The trainer's status.json (replaced atomically), or None before the first one."""
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _wait_for_status(process, run_dir, condition, what, timeout=180) -> dict:
    """Poll status.json until ``condition(status)`` holds; fail if the trainer exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the trainer exited (code {process.returncode}) before {what}")
        status = _status(run_dir)
        if status is not None and condition(status):
            return status
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting until {what}: {_status(run_dir)}")


def _wait_until_training(process, run_dir, timeout=180):
    return _wait_for_status(process, run_dir, lambda s: s["samples"] > 0,
                            "the trainer trained", timeout)


def _assert_trained_exactly_once(broker, topic, group, run_dir, stdout, total):
    summary = json.loads(stdout.strip().splitlines()[-1])
    latest, store = _final_store(run_dir, "sid")
    rows = store.to_numpy()
    # Every sample's unique id has a row, updated exactly once: trained exactly once by the
    # restored model's lineage, whatever happened to the process, the broker or the group.
    assert sorted(rows["ids"].tolist()) == list(range(total))
    assert set(rows["update_counts"].tolist()) == {1}
    assert latest.state["offsets"] == summary["offsets"]
    assert sum(latest.state["offsets"].values()) == total
    # Kafka's committed offsets equal the checkpoint's
    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group})
    committed = consumer.committed([TopicPartition(topic, p) for p in (0, 1)], timeout=10)
    consumer.close()
    assert {str(tp.partition): tp.offset for tp in committed} == latest.state["offsets"]
    return summary


@pytest.fixture
def broker_behind_proxy():
    """A Tansu broker of its own that clients reach only through a TcpProxy (it advertises
    the proxy's port), so a test can take it away and bring it back. Its clients get the
    6 s group session (as with the ``kafka_broker`` fixture, which may not have run in this
    process)."""
    proxy_port = local_broker.free_port()
    with local_broker.tansu(advertised_port=proxy_port) as (bootstrap, process, log_path), \
            group_settings_for_tansu():
        upstream = ("127.0.0.1", int(bootstrap.rsplit(":", 1)[1]))
        with TcpProxy(upstream, port=proxy_port) as proxy:
            broker = KafkaBroker(f"127.0.0.1:{proxy_port}", process, log_path)
            try:
                broker.admin.list_topics(timeout=30)
                yield broker, proxy
            finally:
                broker.admin = None


def test_a_broker_outage_is_survived_without_losing_or_repeating_a_sample(
        broker_behind_proxy, files, tmp_path):
    # --idle-exit 3 is far shorter than the outage: the outage lasts until the trainer has
    # lost its partitions (the 6 s group session expired), so a trainer that counted an
    # outage as idle time would give up in the middle of it, every time.
    broker, proxy = broker_behind_proxy
    topic, run_dir, producer, process = _run_while_streaming(
        broker, files, tmp_path, "g-outage", "--report-every", "1", idle_exit="3")
    try:
        before = _wait_until_training(process, run_dir)["samples"]
        # no produce request in flight when the broker goes: a retried one could be written
        # twice, and this test is about the trainer, not about the producer
        produced = producer.hold()
        proxy.cut()  # every connection reset, reconnects refused: the broker is gone
        cut_at = time.monotonic()
        during = _wait_for_status(
            process, run_dir,
            lambda s: s["broker_reachable"] is False and not s["assigned"],
            "the trainer saw the broker go and lost its partitions (group session expired)")
        assert time.monotonic() - cut_at > 3  # longer than --idle-exit, and still running
        assert during["idle_s"] == 0
        proxy.restore()  # and back
        producer.resume()
        # trains again: past everything produced before the outage
        _wait_for_status(process, run_dir, lambda s: s["samples"] > produced,
                         "the trainer trained again after the outage")
    except BaseException:
        process.kill()
        raise
    finally:
        if not proxy.up:
            proxy.restore()
        total = producer.stop()
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    summary = _assert_trained_exactly_once(broker, topic, "g-outage", run_dir, out, total)
    assert 0 < before <= produced < summary["samples"] == total  # before and after the outage
    assert "Connection refused" in err or "Disconnected" in err  # the outage was seen
    assert "revoked partitions" in err  # the member lost its partitions


def test_a_rebalance_mid_run_loses_and_repeats_nothing(kafka_broker, files, tmp_path):
    topic, run_dir, producer, process = _run_while_streaming(kafka_broker, files, tmp_path,
                                                             "g-rebalance")
    taken = set()
    try:
        _wait_until_training(process, run_dir)
        # A second member joins the group: the trainer gives up a partition; it leaves without
        # committing: the trainer gets the partition back and resumes where *it* stopped.
        other = Consumer({"bootstrap.servers": kafka_broker.bootstrap, "group.id": "g-rebalance",
                          "enable.auto.commit": False, "auto.offset.reset": "earliest",
                          "session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
        other.subscribe([topic], on_assign=lambda c, ps: taken.update(p.partition for p in ps))
        deadline = time.monotonic() + 60
        while not taken and time.monotonic() < deadline:
            other.poll(0.2)
        end = time.monotonic() + 3
        while time.monotonic() < end:
            other.poll(0.2)
        other.close()
        time.sleep(3.0)
    finally:
        total = producer.stop()
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    assert len(taken) == 1, "the second member was never given a partition"
    assert "revoked partitions" in err
    _assert_trained_exactly_once(kafka_broker, topic, "g-rebalance", run_dir, out, total)


def test_restored_store_equals_the_checkpointed_one_bit_for_bit(kafka_broker, files,
                                                                tmp_path):
    from trainer.trainer import Trainer

    schema_path, config_path = files
    topic = kafka_broker.create_topic()
    kafka_broker.produce(topic, [_sample(i) for i in range(700)])
    run_dir = str(tmp_path / "run")
    command = _online(schema_path, config_path, kafka_broker, topic, "g-restore", run_dir,
                      "--max-samples", "700")
    done = in_process("trainer.online", *command[3:])
    assert done.returncode == 0, done.stderr[-3000:]
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
                                       "g-term", run_dir, "--checkpoint-every", "1000",
                                       "--metrics-port", "0"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    status = _wait_until_training(process, run_dir)  # past start-up, training
    # the Prometheus endpoint reports the run while it trains
    with urllib.request.urlopen(status["metrics_url"], timeout=30) as response:
        metrics = {line.split(" ")[0]: float(line.split(" ")[1])
                   for line in response.read().decode().splitlines()
                   if line and not line.startswith("#")}
    assert metrics["prefixrec_online_samples_total"] > 0
    assert metrics["prefixrec_online_store_rows"] > 0 and "prefixrec_online_pv_auc" in metrics
    assert metrics["prefixrec_online_broker_reachable"] == 1.0
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
    result = in_process("trainer.online", *_online(
        schema_path, config_path, kafka_broker, topic, "g-dlq", run_dir, "--max-samples",
        "400")[3:])
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


def test_expiry_by_a_config_function_and_run_metrics_in_tensorboard(kafka_broker, tmp_path):
    import tensorflow as tf

    (tmp_path / "online_rules.py").write_text(
        "def odd_ids(ids, update_counts, last_steps, last_times, l2_norms, step):\n"
        "    return ids % 2 == 1\n")
    schema_path = tmp_path / "schema.yaml"
    schema_path.write_text(yaml.safe_dump(SCHEMA))
    config = {**CONFIG, "embedding": {**CONFIG["embedding"], "expire": {
        "every_steps": 1000, "function": "online_rules:odd_ids"}}}
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    topic = kafka_broker.create_topic()
    kafka_broker.produce(topic, [_sample(i) for i in range(1000)])
    run_dir = str(tmp_path / "run")
    result = subprocess.run(
        _online(str(schema_path), str(config_path), kafka_broker, topic, "g-expire", run_dir,
                "--expire-every", "1", "--max-samples", "1000", "--report-every", "0.2",
                "--export-dir", str(tmp_path / "export"), "--export-every", "0.2"),
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    _, store = _final_store(run_dir, "sid")
    # every step ends with the user's rule: each sample's own id is odd or even, so what is
    # left of table sid is exactly the even ids
    assert sorted(store.to_numpy()["ids"].tolist()) == list(range(0, 1000, 2))
    assert summary["expired"] >= 500 and summary["lag"] is not None
    assert re.search(r"samples/s \(waited for input \d+%\), lag", result.stderr)  # console
    tags = set()
    for path in glob.glob(os.path.join(run_dir, "online", "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update(v.tag for v in event.summary.value)
    assert {"samples_per_sec", "waited_for_input", "lag_messages", "dead_letters", "store/rows",
            "store/admitted", "store/rejected", "store/expired", "delay/p50_s",
            "delay/p99_s"} <= tags


def test_delay_histogram_percentiles_within_a_bucket():
    from trainer.online import DelayHistogram

    histogram = DelayHistogram()
    assert histogram.percentiles() == {"p50": None, "p99": None}
    histogram.add(np.arange(1000) * 10.0)          # 0 ms .. 9.99 s, 10 ms apart
    histogram.add(np.array([-5.0, 3_600_000.0]))   # clock skew and a stuck sample: clamped
    got = histogram.percentiles()
    exact = np.percentile(np.r_[np.arange(1000) * 10.0, -5.0, 3_600_000.0], [50, 99]) / 1000
    assert abs(got["p50"] - exact[0]) <= 0.011 and abs(got["p99"] - exact[1]) <= 0.011
    assert histogram.counts.sum() == 1002 and histogram.counts[-1] == 1


def test_init_from_a_batch_run_continues_its_model(kafka_broker, files, tmp_path):
    """``--init-from RUN_DIR`` starts a new online run from the model a batch run kept: its
    step, config and every row; a row the stream never touches stays the batch run's bit for
    bit, the rows it does touch go on from the batch run's (counts add up)."""
    import pyarrow as pa

    import schemas
    from trainer import TrainConfig, Trainer, models

    schema_path, config_path = files
    samples = [json.loads(_sample(i)[1]) for i in range(1200)]
    batch = Trainer(schemas.load(schema_path), models.MLP(), TrainConfig.from_dict(CONFIG))
    batch.fit(pa.Table.from_pylist(samples[:600]), shuffle=False)
    batch.save(tmp_path / "batch" / "checkpoint")
    topic = kafka_broker.create_topic()
    kafka_broker.produce(topic, [_sample(i) for i in range(600, 1200)])
    run_dir = str(tmp_path / "online")
    command = [sys.executable, "-m", "trainer.online", "--schema", schema_path,
               "--bootstrap-servers", kafka_broker.bootstrap, "--topic", topic,
               "--group", "g-init", "--run-dir", run_dir, "--max-samples", "600"]
    refused = subprocess.run(command + ["--init-from", str(tmp_path / "batch"), "--config",
                                        config_path], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "drop --config" in refused.stderr
    out = subprocess.run(command + ["--init-from", str(tmp_path / "batch")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"initialised from {tmp_path / 'batch'}: step {batch.step}" in out.stderr
    latest, sids = _final_store(run_dir, "sid")
    assert latest.step > batch.step
    online = sids.to_numpy()
    before = batch.stores["sid"].to_numpy()
    seen = np.isin(online["ids"], before["ids"])
    assert seen.sum() == len(before["ids"])  # every row of the batch run is there
    order_a, order_b = np.argsort(online["ids"][seen]), np.argsort(before["ids"])
    for key in ("values", "state", "update_counts", "last_steps"):
        np.testing.assert_array_equal(online[key][seen][order_a], before[key][order_b])
    _, uids = _final_store(run_dir, "uid")
    after, start = uids.to_numpy(), batch.stores["uid"].to_numpy()
    assert np.array_equal(np.sort(after["ids"]), np.sort(start["ids"]))  # 37 users, both
    assert after["update_counts"].sum() > start["update_counts"].sum()
