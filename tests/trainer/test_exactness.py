"""Structured and flat compute give the same numbers; so do split and unsplit batches."""
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import compression
from trainer import TrainConfig, Trainer, models

SMALL = dict(hidden=(16, 8))
SHARED_MEAN = {"embedding": {"dim": 6},
               "features": {"clicked_cats": {"table": "cate", "pooling": "mean"},
                            "cate_id": {"table": "cate"},
                            "clicked_items": {"pooling": "mean"}}}


# Adagrad, not the default per-row Adam, on the store: Adam's first step is about
# lr * sign(g), which turns float rounding of gradients near zero into full-size differences
# of the updated rows; Adagrad's step stays proportional to the gradient.
ADAGRAD = {"name": "adagrad", "lr": 0.05, "initial_accumulator": 0.1}


def small_config(**changes):
    base = {"batch_size": 256, "embedding": {"dim": 6, "optimizer": ADAGRAD}}
    for key, value in changes.items():
        base[key] = {**base[key], **value} if key == "embedding" else value
    return TrainConfig.from_dict(base)


MODELS = {
    "mlp": lambda: models.MLP(**SMALL),
    "din": lambda: models.DIN(behaviour="clicked_cats", query="cate_id", attention_hidden=(8,),
                              **SMALL),
    "esmm": lambda: models.ESMM(**SMALL),
}


def first_batch(schema, trees, size=256):
    return next(compression.iter_batches(trees, schema, size))


def assert_same_gradients(a, b, loss_rtol=2e-6):
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=loss_rtol)
    assert len(a["dense"]) == len(b["dense"])
    for ga, gb in zip(a["dense"], b["dense"]):
        np.testing.assert_allclose(ga, gb, rtol=1e-4, atol=1e-7)
    assert a["embeddings"].keys() == b["embeddings"].keys()
    for table, (ids_a, ga) in a["embeddings"].items():
        ids_b, gb = b["embeddings"][table]
        oa, ob = np.argsort(ids_a), np.argsort(ids_b)
        np.testing.assert_array_equal(ids_a[oa], ids_b[ob])
        np.testing.assert_allclose(ga[oa], gb[ob], rtol=1e-4, atol=1e-8, err_msg=table)


@pytest.mark.parametrize("model, layout", [
    ("mlp", "own tables, sum"), ("mlp", "shared table, mean"), ("din", "shared table, mean"),
    ("esmm", "own tables, sum")])
def test_structured_and_flat_first_step_equal(schema, trees_small, model, layout):
    config = small_config(**(SHARED_MEAN if layout != "own tables, sum" else {}))
    batch = first_batch(schema, trees_small)
    assert batch.layers[0].size < batch.num_leaves / 3  # the trees really share user nodes
    structured = Trainer(schema, MODELS[model](), config)
    flat = Trainer(schema, MODELS[model](), config.replace(compute="flat"))
    for vs, vf in zip(structured.network.variables, flat.network.variables):
        np.testing.assert_array_equal(vs.numpy(), vf.numpy())
    gs, gf = structured.compute_gradients(batch), flat.compute_gradients(batch)
    assert_same_gradients(gs, gf)
    # Gradients are not zero by construction: every table receives some.
    assert all(np.abs(g).sum() > 0 for _, g in gs["embeddings"].values())

    # The first real step (dense optimizer, store update) lands on the same parameters.
    structured.fit([batch])
    flat.fit([batch])
    for vs, vf in zip(structured.network.variables, flat.network.variables):
        np.testing.assert_allclose(vs.numpy(), vf.numpy(), rtol=1e-5, atol=1e-7)
    for table, store in structured.stores.items():
        ids, _ = gs["embeddings"][table]
        np.testing.assert_allclose(store.lookup(ids, train=False),
                                   flat.stores[table].lookup(ids, train=False),
                                   rtol=1e-5, atol=1e-7, err_msg=table)


