"""Checkpoints of the same step saved again, killed at every point of the save; an online run
that checkpoints only when something changed and resumes from a crash in such a save; and the
progressive validation (each sample scored before it is trained) that online learning reports.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pytest
import yaml
from commands import in_process
from confluent_kafka import Consumer, TopicPartition

import compression
import native
import schemas
from trainer import models
from native.crash_points import ENV as CRASH_ENV
from native.crash_points import EXIT_CODE as CRASH_EXIT_CODE
from trainer.checkpoints import LATEST_FILE, CheckpointManager
from trainer.config import TrainConfig
from trainer.kafka_source import KafkaSampleSource, group_id
from trainer.metrics import auc, logloss
from trainer.online import OnlineTrainer
from trainer.trainer import Trainer

SCHEMA = {"name": "pv_test", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"}]},
    {"name": "sample", "key": ["sid"], "features": [{"name": "sid", "kind": "id"}]}]}
CONFIG = {"batch_size": 100, "seed": 7, "threads": 1,
          "embedding": {"dim": 4, "optimizer": {"name": "adagrad", "lr": 0.3},
                        "initializer": {"name": "normal", "stddev": 0.01}}}

# Saves step 10, then step 10 again with other offsets (what an online run does when a poll
# held only dead letters), in a child process that the crash hook may kill mid-save.
_CHILD = """
import os, sys
from trainer.checkpoints import CheckpointManager

manager = CheckpointManager(sys.argv[1])

def fill(text):
    def write(directory):
        os.makedirs(os.path.join(directory, "model"))
        with open(os.path.join(directory, "model", "payload"), "w") as f:
            f.write(text)
    return write

