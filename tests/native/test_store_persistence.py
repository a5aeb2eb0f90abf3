"""save -> load and export_delta -> apply_delta round trips, followers, corrupt and stray files."""
import os

import numpy as np
import pytest

import native
from store_reference import assert_same_rows, rows_by_id

CONFIGS = {
    "sgd": native.StoreConfig(dim=4, optimizer=native.SGD(0.1), seed=1),
    "adagrad-counter": native.StoreConfig(dim=8, optimizer=native.Adagrad(0.05),
                                          entry_filter=native.CounterFilter(2), seed=2),
    "adam-bloom-capped": native.StoreConfig(
        dim=3, optimizer=native.Adam(0.01), entry_filter=native.CountingBloomFilter(2, 5000),
        max_rows=300, seed=3, num_shards=5),
    "ftrl-probability": native.StoreConfig(dim=5, optimizer=native.FTRL(0.1, 1.0, 0.001, 0.01),
                                           entry_filter=native.ProbabilityFilter(0.5), seed=4),
}


def counters(store):
    """stats() without the memory figures (hash-map capacities differ after a reload)."""
    stats = store.stats().as_dict()
    del stats["bytes"], stats["filter_bytes"]
    return stats


def train_round(store, rng, step, expire=False):
    """One deterministic round of trainer work: lookup, update, sometimes expiry."""
    ids = rng.zipf(1.3, size=400) % 2000
    unique, _, _ = store.lookup_unique(ids, now=1000.0 + step)
    grads = rng.normal(size=(len(unique), store.dim)).astype(np.float32)
    store.apply_gradients(unique, grads, step, now=1000.0 + step)
    if expire:
        store.expire(max_idle_steps=2)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_save_load_is_bit_exact_and_continues_identically(tmp_path, name):
    config = CONFIGS[name]
    store = native.EmbeddingStore(config)
    rng = np.random.default_rng(0)
    for step in range(1, 6):
        train_round(store, rng, step, expire=step == 4)
    store.save(tmp_path / "ckpt")
    restored = native.EmbeddingStore.load(tmp_path / "ckpt")
    assert restored.config == config
    assert counters(restored) == counters(store)
    assert_same_rows(restored, store)
    # Filter state, pending delta state and counters were restored too: both continue alike.
    for step in range(6, 9):
        seed = step * 7
        train_round(store, np.random.default_rng(seed), step)
        train_round(restored, np.random.default_rng(seed), step)
    assert_same_rows(restored, store)
    assert counters(restored) == counters(store)
    store.save(tmp_path / "a")
    restored.save(tmp_path / "b")
    assert (tmp_path / "a/store.snapshot").read_bytes() == (tmp_path / "b/store.snapshot").read_bytes()
    assert sorted(os.listdir(tmp_path / "a")) == ["store.snapshot"]  # no temp files left behind


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_follower_applying_every_delta_holds_the_trainers_rows(tmp_path, name):
    trainer = native.EmbeddingStore(CONFIGS[name])
    follower = native.EmbeddingStore(CONFIGS[name])
    rng = np.random.default_rng(1)
    for step in range(1, 9):
        train_round(trainer, rng, step, expire=step % 3 == 0)
        path = trainer.export_delta(tmp_path)
        assert os.path.basename(path) == f"delta-{step:06d}.bin"
        assert follower.apply_delta(path) == step
        assert_same_rows(follower, trainer)
    assert trainer.stats().expired + trainer.stats().evicted > 0  # tombstones were exercised


def test_tombstones_remove_rows_and_readmitted_ids_come_back(tmp_path):
    config = native.StoreConfig(dim=2, optimizer=native.SGD(1.0))
    trainer, follower = native.EmbeddingStore(config), native.EmbeddingStore(config)
    trainer.lookup([1, 2, 3])
    follower.apply_delta(trainer.export_delta(tmp_path))
    trainer.expire_where(lambda ids, *rest: ids != 3)   # tombstones for 1 and 2
    trainer.lookup([2])                                  # 2 comes back in the same delta
    trainer.apply_gradients([2], np.ones((1, 2)), step=5)
    path = trainer.export_delta(tmp_path)
    contents = follower.read_delta(path)  # its net effect, read before it is applied
    assert contents["tombstones"].tolist() == [1] and contents["ids"].tolist() == [2]
    np.testing.assert_array_equal(contents["rows"], trainer.lookup([2], train=False))
    with pytest.raises(native.IncompatibleStoreError):
        native.EmbeddingStore(native.StoreConfig(dim=3, optimizer=native.SGD(1.0))).read_delta(
            path, ahead=1)
    with pytest.raises(native.InvalidInputError):
        follower.read_delta(path, ahead=-1)
    follower.apply_delta(path)
    assert sorted(rows_by_id(follower)["ids"].tolist()) == [2, 3]
    assert_same_rows(follower, trainer)