def test_a_split_tree_gives_the_gradient_of_the_whole(schema, trees_small):
    config = small_config()
    trainer = Trainer(schema, models.MLP(**SMALL), config)
    whole = first_batch(schema, trees_small, 300)
    # cut inside the tree of the user that holds leaf 150: that user goes into both halves
    cut = 150
    roots = whole.leaf_ancestors(0)
    assert roots[cut - 1] == roots[cut]
    left, right = whole.slice_leaves(0, cut), whole.slice_leaves(cut, whole.num_leaves)
    assert left.layers[0].size + right.layers[0].size == whole.layers[0].size + 1
    g = trainer.compute_gradients(whole)
    gl, gr = trainer.compute_gradients(left), trainer.compute_gradients(right)
    wl, wr = cut / whole.num_leaves, 1 - cut / whole.num_leaves   # losses are leaf means
    np.testing.assert_allclose(g["loss"], wl * gl["loss"] + wr * gr["loss"], rtol=1e-6)
    for a, b, c in zip(g["dense"], gl["dense"], gr["dense"]):
        np.testing.assert_allclose(a, wl * b + wr * c, rtol=1e-4, atol=1e-7)
    for table, (ids, grads) in g["embeddings"].items():
        combined = {}
        for (part_ids, part), w in ((gl["embeddings"][table], wl), (gr["embeddings"][table], wr)):
            for i, row in zip(part_ids, part):
                combined[i] = combined.get(i, 0) + w * row
        expected = np.stack([combined[i] for i in ids])
        np.testing.assert_allclose(grads, expected, rtol=1e-4, atol=1e-8, err_msg=table)


