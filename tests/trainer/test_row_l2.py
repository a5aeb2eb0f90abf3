"""The rows' L2 (TableConfig.l2): its schedule in a fit, its config, old checkpoints."""
import numpy as np
import pytest

import compression
import trainer.trainer as trainer_module
from trainer import TrainConfig, Trainer, models
from trainer.config import ConfigError

CONFIG = {"batch_size": 256, "embedding": {"dim": 4, "l2": 40.0},
          "tables": {"user_id": {"l2": 0}}}


def manual(schema, batches, scales):
    """The steps of a fit written out: pass k with ``row_l2_scale = scales[k]``, the dense
    network in the first pass only (the default)."""
    t = Trainer(schema, models.MLP(hidden=(8,)), TrainConfig.from_dict(CONFIG))
    for k, scale in enumerate(scales):
        t.row_l2_scale = scale
        for batch in batches:
            t._train_on(t.builder.lookup(t.prepare_numpy(batch), t.stores, train=True),
                        dense=k == 0)
    return t


def assert_same(a, b):
    for x, y in zip(a.network.variables, b.network.variables, strict=True):
        np.testing.assert_array_equal(x.numpy(), y.numpy())
    for table, store in a.stores.items():
        ids = np.sort(store.to_numpy()["ids"])
        np.testing.assert_array_equal(store.lookup(ids, train=False),
                                      b.stores[table].lookup(ids, train=False), err_msg=table)


def differ(a, b, table) -> bool:
    ids = np.sort(a.stores[table].to_numpy()["ids"])
    return not np.array_equal(a.stores[table].lookup(ids, train=False),
                              b.stores[table].lookup(ids, train=False))


def test_a_fit_spreads_one_pass_of_l2_over_its_steps(schema, trees_small, monkeypatch):
    """Data of known size: every step of every pass gets l2 * its samples / the pass's
    samples. Unknown size (CSV, JSON lines): the first pass counts them, the L2 starts with
    the second."""
    batches = list(compression.iter_batches(trees_small, schema, 256))
    n = sum(b.num_leaves for b in batches)
    known = Trainer(schema, models.MLP(hidden=(8,)), TrainConfig.from_dict(CONFIG))
    history = known.fit(trees_small, epochs=2, shuffle=False)
    assert history["samples"] == 2 * n and known.row_l2_scale == 0.0  # only inside a fit
    assert known.fit_state.pass_samples == n
    assert_same(known, manual(schema, batches, [1 / n, 1 / n]))

    monkeypatch.setattr(trainer_module, "count_samples", lambda *_: None)
    counted = Trainer(schema, models.MLP(hidden=(8,)), TrainConfig.from_dict(CONFIG))
    counted.fit(trees_small, epochs=2, shuffle=False)
    assert counted.fit_state.pass_samples == n
    assert_same(counted, manual(schema, batches, [0.0, 1 / n]))

    # the L2 changes the rows (against the same steps without it)
    none = manual(schema, batches, [0.0, 0.0])
    assert differ(known, none, "ad_id") and differ(counted, none, "ad_id")


def test_l2_is_checked_up_front_and_written_out():
    for raw, where in (({"embedding": {"l2": -1}}, "embedding.l2"),
                       ({"embedding": {"l2": "high"}}, "embedding.l2"),
                       ({"embedding": {"l2": True}}, "embedding.l2"),
                       ({"tables": {"cate": {"l2": float("nan")}}}, "tables.cate.l2")):
        with pytest.raises(ConfigError, match=f"{where}: expected a number >= 0"):
            TrainConfig.from_dict(raw)
    config = TrainConfig.from_dict(CONFIG)
    assert TrainConfig().embedding.l2 == 7.0
    assert config.table("ad_id").l2 == 40.0 and config.table("user_id").l2 == 0.0
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_a_checkpoint_from_before_l2_restores_without_it():
    written = TrainConfig.from_dict(CONFIG).to_dict()
    for raw in [written["embedding"], *written["tables"].values()]:
        del raw["l2"]
    old = TrainConfig.from_dict(trainer_module.config_before_l2(written))
    assert old.embedding.l2 == 0.0 and old.table("user_id").l2 == 0.0
    assert old.table("ad_id").l2 == 0.0
    # a config that has it is left as it is
    current = TrainConfig.from_dict(CONFIG).to_dict()
    assert trainer_module.config_before_l2(current) == current
