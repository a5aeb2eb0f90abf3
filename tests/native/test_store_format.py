"""Row format version 2: packed row metadata (steps, times, counts), old files, dense tables."""
import json
import os
import shutil
import struct

import numpy as np
import pytest

import native
from store_reference import assert_same_rows, rows_by_id

DATA = os.path.join(os.path.dirname(__file__), "data")
# Written by data/make_v1_fixtures.py with the session-2 build (snapshot/delta format version 1).
V1_CONFIG = native.StoreConfig(dim=3, optimizer=native.Adagrad(0.05),
                               entry_filter=native.CounterFilter(2), seed=5, num_shards=3)


def expected_v1(key=None):
    with open(os.path.join(DATA, "v1_expected.json")) as f:
        expected = json.load(f)
    return expected if key is None else expected[key]


def assert_rows_match_v1(store, expected):
    rows = rows_by_id(store)
    assert rows["ids"].tolist() == expected["ids"]
    np.testing.assert_array_equal(rows["values"], np.array(expected["values"], np.float32))
    np.testing.assert_array_equal(rows["state"], np.array(expected["state"], np.float32))
    assert rows["update_counts"].tolist() == expected["update_counts"]
    assert rows["last_steps"].tolist() == expected["last_steps"]  # steps beyond 2**32 survive
    # Version 2 keeps times to the second, rounded to nearest (1000.75 -> 1001, 1010.5 -> 1011).
    np.testing.assert_array_equal(rows["last_times"], np.floor(np.array(expected["last_times"]) + 0.5))


def test_version1_snapshot_is_converted_on_load(tmp_path):
    store = native.EmbeddingStore.load(os.path.join(DATA, "v1_snapshot"))
    assert store.config == V1_CONFIG
    assert_rows_match_v1(store, expected_v1())
    stats = store.stats().as_dict()
    for name, value in expected_v1("stats").items():
        assert stats[name] == value, name
    # Pending delta state came along: the next delta holds the row changed after delta 2 and
    # applies to a follower that applied the two version-1 deltas.
    follower = native.EmbeddingStore(V1_CONFIG)
    for name in ("delta-000001.bin", "delta-000002.bin"):
        follower.apply_delta(os.path.join(DATA, "v1_deltas", name))
    follower.apply_delta(store.export_delta(tmp_path / "deltas"))
    assert_same_rows(follower, store)
    # Filter state came along: id 77 was seen once before the save and is admitted now.
    assert store.lookup([77], now=1012.0).any()
    # Saved again, the snapshot is version 2 and loads back equal.
    store.save(tmp_path / "v2")
    with open(tmp_path / "v2/store.snapshot", "rb") as f:
        assert struct.unpack("<8sI", f.read(12))[1] == 2
    assert_same_rows(native.EmbeddingStore.load(tmp_path / "v2"), store)


def test_version1_deltas_are_converted_on_apply():
    follower = native.EmbeddingStore(V1_CONFIG)
    assert follower.apply_delta(os.path.join(DATA, "v1_deltas", "delta-000001.bin")) == 1
    assert follower.apply_delta(os.path.join(DATA, "v1_deltas", "delta-000002.bin")) == 2
    assert_rows_match_v1(follower, expected_v1("follower"))
    assert follower.stats().global_step == 2**32 + 9


def with_version(data, version):
    return data[:8] + struct.pack("<I", version) + data[12:]


@pytest.mark.parametrize("version", [0, 3, 77])
def test_unknown_versions_are_refused_naming_the_version(tmp_path, version):
    store = native.EmbeddingStore(native.StoreConfig(dim=2, optimizer=native.SGD(0.1)))
    store.lookup([1, 2, 3])
    store.save(tmp_path / "good")
    data = (tmp_path / "good/store.snapshot").read_bytes()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad/store.snapshot").write_bytes(with_version(data, version))
    with pytest.raises(native.CorruptFileError,
                       match=f"snapshot version {version}, this build reads versions 1 to 2"):
        native.EmbeddingStore.load(tmp_path / "bad")
    delta = store.export_delta(tmp_path / "deltas")
    bad = tmp_path / "bad.bin"
    bad.write_bytes(with_version(open(delta, "rb").read(), version))
    follower = native.EmbeddingStore(store.config)
    with pytest.raises(native.CorruptFileError,
                       match=f"delta version {version}, this build reads versions 1 to 2"):
        follower.apply_delta(bad)
    assert len(follower) == 0


