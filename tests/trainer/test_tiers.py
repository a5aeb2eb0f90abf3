"""Memory budgets in trainer.train (two tiers, docs/tiered-store.md): a run whose tables are
4x their budget equals the unbounded run; budget settings are checked up front, naming the
table and the fix."""
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from commands import in_process

import compression
import native
from trainer import TrainConfig, Trainer, tiers
from trainer.config import ConfigError

from trainer_data import SCHEMA_PATH

ADAGRAD = {"name": "adagrad", "lr": 0.05, "initial_accumulator": 0.1}
COMPARED = ("ids", "values", "state", "update_counts", "last_steps")  # not the wall clock


def sorted_rows(store) -> dict:
    rows = store.to_numpy()
    order = np.argsort(rows["ids"], kind="stable")
    return {k: rows[k][order] for k in COMPARED}


def assert_same_tables(a: Trainer, b: Trainer) -> None:
    assert a.stores.keys() == b.stores.keys()
    for table in a.stores:
        ra, rb = sorted_rows(a.stores[table]), sorted_rows(b.stores[table])
        for key in COMPARED:
            np.testing.assert_array_equal(ra[key], rb[key], err_msg=f"{table} {key}")


def train(tmp_path, name, config: dict, *extra):
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(config))
    out = in_process("trainer.train", "--schema", SCHEMA_PATH,
                     "--train-data", tmp_path / "trees" / "*.parquet",
                     "--eval-data", tmp_path / "eval.parquet", "--config", path,
                     "--hidden", "8", "--batch-size", "200", "--epochs", "2",
                     "--patience", "0", "--no-progress", "--out", tmp_path / name, *extra)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture(scope="module")
def data(tmp_path_factory, raw_small, trees_small):
    root = tmp_path_factory.mktemp("tiers")
    compression.write_trees(trees_small, str(root / "trees" / "part-00000.parquet"))
    pq.write_table(raw_small.slice(0, 600), root / "eval.parquet")
    return root


