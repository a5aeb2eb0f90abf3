"""save/restore: a restored run continues exactly as the uninterrupted one."""
import json
import os

import numpy as np
import pytest

import compression
from trainer import TrainConfig, Trainer, models

CONFIG = {"batch_size": 128, "embedding": {"dim": 6, "filter": {"name": "counter", "min_count": 2}},
          "features": {"clicked_cats": {"table": "cate", "pooling": "mean"},
                       "cate_id": {"table": "cate"}}}


def store_rows(store):
    rows = store.to_numpy()
    order = np.argsort(rows["ids"])
    return {k: rows[k][order] for k in ("ids", "values", "state", "update_counts", "last_steps")}


def test_restored_run_continues_exactly(schema, trees_small, tmp_path):
    config = TrainConfig.from_dict(CONFIG)
    batches = list(compression.iter_batches(trees_small, schema, config.batch_size))
    assert len(batches) >= 8
    k = 5
    # uninterrupted: the same two fits in one trainer (a fit spreads the rows' L2 of one pass
    # over its own data, so one fit of all batches is another run)
    straight = Trainer(schema, models.MLP(hidden=(16, 8)), config)
    straight.fit(batches[:k])
    straight.fit(batches[k:])

    first = Trainer(schema, models.MLP(hidden=(16, 8)), config)
    first.fit(batches[:k])
    checkpoint = first.save(tmp_path / "ckpt")
    # the config as trained: price's transform and statistics resolved from the first batch
    trained_config = first.config
    assert trained_config.dense_config("price").mean is not None
    assert trained_config.replace(dense=()) == config
    del first
    resumed = Trainer.restore(checkpoint)
    assert resumed.step == k
    assert resumed.config == trained_config and isinstance(resumed.model, models.MLP)
    resumed.fit(batches[k:])

    assert resumed.step == straight.step == len(batches)
    assert resumed.samples == straight.samples
    for a, b in zip(resumed.network.variables, straight.network.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for a, b in zip(resumed.network.optimizer.variables, straight.network.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()))
    assert resumed.stores.keys() == straight.stores.keys()
    for table in straight.stores:
        ra, rb = store_rows(resumed.stores[table]), store_rows(straight.stores[table])
        for key in ra:
            np.testing.assert_array_equal(ra[key], rb[key], err_msg=f"{table} {key}")
        assert resumed.stores[table].stats().rejected == straight.stores[table].stats().rejected


def test_checkpoint_layout_and_errors(schema, trees_small, tmp_path):
    trainer = Trainer(schema, models.MLP(hidden=(8,)), TrainConfig(batch_size=512))
    trainer.fit(trees_small)
    path = trainer.save(tmp_path / "ckpt")
    trainer.save(path)  # overwriting an existing checkpoint replaces it
    names = sorted(os.listdir(path))
    assert names == ["dense.npz", "stores", "trainer.json"]
    assert sorted(os.listdir(os.path.join(path, "stores"))) == sorted(trainer.tables)
    with open(os.path.join(path, "trainer.json")) as f:
        state = json.load(f)
    assert state["step"] == trainer.step and state["model"]["name"] == "mlp"
    with pytest.raises(FileNotFoundError, match="no trainer checkpoint"):
        Trainer.restore(tmp_path / "missing")


def test_a_version_1_checkpoint_restores_with_that_versions_defaults(schema, trees_small,
                                                                      tmp_path):
    """Version 1 wrote no row_gradients, pooled ids lists by sum unless told and fed dense
    values raw: restoring one must keep that, not take today's defaults."""
    trainer = Trainer(schema, models.MLP(hidden=(8,)), TrainConfig(batch_size=512))
    trainer.fit(trees_small)
    path = trainer.save(tmp_path / "ckpt")
    with open(os.path.join(path, "trainer.json")) as f:
        state = json.load(f)
    state["version"] = 1
    for key in ("row_gradients", "dense", "features"):
        state["config"].pop(key)
    state["config"]["features"] = {"clicked_cats": {"table": None, "pooling": "mean"}}
    with open(os.path.join(path, "trainer.json"), "w") as f:
        json.dump(state, f)
    restored = Trainer.restore(path)
    config = restored.config
    assert config.row_gradients == "mean"
    assert config.feature("clicked_cats").pooling == "mean"  # what it said stays
    assert config.feature("clicked_items").pooling == "sum"
    price = config.dense_config("price")
    assert (price.transform, price.standardize) == ("none", False) and price.resolved
    assert restored.step == trainer.step


def test_a_fit_stopped_by_should_stop_resumes_exactly_and_checkpoints_on_schedule(
        schema, trees_small, tmp_path):
    """The one fit loop in process: ``checkpoint_dir`` gets a checkpoint before the first step
    and every ``checkpoint_every`` steps; ``should_stop`` ends the fit after the step it was
    asked at (``interrupted``), and the fit resumed from ``fit_state`` on the trainer saved
    then ends where the uninterrupted fit ends."""
    config = TrainConfig.from_dict(CONFIG)
    batches = list(compression.iter_batches(trees_small, schema, config.batch_size))
    straight = Trainer(schema, models.MLP(hidden=(16, 8)), config)
    expected = straight.fit(batches, epochs=2)
    assert expected["interrupted"] is False

    first = Trainer(schema, models.MLP(hidden=(16, 8)), config)
    stop_after = len(batches) + 2  # in the second pass
    history = first.fit(batches, epochs=2, checkpoint_dir=tmp_path / "rollback",
                        checkpoint_every=3, should_stop=lambda: first.step >= stop_after)
    assert history["interrupted"] is True and first.step == stop_after
    state = first.fit_state
    assert (state.epoch, state.batches, state.steps) == (2, 2, stop_after)
    # checkpoints at steps 0, 3, ..., 15, the end of pass 1 (16), not 18: a stop comes first
    assert len(batches) == 16
    assert Trainer.restore(tmp_path / "rollback").step == len(batches)
    first.save(tmp_path / "stopped")
    resumed = Trainer.restore(tmp_path / "stopped")
    result = resumed.fit(batches, epochs=2, resume=state)
    assert (result["steps"], result["samples"]) == (expected["steps"], expected["samples"])
    assert result["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    for a, b in zip(resumed.network.variables, straight.network.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)
    for table in straight.stores:
        ra, rb = store_rows(resumed.stores[table]), store_rows(straight.stores[table])
        for key in ("ids", "update_counts", "last_steps"):
            np.testing.assert_array_equal(ra[key], rb[key], err_msg=f"{table} {key}")
