"""Entry filters: probability statistics, counting Bloom admission at min_count, exact counters."""
import math

import numpy as np

import native


def make(entry_filter, **kwargs):
    return native.EmbeddingStore(native.StoreConfig(
        dim=4, optimizer=native.SGD(1.0), entry_filter=entry_filter, **kwargs))


def admitted_mask(store, ids):
    return np.any(store.lookup(ids, train=False) != 0, axis=1)


def test_probability_filter_admits_each_sighting_with_probability_p():
    p, n = 0.3, 20000
    store = make(native.ProbabilityFilter(p))
    ids = np.arange(n)
    store.lookup(ids)
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(len(store) / n - p) < 5 * sd
    rows_after = [len(store)]
    for _ in range(2):  # every further sighting is an independent draw
        store.lookup(ids)
        rows_after.append(len(store))
    expected = 1 - (1 - p) ** 3
    assert abs(len(store) / n - expected) < 5 * math.sqrt(expected * (1 - expected) / n)
    stats = store.stats()
    assert stats.admitted == len(store)
    assert stats.rejected == sum(n - rows for rows in rows_after)


def test_probability_filter_counts_duplicates_in_one_call_once():
    store = make(native.ProbabilityFilter(0.0))
    store.lookup(np.zeros(50, dtype=np.int64))
    assert store.stats().rejected == 1


def test_rejected_ids_read_zeros_and_ignore_gradients():
    store = make(native.ProbabilityFilter(0.0))
    rows = store.lookup([1, 2, 3])
    np.testing.assert_array_equal(rows, np.zeros((3, 4), np.float32))
    store.apply_gradients([1, 2, 3], np.ones((3, 4)), step=1)
    np.testing.assert_array_equal(store.lookup([1, 2, 3]), np.zeros((3, 4), np.float32))
    assert len(store) == 0 and store.stats().updates == 0


def test_counter_filter_admits_exactly_on_the_min_count_th_sighting():
    store = make(native.CounterFilter(3))
    ids = np.array([10, 11, 12])
    store.lookup(ids)
    store.lookup(np.array([10, 10, 10, 11]))  # duplicates in a call are one sighting
    assert len(store) == 0
    store.lookup(ids)
    assert admitted_mask(store, ids).tolist() == [True, True, False]  # 12 was seen twice
    store.lookup(ids)
    assert admitted_mask(store, ids).tolist() == [True, True, True]
    assert store.stats().rejected == 3 + 2 + 1
    assert store.stats().admitted == 3


def test_counting_bloom_filter_admits_at_min_count_and_reports_memory():
    capacity, rate = 20000, 0.01
    store = make(native.CountingBloomFilter(min_count=3, capacity=capacity, false_positive_rate=rate))
    ids = np.arange(capacity) * 1000003
    store.lookup(ids)
    store.lookup(ids)
    early = len(store)  # only false positives can be admitted before the 3rd sighting
    assert early < 0.05 * capacity
    store.lookup(ids)
    assert len(store) == capacity  # a Bloom filter never under-counts
    counters = math.ceil(-capacity * math.log(rate) / math.log(2) ** 2)
    assert counters <= store.stats().filter_bytes <= counters + 16 * 64


def test_counting_bloom_filter_with_min_count_1_admits_everything():
    store = make(native.CountingBloomFilter(min_count=1, capacity=100))
    store.lookup(np.arange(1000))
    assert len(store) == 1000


def test_large_batches_count_one_sighting_per_id_too():
    store = make(native.CounterFilter(2))
    ids = np.repeat(np.arange(3000), 3)  # above the size where lookups deduplicate first
    np.random.default_rng(0).shuffle(ids)
    store.lookup(ids)
    assert len(store) == 0 and store.stats().rejected == 3000
    rows = store.lookup(ids)
    assert len(store) == 3000
    np.testing.assert_array_equal(rows, store.initial_rows(ids))
