"""Entry filters: probability statistics, counting Bloom admission at min_count, exact counters."""
import math

import numpy as np
import pytest

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


# -- moving filter state between stores (resharding a table) ---------------------------------

def split_by_parity(ids):
    return ids[ids % 2 == 0], ids[ids % 2 == 1]


def test_counter_filter_state_moves_to_another_store_exactly():
    """Two stores that each saw part of the ids, their pending counts merged into a third: it
    admits every id exactly when one store that saw all of them would (large enough to take
    the parallel path)."""
    rng = np.random.default_rng(4)
    sightings = [rng.choice(40000, 15000, replace=False) for _ in range(2)]
    one = make(native.CounterFilter(3))
    parts = [make(native.CounterFilter(3)) for _ in range(2)]
    for ids in sightings:
        one.lookup(ids)
        for store, own in zip(parts, split_by_parity(ids)):
            store.lookup(own)
    merged = make(native.CounterFilter(3))
    for store in parts:
        state = store.filter_state()
        assert state["ids"].dtype == np.int64 and state["counts"].dtype == np.uint32
        assert (np.diff(state["ids"]) > 0).all() and state["bloom"].size == 0
        assert merged.merge_filter_state(state["ids"], state["counts"]) == len(state["ids"])
    want = one.filter_state()
    got = merged.filter_state()
    np.testing.assert_array_equal(got["ids"], want["ids"])
    np.testing.assert_array_equal(got["counts"], want["counts"])
    assert len(want["ids"]) > 10000 and set(want["counts"].tolist()) == {1, 2}
    later = rng.choice(40000, 20000, replace=False)
    one.lookup(later)
    merged.lookup(later)
    np.testing.assert_array_equal(np.sort(merged.to_numpy()["ids"]),
                                  np.sort(one.to_numpy()["ids"]))


def test_filter_state_survives_a_snapshot(tmp_path):
    for entry_filter in (native.CounterFilter(4), native.CountingBloomFilter(3, 500)):
        store = make(entry_filter)
        store.lookup(np.arange(100))
        store.lookup(np.arange(50))
        store.save(tmp_path / type(entry_filter).__name__)
        loaded = native.EmbeddingStore.load(tmp_path / type(entry_filter).__name__)
        for key, value in store.filter_state().items():
            np.testing.assert_array_equal(loaded.filter_state()[key], value, err_msg=key)


def test_merged_counts_are_capped_and_skip_ids_with_a_row():
    store = make(native.CounterFilter(3))
    store.lookup([7])
    store.lookup([7])
    store.lookup([7])  # admitted: 7 has a row and no count
    assert len(store) == 1 and store.filter_state()["ids"].size == 0
    assert store.merge_filter_state([7, 8, 9], np.array([1, 5, 1], np.uint32)) == 2
    state = store.filter_state()
    assert state["ids"].tolist() == [8, 9] and state["counts"].tolist() == [2, 1]
    assert store.merge_filter_state([9], [1]) == 1  # added to its count: 2
    store.lookup([8, 9])  # the next sighting of each admits it
    assert len(store) == 3 and store.filter_state()["ids"].size == 0
    one = make(native.CounterFilter(1))  # admits at once: keeps no counts
    assert one.merge_filter_state([1, 2], [1, 1]) == 0 and one.filter_state()["ids"].size == 0


def test_counting_bloom_filter_states_add_up_to_one_stores():
    """Stores of equal options share the counters' layout: the counters of stores that saw
    parts of the sightings add up to those of one store that saw them all (saturating), as
    long as no id was admitted (an admitted id is counted no more, and which ids one store
    admits early, by false positives, depends on all the ids sharing its counters)."""
    bloom = native.CountingBloomFilter(min_count=50, capacity=300)
    one, parts = make(bloom), [make(bloom) for _ in range(2)]
    rng = np.random.default_rng(5)
    for _ in range(3):
        ids = rng.choice(2000, 400, replace=False)
        one.lookup(ids)
        for store, own in zip(parts, split_by_parity(ids)):
            store.lookup(own)
    merged = make(bloom)
    for store in parts:
        assert merged.merge_filter_state(bloom=store.filter_state()["bloom"]) > 0
    want = one.filter_state()["bloom"]
    np.testing.assert_array_equal(merged.filter_state()["bloom"], want)
    assert len(one) == 0
    assert want.dtype == np.uint8 and want.size >= 64 * 16 and want.max() > 2
    saturated = make(bloom)
    for _ in range(2):
        saturated.merge_filter_state(bloom=np.full(want.size, 200, np.uint8))
    assert set(saturated.filter_state()["bloom"].tolist()) == {255}


def test_a_filter_state_that_does_not_fit_is_refused_and_changes_nothing():
    counter = make(native.CounterFilter(3))
    counter.lookup([1, 2])
    bloom = make(native.CountingBloomFilter(min_count=2, capacity=100))
    bloom.lookup([1, 2])
    before = {id(s): s.filter_state() for s in (counter, bloom)}
    bad = [
        (counter, dict(ids=[3, 4], counts=np.array([1, 0], np.uint32)), "is 0|1 .. 2"),
        (counter, dict(ids=[3, 4, 3], counts=[1, 1, 1]), "given twice"),
        (counter, dict(ids=[3, 4], counts=[1]), "shape"),
        (counter, dict(ids=[3], counts=[1.5]), "integers"),
        (counter, dict(ids=[3], counts=[-1]), "1 .. 2"),
        (counter, dict(bloom=np.ones(64 * 16, np.uint8)), "CountingBloomFilter only"),
        (bloom, dict(ids=[3], counts=[1]), "CounterFilter only"),
        (bloom, dict(bloom=np.ones(7, np.uint8)), "Bloom counters: got 7"),
        (bloom, dict(bloom=np.ones(64 * 16, np.int32)), "uint8"),
        (make(native.ProbabilityFilter(0.5)), dict(ids=[3], counts=[1]), "CounterFilter only"),
        (make(None), dict(bloom=np.ones(64 * 16, np.uint8)), "CountingBloomFilter only"),
    ]
    for store, kwargs, message in bad:
        with pytest.raises((native.InvalidInputError, native.InvalidDtypeError),
                           match=message):
            store.merge_filter_state(**kwargs)
    for store in (counter, bloom):
        for key, value in store.filter_state().items():
            np.testing.assert_array_equal(value, before[id(store)][key])
    # the compiled module checks its buffers itself (the facade is not the only caller)
    raw = counter._native
    for args in ((np.array([3], np.int64), np.array([1], np.int64), np.zeros(0, np.uint8)),
                 (np.array([3], np.int64), np.array([1, 1], np.uint32), np.zeros(0, np.uint8)),
                 (np.array([3], np.int64), np.array([1], np.uint32), np.zeros((2, 2), np.uint8)),
                 (np.array([3, 4], np.int64), np.array([1, 1, 1, 1], np.uint32)[::2],
                  np.zeros(0, np.uint8))):
        with pytest.raises(native.InvalidInputError):
            raw.merge_filter_state(*args)
