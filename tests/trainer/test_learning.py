"""The models learn the generator's planted signal, and the trainer reads every input kind."""
import numpy as np
import pyarrow.parquet as pq
import pytest

import compression
from trainer import TrainConfig, Trainer, models
from trainer.metrics import StreamingAUC, auc, logloss

from trainer_data import generated


@pytest.fixture(scope="module")
def learn_data(schema):
    """24,000 samples to train on and the next 6,000 (in time order) to test on."""
    data = generated(schema, 30000, seed=21)
    return data.slice(0, 24000).drop_columns(["p_click", "p_conversion"]), data.slice(24000)


# Small data learns fast only with large steps.
FAST = {"batch_size": 500, "embedding": {"dim": 8, "optimizer": {"name": "adagrad", "lr": 1.0}},
        "dense_optimizer": {"name": "adam", "lr": 0.01}}


def test_mlp_learns_the_planted_signal(schema, learn_data):
    train, test = learn_data
    trainer = Trainer(schema, models.MLP(hidden=(32, 16)), TrainConfig.from_dict(FAST))
    history = trainer.fit(train, epochs=3)
    assert history["samples"] == 72000 and history["steps"] >= 144
    result = trainer.evaluate(test.drop_columns(["p_click", "p_conversion"]))
    bayes = auc(test["p_click"].to_numpy(), test["click"].to_numpy())
    assert result["auc"] > 0.6, (result, bayes)
    assert result["auc"] < bayes + 0.02


def test_esmm_and_din_learn(schema, learn_data):
    train, test = learn_data
    test = test.drop_columns(["p_click", "p_conversion"])
    config = TrainConfig.from_dict({**FAST, "features": {"clicked_cats": {"table": "cate"},
                                                         "cate_id": {"table": "cate"}}})
    esmm = Trainer(schema, models.ESMM(hidden=(16, 8)), config)
    esmm.fit(train, epochs=2)
    result = esmm.evaluate(test)
    assert set(result) >= {"auc/click", "auc/conversion", "logloss/conversion"}
    assert result["auc/click"] > 0.6
    assert esmm.predict(test).shape == (6000, 2)
    din = Trainer(schema, models.DIN(hidden=(16, 8), attention_hidden=(8,)), config)
    din.fit(train, epochs=2)
    assert din.evaluate(test)["auc"] > 0.6


def test_reads_tree_parquet_raw_parquet_and_csv(schema, raw_small, trees_small, tmp_path):
    compression.write_trees(trees_small, str(tmp_path / "trees" / "part-0.parquet"))
    pq.write_table(raw_small, tmp_path / "raw.parquet")
    config = TrainConfig.from_dict({"batch_size": 300, "embedding": {"dim": 4}})
    trainer = Trainer(schema, models.MLP(hidden=(8,)), config)
    from_trees = trainer.predict(str(tmp_path / "trees" / "*.parquet"))
    from_table = trainer.predict(trees_small)
    from_raw = trainer.predict(str(tmp_path / "raw.parquet"))
    assert len(from_trees) == len(from_raw) == raw_small.num_rows
    np.testing.assert_array_equal(from_trees, from_table)
    # raw files are compressed on the fly, into the same trees
    np.testing.assert_allclose(np.sort(from_raw), np.sort(from_trees), rtol=1e-6)
    history = trainer.fit(str(tmp_path / "raw.parquet"))
    assert history["samples"] == raw_small.num_rows


def test_metrics():
    labels = np.array([0, 0, 1, 1, 0, 1])
    scores = np.array([0.1, 0.4, 0.35, 0.8, 0.4, 0.4])
    # pairs (pos, neg): 0.35>0.1, 0.35<0.4 x2, 0.8 > all, 0.4 vs 0.1 win, vs 0.4 ties x2
    assert auc(scores, labels) == pytest.approx((1 + 3 + 1 + 0.5 + 0.5) / 9)
    assert np.isnan(auc([0.1, 0.2], [1, 1]))
    assert logloss([0.5, 0.5], [0, 1]) == pytest.approx(np.log(2))
    streaming = StreamingAUC(bins=1000)
    rng = np.random.default_rng(0)
    y = rng.random(20000) < 0.3
    p = np.clip(0.3 + 0.2 * y + rng.normal(0, 0.2, 20000), 0, 1)
    streaming.add(p[:5000], y[:5000])
    streaming.add(p[5000:], y[5000:])
    assert streaming.result() == pytest.approx(auc(p, y), abs=2e-3)