def test_delta_holds_only_changed_rows(tmp_path):
    trainer = native.EmbeddingStore(native.StoreConfig(dim=64, optimizer=native.SGD(0.1)))
    trainer.lookup(np.arange(1000))
    first = os.path.getsize(trainer.export_delta(tmp_path))
    trainer.apply_gradients([5], np.ones((1, 64)), step=1)
    second = os.path.getsize(trainer.export_delta(tmp_path))
    assert second < first / 100


def test_follower_from_a_snapshot_continues_with_the_next_delta(tmp_path):
    config = CONFIGS["adagrad-counter"]
    trainer = native.EmbeddingStore(config)
    rng = np.random.default_rng(2)
    for step in range(1, 4):
        train_round(trainer, rng, step)
        trainer.export_delta(tmp_path / "deltas")
    train_round(trainer, rng, 4)             # pending changes are in the snapshot, too
    trainer.save(tmp_path / "snap")
    follower = native.EmbeddingStore.load(tmp_path / "snap")
    with pytest.raises(native.DeltaOrderError, match="has sequence 3 but this store expects 4"):
        follower.apply_delta(tmp_path / "deltas/delta-000003.bin")
    for step in range(5, 8):
        train_round(trainer, rng, step, expire=True)
        follower.apply_delta(trainer.export_delta(tmp_path / "deltas"))
    assert_same_rows(follower, trainer)


def test_out_of_order_and_repeated_deltas_are_refused(tmp_path):
    config = CONFIGS["sgd"]
    trainer, follower = native.EmbeddingStore(config), native.EmbeddingStore(config)
    rng = np.random.default_rng(3)
    paths = []
    for step in range(1, 4):
        train_round(trainer, rng, step)
        paths.append(trainer.export_delta(tmp_path))
    with pytest.raises(native.DeltaOrderError, match="has sequence 2 but this store expects 1"):
        follower.apply_delta(paths[1])
    assert len(follower) == 0
    follower.apply_delta(paths[0])
    with pytest.raises(native.DeltaOrderError, match="has sequence 1 but this store expects 2"):
        follower.apply_delta(paths[0])
    follower.apply_delta(paths[1])
    follower.apply_delta(paths[2])
    assert_same_rows(follower, trainer)


def test_incompatible_files_are_refused(tmp_path):
    small = native.EmbeddingStore(native.StoreConfig(dim=4, optimizer=native.SGD(0.1)))
    small.lookup([1, 2])
    delta = small.export_delta(tmp_path)
    other_dim = native.EmbeddingStore(native.StoreConfig(dim=8, optimizer=native.SGD(0.1)))
    with pytest.raises(native.IncompatibleStoreError, match="dim 4 .*this store has dim 8"):
        other_dim.apply_delta(delta)
    other_optimizer = native.EmbeddingStore(native.StoreConfig(dim=4, optimizer=native.Adagrad(0.1)))
    with pytest.raises(native.IncompatibleStoreError, match="dim 4 and optimizer SGD; this store has dim 4 and optimizer Adagrad"):
        other_optimizer.apply_delta(delta)
    assert len(other_dim) == 0 and other_optimizer.stats().delta_sequence == 0
    small.save(tmp_path / "snap")
    with pytest.raises(native.IncompatibleStoreError, match="has dim 4 and optimizer SGD, expected dim 8"):
        native.EmbeddingStore.load(tmp_path / "snap", config=other_dim.config)