def test_predictions_do_not_depend_on_batching(schema, trees_small):
    trainer = Trainer(schema, models.MLP(**SMALL), small_config())
    trainer.fit(trees_small)
    whole = trainer.predict(list(compression.iter_batches(trees_small, schema, 10**6)))
    split = trainer.predict(list(compression.iter_batches(trees_small, schema, 97)))
    unsplit = trainer.predict(list(compression.iter_batches(trees_small, schema, 97,
                                                           split_trees=False)))
    assert len(whole) == len(split) == len(unsplit) == trees_small_leaves(trees_small, schema)
    np.testing.assert_allclose(split, whole, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(unsplit, whole, rtol=1e-5, atol=1e-7)


def test_training_on_split_and_unsplit_batches_agrees(schema, trees_small):
    """The same leaves in the same batches, once cut across trees (split) and once cut at tree
    boundaries of the same positions: equal batch contents, so equal training."""
    config = small_config()
    batches = list(compression.iter_batches(trees_small, schema, 128, split_trees=False))
    cuts = np.cumsum([b.num_leaves for b in batches])
    whole = compression.TreeBatch.from_trees(trees_small, schema)
    resliced = [whole.slice_leaves(int(a), int(b)) for a, b in zip(np.r_[0, cuts[:-1]], cuts)]
    a = Trainer(schema, models.MLP(**SMALL), config)
    b = Trainer(schema, models.MLP(**SMALL), config)
    a.fit(batches)
    b.fit(resliced)
    for va, vb in zip(a.network.variables, b.network.variables):
        np.testing.assert_array_equal(va.numpy(), vb.numpy())


def trees_small_leaves(trees, schema):
    return compression.TreeBatch.from_trees(trees, schema).num_leaves


def test_auc_after_an_epoch_matches_between_structured_and_flat(schema, trees_small):
    from trainer_data import generated
    test = generated(schema, 1500, seed=12).drop_columns(["p_click", "p_conversion"])
    config = small_config(batch_size=200)
    results = {}
    for mode in ("structured", "flat"):
        trainer = Trainer(schema, models.MLP(**SMALL), config.replace(compute=mode))
        trainer.fit(trees_small)
        results[mode] = trainer.evaluate(test)
    assert results["structured"]["samples"] == results["flat"]["samples"] == 1500
    assert abs(results["structured"]["auc"] - results["flat"]["auc"]) < 0.002
    assert abs(results["structured"]["logloss"] - results["flat"]["logloss"]) < 1e-3


class UserNet(models.DenseNet):
    """A user's own DenseNet: its own per-layer projections, expanded to the leaves by hand."""

    def __init__(self):
        super().__init__()
        self.parts = None

    def forward(self, inputs):
        import keras
        import tensorflow as tf

        if self.parts is None:  # built after the trainer seeded Keras
            self.parts = [keras.layers.Dense(4, use_bias=False) for _ in range(inputs.levels)]
            self.out = keras.layers.Dense(1)
        h = sum(inputs.expand(part(inputs.concat(level)), level)
                for level, part in enumerate(self.parts))
        user_price = inputs.expand_to(inputs.feature("age_level"), 0, 1)   # user -> ad nodes
        h = h + inputs.expand(tf.reduce_sum(user_price * inputs.feature("cate_id"), 1,
                                            keepdims=True), 1)
        return {"click": self.out(tf.nn.tanh(h))[:, 0]}


def test_a_users_own_densenet_runs_structured_and_flat_alike(schema, trees_small):
    config = small_config()
    batch = first_batch(schema, trees_small)
    structured = Trainer(schema, UserNet(), config)
    flat = Trainer(schema, UserNet(), config.replace(compute="flat"))
    assert_same_gradients(structured.compute_gradients(batch), flat.compute_gradients(batch))


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_structured_equals_flat_on_random_schemas(data):
    """1 to 4 layers, string and int ids, empty lists, dense features anywhere (each example
    traces TensorFlow twice, so only a few)."""
    from sample_data import random_schemas, raw_tables

    schema = data.draw(random_schemas())
    table = data.draw(raw_tables(schema, max_rows=30))
    assume(table.num_rows > 0)
    trees = compression.build_trees(table, schema)
    batch = next(compression.iter_batches(trees, schema, 16))
    config = TrainConfig.from_dict({"batch_size": 16, "embedding": {"dim": 3}})
    structured = Trainer(schema, models.MLP(hidden=(4,)), config)
    flat = Trainer(schema, models.MLP(hidden=(4,)), config.replace(compute="flat"))
    assert_same_gradients(structured.compute_gradients(batch), flat.compute_gradients(batch))


def test_the_flat_call_of_a_step_equals_the_tf_function_call(schema, trees_small):
    # Network calls its steps through the concrete function's flat entry point (the
    # tf.function call's argument binding costs ~2 ms a step); both give the same numbers.
    trainer = Trainer(schema, models.MLP(**SMALL), small_config())
    batch = first_batch(schema, trees_small)
    feed = trainer.builder.lookup(trainer.prepare_numpy(batch), trainer.stores, train=False)
    network = trainer.network
    loss, probabilities = network.predict_step(feed.feed)
    loss_ref, probabilities_ref = network.predict_step.function(feed.feed)
    assert network.predict_step._concrete not in (None, False)  # the flat path really ran
    np.testing.assert_array_equal(loss.numpy(), loss_ref.numpy())
    for label, p in probabilities.items():
        np.testing.assert_array_equal(p.numpy(), probabilities_ref[label].numpy())
    broken = dict(feed.feed)
    del broken["labels"]
    with pytest.raises((ValueError, TypeError)):
        network.predict_step(broken)


def test_a_step_traced_ahead_trains_like_one_traced_in_its_first_call(schema, trees_small):
    # Online learning traces the step while its reader joins the consumer group
    # (Trainer.trace); tracing must neither change state nor change what the steps compute.
    batches = list(compression.iter_batches(trees_small, schema, 256))[:3]
    ahead = Trainer(schema, models.MLP(**SMALL), small_config())
    before = [v.numpy().copy() for v in ahead.network.variables]
    ahead.trace()
    assert ahead.network.train_step._concrete not in (None, False)  # traced, not run
    assert ahead.step == 0 and ahead.store_rows() == 0
    for v, b in zip(ahead.network.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)
    ahead.trace()  # a second call is a no-op
    lazy = Trainer(schema, models.MLP(**SMALL), small_config())
    for batch in batches:
        assert ahead.train_batch(batch) == lazy.train_batch(batch)
    for a, b in zip(ahead.network.variables, lazy.network.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for table, store in ahead.stores.items():
        rows_a, rows_b = store.to_numpy(), lazy.stores[table].to_numpy()
        order_a, order_b = np.argsort(rows_a["ids"]), np.argsort(rows_b["ids"])
        np.testing.assert_array_equal(rows_a["ids"][order_a], rows_b["ids"][order_b])
        np.testing.assert_array_equal(rows_a["values"][order_a], rows_b["values"][order_b])
