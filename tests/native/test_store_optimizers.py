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


@pytest.mark.parametrize("optimizer", OPTIMIZERS[:2], ids=lambda o: type(o).__name__)
def test_lazy_l2_decays_a_row_for_every_step_since_its_last_update(optimizer):
    """l2: a row's gradient gets l2 * idle * w first, idle = steps since its last update (its
    admission for a new row), computed in double as the store does; duplicates summed first."""
    dim, l2 = 4, 0.05
    store = native.EmbeddingStore(native.StoreConfig(
        dim=dim, optimizer=optimizer, initializer=native.Uniform(0.5), seed=3, num_shards=4))
    ids = np.array([3, 17, -5, 2**40, 99, 7])
    start = store.lookup(ids)  # admitted at global step 0
    reference = {int(i): (start[k].copy(), initial_state(optimizer, dim), 0, 0)
                 for k, i in enumerate(ids)}
    rng = np.random.default_rng(8)
    for step in (1, 2, 5, 6, 11, 30):  # gaps: idle rows take several steps of decay at once
        batch = rng.choice(ids, size=5)
        grads = rng.normal(size=(5, dim)).astype(np.float32)
        store.apply_gradients(batch, grads, step, l2=l2)
        for id_, g in zip(*sum_duplicates(batch, grads)):
            w, state, t, last = reference[id_]
            scale = np.float64(np.float32(l2)) * (step - last)
            g = (g.astype(np.float64) + scale * w.astype(np.float64)).astype(np.float32)
            w, state = update(optimizer, w, state, g, t + 1)
            reference[id_] = (w, state, t + 1, step)
    rows = rows_by_id(store)
    assert rows["update_counts"].sum() > len(ids)  # rows updated again after idle steps
    for k, id_ in enumerate(rows["ids"].tolist()):
        w, state, t, last = reference[id_]
        np.testing.assert_array_equal(rows["values"][k], w)
        np.testing.assert_array_equal(rows["state"][k], state)
        assert rows["last_steps"][k] == last


def test_lazy_l2_pulls_an_idle_row_toward_zero_and_refuses_bad_values():
    store = native.EmbeddingStore(native.StoreConfig(
        dim=3, optimizer=native.SGD(lr=0.1), initializer=native.Uniform(1.0), seed=2))
    ids = np.array([1, 2])
    w0 = store.lookup(ids)
    zero = np.zeros((2, 3), np.float32)
    store.apply_gradients(ids, zero, 1)  # no l2: a zero gradient changes nothing
    np.testing.assert_array_equal(store.lookup(ids, train=False), w0)
    store.apply_gradients(ids[:1], zero[:1], 5, l2=0.5)  # idle 4 steps: w -= 0.1 * 2.0 * w
    np.testing.assert_allclose(store.lookup(ids, train=False),
                               np.stack([w0[0] * 0.8, w0[1]]), rtol=1e-6)
    before = rows_by_id(store)
    for bad in (-0.1, float("nan"), float("inf"), True, "0.1", 1e300):
        with pytest.raises(native.InvalidInputError, match="l2 must be a finite number"):
            store.apply_gradients(ids, zero, 6, l2=bad)
    with pytest.raises(native.InvalidInputError, match="l2 must be a finite number"):
        store._native.apply_gradients(ids, zero, 6, 0.0, -1.0)  # the compiled module checks too
    after = rows_by_id(store)
    for key in before:
        np.testing.assert_array_equal(after[key], before[key])
    # a huge decay is a huge but finite step, never inf or NaN
    store.apply_gradients(ids, zero, 2**30, l2=3e38)
    assert np.isfinite(store.lookup(ids, train=False)).all()
