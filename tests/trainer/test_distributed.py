"""Distributed training on a real local Ray cluster (store shards and workers are separate
processes) equals single-process training on the union of the workers' batches."""
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")

import compression  # noqa: E402
import native  # noqa: E402
from trainer import TrainConfig, Trainer, models  # noqa: E402
from trainer import distributed  # noqa: E402
from trainer.distributed import DistributedTrainer, id_shards, tree_shards  # noqa: E402
from ray_reference import assert_rows_equal, single_process_run, sorted_rows  # noqa: E402
from trainer_data import ROOT, auc_tolerance, generated  # noqa: E402

W, S = 2, 2
SAMPLES = 2400
EPOCHS = 2
SMALL = dict(hidden=(16, 8))
MODELS = {"mlp": lambda: models.MLP(**SMALL), "esmm": lambda: models.ESMM(**SMALL)}


def config(**changes):
    base = {"batch_size": 300, "seed": 3,
            "embedding": {"dim": 4,
                          # Adagrad: a row's step stays proportional to its gradient, so float
                          # rounding stays float rounding (see test_exactness.py)
                          "optimizer": {"name": "adagrad", "lr": 0.05,
                                        "initial_accumulator": 0.1},
                          "filter": {"name": "counter", "min_count": 2},
                          "expire": {"every_steps": 3, "max_idle_steps": 2}},
            "features": {"clicked_cats": {"table": "cate"}, "cate_id": {"table": "cate"}}}
    base.update(changes)
    return TrainConfig.from_dict(base)


@pytest.fixture(scope="module")
def trees(schema):
    raw = generated(schema, SAMPLES, seed=5).drop_columns(["p_click", "p_conversion"])
    return compression.build_trees(raw, schema)


def test_placement_is_stable_and_keeps_trees_whole(schema, trees):
    ids = np.array([0, 1, 2, -1, 2**62, -(2**63)], np.int64)
    # the documented function, by hand for id 1: SplitMix64's finalizer mod S
    x = 1
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) % 2**64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) % 2**64
    x ^= x >> 31
    assert id_shards(ids, 7)[1] == x % 7
    assert id_shards(ids, 1).tolist() == [0] * 6
    counts = np.bincount(id_shards(np.arange(10000), 4), minlength=4)
    assert counts.min() > 2300  # sequential ids spread evenly
    owner = tree_shards(trees, schema, W)
    # the Beam job's root-key shard hash: its shard files split whole across workers
    from schemas.hashing import root_key_hash

    np.testing.assert_array_equal(owner, root_key_hash(trees, schema) % np.uint64(W))
    users = trees.column("user_id").to_numpy()
    for user in np.unique(users)[:50]:
        assert len(set(owner[users == user])) == 1  # all trees of a root key on one worker
    assert 0.3 < owner.mean() < 0.7


