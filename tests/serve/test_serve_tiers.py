"""Serving a model larger than its memory budget (two tiers, docs/tiered-store.md): the
Predictor, the live model and the service answer from memory and disk what an all-in-memory
copy answers, follow published versions, and show where the rows are in /metrics."""

import os

import numpy as np
import pyarrow as pa
import pytest
from commands import in_process
from service import Service

import compression
import schemas
from trainer import models, tiers
from trainer.config import ConfigError, TrainConfig
from trainer.live import LiveModel
from trainer.serving import Predictor, export_increment, serving_budgets
from trainer.trainer import Trainer

SCHEMA = schemas.from_dict({"name": "tier_serve", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"},
                                                  {"name": "age", "kind": "id"}]},
    {"name": "sample", "key": ["item"], "features": [{"name": "item", "kind": "id"}]}]})
CONFIG = TrainConfig.from_dict({"batch_size": 500, "seed": 3, "threads": 1,
                                "embedding": {"dim": 4, "optimizer": {"name": "adagrad",
                                                                      "lr": 0.2}}})
ROW = tiers.memory_row_bytes(4, CONFIG.embedding.optimizer)


def samples(n, seed):
    rng = np.random.default_rng(seed)
    uid, item = rng.integers(0, 1500, n), rng.integers(0, 2500, n)
    return [{"uid": int(u), "age": int(u % 5), "item": int(i), "click": float(c)}
            for u, i, c in zip(uid, item, rng.random(n) < 0.3)]


def train(trainer, seed, n=3000):
    trees = compression.build_trees(pa.Table.from_pylist(samples(n, seed)), SCHEMA)
    for batch in compression.iter_batches(trees, SCHEMA, 500):
        trainer.train_batch(batch)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    trainer = Trainer(SCHEMA, models.MLP(hidden=(8,)), CONFIG)
    train(trainer, 0)
    export = tmp_path_factory.mktemp("tiers") / "export"
    export_increment(trainer, export)
    return trainer, export


def quarter(trainer) -> int:
    """A budget of a quarter of the model's rows."""
    return trainer.store_rows() * ROW // 4


def probe(seed=9, n=400):
    return [{k: s[k] for k in ("uid", "age", "item")} for s in samples(n, seed)]


def test_predictor_with_the_model_4x_its_budget_answers_as_all_in_memory(trained, tmp_path):
    trainer, export = trained
    assert trainer.store_rows() > 3000
    whole = Predictor(export)
    budgeted = Predictor(export, memory_budget=quarter(trainer), tier_dir=str(tmp_path))
    for seed in (1, 2, 3):  # other ids each time: rows come back from disk
        rows = probe(seed)
        np.testing.assert_allclose(budgeted.predict(rows), whole.predict(rows), rtol=1e-6)
    stats = {t: tiers.tier_stats(s) for t, s in budgeted.stores.items()}
    assert stats["item"]["disk_rows"] > stats["item"]["memory_rows"] > 0, stats
    assert stats["item"]["faults"] > 0 and 0 < stats["item"]["hit_rate"] < 1
    assert sum(s["memory_rows"] + s["disk_rows"] for s in stats.values()) == \
        trainer.store_rows()
    # split in proportion to the tables' snapshot bytes (a table's share of its rows the
    # same), a small table at least one row per store shard
    budgets = {t: s["budget_bytes"] for t, s in stats.items()}
    sizes = {t: os.path.getsize(os.path.join(export, "stores", t, "store.snapshot"))
             for t in budgets}
    assert budgets["item"] > budgets["uid"] > budgets["age"]
    least = tiers.min_budget(4, CONFIG.embedding.optimizer)
    if budgets["age"] == least:  # the small table got its least, the others share the rest
        left = quarter(trainer) - least
        assert budgets["item"] == left * sizes["item"] // (sizes["item"] + sizes["uid"])
    else:
        assert budgets["item"] == quarter(trainer) * sizes["item"] // sum(sizes.values())
    assert quarter(trainer) - 3 <= sum(budgets.values()) <= quarter(trainer)
    # a budget that cannot hold one row per store shard names the flag and the size
    with pytest.raises(ConfigError, match=r"--memory-budget 1000 B cannot hold one row per "
                                          r"store shard of every table; raise it to at least"):
        Predictor(export, memory_budget=1000, tier_dir=str(tmp_path))


def test_live_model_follows_versions_with_rows_on_disk(trained, tmp_path):
    trainer, export = trained
    live = LiveModel(export, memory_budget=quarter(trainer), tier_dir=str(tmp_path / "tiers"))
    try:
        reference = Predictor(export)
        rows = probe(5)
        got, info = live.predict(rows)
        np.testing.assert_allclose(got[:, 0], reference.predict(rows), rtol=1e-6)
        train(trainer, 1)  # a new version: its deltas go into stores with rows on disk
        assert export_increment(trainer, export)["version"] == 1
        assert reference.update() == len(trainer.tables)
        assert live.poll() == 1
        live.poll()  # the next poll applies the version's deltas to the stores themselves
        for seed in (5, 6):
            got, info = live.predict(probe(seed))
            assert info["version"] == 1
            np.testing.assert_allclose(got[:, 0], reference.predict(probe(seed)), rtol=1e-6)
        stats = tiers.tier_stats(live.version.base.stores["item"])
        assert stats["disk_rows"] > 0 and stats["faults"] > 0
    finally:
        live.close()
    # the tiers were in their own directories under --tier-dir
    assert all(p.name.startswith("store-") for p in (tmp_path / "tiers" / "item").iterdir())


def test_service_with_a_memory_budget_answers_and_reports_tiers(trained, tmp_path):
    trainer, export = trained
    rows = probe(7, 200)
    reference = Predictor(export)
    reference.update()  # the versions published so far, as the service follows them
    want = reference.predict(rows)
    with Service(export, "--memory-budget", str(quarter(trainer)), "--tier-dir",
                 tmp_path / "tiers", "--threads", "1") as service:
        status, answer = service.predict({"samples": rows})
        assert status == 200
        np.testing.assert_allclose([p["click"] for p in answer["predictions"]], want,
                                   rtol=1e-6)
        assert service.metric('prefixrec_serve_tier_disk_rows{table="item"}') > 0
        assert service.metric('prefixrec_serve_tier_faults_total{table="item"}') > 0
        assert 0 < service.metric('prefixrec_serve_tier_hit_ratio{table="item"}') < 1
        budgets = serving_budgets(str(export), CONFIG, ("uid", "age", "item"), None,
                                  quarter(trainer))
        assert service.metric('prefixrec_serve_tier_budget_bytes{table="uid"}') == \
            budgets["uid"]


@pytest.mark.parametrize("args, message", [
    (["--tier-dir", "/tmp"], "--tier-dir holds the rows beyond --memory-budget"),
    (["--memory-budget", "lots"], "--memory-budget: expected a size like 512MiB"),
    (["--memory-budget", "1GiB", "--tier-dir", "s3://bucket/tiers"],
     "--tier-dir: s3://bucket/tiers is not a local directory"),
])
def test_bad_budget_flags_are_usage_errors(trained, args, message):
    _, export = trained
    out = in_process("trainer.serve", "--export-dir", export, "--port", "0", *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
