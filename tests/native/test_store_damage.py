"""Damage every byte: each single-byte flip and each truncation of a small snapshot or delta
(current and version-1 formats) is refused with CorruptFileError naming the file, and changes
nothing already loaded (also run under ASan + UBSan by ``make test-asan``)."""
import os
import re
import shutil

import numpy as np
import pytest

import native
from store_reference import rows_by_id

DATA = os.path.join(os.path.dirname(__file__), "data")
CONFIGS = {
    "adagrad-counter": native.StoreConfig(dim=2, optimizer=native.Adagrad(0.05),
                                          entry_filter=native.CounterFilter(2), seed=2,
                                          num_shards=2),
    "adam-bloom": native.StoreConfig(dim=2, optimizer=native.Adam(0.01),
                                     entry_filter=native.CountingBloomFilter(1, 20), seed=3,
                                     num_shards=2),
}
V1_CONFIG = native.StoreConfig(dim=3, optimizer=native.Adagrad(0.05),
                               entry_filter=native.CounterFilter(2), seed=5, num_shards=3)


def damaged(data: bytes):
    """``(what, bytes)`` for every byte flipped (xor 0xFF) and every truncation to 0 ..
    len - 1 bytes."""
    for i in range(len(data)):
        yield f"byte {i} of {len(data)} flipped", data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
    for n in range(len(data)):
        yield f"truncated to {n} of {len(data)} bytes", data[:n]


def train(store, steps):
    """A few rows with optimizer state, filter state (ids seen once) and a tombstone."""
    for step in steps:
        ids = [1, 2, 3, 4, 5, 6, 3, 4, 5, 100 + step]
        unique, _, _ = store.lookup_unique(ids, now=1000.0 + step)
        grads = np.full((len(unique), store.dim), 0.1 * step, np.float32)
        store.apply_gradients(unique, grads, step, now=1000.0 + step)
    store.expire_where(lambda ids, *_: ids == 6)


def state(store):
    """Everything a refused file must leave as it was: every row's bytes and the counters."""
    stats = store.stats().as_dict()
    del stats["bytes"], stats["filter_bytes"]  # capacities, not contents
    return {k: v.tobytes() for k, v in rows_by_id(store).items()}, stats


def assert_every_damage_refused(data, bad_path, attempt, unchanged):
    """Write each damaged copy of ``data`` to ``bad_path``; ``attempt()`` must raise
    CorruptFileError naming ``bad_path`` and leave ``unchanged()`` true."""
    count = 0
    for what, blob in damaged(data):
        with open(bad_path, "wb") as f:
            f.write(blob)
        with pytest.raises(native.CorruptFileError) as error:
            attempt()
        assert str(bad_path) in str(error.value), (what, str(error.value))
        assert unchanged(), what
        count += 1
    assert count == 2 * len(data)


@pytest.mark.parametrize("name", [*CONFIGS, "version 1"])
def test_every_damaged_snapshot_is_refused_naming_the_file(tmp_path, name):
    if name == "version 1":
        good = os.path.join(DATA, "v1_snapshot")
    else:
        store = native.EmbeddingStore(CONFIGS[name])
        train(store, (1, 2))
        good = tmp_path / "good"
        store.save(good)
    with open(os.path.join(good, "store.snapshot"), "rb") as f:
        data = f.read()
    assert len(data) < 2000  # small: every byte is tried twice
    loaded = native.EmbeddingStore.load(good)
    before = state(loaded)
    assert len(loaded) >= 4
    (tmp_path / "bad").mkdir()
    bad = tmp_path / "bad" / "store.snapshot"
    assert_every_damage_refused(data, bad, lambda: native.EmbeddingStore.load(bad.parent),
                                lambda: state(loaded) == before)
    # the intact file still loads, to the same rows
    assert state(native.EmbeddingStore.load(good)) == before