@pytest.mark.parametrize("model", ["mlp", "esmm"])
def test_two_shards_two_workers_equal_single_process(cluster, schema, trees, model, tmp_path):
    """For the MLP the distributed run also stops after the first pass, writes a checkpoint,
    and a new set of actors restored from it trains the second pass; ESMM (two heads) runs
    with row gradients of the batch mean, the MLP with per-sample sums (the default)."""
    cfg = config() if model == "mlp" else config(row_gradients="mean")
    # the MLP's distributed run makes its passes in two fits, ESMM's in one (where the dense
    # network trains in the first pass only)
    single, single_losses = single_process_run(schema, MODELS[model](), cfg, trees, EPOCHS, W,
                                               one_fit=model == "esmm")

    dt = DistributedTrainer(schema, MODELS[model](), cfg, workers=W, shards=S)
    try:
        # equal initial dense weights in every worker and the single trainer
        fresh = Trainer(schema, MODELS[model](), cfg)
        for a, b, c in zip(dt.dense_weights(0), dt.dense_weights(1), fresh.network.variables):
            np.testing.assert_array_equal(a, c.numpy())
            np.testing.assert_array_equal(b, c.numpy())
        if model == "mlp":
            dt.fit(trees, epochs=1)
            losses = list(dt.losses)
            checkpoint = tmp_path / "ckpt"
            dt.save(checkpoint)
            dt.close()
            check_manifest(checkpoint, dt.step)
            dt = DistributedTrainer.restore(checkpoint)
            assert dt.config == single.config  # the resolved dense statistics came back
            dt.fit(trees, epochs=EPOCHS - 1)
            losses += dt.losses
        else:
            dt.fit(trees, epochs=EPOCHS)
            losses = dt.losses
        assert dt.step == single.step == len(single_losses)
        assert dt.samples == single.samples == EPOCHS * SAMPLES
        np.testing.assert_allclose(losses, single_losses, rtol=1e-5)
        # the dense resolution the driver shipped equals the single trainer's
        assert dt.config.dense == single.config.dense
        for w in range(W):
            for a, b in zip(dt.dense_weights(w), single.network.variables):
                np.testing.assert_allclose(a, b.numpy(), rtol=1e-5, atol=1e-7)

        tables = dt.table_rows()
        per_shard = ray.get([s.rows.remote() for s in dt._shards])
        for table in single.stores:
            for s, rows in enumerate(per_shard):  # every id on its own shard
                assert (id_shards(rows[table]["ids"], S) == s).all()
        assert_rows_equal(tables, single.stores)
        stats, want = dt.store_stats(), single.store_stats()
        for key in ("rows", "admitted", "rejected", "expired"):
            assert stats[key] == want[key], key
        assert stats["updates"] == sum(s.stats().updates for s in single.stores.values())
        assert want["rejected"] > 0 and want["expired"] > 0  # filter and expiry did work
        assert dt.expired == single.expired

        if model == "mlp":
            ev, want_ev = dt.evaluate(trees), single.evaluate(trees)
            assert ev["samples"] == want_ev["samples"]
            np.testing.assert_allclose(ev["auc"], want_ev["auc"], rtol=1e-5)
            np.testing.assert_allclose(ev["loss"], want_ev["loss"], rtol=1e-5)
    finally:
        dt.close()
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        DistributedTrainer.restore(tmp_path / "nothing")


def check_manifest(checkpoint, step):
    """The shards' snapshots and the dense weights, then the manifest, all in one directory
    put in place atomically."""
    import json

    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["shards"] == S and manifest["passes"] == 1 and manifest["step"] == step
    assert sorted(os.listdir(checkpoint)) == ["dense.npz", "manifest.json", "shard-0000",
                                              "shard-0001"]
    assert sorted(os.listdir(checkpoint / "shard-0000")) == sorted(manifest["tables"])
    assert not [p for p in os.listdir(checkpoint.parent) if ".tmp-" in p]

