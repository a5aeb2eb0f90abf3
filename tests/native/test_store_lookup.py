"""Lookups, deterministic initialisation, dedup, capacity eviction and bad-input handling."""

import numpy as np
import pytest

import native
from store_reference import rows_by_id


def make(dim=4, **kwargs):
    return native.EmbeddingStore(native.StoreConfig(dim=dim, **kwargs))


def test_initial_rows_depend_only_on_seed_and_id():
    ids = np.arange(-500, 500, dtype=np.int64) * 7919
    a = make(dim=8, seed=42, num_shards=1, num_threads=1)
    b = make(dim=8, seed=42, num_shards=64, num_threads=2)
    rows_a = a.lookup(ids)
    rows_b = b.lookup(ids[::-1])[::-1]
    np.testing.assert_array_equal(rows_a, rows_b)
    np.testing.assert_array_equal(rows_a, a.initial_rows(ids))
    assert not np.array_equal(rows_a, make(dim=8, seed=43).lookup(ids))


@pytest.mark.parametrize("initializer, low, high", [
    (native.Zeros(), 0.0, 0.0),
    (native.Uniform(0.5), -0.5, 0.5),
    (native.Normal(0.1), -0.2, 0.2),
])
def test_initializers_stay_in_range(initializer, low, high):
    rows = make(dim=16, initializer=initializer).lookup(np.arange(5000))
    assert rows.min() >= low and rows.max() <= high
    if high > 0:
        assert abs(rows.mean()) < 0.01 * high * 10
        assert rows.std() > 0.2 * high


def test_normal_initializer_has_the_stddev_of_a_2_sigma_truncated_normal():
    rows = make(dim=64, initializer=native.Normal(1.0)).lookup(np.arange(4000))
    # stddev of N(0, 1) truncated to [-2, 2] is 0.8796.
    assert abs(rows.std() - 0.8796) < 0.01


def test_non_training_lookup_changes_nothing_and_reads_zeros():
    store = make()
    rows = store.lookup([1, 2, 3], train=False)
    np.testing.assert_array_equal(rows, np.zeros((3, 4), np.float32))
    assert len(store) == 0
    assert store.stats().admitted == 0


def test_lookup_returns_rows_per_position_with_duplicates():
    store = make()
    ids = np.array([5, 9, 5, 5, 1])
    rows = store.lookup(ids)
    assert len(store) == 3
    np.testing.assert_array_equal(rows[0], rows[2])
    np.testing.assert_array_equal(rows, store.initial_rows(ids))


def test_lookup_unique_returns_first_appearance_order_and_inverse():
    store = make()
    ids = np.array([7, 3, 7, 9, 3])
    unique, inverse, rows = store.lookup_unique(ids)
    assert unique.tolist() == [7, 3, 9]
    assert inverse.tolist() == [0, 1, 0, 2, 1]
    np.testing.assert_array_equal(unique[inverse], ids)
    np.testing.assert_array_equal(rows[inverse], store.lookup(ids, train=False))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_large_lookup_unique_matches_a_serial_first_appearance_dedup(threads):
    # Batches of 16384 ids or more are deduplicated by several tasks and merged; the result must
    # be the serial one: first-appearance order, inverse, rows.
    ids = np.random.default_rng(threads).zipf(1.1, size=70001) % 50000 - 7
    store = make(dim=3, num_threads=threads)
    unique, inverse, rows = store.lookup_unique(ids)
    first = np.unique(ids, return_index=True)[1]
    assert unique.tolist() == ids[np.sort(first)].tolist()
    np.testing.assert_array_equal(unique[inverse], ids)
    np.testing.assert_array_equal(rows, store.initial_rows(unique))
    unique2, inverse2, rows2 = store.lookup_unique(ids, train=False)
    np.testing.assert_array_equal(unique2, unique)
    np.testing.assert_array_equal(inverse2, inverse)
    np.testing.assert_array_equal(rows2, rows)


def test_large_batch_uses_threads_and_matches_small_batches():
    ids = np.random.default_rng(0).zipf(1.2, size=60000) % 100000
    a, b = make(dim=8, num_threads=2), make(dim=8, num_threads=1)
    rows_a = a.lookup(ids)
    rows_b = np.concatenate([b.lookup(chunk) for chunk in np.array_split(ids, 50)])
    np.testing.assert_array_equal(rows_a, rows_b)
    grads = np.random.default_rng(1).normal(size=(len(ids), 8)).astype(np.float32)
    a.apply_gradients(ids, grads, step=1)
    b.apply_gradients(ids, grads, step=1)
    ra, rb = rows_by_id(a), rows_by_id(b)
    np.testing.assert_array_equal(ra["values"], rb["values"])


def test_gradients_for_ids_without_rows_are_ignored():
    store = make(optimizer=native.SGD(1.0))
    store.lookup([1])
    store.apply_gradients([1, 2], np.ones((2, 4)), step=3)
    assert len(store) == 1
    assert store.stats().updates == 1
    np.testing.assert_array_equal(store.lookup([2], train=False), np.zeros((1, 4), np.float32))


def test_max_rows_evicts_least_recently_updated_rows():
    store = make(optimizer=native.SGD(0.1), max_rows=10)
    store.lookup(np.arange(10))
    for step, id_ in enumerate(range(10), start=1):  # row i last updated at step i + 1
        store.apply_gradients([id_], np.ones((1, 4)), step=step)
    store.lookup(np.arange(10, 13))  # three new rows; they count as updated at step 10
    assert len(store) == 10
    assert sorted(rows_by_id(store)["ids"].tolist()) == list(range(3, 13))
    assert store.stats().evicted == 3