def corruptions(data):
    middle = bytearray(data)
    middle[len(data) // 2] ^= 0x40
    header = bytearray(data)
    header[20] ^= 0x01
    magic = bytearray(data)
    magic[0:8] = b"NOTMAGIC"
    return {
        "flipped byte in the body": bytes(middle),
        "flipped byte in the header": bytes(header),
        "bad magic": bytes(magic),
        "truncated by one byte": data[:-1],
        "truncated to half": data[: len(data) // 2],
        "trailing garbage": data + b"\0" * 8,
        "empty": b"",
    }


@pytest.mark.parametrize("kind", list(corruptions(b"x" * 64)))
def test_corrupt_snapshots_are_refused(tmp_path, kind):
    store = native.EmbeddingStore(CONFIGS["adagrad-counter"])
    train_round(store, np.random.default_rng(4), 1)
    store.save(tmp_path / "good")
    data = (tmp_path / "good/store.snapshot").read_bytes()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad/store.snapshot").write_bytes(corruptions(data)[kind])
    with pytest.raises(native.CorruptFileError, match=r"corrupt store file .*store.snapshot: "):
        native.EmbeddingStore.load(tmp_path / "bad")


@pytest.mark.parametrize("kind", list(corruptions(b"x" * 64)))
def test_corrupt_deltas_are_refused_and_change_nothing(tmp_path, kind):
    config = CONFIGS["sgd"]
    trainer, follower = native.EmbeddingStore(config), native.EmbeddingStore(config)
    rng = np.random.default_rng(5)
    train_round(trainer, rng, 1)
    follower.apply_delta(trainer.export_delta(tmp_path))
    train_round(trainer, rng, 2, expire=True)
    good = trainer.export_delta(tmp_path)
    data = open(good, "rb").read()
    bad = tmp_path / "bad.bin"
    bad.write_bytes(corruptions(data)[kind])
    before = {k: v.tobytes() for k, v in rows_by_id(follower).items()}
    with pytest.raises(native.CorruptFileError):
        follower.apply_delta(bad)
    with pytest.raises(native.CorruptFileError):
        follower.read_delta(bad)  # read as apply_delta checks it
    assert {k: v.tobytes() for k, v in rows_by_id(follower).items()} == before
    assert follower.stats().delta_sequence == 1
    follower.apply_delta(good)  # the intact file still applies
    assert_same_rows(follower, trainer)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_read_delta_is_what_apply_delta_does_without_doing_it(tmp_path, name):
    """A serving copy answers on "store + delta" before applying it: read_delta gives the
    delta's net effect (rows, removed ids), checked as apply_delta checks it, and changes
    nothing; the store patched with it equals the store after apply_delta."""
    trainer, follower = native.EmbeddingStore(CONFIGS[name]), native.EmbeddingStore(
        CONFIGS[name])
    rng = np.random.default_rng(7)
    for step in range(1, 6):
        train_round(trainer, rng, step, expire=step % 2 == 0)
        path = trainer.export_delta(tmp_path)
        before = {k: v.tobytes() for k, v in rows_by_id(follower).items()}
        ahead = trainer.export_delta(tmp_path / "ahead") if step == 3 else None
        sequence = follower.stats().delta_sequence + 1
        contents = follower.read_delta(path)
        assert {k: v.tobytes() for k, v in rows_by_id(follower).items()} == before
        assert contents["sequence"] == sequence and not set(contents["ids"]) & set(
            contents["tombstones"])
        ids = np.concatenate([rows_by_id(follower)["ids"], contents["ids"]])
        follower.apply_delta(path)
        after = follower.lookup(np.unique(ids), train=False)
        patched = dict(zip(contents["ids"].tolist(), contents["rows"]))
        for i, id_ in enumerate(np.unique(ids).tolist()):
            want = patched.get(id_)
            if want is not None:
                np.testing.assert_array_equal(after[i], want)
        assert not set(contents["tombstones"].tolist()) & set(
            rows_by_id(follower)["ids"].tolist())
        if ahead is not None:  # the next one, read one ahead of the store
            assert follower.read_delta(ahead, ahead=0)["sequence"] == sequence + 1
            with pytest.raises(native.DeltaOrderError):
                follower.read_delta(ahead, ahead=1)
            follower.apply_delta(ahead)
    assert_same_rows(follower, trainer)


def test_missing_files_raise_os_errors(tmp_path):
    with pytest.raises(native.StoreIOError, match="cannot open .*store.snapshot"):
        native.EmbeddingStore.load(tmp_path / "nothing")
    store = native.EmbeddingStore(CONFIGS["sgd"])
    with pytest.raises(FileNotFoundError.__mro__[1]):  # OSError
        store.apply_delta(tmp_path / "delta-000001.bin")


def test_failed_export_keeps_changes_pending(tmp_path):
    config = CONFIGS["sgd"]
    trainer, follower = native.EmbeddingStore(config), native.EmbeddingStore(config)
    train_round(trainer, np.random.default_rng(6), 1)
    trainer.expire(max_idle_steps=0)
    train_round(trainer, np.random.default_rng(7), 2)
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(native.StoreIOError, match="expected a directory"):
        trainer.export_delta(tmp_path / "file")
    assert trainer.stats().delta_sequence == 0
    follower.apply_delta(trainer.export_delta(tmp_path / "deltas"))
    assert_same_rows(follower, trainer)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_rebase_delta_turns_a_follower_into_another_lineages_snapshot(tmp_path, name):
    """A serving copy following lineage A meets a new full export B (the trainer restored to an
    older checkpoint and trained on differently): write_rebase_delta gives the rows that differ
    and the ids B lacks, so the copy becomes B's store without loading a second one, then
    follows B's own deltas."""
    config = CONFIGS[name]
    trainer = native.EmbeddingStore(config)
    rng = np.random.default_rng(11)
    for step in range(1, 4):
        train_round(trainer, rng, step)
    trainer.export_delta(tmp_path / "a")
    trainer.save(tmp_path / "old")
    follower = native.EmbeddingStore.load(tmp_path / "old")
    for step in range(4, 6):  # lineage A goes on; the follower follows it
        train_round(trainer, rng, step)
        follower.apply_delta(trainer.export_delta(tmp_path / "a"))
    restored = native.EmbeddingStore.load(tmp_path / "old")  # lineage B from the older state
    other = np.random.default_rng(12)
    for step in range(4, 7):
        train_round(restored, other, step)
    restored.expire_where(lambda ids, *_: ids % 7 == 0)  # B removes rows the follower holds
    restored.export_delta(tmp_path / "b")
    restored.save(tmp_path / "new")
    before = {k: v.tobytes() for k, v in rows_by_id(follower).items()}

    stats = follower.write_rebase_delta(tmp_path / "new", tmp_path / "rebase.bin")
    contents = follower.read_delta(tmp_path / "rebase.bin")
    assert {k: v.tobytes() for k, v in rows_by_id(follower).items()} == before  # read only
    assert contents["rebase"] == restored.stats().delta_sequence
    assert stats["rows"] == len(contents["ids"]) and stats["tombstones"] == len(
        contents["tombstones"])
    assert stats["rows"] + stats["unchanged"] == len(restored)
    assert stats["unchanged"] > 0  # rows neither lineage touched since "old" are not carried
    assert set(contents["tombstones"].tolist()) == set(rows_by_id(follower)["ids"].tolist()) - set(
        rows_by_id(restored)["ids"].tolist())
    follower.apply_delta(tmp_path / "rebase.bin")
    assert_same_rows(follower, restored)
    assert follower.stats().delta_sequence == restored.stats().delta_sequence
    train_round(restored, other, 7)  # B's next delta follows
    follower.apply_delta(restored.export_delta(tmp_path / "b"))
    assert_same_rows(follower, restored)
    assert follower.write_rebase_delta(tmp_path / "new", tmp_path / "again.bin")["unchanged"] > 0


def test_a_rebase_from_a_damaged_or_foreign_snapshot_writes_nothing(tmp_path):
    store = native.EmbeddingStore(CONFIGS["adagrad-counter"])
    train_round(store, np.random.default_rng(4), 1)
    store.save(tmp_path / "good")
    data = (tmp_path / "good/store.snapshot").read_bytes()
    follower = native.EmbeddingStore.load(tmp_path / "good")
    for kind, damaged in corruptions(data).items():
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "store.snapshot").write_bytes(damaged)
        with pytest.raises(native.CorruptFileError):
            follower.write_rebase_delta(tmp_path / kind, tmp_path / "out.bin")
        assert not os.path.exists(tmp_path / "out.bin"), kind
    other = native.EmbeddingStore(CONFIGS["sgd"])
    with pytest.raises(native.IncompatibleStoreError, match="dim"):
        other.write_rebase_delta(tmp_path / "good", tmp_path / "out.bin")
    assert sorted(os.listdir(tmp_path)) == sorted(["good", *corruptions(data)])