def test_cli_trains_on_ray_and_explains_bad_setups(cluster, schema, trees, tmp_path, capsys,
                                                   s3_bucket):
    from compression import fs
    from trainer import train

    compression.write_trees(trees, str(tmp_path / "trees" / "part-00000.parquet"))
    # --batch-size is the global batch: 2 workers take 400 leaves each a step
    (tmp_path / "cfg.yaml").write_text("embedding: {dim: 4}\nbatch_size: 800\nlog_every: 2\n")
    base = ["--schema", os.path.join(os.path.dirname(__file__), "..", "..", "schemas",
                                     "examples", "taobao_like.yaml"),
            "--train-data", str(tmp_path / "trees" / "*.parquet"),
            "--config", str(tmp_path / "cfg.yaml"), "--hidden", "8", "--no-progress"]

    def error(args):
        with pytest.raises(SystemExit) as e:
            train.run(base + args)
        assert e.value.code == 2
        return capsys.readouterr().err

    with socket_closed() as port:  # nothing listens there
        err = error(["--out", str(tmp_path / "a"), "--workers", "2",
                     "--ray-address", f"127.0.0.1:{port}"])
        # the command itself tells it before it imports TensorFlow (or Ray): the child
        # reports at exit which of them it imported
        child = subprocess.run(
            [sys.executable, "-c", REPORT_IMPORTS, *base, "--out", str(tmp_path / "a"),
             "--workers", "2", "--ray-address", f"127.0.0.1:{port}"],
            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert f"127.0.0.1:{port}" in err and "does not answer" in err
    assert child.returncode == 2, child.stderr
    *_, said, imported = child.stderr.splitlines()
    assert said == err.strip().splitlines()[-1] and "does not answer" in said
    assert imported == "imported: tensorflow False ray False"
    assert not (tmp_path / "a").exists()
    assert "expected a number >= 1" in error(["--out", str(tmp_path / "b"), "--shards", "0"])
    assert "HOST:PORT" in error(["--out", str(tmp_path / "c"), "--ray-address", "nonsense"])

    # evaluation after every pass and every 4 steps, the best model kept, early stopping
    result = train.run(base + ["--out", str(tmp_path / "run"), "--workers", "2",
                               "--shards", "2", "--eval-data", str(tmp_path / "trees"),
                               "--epochs", "2", "--eval-every", "3", "--patience", "1",
                               "--export-dir", f"{s3_bucket}/export"])
    evaluations = result["evaluations"]
    cfg800 = TrainConfig.from_dict({"embedding": {"dim": 4}, "batch_size": 800})
    per_pass = max(len(list(distributed.worker_batches(trees, schema, cfg800, w, W, 1, True)))
                   for w in range(W))
    due = sorted({3, 6, 9, per_pass, 2 * per_pass} - set(range(2 * per_pass + 1, 10)))
    steps = [e["step"] for e in evaluations]
    assert steps == due[:len(steps)] and steps[-1] == result["steps"]
    best = max(evaluations, key=lambda e: e["auc"])
    assert result["auc"] == best["auc"] and result["checkpoint_step"] == best["step"]
    assert result["stopped_early"] == (evaluations[-1] is not best)
    manifest = __import__("json").loads((tmp_path / "run" / "checkpoint" /
                                         "manifest.json").read_text())
    assert manifest["step"] == best["step"]  # the checkpoint is the best model
    assert not (tmp_path / "run" / "rollback").exists()
    assert result["samples"] >= SAMPLES and result["eval_samples"] == SAMPLES
    assert result["workers"] == 2 and result["shards"] == 2 and result["store_rows"] > 0
    assert result["id_compression"] > 1.5  # (its AUC is the best evaluation's: above)
    assert (tmp_path / "run" / "result.json").exists()
    assert [p for p in os.listdir(tmp_path / "run" / "train") if p.startswith("events.")]
    # --export-dir on an object store: the kept (best) model, sharded (its shards written by
    # the shard actors, then published), scores the eval data as it did, read from there
    from trainer.metrics import auc
    from trainer.serving import Predictor

    assert fs.download_published(f"{s3_bucket}/export", str(tmp_path / "export"))

    export = __import__("json").loads((tmp_path / "export" / "export.json").read_text())
    assert export["step"] == best["step"] and export["shards"] == 2
    flat = compression.flatten(trees, schema)
    scores = Predictor(f"{s3_bucket}/export").predict(flat)
    labels = flat.column("click").to_numpy()
    # the workers scored their batches in their processes, the export and the merged
    # trainer score here in other batches: the same scores to float rounding only
    tolerance = auc_tolerance(scores, labels)
    assert auc(scores, labels) == pytest.approx(result["auc"], abs=tolerance)
    # the run as one in-process Trainer (what trainer.online --init-from starts from): its
    # shards merged, it scores as the export does
    merged = Trainer.restore_run(tmp_path / "run")
    assert merged.step == best["step"] and merged.store_rows() == export_rows(tmp_path / "export")
    assert merged.evaluate(trees)["auc"] == pytest.approx(result["auc"], abs=tolerance)

    # the CLI's 2-shard checkpoint restored into 3 shards: every id looks up the same row
    checkpoint = tmp_path / "run" / "checkpoint"
    saved = {}
    for shard in ("shard-0000", "shard-0001"):
        for table in os.listdir(checkpoint / shard):
            rows = native.EmbeddingStore.load(checkpoint / shard / table).to_numpy()
            ids, values = saved.get(table, (np.zeros(0, np.int64), np.zeros((0, 4))))
            saved[table] = (np.concatenate([ids, rows["ids"]]),
                            np.concatenate([values, rows["values"]]))
    with DistributedTrainer.restore(checkpoint, shards=3, workers=1) as dt:
        assert dt.step == result["checkpoint_step"]
        for table, (ids, values) in saved.items():
            unseen = -(2**62) + np.arange(10) * 1_000_003  # no row: zeros
            got = dt.lookup(table, np.concatenate([ids, unseen]))
            np.testing.assert_array_equal(got[:len(ids)], values, err_msg=table)
            assert not got[len(ids):].any()


def test_resharding_keeps_the_counter_filters_pending_counts(cluster, schema, trees,
                                                             tmp_path):
    """A 2-shard run with a counter filter (min_count 3) checkpointed after its first pass,
    while many ids are seen once or twice and have no row, restored into 1 and into 3 shards
    and trained on: every id is admitted when the single store admits it, so the rows equal
    single-process training's (an un-resharded continuation equals it too, above)."""
    cfg = config(embedding={"dim": 4, "optimizer": {"name": "adagrad", "lr": 0.05,
                                                    "initial_accumulator": 0.1},
                            "filter": {"name": "counter", "min_count": 3}})
    single, single_losses = single_process_run(schema, MODELS["mlp"](), cfg, trees, EPOCHS, W,
                                               one_fit=False)
    checkpoint = tmp_path / "ckpt"
    with DistributedTrainer(schema, MODELS["mlp"](), cfg, workers=W, shards=S) as dt:
        dt.fit(trees, epochs=1)
        losses = list(dt.losses)
        dt.save(checkpoint)
    pending, counts = {}, []
    for table in single.stores:
        states = [native.EmbeddingStore.load(checkpoint / f"shard-{s:04d}" / table)
                  .filter_state() for s in range(S)]
        pending[table] = np.concatenate([st["ids"] for st in states])
        counts += [st["counts"] for st in states]
    assert set(np.concatenate(counts).tolist()) == {1, 2}
    # ids the single store admits in the second pass after sightings in the first: without
    # their counts the resharded run would admit them later, or never
    assert sum(np.isin(pending[t], store.to_numpy()["ids"]).sum()
               for t, store in single.stores.items()) > 50
    for shards in (1, 3):
        # (2 workers + 3 shards on the fixture's 4 CPUs: half a CPU each)
        with DistributedTrainer.restore(checkpoint, shards=shards, actor_cpus=0.5) as dt:
            dt.fit(trees, epochs=EPOCHS - 1)
            np.testing.assert_allclose(losses + dt.losses, single_losses, rtol=1e-5)
            for a, b in zip(dt.dense_weights(0), single.network.variables):
                np.testing.assert_allclose(a, b.numpy(), rtol=1e-5, atol=1e-7)
            assert_rows_equal(dt.table_rows(), single.stores, f"{shards} shards: ")
            assert dt.store_rows() == sum(len(st) for st in single.stores.values())


def test_reshard_two_into_one_and_three_moves_every_row_exactly(tmp_path):
    """The shard class itself (no Ray): rows, optimizer state, counts and steps move, from
    stores that exported a delta for serving before the snapshot (their rows unchanged since
    are not in any later delta), and again from a store resharded before."""
    from trainer.distributed.shard import Shard as shard_class
    store = native.StoreConfig(dim=3, optimizer=native.Adagrad(0.1),
                               entry_filter=native.CounterFilter(2))
    specs = {"a": {"store": store, "expire": None}, "b": {"store": store, "expire": None}}
    old = [shard_class(i, 2, specs) for i in range(2)]
    ids = np.arange(-400, 400) * 7919
    for step in range(1, 4):
        for shard in old:
            own = ids[id_shards(ids, 2) == shard.index]
            for table in specs:
                shard.stores[table].lookup_unique(own[:200 + 60 * step])
                shard.stores[table].apply_gradients(
                    own, np.full((len(own), 3), 0.1 * step, np.float32), step)
            if step == 2:
                shard.export_delta(str(tmp_path / "deltas"))
    dirs = [str(tmp_path / f"shard-{s.index}") for s in old]
    for shard, directory in zip(old, dirs):
        shard.save(directory)
    new = []
    for shards in (1, 3, 2):
        if shards == 2:  # the 3 shards, resharded from the 2 old ones, into 2 again
            dirs = [str(tmp_path / f"resharded-{s.index}") for s in new]
            for shard, directory in zip(new, dirs):
                shard.save(directory)
        new = [shard_class(j, shards, specs, dirs) for j in range(shards)]
        for table in specs:
            want = sorted_rows({k: np.concatenate([s.stores[table].to_numpy()[k] for s in old])
                                for k in ("ids", "values", "state", "update_counts",
                                          "last_steps")})
            parts = [s.stores[table].to_numpy() for s in new]
            for j, part in enumerate(parts):
                assert (id_shards(part["ids"], shards) == j).all()
            got = sorted_rows({k: np.concatenate([p[k] for p in parts]) for k in want})
            assert len(want["ids"]) > 100
            for key in want:
                np.testing.assert_array_equal(got[key], want[key], err_msg=key)
            assert {s.stores[table].stats().global_step for s in new} == {3}
            # the counter filter's pending sightings go with their ids
            want = [s.stores[table].filter_state() for s in old]
            got = [s.stores[table].filter_state() for s in new]
            for j, state in enumerate(got):
                assert (id_shards(state["ids"], shards) == j).all()
            want_ids = np.concatenate([w["ids"] for w in want])
            got_ids = np.concatenate([g["ids"] for g in got])
            assert len(want_ids) > 50
            np.testing.assert_array_equal(np.sort(got_ids), np.sort(want_ids))
            np.testing.assert_array_equal(
                np.concatenate([g["counts"] for g in got])[np.argsort(got_ids)],
                np.concatenate([w["counts"] for w in want])[np.argsort(want_ids)])


# runs trainer.train's main with the arguments that follow and, at exit, says whether
# TensorFlow and Ray were imported
REPORT_IMPORTS = """
import atexit, sys
atexit.register(lambda: print("imported: tensorflow", "tensorflow" in sys.modules, "ray",
                              "ray" in sys.modules, file=sys.stderr, flush=True))
from trainer.train import main
sys.exit(main(sys.argv[1:]))
"""


class socket_closed:
    """A loopback port with nothing listening on it."""

    def __enter__(self):
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return self.port

    def __exit__(self, *exc):
        return False



@pytest.fixture(scope="module")
def cli_files(trees, tmp_path_factory):
    """The module's trees as a file, a small config and the arguments every CLI run shares."""
    base = tmp_path_factory.mktemp("cli")
    compression.write_trees(trees, str(base / "trees" / "part-00000.parquet"))
    (base / "cfg.yaml").write_text("embedding: {dim: 4}\nbatch_size: 100\n")
    args = ["--schema", os.path.join(ROOT, "schemas", "examples", "taobao_like.yaml"),
            "--train-data", base / "trees" / "*.parquet", "--config", base / "cfg.yaml",
            "--hidden", "8", "--workers", W, "--shards", S]
    return base, [str(a) for a in args]


def staged_leftovers(directory):
    return [p for p in os.listdir(directory) if ".tmp-" in p or ".old-" in p]


def test_cli_writes_the_run_directory_whole_or_not_at_all(cluster, cli_files, tmp_path):
    """As in process: through a temporary directory next to --out, renamed into place at the
    end; --overwrite replaces a directory whole; a run that fails after training started
    leaves no run directory (and a failed --overwrite leaves the old one as it was)."""
    from trainer import train

    base, args = cli_files
    run = tmp_path / "run"
    run.mkdir()
    (run / "stray.txt").write_text("from another run")
    result = train.run(args + ["--out", str(run), "--overwrite", "--no-progress"])
    assert result["run_dir"] == str(run) and result["steps"] > 0
    assert sorted(os.listdir(run)) == ["checkpoint", "result.json", "train"]
    assert json.loads((run / "result.json").read_text()) == result
    assert read_json(run / "checkpoint" / "manifest.json")["step"] == result["steps"]
    assert staged_leftovers(tmp_path) == []

    # evaluation data the trainer cannot use (no such columns), found after the first pass
    # (on 1 worker x 1 shard: what is under test is the run directory, not the sharding)
    pq.write_table(pa.table({"x": [1, 2, 3]}), tmp_path / "bad-eval.parquet")
    bad = args + ["--eval-data", str(tmp_path / "bad-eval.parquet"), "--no-progress",
                  "--workers", "1", "--shards", "1"]
    with pytest.raises(Exception):  # noqa: B017 - which error is not the point here
        train.run(bad + ["--out", str(tmp_path / "failed")])
    assert not (tmp_path / "failed").exists()
    with pytest.raises(Exception):  # noqa: B017
        train.run(bad + ["--out", str(run), "--overwrite"])
    assert sorted(os.listdir(run)) == ["checkpoint", "result.json", "train"]
    assert json.loads((run / "result.json").read_text()) == result
    assert staged_leftovers(tmp_path) == []


def export_rows(directory) -> int:
    """Rows of every table of a sharded export."""
    return sum(len(native.EmbeddingStore.load(path))
               for path in glob.glob(os.path.join(directory, "stores", "*", "shard-*")))


def read_json(path):
    with open(path) as f:
        return json.load(f)
