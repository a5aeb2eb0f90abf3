"""Large batches: per-range dedup of lookups, grouped gradient sums, tagged hash slots, chunk growth."""

import numpy as np
import pytest

import native
from store_reference import rows_by_id


def make(dim=4, **kwargs):
    return native.EmbeddingStore(native.StoreConfig(dim=dim, **kwargs))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_large_non_training_lookup_matches_small_ones_and_reads_absent_ids_as_zeros(threads):
    store = make(dim=6, num_threads=threads, num_shards=5, initializer=native.Uniform(1.0))
    store.lookup(np.arange(0, 20000, 2))  # even ids have rows, odd ids do not
    ids = np.random.default_rng(0).zipf(1.1, size=50000) % 20000
    rows = store.lookup(ids, train=False)
    expected = np.concatenate([store.lookup(c, train=False) for c in np.array_split(ids, 40)])
    np.testing.assert_array_equal(rows, expected)
    assert not rows[ids % 2 == 1].any()
    np.testing.assert_array_equal(rows[ids % 2 == 0], store.initial_rows(ids[ids % 2 == 0]))


@pytest.mark.parametrize("dim, n", [(3, 200000), (8, 100000), (18, 100000), (64, 30000)])
def test_large_lookup_output_of_any_dim_is_exact(dim, n):
    # Outputs over 2 MiB are mapped by the extension itself rather than allocated by numpy.
    store = make(dim=dim, num_threads=2, initializer=native.Uniform(1.0))
    ids = np.random.default_rng(1).zipf(1.3, size=n) % 5000
    rows = store.lookup(ids, train=True)
    np.testing.assert_array_equal(rows, store.initial_rows(ids))
    np.testing.assert_array_equal(store.lookup(ids, train=False), rows)


def test_training_lookup_sights_each_id_once_per_call_across_ranges():
    # The id repeats in every range of the batch but is one sighting for the counter filter.
    store = make(dim=4, num_threads=2, entry_filter=native.CounterFilter(min_count=2))
    ids = np.full(40000, 12345, dtype=np.int64)
    ids[::7] = np.arange(len(ids[::7])) + 1_000_000  # other ids, seen once each
    assert not store.lookup(ids).any()
    assert len(store) == 0
    rows = store.lookup(ids)
    assert len(store) == len(np.unique(ids))
    np.testing.assert_array_equal(rows, store.initial_rows(ids))


@pytest.mark.parametrize("shards, threads", [(1, 2), (3, 2), (16, 2), (7, 3), (5, 4)])
def test_grouped_gradient_sums_match_one_thread(shards, threads):
    ids = np.random.default_rng(2).zipf(1.2, size=30000) % 3000
    grads = np.random.default_rng(3).normal(size=(len(ids), 5)).astype(np.float32)
    a = make(dim=5, num_shards=shards, num_threads=threads, optimizer=native.Adagrad(0.1))
    b = make(dim=5, num_shards=1, num_threads=1, optimizer=native.Adagrad(0.1))
    for store in (a, b):
        store.lookup(ids)
        store.apply_gradients(ids, grads, step=4)
    ra, rb = rows_by_id(a), rows_by_id(b)
    np.testing.assert_array_equal(ra["values"], rb["values"])
    np.testing.assert_array_equal(ra["update_counts"], rb["update_counts"])
    # The sum of each id's gradients, in input order, is what the update used.
    sgd = make(dim=5, num_threads=threads, num_shards=shards, optimizer=native.SGD(1.0),
               initializer=native.Zeros())
    sgd.lookup(ids)
    sgd.apply_gradients(ids, grads, step=1)
    unique, inverse = np.unique(ids, return_inverse=True)
    sums = np.zeros((len(unique), 5), np.float32)
    for i, u in enumerate(inverse):
        sums[u] += grads[i]
    np.testing.assert_array_equal(sgd.lookup(unique, train=False), -sums)


def test_first_non_finite_gradient_of_a_large_batch_is_named_and_nothing_changes():
    store = make(dim=4, num_threads=2)
    ids = np.arange(50000) % 9000
    store.lookup(ids)
    before = store.lookup(np.arange(9000), train=False)
    grads = np.ones((len(ids), 4), np.float32)
    grads[41234, 2] = np.inf
    grads[30001, 1] = np.nan
    with pytest.raises(native.InvalidInputError, match="grads row 30001 "):
        store.apply_gradients(ids, grads, step=1)
    np.testing.assert_array_equal(store.lookup(np.arange(9000), train=False), before)
    assert store.stats().updates == 0


def test_tagged_slots_survive_growth_removal_and_reinsertion():
    store = make(dim=2, num_shards=1, num_threads=2, initializer=native.Uniform(1.0))
    ids = np.random.default_rng(4).permutation(120000).astype(np.int64) * 1_000_003 - 5
    store.lookup(ids)
    assert len(store) == len(ids)
    gone = ids[::3]
    assert store.expire_where(lambda i, *rest: np.isin(i, gone)) == len(gone)
    kept = np.setdiff1d(ids, gone)
    np.testing.assert_array_equal(store.lookup(kept, train=False), store.initial_rows(kept))
    assert not store.lookup(gone, train=False).any()
    store.lookup(gone[:1000])
    np.testing.assert_array_equal(store.lookup(gone[:1000], train=False),
                                  store.initial_rows(gone[:1000]))
    assert len(store) == len(kept) + 1000


def test_last_chunk_grows_in_steps_instead_of_whole_huge_pages():
    store = make(dim=64, num_shards=4, optimizer=native.Adagrad(0.1))
    store.lookup(np.arange(12000))  # 3000 rows of 544 bytes a shard, under one 2 MiB chunk
    bytes_per_row = store.stats().bytes / len(store)
    assert bytes_per_row < 1.2 * (8 + 8 * 64)
