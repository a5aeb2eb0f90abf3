"""DCN-v2 and DeepFM: structured compute equals flat, checkpoints restore them, they learn."""
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import compression
from test_exactness import SHARED_MEAN, assert_same_gradients, first_batch, small_config
from trainer import TrainConfig, Trainer, models
from trainer.metrics import auc
from trainer_data import generated

# The cross terms are polynomials of degree cross_layers + 1 in the inputs: raw prices (up to
# ~3000) make them explode, so these tests transform them as trainer/examples/mlp.yaml does.
LOG_PRICE = {"dense": {"price": {"transform": "log1p"}}}

MODELS = {
    "dcn": lambda: models.DCN(hidden=(16, 8), rank=4),
    "dcn, 1 cross layer": lambda: models.DCN(hidden=(16, 8), rank=4, cross_layers=1),
    "dcn, 3 cross layers": lambda: models.DCN(hidden=(16, 8), rank=4, cross_layers=3),
    "deepfm": lambda: models.DeepFM(hidden=(16, 8)),
}


@pytest.mark.parametrize("model, layout", [
    ("dcn", "own tables, sum"), ("dcn, 1 cross layer", "own tables, sum"),
    ("dcn, 3 cross layers", "shared table, mean"), ("deepfm", "own tables, sum"),
    ("deepfm", "shared table, mean")])
def test_structured_and_flat_first_step_equal(schema, trees_small, model, layout):
    config = small_config(**LOG_PRICE, **(SHARED_MEAN if layout != "own tables, sum" else {}))
    batch = first_batch(schema, trees_small)
    assert batch.layers[0].size < batch.num_leaves / 3  # the trees really share user nodes
    structured = Trainer(schema, MODELS[model](), config)
    flat = Trainer(schema, MODELS[model](), config.replace(compute="flat"))
    assert len(structured.network.variables) == len(flat.network.variables)
    for vs, vf in zip(structured.network.variables, flat.network.variables):
        np.testing.assert_array_equal(vs.numpy(), vf.numpy())
    gs, gf = structured.compute_gradients(batch), flat.compute_gradients(batch)
    assert_same_gradients(gs, gf)
    assert all(np.abs(g).sum() > 0 for _, g in gs["embeddings"].values())
    # every variable of the cross network / the linear part receives a gradient
    own = [g for v, g in zip(structured.network.variables, gs["dense"])
           if v.path.split("/")[-1].startswith(("cross_", "linear"))]
    assert own and all(np.abs(g).sum() > 0 for g in own)

    structured.fit([batch])
    flat.fit([batch])
    for vs, vf in zip(structured.network.variables, flat.network.variables):
        np.testing.assert_allclose(vs.numpy(), vf.numpy(), rtol=1e-5, atol=1e-7)


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_structured_equals_flat_on_random_schemas(data):
    """1 to 4 layers, string and int ids, empty lists, dense features anywhere (few examples:
    each traces four models)."""
    from sample_data import random_schemas, raw_tables

    schema = data.draw(random_schemas())
    table = data.draw(raw_tables(schema, max_rows=30))
    assume(table.num_rows > 0)
    batch = next(compression.iter_batches(compression.build_trees(table, schema), schema, 16))
    config = TrainConfig.from_dict({"batch_size": 16, "embedding": {"dim": 3}})
    for make in (lambda: models.DCN(hidden=(4,), rank=2), lambda: models.DeepFM(hidden=(4,))):
        structured = Trainer(schema, make(), config)
        flat = Trainer(schema, make(), config.replace(compute="flat"))
        assert_same_gradients(structured.compute_gradients(batch), flat.compute_gradients(batch))


@pytest.mark.parametrize("model", ["dcn", "deepfm"])
def test_auc_after_training_matches_between_structured_and_flat(schema, trees_small, model):
    test = generated(schema, 1500, seed=12).drop_columns(["p_click", "p_conversion"])
    config = small_config(batch_size=200, **LOG_PRICE)
    results = {}
    for mode in ("structured", "flat"):
        trainer = Trainer(schema, MODELS[model](), config.replace(compute=mode))
        assert trainer.fit(trees_small)["steps"] >= 10
        results[mode] = trainer.evaluate(test)
    assert results["structured"]["samples"] == results["flat"]["samples"] == 1500
    assert abs(results["structured"]["auc"] - results["flat"]["auc"]) < 0.002
    assert abs(results["structured"]["logloss"] - results["flat"]["logloss"]) < 1e-3


@pytest.mark.parametrize("make", [
    lambda: models.DCN(hidden=(12,), cross_layers=3, rank=5, activation="tanh", label="click"),
    lambda: models.DeepFM(hidden=(12, 6), activation="tanh", label="click")],
    ids=["dcn", "deepfm"])
def test_save_and_restore_give_the_same_predictions(schema, trees_small, tmp_path, make):
    model = make()
    rebuilt = models.from_spec(model.spec())
    assert type(rebuilt) is type(model) and rebuilt.spec() == model.spec()
    assert model.spec()["name"] in models.MODELS

    trainer = Trainer(schema, model, small_config(batch_size=500, **LOG_PRICE))
    trainer.fit(trees_small)
    before = trainer.predict(trees_small)
    restored = Trainer.restore(trainer.save(tmp_path / "ckpt"))
    assert type(restored.model) is type(model) and restored.model.spec() == model.spec()
    np.testing.assert_array_equal(restored.predict(trees_small), before)


def test_deepfm_needs_one_embedding_dimension(schema):
    config = small_config(tables={"age_level": {"dim": 4}})
    with pytest.raises(ValueError, match=r"DeepFM.*one embedding dimension.*dim 4: age_level"):
        Trainer(schema, models.DeepFM(hidden=(8,)), config)
    Trainer(schema, models.DCN(hidden=(8,), rank=2), config)  # DCN takes mixed dimensions


@pytest.mark.parametrize("bad", [{"rank": 0}, {"cross_layers": 0}, {"rank": 2.5},
                                 {"cross_layers": True}])
def test_dcn_rejects_a_bad_shape(bad):
    with pytest.raises(ValueError, match="DCN"):
        models.DCN(**bad)
