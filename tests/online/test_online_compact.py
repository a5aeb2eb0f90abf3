"""trainer.online with compact tables: a cold table (users the filter has not admitted read a
shared bucket row) and a multi-hash table train exactly what a single process trains on the
same steps (both engines), restart from their checkpoint (also after a kill in the middle of
saving the cold table), and their export serves new users the bucket rows."""
import json
import os

import numpy as np
import pyarrow as pa
import pytest
import yaml
from commands import in_process

import compression
import schemas
from online_samples import CONFIG, SCHEMA, sample_message
from trainer.checkpoints import CheckpointManager
from trainer.compact import cold_buckets



def replay(run_dir, by_offset, config):
    """A single-process Trainer that trained the batches of the run's step log (one unit's
    samples compressed at once, cut into batches), step by step, as trainer.online did."""
    from compression.messages import decode_json_samples
    from trainer import Trainer, models
    from trainer.config import TrainConfig

    schema = schemas.from_dict(SCHEMA)
    single = Trainer(schema, models.MLP(), TrainConfig.from_dict(config))
    with open(os.path.join(run_dir, "steps.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    batches = []
    for step in steps:
        (worker,) = step["workers"]
        if worker["ranges"]:
            (first, end), = worker["ranges"].values()
            table, _ = decode_json_samples([by_offset[o] for o in range(first, end)], schema)
            batches += compression.iter_batches(compression.build_trees(table, schema), schema,
                                                config["batch_size"])
    for number, batch in enumerate(batches):
        if number == 0:
            single.calibrate_output(batch)
        single.train_batch(batch)
    return single

COMPACT = {**CONFIG, "tables": {
    "uid": {"filter": {"name": "counter", "min_count": 3}, "cold_buckets": 4},
    "sid": {"multi_hash": {"buckets": [3, 5], "combine": "sum"}}}}


def test_online_with_a_cold_table_and_a_multi_hash_table(kafka_broker, tmp_path):
    from trainer import Trainer
    from trainer.serving import Predictor

    topic = kafka_broker.create_topic()
    messages = [sample_message(sid) for sid in range(600)]
    by_offset = dict(zip(kafka_broker.produce(topic, messages), (v for _, v in messages)))
    (tmp_path / "schema.yaml").write_text(yaml.safe_dump(SCHEMA))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(COMPACT))
    run_dir = tmp_path / "run"
    command = ["trainer.online", "--schema", tmp_path / "schema.yaml", "--config",
               tmp_path / "config.yaml", "--bootstrap-servers", kafka_broker.bootstrap,
               "--topic", topic, "--group", "g-compact", "--run-dir", run_dir,
               "--unit-samples", "200", "--report-every", "100", "--checkpoint-every", "600",
               "--step-log", "--export-dir", tmp_path / "export", "--export-every", "600",
               "-X", "max.poll.interval.ms=8000"]
    first = in_process(*command, "--max-samples", "600")
    assert first.returncode == 0, first.stderr[-3000:]
    model = Trainer.restore(os.path.join(CheckpointManager(str(run_dir)).latest().path,
                                         "model"))
    assert list(model.stores) == ["uid", "uid__cold", "sid"]
    assert len(model.stores["sid"]) <= 8 and 0 < len(model.stores["uid__cold"]) <= 4
    assert len(model.stores["uid"]) == 37  # every user seen 3 times by now
    # the model is the one a single process trains on the run's steps, to the bit
    single = replay(run_dir, by_offset, COMPACT)
    assert list(single.stores) == list(model.stores)
    for table, store in single.stores.items():
        want, got = store.to_numpy(), model.stores[table].to_numpy()
        wo, go = np.argsort(want["ids"]), np.argsort(got["ids"])
        for key in ("ids", "values", "state", "update_counts", "last_steps"):
            np.testing.assert_array_equal(got[key][go], want[key][wo], err_msg=f"{table} {key}")

    # its export answers users never seen with their bucket rows, as the trainer does
    new = pa.table({"uid": np.arange(1000, 1040), "sid": np.arange(40) * 7,
                    "click": np.zeros(40, np.float32)})
    assert not model.stores["uid"].contains(new["uid"].to_numpy()).any()
    served = Predictor(tmp_path / "export").predict(new.drop_columns(["click"]))
    np.testing.assert_allclose(np.sort(served), np.sort(model.predict(new)), rtol=1e-5)
    buckets = cold_buckets(new["uid"].to_numpy(), "uid", 4)
    assert len(set(buckets.tolist())) > 1 and np.abs(
        model.stores["uid__cold"].lookup(buckets, train=False)).sum() > 0

    # restarted from its checkpoint: 30 new users, each read its bucket until admitted
    kafka_broker.produce(topic, [(str(u).encode(), json.dumps(
        {"uid": u, "sid": 600 + k, "click": float(k % 2)}).encode())
        for k, u in enumerate(np.repeat(np.arange(100, 130), 2).tolist())])
    second = in_process(*command, "--max-samples", "60")
    assert second.returncode == 0, second.stderr[-3000:]
    after = Trainer.restore(os.path.join(CheckpointManager(str(run_dir)).latest().path,
                                         "model"))
    assert len(after.stores["uid"]) == 37  # seen twice: none admitted
    cold = after.stores["uid__cold"].to_numpy()
    before = model.stores["uid__cold"].to_numpy()
    trained = cold_buckets(np.arange(100, 130), "uid", 4)
    for bucket in set(trained.tolist()):
        assert cold["update_counts"][cold["ids"] == bucket] > \
            before["update_counts"][before["ids"] == bucket].sum(), bucket


def test_killed_while_saving_the_cold_table_the_restarted_run_trains_exactly_once(
        kafka_broker, tmp_path):
    import subprocess
    import sys

    from native import crash_points
    from trainer import Trainer

    topic = kafka_broker.create_topic()
    messages = [sample_message(sid) for sid in range(600)]
    by_offset = dict(zip(kafka_broker.produce(topic, messages), (v for _, v in messages)))
    (tmp_path / "schema.yaml").write_text(yaml.safe_dump(SCHEMA))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(COMPACT))
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "trainer.online", "--schema", str(tmp_path / "schema.yaml"),
               "--config", str(tmp_path / "config.yaml"), "--bootstrap-servers",
               kafka_broker.bootstrap, "--topic", topic, "--group", "g-compact-crash",
               "--run-dir", str(run_dir), "--unit-samples", "100", "--report-every", "100",
               "--checkpoint-every", "600", "--step-log", "-X", "max.poll.interval.ms=8000"]
    env = {k: v for k, v in os.environ.items() if k != crash_points.ENV}
    first = subprocess.run(command + ["--max-samples", "200"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    offset = CheckpointManager(str(run_dir)).latest().state["offsets"]["0"]
    # killed in its final checkpoint once uid__cold's snapshot (the second) is in place and
    # before sid's: the checkpoint is not named, the one before it stays the latest
    killed = subprocess.run(command + ["--max-samples", "200"],
                            env={**env, crash_points.ENV: "store.snapshot.renamed:2"},
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == crash_points.EXIT_CODE, killed.stderr[-3000:]
    assert CheckpointManager(str(run_dir)).latest().state["offsets"]["0"] == offset
    rest = subprocess.run(command + ["--max-samples", str(600 - offset)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert rest.returncode == 0, rest.stderr[-3000:]
    latest = CheckpointManager(str(run_dir)).latest()
    assert latest.state["offsets"]["0"] == 600 and latest.state["samples"] == 600
    model = Trainer.restore(os.path.join(latest.path, "model"))
    single = replay(run_dir, by_offset, COMPACT)  # the step log keeps the steps it restored
    for table, store in single.stores.items():
        want, got = store.to_numpy(), model.stores[table].to_numpy()
        wo, go = np.argsort(want["ids"]), np.argsort(got["ids"])
        for key in ("ids", "values", "state", "update_counts", "last_steps"):
            np.testing.assert_array_equal(got[key][go], want[key][wo], err_msg=f"{table} {key}")


def test_online_on_ray_with_a_cold_table_and_a_multi_hash_table(kafka_broker, tmp_path):
    """The Ray engine (1 worker x 2 shards): the shards send which users have a row with
    their rows, the worker routes the others to their buckets; the model is its step log's
    replay in one process."""
    ray = pytest.importorskip("ray")
    from trainer import Trainer

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)  # 1 worker + 2 shards
    try:
        topic = kafka_broker.create_topic()
        messages = [sample_message(sid) for sid in range(400)]
        by_offset = dict(zip(kafka_broker.produce(topic, messages), (v for _, v in messages)))
        (tmp_path / "schema.yaml").write_text(yaml.safe_dump(SCHEMA))
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(COMPACT))
        run_dir = tmp_path / "run"
        done = in_process(
            "trainer.online", "--schema", tmp_path / "schema.yaml", "--config",
            tmp_path / "config.yaml", "--bootstrap-servers", kafka_broker.bootstrap,
            "--topic", topic, "--group", "g-compact-ray", "--run-dir", run_dir,
            "--unit-samples", "200", "--report-every", "100", "--checkpoint-every", "600",
            "--step-log", "--workers", "1", "--shards", "2", "--ray-address",
            ray.get_runtime_context().gcs_address, "-X", "max.poll.interval.ms=8000",
            "--max-samples", "400")
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1])["engine"] == "ray"
        latest = CheckpointManager(str(run_dir)).latest()
        as_run = tmp_path / "as-run"
        as_run.mkdir()
        (as_run / "checkpoint").symlink_to(os.path.join(latest.path, "model"))
        model = Trainer.restore_run(as_run)
        single = replay(run_dir, by_offset, COMPACT)
        assert 0 < len(model.stores["uid__cold"]) <= 4 and len(model.stores["sid"]) <= 8
        for table, store in single.stores.items():
            want, got = store.to_numpy(), model.stores[table].to_numpy()
            wo, go = np.argsort(want["ids"]), np.argsort(got["ids"])
            for key in ("ids", "update_counts", "last_steps"):
                np.testing.assert_array_equal(got[key][go], want[key][wo],
                                              err_msg=f"{table} {key}")
            for key in ("values", "state"):  # gradients summed on the shards: to rounding
                np.testing.assert_allclose(got[key][go], want[key][wo], rtol=1e-5, atol=1e-7,
                                           err_msg=f"{table} {key}")
    finally:
        if started:
            ray.shutdown()