def test_last_steps_are_exact_across_the_32_bit_wrap(tmp_path):
    store = native.EmbeddingStore(native.StoreConfig(dim=2, optimizer=native.SGD(0.1)))
    store.lookup([1, 2, 3, 4], now=50.0)
    steps = {1: 2**32 - 3, 2: 2**32 - 1, 3: 2**32, 4: 2**32 + 5}
    for id_, step in steps.items():
        store.apply_gradients([id_], np.ones((1, 2)), step=step, now=100.0)
    rows = rows_by_id(store)
    assert rows["last_steps"].tolist() == [steps[i] for i in (1, 2, 3, 4)]
    # Idle steps from the global step 2**32 + 5: 8, 6, 5, 0.
    assert store.expire(max_idle_steps=6) == 1
    assert sorted(rows_by_id(store)["ids"].tolist()) == [2, 3, 4]
    assert store.expire(max_idle_steps=5) == 1
    assert sorted(rows_by_id(store)["ids"].tolist()) == [3, 4]
    # The same after a save/load and on a follower.
    store.save(tmp_path / "snap")
    assert rows_by_id(native.EmbeddingStore.load(tmp_path / "snap"))["last_steps"].tolist() == [
        2**32, 2**32 + 5]


def test_last_steps_near_int64_max_and_updates_with_an_older_step():
    store = native.EmbeddingStore(native.StoreConfig(dim=2, optimizer=native.SGD(0.1)))
    store.lookup([1, 2])
    top = 2**63 - 1
    store.apply_gradients([1], np.ones((1, 2)), step=top)
    store.apply_gradients([2], np.ones((1, 2)), step=top - 10)  # an older step than the global one
    rows = rows_by_id(store)
    assert rows["last_steps"].tolist() == [top, top - 10]
    assert store.stats().global_step == top
    assert store.expire(max_idle_steps=10) == 0
    assert store.expire(max_idle_steps=9) == 1


def test_last_times_are_kept_to_the_second():
    store = native.EmbeddingStore(native.StoreConfig(dim=2, optimizer=native.SGD(0.1)))
    store.lookup([1, 2, 3, 4, 5, 6], now=1000.0)
    times = {1: 1000.4, 2: 1000.5, 3: 1001.49, 4: -5.0, 5: 2.0**32 + 100, 6: 1_763_700_000.7}
    for id_, now in times.items():
        store.apply_gradients([id_], np.ones((1, 2)), step=1, now=now)
    rows = rows_by_id(store)
    # Nearest second; clamped to 0 .. 2**32 - 1 (the years 1970 to 2106).
    assert rows["last_times"].tolist() == [1000.0, 1001.0, 1001.0, 0.0, 2.0**32 - 1, 1_763_700_001.0]
    # Idle seconds are counted from the stored second: row 1 (1000) is 2.6 s idle at 1002.6,
    # rows 2 and 3 (1001) 1.6 s, so a 2 s limit removes row 1 and the clamped row 4.
    store.expire_where(lambda ids, *rest: ids >= 5)
    assert store.expire(max_idle_seconds=2.0, now=1002.6) == 2
    assert sorted(rows_by_id(store)["ids"].tolist()) == [2, 3]


def test_removals_and_regrowth_keep_every_row_findable():
    # Small tables grow through many sizes; removals shift probe runs back (also across the end
    # of the slot array, which is not a power of two long).
    rng = np.random.default_rng(0)
    for shards in (1, 3):
        store = native.EmbeddingStore(native.StoreConfig(dim=3, optimizer=native.SGD(0.1),
                                                         num_shards=shards, seed=9))
        present = set()
        for round_ in range(12):
            new = rng.integers(-2**62, 2**62, size=int(rng.integers(1, 3000)))
            store.lookup(new)
            present.update(new.tolist())
            gone = rng.choice(sorted(present), size=len(present) // 3, replace=False)
            assert store.expire_where(lambda ids, *rest: np.isin(ids, gone)) == len(gone)
            present.difference_update(gone.tolist())
            ids = np.array(sorted(present), np.int64)
            np.testing.assert_array_equal(store.lookup(ids, train=False), store.initial_rows(ids))
            assert not store.lookup(gone, train=False).any()
            assert len(store) == len(present)


def test_rows_are_packed_tightly_at_dim_8():
    # Heap bytes per row of a 1M-row Adagrad store at dim 8: 84-byte rows (20 bytes of
    # metadata), 4-byte hash slots at least 74% full, chunks grown by 32nds. A memory figure, not
    # a timing: it is the same on every machine.
    store = native.EmbeddingStore(native.StoreConfig(dim=8, optimizer=native.Adagrad(0.05)))
    store.lookup(np.arange(1_000_000, dtype=np.int64) * 7919)
    stats = store.stats()
    assert stats.bytes / stats.rows <= 1.25 * (8 + 8 * 8)