manager.save(fill("first"), {"step": 10, "offsets": {"0": 100}})
manager.save(fill("second"), {"step": 10, "offsets": {"0": 103}})
"""


def _payload(checkpoint):
    with open(os.path.join(checkpoint.path, "model", "payload")) as f:
        return f.read()


@pytest.mark.parametrize("point, survivor", [
    ("written", "first"),    # the new one complete but still a temporary directory
    ("renamed", "second"),   # the new one in place, LATEST still names the old one
    ("latest", "second"),    # LATEST names the new one, the old one not removed yet
    ("removing", "second"),  # the old one renamed away, half removed
])
def test_a_crash_anywhere_in_saving_the_same_step_again_leaves_a_checkpoint(tmp_path, point,
                                                                            survivor):
    run_dir = str(tmp_path / "run")
    # ".same-step": only in the second save (the same step), as the online loop's
    child = subprocess.run([sys.executable, "-c", _CHILD, run_dir], capture_output=True,
                           text=True, timeout=120,
                           env={**os.environ, CRASH_ENV: f"checkpoint.{point}.same-step"})
    assert child.returncode == CRASH_EXIT_CODE, child.stderr  # killed where asked
    manager = CheckpointManager(run_dir)  # the next start: cleans up, then restores
    latest = manager.latest()
    assert latest.step == 10 and _payload(latest) == survivor
    assert latest.state["offsets"] == {"0": 100 if survivor == "first" else 103}
    assert not [n for n in os.listdir(manager.directory) if n.startswith(".tmp-")]
    # and the run goes on from there: saving the same step again, then a new one
    manager.save(lambda d: os.makedirs(os.path.join(d, "model")) or open(
        os.path.join(d, "model", "payload"), "w").write("third"), {"step": 10, "offsets": {}})
    assert _payload(manager.latest()) == "third"
    assert [c.step for c in manager.all()] == [10]  # older revisions of step 10 are gone
    with open(os.path.join(manager.directory, LATEST_FILE)) as f:
        assert os.path.join(manager.directory, f.read().strip()) == manager.latest().path


def test_saving_the_same_step_never_removes_what_latest_names_first(tmp_path):
    manager = CheckpointManager(str(tmp_path), keep=2)
    for step, text in ((5, "a"), (7, "b"), (7, "c"), (7, "d")):
        manager.save(lambda d, t=text: open(os.path.join(d, "w"), "w").write(t),
                     {"step": step})
    names = sorted(n for n in os.listdir(manager.directory) if n.startswith("ckpt-"))
    assert names == ["ckpt-0000000005", "ckpt-0000000007-2"]  # revisions, newest kept
    assert open(os.path.join(manager.latest().path, "w")).read() == "d"


def _json_sample(sid):
    uid = sid % 37
    # learnable from the user alone: a third of the users click, the others never do
    value = {"uid": uid, "sid": sid, "click": float(uid % 3 == 0)}
    return str(uid).encode(), json.dumps(value).encode()


@pytest.fixture
def files(tmp_path):
    schema_path = tmp_path / "schema.yaml"
    schema_path.write_text(yaml.safe_dump(SCHEMA))
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(CONFIG))
    return str(schema_path), str(config_path)


def _online(files, broker, topic, group, run_dir, *extra):
    schema_path, config_path = files
    return [sys.executable, "-m", "trainer.online", "--schema", schema_path, "--config",
            config_path, "--bootstrap-servers", broker.bootstrap, "--topic", topic, "--group",
            group, "--run-dir", run_dir, "-X", "max.poll.interval.ms=8000", *extra]


def _wait(process, condition, what, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if process.poll() is not None:
            raise AssertionError(f"the trainer exited (code {process.returncode}) before "
                                 f"{what}: {process.stderr.read()[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting until {what}")


def _status(run_dir):
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def test_online_checkpoints_only_changes_and_resumes_from_a_crash_in_a_same_step_save(
        kafka_broker, files, tmp_path):
    topic = kafka_broker.create_topic()
    kafka_broker.produce(topic, [_json_sample(i) for i in range(400)])
    run_dir = str(tmp_path / "run")
    command = _online(files, kafka_broker, topic, "g-same-step", run_dir,
                      "--checkpoint-every", "0.1", "--report-every", "0.2")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, CRASH_ENV: "checkpoint.renamed.same-step"})
    manager = CheckpointManager(run_dir)

    def covering_all():
        latest = manager.latest()
        return latest if latest and latest.state["offsets"] == {"0": 400} else None

    def status_after(seconds):
        status = _status(run_dir)
        return status if status and status["seconds"] > seconds else None

    try:
        first = _wait(process, covering_all, "a checkpoint covers the 400 samples")
        # nothing arrives: the checkpoint is not written again, every 0.1 s or ever (a
        # rewrite would have a new "time" in its state, and a new count in status.json)
        seen = _wait(process, lambda: status_after(0), "status.json is written")
        counts = []
        for _ in range(4):  # four status rewrites (one a second): ~30 checkpoint periods
            seen = _wait(process, lambda: status_after(seen["seconds"] + 1),
                         "the status is rewritten")
            counts.append(seen["checkpoints"])
        assert manager.all()[-1] == first and len(set(counts[1:])) == 1
        # a poll of dead letters only: new offsets, the same step, so the same step is saved
        # again; the process is killed after the new checkpoint is in place, before LATEST
        # names it
        kafka_broker.produce(topic, [(b"x", b"{broken"), (b"y", b"[]"), (b"z", b"nope")])
        process.wait(timeout=120)
        assert process.returncode == CRASH_EXIT_CODE, process.stderr.read()[-3000:]
    except BaseException:
        process.kill()
        raise
    finally:
        process.stdout.close()
        process.stderr.close()
    with open(os.path.join(manager.directory, LATEST_FILE)) as f:
        assert f.read().strip() == os.path.basename(first.path)  # LATEST was not moved yet
    latest = CheckpointManager(run_dir).latest()  # the newest complete one wins
    assert latest.step == first.step and latest.state["offsets"] == {"0": 403}

    kafka_broker.produce(topic, [_json_sample(i) for i in range(400, 600)])
    final = in_process("trainer.online", *command[3:], "--idle-exit", "3")
    assert final.returncode == 0, final.stderr[-3000:]
    summary = json.loads(final.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 200 and summary["dead_letters"] == 0  # nothing twice
    latest = CheckpointManager(run_dir).latest()
    assert latest.state["offsets"] == summary["offsets"] == {"0": 603}
    rows = native.EmbeddingStore.load(
        os.path.join(latest.path, "model", "stores", "sid")).to_numpy()
    assert sorted(rows["ids"].tolist()) == list(range(600))
    assert set(rows["update_counts"].tolist()) == {1}
    assert len(kafka_broker.consume_all(f"{topic}.dlq")) == 3  # dead-lettered once
    consumer = Consumer({"bootstrap.servers": kafka_broker.bootstrap, "group.id": "g-same-step"})
    committed = consumer.committed([TopicPartition(topic, 0)], timeout=10)
    consumer.close()
    assert committed[0].offset == 603


def _batch(schema, first, n):
    rows = [json.loads(_json_sample(i)[1]) for i in range(first, first + n)]
    table = pa.Table.from_pylist(rows).cast(schema.raw_arrow_schema())
    trees = compression.build_trees(table, schema)
    batches = list(compression.iter_batches(trees, schema, n))
    assert len(batches) == 1
    return batches[0]


def test_train_batch_predictions_are_made_before_the_update():
    schema = schemas.from_dict(SCHEMA)
    config = TrainConfig.from_dict(CONFIG)
    first, second = _batch(schema, 0, 100), _batch(schema, 100, 100)
    trained = Trainer(schema, models.MLP(hidden=(8,)), config)
    loss, probabilities, labels = trained.train_batch(first, predictions=True)
    assert isinstance(loss, float) and trained.step == 1
    assert set(probabilities) == set(labels) == {"click"}
    # the same model, same seed, not trained: it scores the batch as the step did
    fresh = Trainer(schema, models.MLP(hidden=(8,)), config)
    feed = fresh.builder.lookup(fresh.builder.prepare(first), fresh.stores, train=True)
    _, before = fresh.network.predict_step(feed.feed)
    np.testing.assert_allclose(probabilities["click"], before["click"].numpy(), rtol=1e-6)
    np.testing.assert_array_equal(labels["click"], feed.labels["click"])
    # the next step's predictions are the updated model's, not the initial one's
    _, after, _ = trained.train_batch(second, predictions=True)
    feed = fresh.builder.lookup(fresh.builder.prepare(second), fresh.stores, train=True)
    _, initial = fresh.network.predict_step(feed.feed)
    assert not np.allclose(after["click"], initial["click"].numpy(), rtol=1e-4)
    assert isinstance(trained.train_batch(second), float)  # without predictions: the loss


def test_progressive_validation_equals_the_metrics_of_the_recorded_predictions(
        kafka_broker, tmp_path):
    schema = schemas.from_dict(SCHEMA)
    topic = kafka_broker.create_topic()
    kafka_broker.produce(topic, [_json_sample(i) for i in range(3000)])
    trainer = Trainer(schema, models.MLP(hidden=(8,)), TrainConfig.from_dict(CONFIG))
    source = KafkaSampleSource(schema, kafka_broker.bootstrap, topic, group_id())
    online = OnlineTrainer(schema, trainer, source, CheckpointManager(str(tmp_path / "run")),
                           checkpoint_every=1000, max_samples=3000, unit_samples=300,
                           report_every=1000, record_predictions=True)
    try:
        summary = online.run()
    finally:
        source.close()
    assert summary["samples"] == 3000
    p = np.concatenate([p for p, _ in online.predictions])
    y = np.concatenate([y for _, y in online.predictions])
    assert len(p) == 3000 and y.mean() == pytest.approx(
        np.mean([json.loads(_json_sample(i)[1])["click"] for i in range(3000)]))
    pv = summary["pv"]
    assert pv["label"] == "click" and pv["samples"] == 3000
    assert pv["auc"] == pytest.approx(auc(p, y), abs=1e-3)      # streaming: within 1/10,000 bins
    assert pv["logloss"] == pytest.approx(logloss(p, y), rel=1e-5)
    # the users' click rates are learnt as the run goes: a constant predictor's AUC is 0.5,
    # the untrained model's log loss (every p near 0.5) log(2)
    assert 0.6 < pv["auc"] <= 1 and pv["logloss"] < np.log(2)
    # the only report was the final one: its window is the whole run
    assert pv["window"] == {k: pv[k] for k in ("auc", "logloss", "samples")}

    # the headline rate: steady only when measured over several units and most of the run
    now = time.monotonic()
    stats = online.stats
    stats.started, stats.first_unit, stats.last_unit, stats.units = now - 10, now - 9, now - 1, 9
    rate = online.summary()["rate"]
    assert rate["over"] == "steady"
    assert rate["samples_per_sec"] == pytest.approx((3000 - stats.first_unit_samples) / 8,
                                                    rel=1e-3)
    stats.first_unit, stats.last_unit, stats.units = now - 2, now - 1.8, 9   # 2% of the run
    assert online.summary()["rate"]["over"] == "whole run"
    stats.first_unit, stats.last_unit, stats.units = now - 9, now - 1, 3     # 2 units after
    short = online.summary()
    assert short["rate"] == {"samples_per_sec": short["samples_per_sec"], "over": "whole run"}


def test_a_short_run_reports_its_whole_run_rate_and_progressive_validation(
        kafka_broker, files, tmp_path):
    import tensorflow as tf

    topic = kafka_broker.create_topic()
    kafka_broker.produce(topic, [_json_sample(i) for i in range(3000)])
    run_dir = str(tmp_path / "run")
    result = subprocess.run(_online(files, kafka_broker, topic, "g-pv", run_dir,
                                    "--max-samples", "3000", "--report-every", "0.2",
                                    "--unit-samples", "1000"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line, last = result.stdout.strip().splitlines()[-2:]
    summary = json.loads(last)
    # start-up (joining the group, tracing the step) is most of a run this short: its steady
    # rate would be the speed of a few polls; the headline is the whole run's
    assert summary["rate"] == {"samples_per_sec": summary["samples_per_sec"],
                               "over": "whole run"}
    assert f"({summary['samples_per_sec']:,.0f} samples/s over the whole run" in line
    status = _status(run_dir)
    assert status["samples"] == 3000
    # a constant predictor's AUC is 0.5: the model learns the users' click rates as it goes
    assert 0.5 < status["pv"]["auc"] <= 1 and status["pv"]["samples"] == 3000
    assert 0 < status["pv"]["logloss"] < 1
    assert f"progressive validation AUC {summary['pv']['auc']:.4f}" in line
    assert "progressive validation AUC" in result.stderr  # the console report
    tags = set()
    for path in os.listdir(os.path.join(run_dir, "online")):
        for event in tf.compat.v1.train.summary_iterator(os.path.join(run_dir, "online", path)):
            tags.update(v.tag for v in event.summary.value)
    assert {"pv/auc", "pv/logloss", "pv/window_auc", "pv/window_logloss"} <= tags
