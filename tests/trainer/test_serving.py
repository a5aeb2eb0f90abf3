"""export -> Predictor: the same scores as the trainer, and embeddings that follow deltas."""
import numpy as np
import pytest

from trainer import TrainConfig, Trainer, models
from trainer.serving import Predictor, export_increment


def test_export_predict_and_follow_deltas(schema, raw_small, trees_small, tmp_path):
    config = TrainConfig.from_dict({"batch_size": 250, "embedding": {"dim": 4},
                                    "features": {"clicked_cats": {"table": "cate"},
                                                 "cate_id": {"table": "cate"}}})
    trainer = Trainer(schema, models.ESMM(hidden=(8,)), config)
    trainer.fit(trees_small)
    export = trainer.export(tmp_path / "export")
    samples = raw_small.slice(0, 400)
    expected = trainer.predict(samples)          # tree order

    predictor = Predictor(export, batch_size=150)
    unlabelled = samples.drop_columns(list(schema.labels))
    scores = predictor.predict(unlabelled)       # input order
    assert scores.shape == (400, 2)
    np.testing.assert_allclose(np.sort(scores[:, 0]), np.sort(expected[:, 0]), rtol=1e-5)
    np.testing.assert_allclose(np.sort(scores[:, 1]), np.sort(expected[:, 1]), rtol=1e-5)
    reversed_scores = predictor.predict(unlabelled.take(np.arange(399, -1, -1)))
    np.testing.assert_allclose(reversed_scores, scores[::-1], rtol=1e-6)
    rows = unlabelled.slice(0, 3).to_pylist()
    np.testing.assert_allclose(predictor.predict(rows), scores[:3], rtol=1e-6)

    # the trainer goes on; the predictor follows its embeddings through deltas
    trainer.fit(trees_small)
    trainer.export_delta(tmp_path / "deltas")
    assert predictor.update(tmp_path / "deltas") == len(trainer.tables)
    assert predictor.update(tmp_path / "deltas") == 0        # nothing new
    for table, store in trainer.stores.items():
        ids = np.sort(store.to_numpy()["ids"])
        np.testing.assert_array_equal(predictor.stores[table].lookup(ids, train=False),
                                      store.lookup(ids, train=False), err_msg=table)


def test_export_increment_carries_embeddings_and_dense_weights(schema, raw_small, trees_small,
                                                             tmp_path):
    trainer = Trainer(schema, models.MLP(hidden=(8,)),
                      TrainConfig.from_dict({"batch_size": 250, "embedding": {"dim": 4}}))
    batches = list(__import__("compression").iter_batches(trees_small, schema, 250))
    for batch in batches[:3]:
        trainer.train_batch(batch)
    assert export_increment(trainer, tmp_path / "export")["full"] == str(tmp_path / "export")
    predictor = Predictor(tmp_path / "export")
    samples = raw_small.slice(0, 200)
    for batch in batches[3:]:
        trainer.train_batch(batch)
    before = predictor.predict(samples)
    export_increment(trainer, tmp_path / "export")
    assert predictor.update() == len(trainer.tables)
    after = predictor.predict(samples)
    assert not np.allclose(before, after)
    np.testing.assert_allclose(np.sort(after), np.sort(trainer.predict(samples)), rtol=1e-5)


def test_predictor_needs_an_export(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a trainer export"):
        Predictor(tmp_path)
