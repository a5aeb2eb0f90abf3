"""EmbeddingStore.contains: which ids have a row, read without touching the entry filter, the
counters or the tiers (what a cold table's routing asks)."""
import numpy as np
import pytest

import native


def test_contains_follows_admission_removal_and_counts_nothing():
    store = native.EmbeddingStore(native.StoreConfig(
        dim=2, entry_filter=native.CounterFilter(min_count=2), num_shards=4))
    assert store.contains(np.zeros(0, np.int64)).shape == (0,)
    ids = np.arange(100, dtype=np.int64)
    store.lookup(ids, train=True)
    assert not store.contains(ids).any()
    before = store.stats()
    for _ in range(5):  # asking is no sighting: still one each
        store.contains(ids)
    assert store.stats() == before
    store.lookup(ids[:30], train=True)  # the second sighting admits these
    held = store.contains(np.concatenate([ids, ids[::-1], [-1, 2**62]]))
    assert held.dtype == np.bool_
    np.testing.assert_array_equal(held[:100], ids < 30)
    np.testing.assert_array_equal(held[100:200], (ids < 30)[::-1])
    assert not held[200:].any()
    store.expire_where(lambda i, *rest: i % 2 == 0)
    np.testing.assert_array_equal(store.contains(ids), (ids < 30) & (ids % 2 == 1))


def test_contains_sees_rows_on_the_disk_tier_without_moving_them(tmp_path):
    store = native.EmbeddingStore(native.StoreConfig(
        dim=3, num_shards=2, memory_budget_bytes=2 * 100 * 64, disk_dir=str(tmp_path)))
    ids = np.arange(20_000, dtype=np.int64)
    for step, part in enumerate((ids, ids[:40]), 1):  # the second lookup evicts the first's
        unique, _, _ = store.lookup_unique(part, train=True)
        store.apply_gradients(unique, np.full((len(unique), 3), 0.01, np.float32), step)
    before = store._native.tier_stats()  # the binding's counters (no facade method yet)
    assert before["disk_rows"] > 0
    assert store.contains(ids).all() and not store.contains(ids + 10**9).any()
    assert store._native.tier_stats() == before


def test_contains_refuses_what_is_not_int64_ids():
    store = native.EmbeddingStore(native.StoreConfig(dim=2))
    with pytest.raises(native.InvalidInputError):
        store.contains(np.zeros((2, 2), np.int64))
    with pytest.raises((native.InvalidDtypeError, native.InvalidInputError)):
        store.contains(np.array([0.5, 1.5]))
    # many ids over the store's threads give the answer of one thread
    ids = np.arange(50_000, dtype=np.int64)
    store.lookup(ids[::3], train=True)
    np.testing.assert_array_equal(store.contains(ids), ids % 3 == 0)
