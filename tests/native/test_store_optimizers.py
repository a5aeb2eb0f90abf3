"""Optimizer maths of the native store against the numpy reference in store_reference.py."""
import numpy as np
import pytest

import native
from store_reference import initial_state, rows_by_id, sum_duplicates, update

OPTIMIZERS = [
    native.SGD(lr=0.1),
    native.Adagrad(lr=0.1, initial_accumulator=0.1),
    native.Adam(lr=0.01, beta1=0.9, beta2=0.999, epsilon=1e-8),
    native.FTRL(alpha=0.1, beta=1.0, l1=0.01, l2=0.001),
]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_updates_match_numpy_reference(optimizer):
    dim = 6
    store = native.EmbeddingStore(native.StoreConfig(
        dim=dim, optimizer=optimizer, initializer=native.Uniform(0.1), seed=11, num_shards=4))
    ids = np.array([3, 17, -5, 2**40, 99])
    start = store.lookup(ids)
    reference = {int(i): (start[k].copy(), initial_state(optimizer, dim), 0) for k, i in enumerate(ids)}
    rng = np.random.default_rng(5)
    for step in range(1, 9):
        batch = rng.choice(ids, size=12)  # duplicates on purpose: they are summed first
        grads = rng.normal(size=(12, dim)).astype(np.float32)
        store.apply_gradients(batch, grads, step)
        for id_, g in zip(*sum_duplicates(batch, grads)):
            w, state, t = reference[id_]
            w, state = update(optimizer, w, state, g, t + 1)
            reference[id_] = (w, state, t + 1)
    rows = rows_by_id(store)
    for k, id_ in enumerate(rows["ids"].tolist()):
        w, state, t = reference[id_]
        np.testing.assert_array_equal(rows["values"][k], w)
        np.testing.assert_array_equal(rows["state"][k], state)
        assert rows["update_counts"][k] == t
    assert store.stats().updates == sum(t for _, _, t in reference.values())


def test_ftrl_l1_zeroes_weights_with_small_gradients():
    store = native.EmbeddingStore(native.StoreConfig(
        dim=3, optimizer=native.FTRL(alpha=0.1, beta=1.0, l1=10.0, l2=0.0)))
    ids = np.array([1])
    store.lookup(ids)
    store.apply_gradients(ids, np.full((1, 3), 0.5), step=1)
    np.testing.assert_array_equal(store.lookup(ids, train=False), np.zeros((1, 3), np.float32))


def test_adam_uses_each_rows_own_update_count():
    optimizer = native.Adam(lr=0.1)
    store = native.EmbeddingStore(native.StoreConfig(dim=2, optimizer=optimizer, initializer=native.Zeros()))
    store.lookup([1, 2])
    g = np.ones((1, 2), np.float32)
    for step in range(1, 4):
        store.apply_gradients([1], g, step)
    store.apply_gradients([2], g, 4)
    rows = rows_by_id(store)
    assert rows["update_counts"].tolist() == [3, 1]
    # After one bias-corrected Adam step the move is lr * g / (|g| + eps) ~= lr.
    np.testing.assert_allclose(rows["values"][1], [-0.1, -0.1], rtol=1e-6)


def test_adam_matches_the_reference_past_its_cached_bias_corrections():
    # The store computes 1 - beta^t once for the first update counts (4096) and with pow
    # beyond; a row updated 4100 times crosses over, bit for bit the same as the reference.
    optimizer = native.Adam(lr=0.01, beta1=0.9, beta2=0.999, epsilon=1e-8)
    store = native.EmbeddingStore(native.StoreConfig(dim=3, optimizer=optimizer,
                                                     initializer=native.Uniform(0.1), seed=3))
    w = store.lookup([7])[0].copy()
    state = initial_state(optimizer, 3)
    grads = np.random.default_rng(9).normal(size=(4100, 1, 3)).astype(np.float32)
    for t in range(1, 4101):
        store.apply_gradients([7], grads[t - 1], t)
        w, state = update(optimizer, w, state, grads[t - 1][0], t)
        if t in (1, 4095, 4096, 4097, 4100):
            np.testing.assert_array_equal(store.lookup([7], train=False)[0], w, err_msg=f"t={t}")
    rows = rows_by_id(store)
    np.testing.assert_array_equal(rows["state"][0], state)
    assert rows["update_counts"].tolist() == [4100]
