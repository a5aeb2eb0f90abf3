"""Faults and bad setups of distributed training on a real local Ray cluster: a store shard and
a worker killed with SIGKILL mid-run (the run rolls back to its last checkpoint and ends equal to
an uninterrupted one), a sharded run's serving export, and clear errors for bad setups."""
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import compression  # noqa: E402
from trainer import TrainConfig, models  # noqa: E402
from trainer.distributed import DistributedTrainer  # noqa: E402
from trainer.live import LiveModel  # noqa: E402
from trainer.serving import Predictor  # noqa: E402
from ray_reference import (assert_rows_equal, single_process_run,  # noqa: E402
                           union_batches)
from trainer_data import ROOT, SCHEMA_PATH, generated  # noqa: E402

W, S = 2, 2
SAMPLES = 2400
EPOCHS = 2
CHECKPOINT_EVERY = 3
# step -> the actor the driver kills (SIGKILL of its process) after that step: a shard in the
# middle of the first pass, a worker at a checkpoint step in the second (where the pipeline
# drains, so its death may only show when the next call reaches the process Ray restarted)
KILLS = {4: ("shards", 1), 6: ("workers", 0)}


def config():
    return TrainConfig.from_dict({
        "batch_size": 300, "seed": 3,
        "embedding": {"dim": 4,
                      "optimizer": {"name": "adagrad", "lr": 0.05, "initial_accumulator": 0.1},
                      "filter": {"name": "counter", "min_count": 2},
                      "expire": {"every_steps": 3, "max_idle_steps": 2}},
        "features": {"clicked_cats": {"table": "cate"}, "cate_id": {"table": "cate"}}})


def model():
    return models.MLP(hidden=(16, 8))


@pytest.fixture(scope="module")
def raw(schema):
    return generated(schema, SAMPLES, seed=5).drop_columns(["p_click", "p_conversion"])


@pytest.fixture(scope="module")
def trees(schema, raw):
    return compression.build_trees(raw, schema)


@pytest.fixture(scope="module")
def runs(cluster, schema, trees, tmp_path_factory):
    """A 2 x 2 run killed twice (a shard, then a worker) and the single-process run on the
    same batches; the distributed trainer stays open for the tests that follow."""
    tmp = tmp_path_factory.mktemp("faults")
    cfg = config()
    single, single_losses = single_process_run(schema, model(), cfg, trees, EPOCHS, W)

    dt = DistributedTrainer(schema, model(), cfg, workers=W, shards=S, max_restarts=2)
    killed, pending = [], dict(KILLS)

    def kill(trainer, loss):
        target = pending.pop(trainer.step, None)
        if target is not None:
            kind, index = target
            pid = trainer.actor_pids()[kind][index]
            killed.append((kind, index, pid))
            os.kill(pid, signal.SIGKILL)

    try:
        history = dt.fit(trees, epochs=EPOCHS, callback=kill,
                         checkpoint_dir=tmp / "rollback", checkpoint_every=CHECKPOINT_EVERY)
        yield {"dt": dt, "single": single, "single_losses": single_losses, "history": history,
               "killed": killed, "tmp": tmp}
    finally:
        dt.close()


def test_killed_shard_and_worker_roll_back_and_finish_equal(runs):
    dt, single, history = runs["dt"], runs["single"], runs["history"]
    assert [(k, i) for k, i, _ in runs["killed"]] == list(KILLS.values())
    recoveries = history["recoveries"]
    assert len(recoveries) == 2
    for recovery, failed in zip(recoveries, KILLS):
        # back to the last checkpoint: every CHECKPOINT_EVERY steps or a pass's end
        assert recovery["failed_at_step"] >= failed
        assert recovery["rolled_back_to_step"] < failed
        assert recovery["failed_at_step"] - recovery["rolled_back_to_step"] <= CHECKPOINT_EVERY
    pids = dt.actor_pids()
    for kind, index, pid in runs["killed"]:
        assert pids[kind][index] != pid  # Ray restarted the process

    assert dt.step == single.step and dt.samples == single.samples == EPOCHS * SAMPLES
    assert history["samples"] == EPOCHS * SAMPLES and history["steps"] == single.step
    np.testing.assert_allclose(dt.losses, runs["single_losses"], rtol=1e-5)
    for w in range(W):
        for a, b in zip(dt.dense_weights(w), single.network.variables):
            np.testing.assert_allclose(a, b.numpy(), rtol=1e-5, atol=1e-7)
    assert_rows_equal(dt.table_rows(), single.stores)
    stats, want = dt.store_stats(), single.store_stats()
    for key in ("rows", "admitted", "rejected", "expired"):
        assert stats[key] == want[key], key
    assert dt.expired == single.expired and want["expired"] > 0

    # the last checkpoint (the end of the run) holds every worker's input position
    manifest = json.loads((runs["tmp"] / "rollback" / "manifest.json").read_text())
    assert manifest["step"] == dt.step and manifest["passes"] == EPOCHS
    assert manifest["positions"] is None  # the pass was finished