def test_max_rows_evicts_one_percent_below_the_cap():
    store = make(max_rows=1000)
    store.lookup(np.arange(1000))
    store.lookup([5000])
    assert len(store) == 990 and store.stats().evicted == 11


# -- bad input: a clear exception and an unchanged store -----------------------------------

def snapshot(store):
    return {k: v.tobytes() for k, v in rows_by_id(store).items()}


@pytest.fixture
def trained():
    store = make(optimizer=native.Adagrad(0.1))
    store.lookup(np.arange(6))
    store.apply_gradients(np.arange(6), np.ones((6, 4)), step=1)
    return store


@pytest.mark.parametrize("ids, error, message", [
    (np.array([1.0, 2.0]), native.InvalidDtypeError, "ids must be integers .* got dtype float64"),
    (np.array([True, False]), native.InvalidDtypeError, "got dtype bool"),
    (np.array(["a"]), native.InvalidDtypeError, "got dtype <U1"),
    (np.array([[1, 2]]), native.InvalidInputError, r"ids must be 1-D, got shape \(1, 2\)"),
    (np.array([2**63], dtype=np.uint64), native.InvalidInputError, "must fit in int64"),
])
def test_bad_ids_are_refused(trained, ids, error, message):
    before = snapshot(trained)
    with pytest.raises(error, match=message):
        trained.lookup(ids)
    with pytest.raises(error, match=message):
        trained.apply_gradients(ids, np.ones((len(ids), 4)), step=2)
    assert snapshot(trained) == before


def test_float_ids_error_is_a_type_error(trained):
    with pytest.raises(TypeError):
        trained.lookup([0.5])


@pytest.mark.parametrize("grads, message", [
    (np.ones((7, 4)), "grads has 7 rows but ids has 6"),
    (np.ones((6, 3)), "grads has 3 columns but the store's dim is 4"),
    (np.ones(6), r"grads must be 2-D \[n, 4\], got shape \(6,\)"),
    (np.ones((6, 4), dtype=np.int32), "grads must be floating point, got dtype int32"),
])
def test_bad_gradient_shapes_are_refused(trained, grads, message):
    before = snapshot(trained)
    with pytest.raises(native.InvalidInputError, match=message):
        trained.apply_gradients(np.arange(6), grads, step=2)
    assert snapshot(trained) == before


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e300])
def test_non_finite_gradients_are_refused_naming_the_row(trained, bad):
    before = snapshot(trained)
    grads = np.ones((6, 4))
    grads[4, 2] = bad
    with pytest.raises(native.InvalidInputError, match=r"grads row 4 \(id 4\) contains .*must be finite"):
        trained.apply_gradients(np.arange(6), grads, step=2)
    assert snapshot(trained) == before
    assert trained.stats().global_step == 1


@pytest.mark.parametrize("step", [-1, 1.5, "3", True, None])
def test_bad_steps_are_refused(trained, step):
    with pytest.raises(native.InvalidInputError, match="step must be a non-negative int"):
        trained.apply_gradients(np.arange(6), np.ones((6, 4)), step=step)


def test_bad_configs_are_refused():
    with pytest.raises(native.InvalidInputError, match=r"StoreConfig.dim must be in \[1, 4096\], got 0"):
        native.StoreConfig(dim=0)
    with pytest.raises(native.InvalidInputError, match=r"Adagrad.lr must be in \(0"):
        native.Adagrad(lr=-1)
    with pytest.raises(native.InvalidInputError, match="entry_filter must be"):
        native.StoreConfig(dim=4, entry_filter=0.5)
    with pytest.raises(ValueError, match=r"min_count must be in \[1, 255\]"):
        native.CountingBloomFilter(min_count=300, capacity=10)


def test_errors_subclass_the_builtins_callers_catch():
    assert issubclass(native.StoreError, RuntimeError)
    assert issubclass(native.CorruptFileError, ValueError)
    assert issubclass(native.InvalidDtypeError, TypeError)
    assert issubclass(native.StoreIOError, OSError)


@pytest.mark.asan  # selected only by `make test-asan` (see pyproject.toml)
def test_the_sanitized_extension_is_the_one_under_test():
    assert "build/asan" in native._store.__file__


def test_a_small_store_stays_small():
    store = make(dim=8)
    store.lookup(np.arange(100))
    assert store.stats().bytes < 256 * 1024


def test_rows_spanning_several_arena_chunks(tmp_path):
    # One shard of 288-byte rows: 7281 rows per 2 MiB chunk, so 20000 rows fill three chunks,
    # and the first chunk grew (moving its rows) on the way.
    store = make(dim=64, optimizer=native.SGD(1.0), num_shards=1, initializer=native.Uniform(1.0))
    ids = np.random.default_rng(3).permutation(20000).astype(np.int64) * 31
    np.testing.assert_array_equal(store.lookup(ids), store.initial_rows(ids))
    removed = store.expire_where(lambda i, *rest: i % 3 == 0)  # moves rows across chunks
    assert removed == int(np.sum(ids % 3 == 0))
    kept = ids[ids % 3 != 0]
    np.testing.assert_array_equal(store.lookup(kept, train=False), store.initial_rows(kept))
    store.save(tmp_path)
    restored = native.EmbeddingStore.load(tmp_path)
    np.testing.assert_array_equal(restored.lookup(kept, train=False), store.initial_rows(kept))


def test_empty_batches_are_fine(trained):
    before = snapshot(trained)
    assert trained.lookup([]).shape == (0, 4)
    unique, inverse, rows = trained.lookup_unique(np.zeros(0, np.int64))
    assert unique.shape == (0,) and inverse.shape == (0,) and rows.shape == (0, 4)
    trained.apply_gradients([], np.zeros((0, 4)), step=3)
    assert snapshot(trained) == before