def test_train_with_tables_4x_their_budget_equals_the_unbounded_run(data, tmp_path):
    for name in ("trees", "eval.parquet"):
        os.symlink(data / name, tmp_path / name)
    base = {"embedding": {"dim": 4, "optimizer": ADAGRAD}, "log_every": 5}
    plain, _ = train(tmp_path, "plain", base, "--export-dir", tmp_path / "export-plain")
    unbounded = Trainer.restore_run(tmp_path / "plain")
    # each table's budget a quarter of its rows (at least one row per store shard: the
    # smallest tables stay whole in memory)
    row_bytes = tiers.memory_row_bytes(4, unbounded.config.embedding.optimizer)
    budgets = {t: max(tiers.min_budget(4, unbounded.config.embedding.optimizer),
                      len(s) * row_bytes // 4) for t, s in unbounded.stores.items()}
    big = [t for t, s in unbounded.stores.items() if len(s) >= 4 * 64]
    assert len(big) >= 2, {t: len(s) for t, s in unbounded.stores.items()}
    config = {**base, "tables": {t: {"memory_budget": b, "eviction": "lru" if i % 2 else "lfu"}
                                 for i, (t, b) in enumerate(budgets.items())}}
    tiered, _ = train(tmp_path, "tiered", config, "--export-dir", tmp_path / "export-tiered")

    assert tiered["auc"] == pytest.approx(plain["auc"], abs=1e-9)
    assert tiered["logloss"] == pytest.approx(plain["logloss"], rel=1e-6)
    for key in ("samples", "steps", "store_rows", "admitted", "rejected"):
        assert tiered[key] == plain[key], key
    assert "tiers" not in plain
    for table in big:  # rows went to disk and came back (the last two batches' rows are
        stats = tiered["tiers"][table]  # pinned in memory, so memory holds more than 1/4)
        assert stats["disk_rows"] > 0 and stats["evicted_to_disk"] > 0, (table, stats)
        assert stats["memory_rows"] + stats["disk_rows"] == len(unbounded.stores[table])
        # read back from disk: by the pipeline's prefetch, or by lookups (evaluation's)
        assert stats["prefetched"] + stats["faults"] > 0 and 0 < stats["hit_rate"] < 1
        assert stats["hit_rate"] == pytest.approx(
            1 - (stats["prefetched"] + stats["faults"]) / stats["lookups"])
        assert stats["disk_bytes"] > 0 and stats["budget_bytes"] == budgets[table]
    assert_same_tables(Trainer.restore_run(tmp_path / "tiered"), unbounded)
    # the serving exports (snapshots of stores with rows on disk) hold the same rows
    for table in budgets:
        a = native.EmbeddingStore.load(tmp_path / "export-tiered" / "stores" / table)
        b = native.EmbeddingStore.load(tmp_path / "export-plain" / "stores" / table)
        ra, rb = sorted_rows(a), sorted_rows(b)
        for key in COMPARED:
            np.testing.assert_array_equal(ra[key], rb[key], err_msg=f"{table} {key}")
    # the disk tiers lived next to the run directory and went with the command
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "eval.parquet", "export-plain", "export-tiered", "plain", "plain.yaml", "tiered",
        "tiered.yaml", "trees"]
    assert not (tmp_path / "tiered" / "tiers").exists()


@pytest.mark.parametrize("config, message", [
    ({"tables": {"user_id": {"memory_budget": "lots"}}},
     "tables.user_id.memory_budget: expected a size like 512MiB"),
    ({"tables": {"user_id": {"memory_budget": 1000}}},
     "tables.user_id.memory_budget: 1000 bytes is below one row per store shard"),
    ({"tables": {"user_id": {"eviction": "fifo"}}},
     "tables.user_id.eviction: 'fifo' is not an eviction policy; use one of lru, lfu"),
    ({"tables": {"user_id": {"memory_budget": "1MiB", "max_rows": 100}}},
     "tables.user_id: max_rows and memory_budget together are not supported yet"),
    ({"memory_budget": "-3GiB"}, "memory_budget: expected a size like 512MiB"),
])
def test_bad_budget_settings_name_the_table_and_the_fix(config, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        TrainConfig.from_dict(config)


def test_model_budget_split_over_tables_by_row_bytes(schema):
    config = TrainConfig.from_dict({
        "memory_budget": "8MiB", "embedding": {"dim": 4},
        "tables": {"user_id": {"memory_budget": "2MiB"}, "ad_id": {"dim": 12}}})
    tables = config.check(schema)
    budgets = config.table_budgets(tables)
    assert budgets["user_id"] == 2 * 2**20
    rest = {t: b for t, b in budgets.items() if t != "user_id"}
    assert sum(rest.values()) <= 6 * 2**20 and sum(rest.values()) > 6 * 2**20 - len(rest)
    # the same number of memory rows each: ad_id's rows (dim 12) cost 2.4x a dim-4 row
    per_row = {t: b / config.table(t).memory_row_bytes for t, b in rest.items()}
    assert max(per_row.values()) - min(per_row.values()) < 1
    # over 4 shards a quarter each
    assert config.table_budgets(tables, 4)["user_id"] == 2**19
    # round trip (what checkpoints keep): sizes as bytes
    assert TrainConfig.from_dict(config.to_dict()) == config
    # a model budget whose share cannot hold a row per store shard names the table
    tight = TrainConfig.from_dict({"memory_budget": "16KiB", "embedding": {"dim": 4}})
    with pytest.raises(ConfigError, match=r"table \w+: its share of memory_budget is \d+ "
                                          r"bytes, below one row per store shard"):
        tight.check(schema)
    with pytest.raises(ConfigError, match="memory_budget: 1048576 bytes, but the tables' own "
                                          "budgets take 2097152 .user_id."):
        TrainConfig.from_dict({"memory_budget": "1MiB", "tables": {
            "user_id": {"memory_budget": "2MiB"}}}).check(schema)


def test_bad_tier_dir_is_a_usage_error_before_any_work(data, tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    for tier_dir, message in ((tmp_path / "a-file" / "tiers", "tier_dir: cannot create"),
                              ("s3://bucket/tiers", "is not a local directory")):
        config = tmp_path / "budget.yaml"
        config.write_text(json.dumps({"memory_budget": "4MiB", "tier_dir": str(tier_dir)}))
        out = in_process("trainer.train", "--schema", SCHEMA_PATH, "--train-data",
                         data / "eval.parquet", "--config", config, "--out", tmp_path / "run")
        assert out.returncode == 2, out.stderr
        assert message in out.stderr
        assert not (tmp_path / "run").exists()
    # a budget too small for its shards on Ray: named before Ray starts
    config.write_text(json.dumps({"tables": {"user_id": {"memory_budget": 4000}}}))
    out = in_process("trainer.train", "--schema", SCHEMA_PATH, "--train-data",
                     data / "eval.parquet", "--config", config, "--out", tmp_path / "run",
                     "--shards", "2")
    assert out.returncode == 2
    assert ("table user_id: tables.user_id.memory_budget is 4000 bytes over 2 shards"
            in out.stderr)


def test_size_strings():
    assert tiers.parse_size("512MiB", "k") == 512 * 2**20
    assert tiers.parse_size("1.5GB", "k") == 1_500_000_000
    assert tiers.parse_size("800k", "k") == 800_000
    assert tiers.parse_size(12345, "k") == 12345
    for bad in ("12 parsecs", "", True, 0, "0B"):
        with pytest.raises(tiers.BudgetError, match="k: expected a size"):
            tiers.parse_size(bad, "k")
