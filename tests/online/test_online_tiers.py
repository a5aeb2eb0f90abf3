"""trainer.online with a memory budget (two tiers, docs/tiered-store.md): the run trains the
model a single process without a budget trains on the same steps (its step log replayed),
restarts from its checkpoint into the budget, and reports rows per tier in its summary,
status.json and /metrics."""
import json
import os
import types
import urllib.request

import numpy as np
import yaml
from commands import in_process

import compression
import schemas
from compression.messages import decode_json_samples
from online_samples import CONFIG, SCHEMA, sample_message
from trainer import tiers
from trainer.checkpoints import CheckpointManager

import native  # noqa: E402

CONFIG_OPTIMIZER = native.Adagrad(0.3)
BUDGET = 4096  # over 2 tables of 41-byte rows (dim 2, Adagrad): ~49 rows of sid in memory


def in_memory(budget: int) -> int:
    """Rows a budget holds (each of the 16 store shards its share, whole rows)."""
    return 16 * (budget // 16 // tiers.memory_row_bytes(2, CONFIG_OPTIMIZER))


def replay(run_dir, by_offset):
    """A single-process Trainer without a budget that trained the batches of the step log
    (one worker: a unit's samples compressed at once, cut into batches), step by step."""
    from trainer import Trainer, models
    from trainer.config import TrainConfig

    schema = schemas.from_dict(SCHEMA)
    single = Trainer(schema, models.MLP(), TrainConfig.from_dict(CONFIG))
    assert single.tier_dir is None
    with open(os.path.join(run_dir, "steps.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    batches, pending = [], 0
    for step in steps:
        (worker,) = step["workers"]
        pending += 1
        if worker["ranges"]:
            (first, end), = worker["ranges"].values()
            table, _ = decode_json_samples([by_offset[o] for o in range(first, end)], schema)
            cut = list(compression.iter_batches(compression.build_trees(table, schema), schema,
                                                CONFIG["batch_size"]))
            assert len(cut) == pending
            batches += cut
            pending = 0
    for number, batch in enumerate(batches):
        if number == 0:
            single.calibrate_output(batch)
        single.train_batch(batch)
    return single


def assert_same_rows(model, single, exact=True):
    """The same rows; ``exact`` False: values and optimizer state to float rounding (the
    Ray engine's gradients cross processes and are summed on the shard)."""
    for table, store in single.stores.items():
        want, got = store.to_numpy(), model.stores[table].to_numpy()
        wo, go = np.argsort(want["ids"]), np.argsort(got["ids"])
        for key in ("ids", "values", "state", "update_counts", "last_steps"):
            if exact or key not in ("values", "state"):
                np.testing.assert_array_equal(got[key][go], want[key][wo],
                                              err_msg=f"{table} {key}")
            else:
                np.testing.assert_allclose(got[key][go], want[key][wo], rtol=1e-5, atol=1e-7,
                                           err_msg=f"{table} {key}")


def test_online_with_a_memory_budget(kafka_broker, tmp_path):
    from trainer import Trainer
    from trainer.online_report import serve_metrics

    topic = kafka_broker.create_topic()
    messages = [sample_message(sid) for sid in range(600)]
    by_offset = dict(zip(kafka_broker.produce(topic, messages), (v for _, v in messages)))
    (tmp_path / "schema.yaml").write_text(yaml.safe_dump(SCHEMA))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    run_dir = tmp_path / "run"
    command = ["trainer.online", "--schema", tmp_path / "schema.yaml", "--config",
               tmp_path / "config.yaml", "--bootstrap-servers", kafka_broker.bootstrap,
               "--topic", topic, "--group", "g-tiers", "--run-dir", run_dir,
               "--unit-samples", "200", "--report-every", "100", "--checkpoint-every", "600",
               "--step-log", "--memory-budget", str(BUDGET), "--tier-dir",
               tmp_path / "tiers", "-X", "max.poll.interval.ms=8000"]
    first = in_process(*command, "--max-samples", "600")
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert json.loads((run_dir / "status.json").read_text()) == summary
    sid = summary["tiers"]["sid"]
    # in memory: the budget's rows plus the batches pinned while they are looked up,
    # trained and prefetched
    assert sid["memory_rows"] + sid["disk_rows"] == 600, sid
    assert sid["memory_rows"] <= in_memory(BUDGET // 2) + 3 * CONFIG["batch_size"], sid
    # every sample id is new: rows go to disk and none comes back
    assert sid["evicted_to_disk"] >= sid["disk_rows"] > 0 and sid["faults"] == 0
    assert sid["budget_bytes"] == BUDGET // 2 and sid["hit_rate"] == 1.0
    uid = summary["tiers"]["uid"]
    assert uid["memory_rows"] + uid["disk_rows"] == 37 and uid["faults"] > 0  # users return

    latest = CheckpointManager(str(run_dir)).latest()
    model = Trainer.restore(os.path.join(latest.path, "model"))
    assert model.config.memory_budget_bytes == BUDGET  # the run's budget is in its config
    assert_same_rows(model, replay(run_dir, by_offset))

    # restarted from its checkpoint into the budget (another one): trains the rest
    more = [sample_message(sid) for sid in range(600, 900)]
    kafka_broker.produce(topic, more)
    second = in_process(*command[:-6], "--memory-budget", "8KiB", "--tier-dir",
                        tmp_path / "tiers", "-X", "max.poll.interval.ms=8000",
                        "--max-samples", "300")
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    sid = summary["tiers"]["sid"]
    assert sid["memory_rows"] + sid["disk_rows"] == 900, sid
    assert sid["memory_rows"] <= in_memory(4096) + 3 * CONFIG["batch_size"], sid
    assert sid["budget_bytes"] == 4096
    rows = Trainer.restore(os.path.join(CheckpointManager(str(run_dir)).latest().path,
                                        "model")).stores["sid"].to_numpy()
    assert sorted(rows["ids"].tolist()) == list(range(900))
    assert set(rows["update_counts"].tolist()) == {1}  # every sample trained once

    # /metrics: the summary's tiers, per table
    run = types.SimpleNamespace(snapshot=summary, timing_observers=[])
    server = serve_metrics(run, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics") as r:
            text = r.read().decode()
    finally:
        server.shutdown()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line.startswith("prefixrec_online_tier_")}
    assert values['prefixrec_online_tier_disk_rows{table="sid"}'] == sid["disk_rows"]
    assert values['prefixrec_online_tier_faults_total{table="sid"}'] == sid["faults"]
    assert values['prefixrec_online_tier_hit_ratio{table="sid"}'] == sid["hit_rate"]
    assert tiers.TIER_METRICS  # every family named there is served
    for _, name, kind, _ in tiers.TIER_METRICS:
        suffix = "_total" if kind == "counter" else ""
        assert f'prefixrec_online_{name}{suffix}{{table="uid"}}' in values, name


def test_online_on_ray_with_a_memory_budget(kafka_broker, tmp_path):
    """The Ray engine (1 worker x 1 shard): the shard's stores in the budget, the summary's
    tiers summed from the shard, the model its step log's replay."""
    ray = __import__("pytest").importorskip("ray")
    from trainer import Trainer

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        topic = kafka_broker.create_topic()
        messages = [sample_message(sid) for sid in range(400)]
        by_offset = dict(zip(kafka_broker.produce(topic, messages), (v for _, v in messages)))
        (tmp_path / "schema.yaml").write_text(yaml.safe_dump(SCHEMA))
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(CONFIG))
        run_dir = tmp_path / "run"
        done = in_process(
            "trainer.online", "--schema", tmp_path / "schema.yaml", "--config",
            tmp_path / "config.yaml", "--bootstrap-servers", kafka_broker.bootstrap,
            "--topic", topic, "--group", "g-tiers-ray", "--run-dir", run_dir,
            "--unit-samples", "200", "--report-every", "100", "--checkpoint-every", "600",
            "--step-log", "--memory-budget", str(BUDGET), "--tier-dir", tmp_path / "tiers",
            "--workers", "1", "--shards", "1", "--ray-address",
            ray.get_runtime_context().gcs_address, "-X", "max.poll.interval.ms=8000",
            "--max-samples", "400")
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        assert summary["engine"] == "ray"
        assert json.loads((run_dir / "status.json").read_text()) == summary
        sid = summary["tiers"]["sid"]
        assert sid["memory_rows"] + sid["disk_rows"] == 400 and sid["disk_rows"] > 0, sid
        assert sid["budget_bytes"] == BUDGET // 2
        assert sorted(os.listdir(tmp_path / "tiers" / "sid")) == ["shard-0000"]
        latest = CheckpointManager(str(run_dir)).latest()
        as_run = tmp_path / "as-run"
        as_run.mkdir()
        (as_run / "checkpoint").symlink_to(os.path.join(latest.path, "model"))
        assert_same_rows(Trainer.restore_run(as_run), replay(run_dir, by_offset), exact=False)
    finally:
        if started:
            ray.shutdown()