@pytest.mark.parametrize("name", [*CONFIGS, "version 1"])
def test_every_damaged_delta_is_refused_and_changes_nothing(tmp_path, name):
    if name == "version 1":
        config = V1_CONFIG
        first = os.path.join(DATA, "v1_deltas", "delta-000001.bin")
        second = os.path.join(DATA, "v1_deltas", "delta-000002.bin")
    else:
        config = CONFIGS[name]
        trainer = native.EmbeddingStore(config)
        train(trainer, (1,))
        first = trainer.export_delta(tmp_path / "deltas")
        train(trainer, (2, 3))
        second = trainer.export_delta(tmp_path / "deltas")
    follower = native.EmbeddingStore(config)
    follower.apply_delta(first)
    before = state(follower)
    with open(second, "rb") as f:
        data = f.read()
    assert len(data) < 2000
    (tmp_path / "bad").mkdir()
    bad = tmp_path / "bad" / os.path.basename(second)
    assert_every_damage_refused(data, bad, lambda: follower.apply_delta(bad),
                                lambda: state(follower) == before)
    assert follower.apply_delta(second) == 2  # the intact delta still applies
    if name != "version 1":
        assert state(follower)[0] == state(trainer)[0]


def test_a_truncated_copy_of_a_large_snapshot_is_refused(tmp_path):
    """Beyond the small files above: rows in more than one read block, cut at block edges."""
    store = native.EmbeddingStore(native.StoreConfig(dim=4, optimizer=native.SGD(0.1), seed=9))
    store.lookup(np.arange(70_000))
    store.save(tmp_path / "good")
    data = (tmp_path / "good" / "store.snapshot").read_bytes()
    (tmp_path / "bad").mkdir()
    bad = tmp_path / "bad" / "store.snapshot"
    for n in (len(data) - 1, len(data) - 16, len(data) - 17, 1 << 20, (1 << 20) + 1,
              len(data) // 2):
        bad.write_bytes(data[:n])
        with pytest.raises(native.CorruptFileError, match=re.escape(str(bad))):
            native.EmbeddingStore.load(bad.parent)
    flipped = bytearray(data)
    flipped[(1 << 20) + 3] ^= 0xFF
    bad.write_bytes(bytes(flipped))
    with pytest.raises(native.CorruptFileError, match=re.escape(f"{bad}: checksum mismatch")):
        native.EmbeddingStore.load(bad.parent)
    shutil.rmtree(tmp_path / "bad")


def test_the_native_loader_refuses_a_max_rows_the_facade_refuses(tmp_path):
    """The C++ options check bounds max_rows as StoreConfig does (at most 2**63 - 1): a snapshot
    holding 2**63, with a valid checksum, is a corrupt file to the native loader itself (the
    facade's own mapping of what it refuses is tests/native/test_fuzz_corpus_native.py)."""
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root not in sys.path:  # after the sanitized build's native/ under `make test-asan`
        sys.path.append(root)
    from benchmarks.fuzz.targets import TRAILER_BYTES, sealed_store_file

    largest = 2**63 - 1
    store = native.EmbeddingStore(native.StoreConfig(
        dim=2, optimizer=native.Adagrad(0.05), seed=2, num_shards=2, max_rows=largest))
    train(store, range(1, 3))
    with open(store.save(tmp_path / "largest"), "rb") as f:
        body = f.read()[:-TRAILER_BYTES]
    assert native.EmbeddingStore.load(tmp_path / "largest").config.max_rows == largest
    field = largest.to_bytes(8, "little")
    assert body.count(field) == 1
    bad = tmp_path / "above" / "store.snapshot"
    bad.parent.mkdir()
    bad.write_bytes(sealed_store_file(body.replace(field, (largest + 1).to_bytes(8, "little"))))
    with pytest.raises(native.CorruptFileError) as error:
        native._store.Store.load(str(bad.parent))
    assert str(error.value) == (
        f"corrupt store file {bad}: invalid options: max_rows must be in 0..2**63-1 "
        f"(0: unbounded), got {largest + 1}")
