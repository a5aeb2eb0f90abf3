"""Expiry by idle steps, by idle seconds and by a user function over the row statistics."""
import numpy as np
import pytest

import native
from store_reference import rows_by_id


def trained_store():
    """Rows 0..9; row i last updated at step i and time 1000 + i; rows 0..4 updated twice."""
    store = native.EmbeddingStore(native.StoreConfig(dim=4, optimizer=native.SGD(0.1)))
    store.lookup(np.arange(10), now=900.0)
    for i in range(5):
        store.apply_gradients([i], np.ones((1, 4)), step=0, now=950.0)
    for i in range(10):
        store.apply_gradients([i], np.full((1, 4), i + 1.0), step=i, now=1000.0 + i)
    return store


def ids_of(store):
    return sorted(rows_by_id(store)["ids"].tolist())


def test_expire_by_idle_steps_counts_from_the_largest_step():
    store = trained_store()
    assert store.expire(max_idle_steps=3) == 6  # global step 9: rows idle > 3 steps are 0..5
    assert ids_of(store) == [6, 7, 8, 9]
    assert store.stats().expired == 6


def test_expire_by_idle_seconds():
    store = trained_store()
    assert store.expire(max_idle_seconds=2.5, now=1009.0) == 7  # last_time < 1006.5
    assert ids_of(store) == [7, 8, 9]


def test_either_condition_suffices():
    store = trained_store()
    assert store.expire(max_idle_steps=8, max_idle_seconds=1.0, now=1009.0) == 8
    assert ids_of(store) == [8, 9]


def test_new_rows_count_as_updated_when_admitted():
    store = trained_store()
    store.lookup([100], now=1009.0)  # admitted at global step 9
    store.expire(max_idle_steps=0)
    assert ids_of(store) == [9, 100]


def test_expire_where_receives_row_statistics():
    store = trained_store()
    expected_norms = np.linalg.norm(rows_by_id(store)["values"].astype(np.float64), axis=1)
    seen = {}

    def fn(ids, update_counts, last_steps, last_times, l2_norms):
        seen.update(ids=ids, counts=update_counts, steps=last_steps, times=last_times, norms=l2_norms)
        return update_counts == 2

    removed = store.expire_where(fn)
    order = np.argsort(seen["ids"])
    assert seen["ids"][order].tolist() == list(range(10))
    assert seen["counts"][order].tolist() == [2] * 5 + [1] * 5
    assert seen["steps"][order].tolist() == list(range(10))
    np.testing.assert_array_equal(seen["times"][order], 1000.0 + np.arange(10))
    np.testing.assert_allclose(seen["norms"][order], expected_norms, rtol=1e-6)
    assert removed == 5 and ids_of(store) == [5, 6, 7, 8, 9]


def test_expire_where_norm_threshold_like_deeprec_l2_weight_evict():
    store = trained_store()
    rows = rows_by_id(store)
    norms = np.linalg.norm(rows["values"], axis=1)
    threshold = float(np.median(norms))
    removed = store.expire_where(lambda ids, c, s, t, l2: l2 < threshold)
    assert removed == int(np.sum(norms < threshold))


@pytest.mark.parametrize("result, message", [
    (lambda n: np.ones(n), "must return a bool array of shape"),
    (lambda n: np.ones(n + 1, bool), r"got dtype bool and shape \(11,\)"),
])
def test_expire_where_refuses_bad_masks(result, message):
    store = trained_store()
    with pytest.raises(native.InvalidInputError, match=message):
        store.expire_where(lambda ids, *rest: result(len(ids)))
    assert len(store) == 10


def test_expire_needs_a_criterion():
    with pytest.raises(native.InvalidInputError, match="needs max_idle_steps or max_idle_seconds"):
        trained_store().expire()
