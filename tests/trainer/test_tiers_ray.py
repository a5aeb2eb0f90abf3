"""Memory budgets on Ray (two tiers, docs/tiered-store.md): each store shard keeps its share
of a table's budget and its own tier directory; the run equals the single process without a
budget, and a checkpoint restores (and reshards) into budgets with every row."""
import os

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import compression  # noqa: E402
from trainer import TrainConfig, models  # noqa: E402
from trainer.distributed import DistributedTrainer  # noqa: E402
from trainer.distributed.manifest import read_manifest, shard_snapshot_spec  # noqa: E402
from trainer.distributed.shard import Shard, table_specs  # noqa: E402
from ray_reference import assert_rows_equal, single_process_run  # noqa: E402
from trainer_data import generated  # noqa: E402

W, S = 2, 2
SMALL = dict(hidden=(16, 8))
COLUMNS = ("ids", "values", "state", "update_counts", "last_steps")


def config(**embedding):
    return TrainConfig.from_dict({
        "batch_size": 300, "seed": 3,
        "embedding": {"dim": 4, "optimizer": {"name": "adagrad", "lr": 0.05,
                                              "initial_accumulator": 0.1},
                      "filter": {"name": "counter", "min_count": 2},
                      "expire": {"every_steps": 3, "max_idle_steps": 2}, **embedding},
        "features": {"clicked_cats": {"table": "cate"}, "cate_id": {"table": "cate"}}})


@pytest.fixture(scope="module")
def raw(schema):
    return generated(schema, 1600, seed=5).drop_columns(["p_click", "p_conversion"])


@pytest.fixture(scope="module")
def trees(schema, raw):
    return compression.build_trees(raw, schema)


def test_budgeted_shards_equal_single_process_and_reshard_into_budgets(cluster, schema, raw,
                                                                        trees, tmp_path):
    # 8 KiB a table: 4 KiB per Ray shard, 4 rows per native shard (dim 4, Adagrad: 57 B a row)
    budgeted = config(memory_budget="8KiB", eviction="lfu")
    single, _ = single_process_run(schema, models.MLP(**SMALL), config(), trees, 1, W)
    tier_dir = tmp_path / "tiers"
    dt = DistributedTrainer(schema, models.MLP(**SMALL), budgeted, workers=W, shards=S,
                            tier_dir=str(tier_dir))
    try:
        dt.fit(trees, epochs=1)
        assert_rows_equal(dt.table_rows(), single.stores)
        stats = dt.store_stats()
        tiers = stats["tiers"]
        assert sum(t["memory_rows"] + t["disk_rows"] for t in tiers.values()) == stats["rows"]
        for table, t in tiers.items():
            assert t["budget_bytes"] == 8192 and t["lookups"] > 0, table
            assert len(single.stores[table]) == t["memory_rows"] + t["disk_rows"]
        on_disk = [t for t, s in tiers.items() if s["disk_rows"] > 0 and s["faults"] > 0]
        assert len(on_disk) >= 3, tiers
        # each shard its own directory under its table's
        for table in tiers:
            assert sorted(os.listdir(tier_dir / table)) == ["shard-0000", "shard-0001"]
        dt.save(tmp_path / "ckpt")
        dt.export(tmp_path / "export")  # snapshots of the shards' stores, rows on disk too
    finally:
        dt.close()
    # the sharded export served in a budget: each shard of each table its share
    from trainer.serving import Predictor
    from trainer import tiers as tier_stats

    whole = Predictor(tmp_path / "export")
    in_budget = Predictor(tmp_path / "export", memory_budget=96 * 1024,
                         tier_dir=str(tmp_path / "serving"))
    rows = raw.slice(0, 300)
    np.testing.assert_allclose(in_budget.predict(rows), whole.predict(rows), rtol=1e-6)
    served = {t: tier_stats.tier_stats(s) for t, s in in_budget.stores.items()}
    assert sum(s["disk_rows"] for s in served.values()) > 0
    # each table's share of the model's, over its 2 shards (rounded up: a byte at most each)
    assert 96 * 1024 - len(served) <= sum(s["budget_bytes"] for s in served.values()) \
        <= 96 * 1024 + len(served)
    assert sorted(os.listdir(tmp_path / "serving" / "user_id")) == ["shard-0000", "shard-0001"]
    # resharded into three shards, each with a third of the budget (the shard class
    # itself, as the driver's restore builds it): the same rows, a third of them on disk
    manifest = read_manifest(str(tmp_path / "ckpt"))
    specs = table_specs(budgeted, list(single.stores), 3, str(tmp_path / "tiers-again"))
    new = [Shard(i, 3, specs, restore=shard_snapshot_spec(str(tmp_path / "ckpt"), manifest,
                                                          i, 3)) for i in range(3)]
    assert_rows_equal({t: {k: np.concatenate([s.stores[t].to_numpy()[k] for s in new])
                           for k in COLUMNS} for t in single.stores}, single.stores)
    per_shard = [s.tier_stats() for s in new]
    assert sum(p[t]["disk_rows"] for p in per_shard for t in p) > 0
    assert all(p["user_id"]["budget_bytes"] == 8192 // 3 + 1 for p in per_shard)
    for table in single.stores:
        assert sorted(os.listdir(tmp_path / "tiers-again" / table)) == [
            f"shard-{i:04d}" for i in range(3)]