def test_sharded_export_predicts_as_single_process_and_follows_deltas(runs, schema, raw,
                                                                      trees):
    """Per-shard snapshots and per-shard deltas: a Predictor on a 2-shard run's export scores
    as one on the single-process run's export."""
    dt, single, tmp = runs["dt"], runs["single"], runs["tmp"]
    dt.export_increment(tmp / "export-dt")
    single.export(tmp / "export-single")
    meta = json.loads((tmp / "export-dt" / "export.json").read_text())
    assert meta["shards"] == S
    assert sorted(os.listdir(tmp / "export-dt" / "stores" / "cate")) == ["shard-0000",
                                                                        "shard-0001"]
    samples = raw.slice(0, 500).drop_columns(list(schema.labels))
    sharded, reference = Predictor(tmp / "export-dt"), Predictor(tmp / "export-single")
    want = reference.predict(samples)
    np.testing.assert_allclose(sharded.predict(samples), want, rtol=1e-5)
    live = LiveModel(tmp / "export-dt")  # the service's model follows a sharded export too

    # one more pass on both; the sharded export follows through per-shard deltas
    cfg = config()
    dt.fit(trees, epochs=1)
    # a new fit: its first pass trains the dense network again
    single.config = single.config.replace(dense_optimizer=cfg.dense_optimizer)
    single.fit(union_batches(schema, cfg, trees, EPOCHS + 1, W), shuffle=False)
    dt.export_increment(tmp / "export-dt")
    assert sharded.update() == S * len(dt.tables)
    assert sorted(os.listdir(tmp / "export-dt" / "versions" / "v00000001" / "cate")) == [
        "shard-0000", "shard-0001"]
    after = sharded.predict(samples)
    assert not np.allclose(after, want)
    assert live.poll() == 1 and live.problem is None
    np.testing.assert_allclose(live.predict(samples)[0].reshape(after.shape), after, rtol=1e-5)
    # a reload of the full export (SIGHUP) rebases every shard back to version 0, then the
    # per-shard deltas of version 1 apply again
    assert live.poll(reload=True) == 1 and live.problem is None
    assert live.last_reload["mode"] == "rebase" and live.last_reload["rows"] > 0
    np.testing.assert_allclose(live.predict(samples)[0].reshape(after.shape), after, rtol=1e-5)
    live.close()
    single.export(tmp / "export-single-2")
    np.testing.assert_allclose(after, Predictor(tmp / "export-single-2").predict(samples),
                               rtol=1e-5)


def test_a_sharded_exports_predictor_loads_without_ray(runs, raw, tmp_path):
    """Serving places ids on shards with trainer.distributed.placement (numpy only): a
    Predictor over a Ray run's export neither imports Ray nor needs a cluster. (Before the
    next test, which leaves a shard restarted without its rows.)"""
    runs["dt"].export_increment(tmp_path / "export")
    samples = tmp_path / "samples.parquet"
    import pyarrow.parquet as pq

    pq.write_table(raw.slice(0, 50), samples)
    code = ("import sys, json; from trainer.serving import Predictor; "
            f"p = Predictor({str(tmp_path / 'export')!r}).predict({str(samples)!r}); "
            "print(json.dumps([len(p), 'ray' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [50, False]


def test_actor_death_without_a_checkpoint_and_incompatible_checkpoints(runs, schema, trees,
                                                                       tmp_path):
    dt = runs["dt"]
    checkpoint = tmp_path / "ckpt"
    dt.save(checkpoint)

    def altered(name, change):
        copy = tmp_path / name
        shutil.copytree(checkpoint, copy)
        manifest = json.loads((copy / "manifest.json").read_text())
        change(copy, manifest)
        (copy / "manifest.json").write_text(json.dumps(manifest))
        return copy

    def drop_feature(copy, manifest):
        manifest["schema"]["layers"][0]["features"].pop()

    with pytest.raises(ValueError, match=r"another schema .*features only in this trainer: "
                                         r"user\.clicked_brands"):
        dt.load(altered("schema", drop_feature))

    def other_lr(copy, manifest):
        manifest["config"]["embedding"]["optimizer"]["lr"] = 0.5

    with pytest.raises(ValueError, match=r"another config \(differs in: embedding\)"):
        dt.load(altered("config", other_lr))

    def other_model(copy, manifest):
        with np.load(copy / "dense.npz") as npz:
            arrays = {k: npz[k] for k in npz.files}
        arrays["model/0000"] = np.zeros((3, 3), np.float32)
        np.savez(copy / "dense.npz", **arrays)

    with pytest.raises(ValueError, match=r"does not fit this model \(variable .* has shape "
                                         r"\(3, 3\) in the checkpoint"):
        dt.load(altered("model", other_model))

    single_dir = tmp_path / "single"
    runs["single"].save(single_dir)
    with pytest.raises(FileNotFoundError, match="single-process checkpoint"):
        DistributedTrainer.restore(single_dir)

    dt.load(checkpoint)  # still loads its own checkpoint
    # an actor death with no checkpoint of this fit to roll back to: a clear error
    victim = dt.actor_pids()["shards"][0]

    def kill(trainer, loss):
        if trainer.step == checkpoint_step + 1:
            os.kill(victim, signal.SIGKILL)

    checkpoint_step = dt.step
    with pytest.raises(RuntimeError, match="no checkpoint of this fit to roll back to; pass "
                                           "checkpoint_dir="):
        dt.fit(trees, epochs=1, callback=kill)


def test_more_shards_than_rows_is_refused(schema):
    cfg = TrainConfig.from_dict({"embedding": {"dim": 4, "max_rows": 3}})
    with pytest.raises(ValueError, match=r"shards: 4 shards for table .* at most 3 rows "
                                         r"\(max_rows\); use at most 3 shards"):
        DistributedTrainer(schema, model(), cfg, workers=1, shards=4)


def test_cli_ray_address_that_does_not_answer(trees, tmp_path):
    """In a child process, as a user runs it: exit 2, one line, no traceback, quickly."""
    compression.write_trees(trees, str(tmp_path / "trees" / "part-00000.parquet"))
    command = [sys.executable, "-m", "trainer.train", "--schema", SCHEMA_PATH,
               "--train-data", str(tmp_path / "trees"), "--out", str(tmp_path / "run"),
               "--workers", "2", "--no-progress", "--ray-address", "127.0.0.1:1"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Ray address '127.0.0.1:1' does not answer" in errors[0], \
        done.stderr
    assert not (tmp_path / "run").exists()

