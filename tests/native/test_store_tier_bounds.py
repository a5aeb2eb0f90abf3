"""Disk space of a budgeted store stays bounded (docs/tiered-store.md; README "Sizing a memory
budget"): the slot file reuses the slots of rows that moved up, and gives back the space of rows
that expired or were removed.

The bounds tested, per shard (each shard has its own slot file of `row_bytes`-byte slots, and the
file's allocated size rounds up to a 4 KiB block):
- under churn (rows moving down and up, no rows leaving the store), a file holds at most as many
  slots as the most rows it held at once; once a shard has reached its cap its memory never holds
  fewer than cap - cap/16 rows (evictions stop there), so in all
  disk bytes <= row_bytes * (rows - shards * (cap - cap // 16)) + shards * 4 KiB;
- at any time, after expiry and removals too:
  disk bytes <= row_bytes * (1.25 * disk rows + 4096 * shards) + shards * 4 KiB
  (past 1.25 slots a row plus 4096 slots the file is compacted, and right after that it holds
  exactly its rows).
Both also hold with threads training while another removes rows, and the rows stay exact."""
import threading

import numpy as np

from native import Adagrad, EmbeddingStore, StoreConfig

DIM = 8
SHARDS = 4
ROW_BYTES = 20 + 4 * 2 * DIM  # header + weights + Adagrad accumulators
MEMORY_ROW_BYTES = ROW_BYTES + 5  # and its table slot (the budget's price of a memory row)
BLOCK = 4096
SLOT_CHUNK = 4096


def _config(**extra) -> StoreConfig:
    return StoreConfig(dim=DIM, optimizer=Adagrad(0.05), seed=5, num_shards=SHARDS, num_threads=2,
                       **extra)


def _budgeted(tmp_path, cap: int) -> EmbeddingStore:
    return EmbeddingStore(_config(memory_budget_bytes=SHARDS * cap * MEMORY_ROW_BYTES,
                                  disk_dir=str(tmp_path / "tiers")))


def _tiers(store) -> dict:
    return store._native.tier_stats()


def _general_bound(tiers: dict) -> float:
    return ROW_BYTES * (1.25 * tiers["disk_rows"] + SLOT_CHUNK * SHARDS) + SHARDS * BLOCK


def _churn_bound(rows: int, cap: int) -> int:
    return ROW_BYTES * (rows - SHARDS * (cap - cap // 16)) + SHARDS * BLOCK


def _train(store, ids, step):
    grads = np.full((len(ids), DIM), 0.01 * (1 + step % 7), np.float32)
    store.lookup(ids, train=True, now=1.8e9 + step)
    store.apply_gradients(ids, grads, step, now=1.8e9 + step)


def _assert_same_rows(a, b):
    rows_a, rows_b = a.to_numpy(), b.to_numpy()
    order_a, order_b = np.argsort(rows_a["ids"]), np.argsort(rows_b["ids"])
    for column in rows_a:
        assert rows_a[column][order_a].tobytes() == rows_b[column][order_b].tobytes(), column


def test_disk_space_is_reused_under_churn_and_given_back_after_expiry(tmp_path):
    cap = 1000  # memory rows a shard
    rows = 120_000  # 30x the memory tier: ~29k rows a shard on disk, past the 4096-slot slack
    plain, tiered = EmbeddingStore(_config()), _budgeted(tmp_path, cap)
    everything = np.arange(1, rows + 1, dtype=np.int64) * 7919
    for store in (plain, tiered):
        for begin in range(0, rows, 20_000):
            _train(store, everything[begin:begin + 20_000], 1 + begin // 20_000)
    assert _tiers(tiered)["disk_bytes"] <= _churn_bound(rows, cap)
    # Churn: a hot window sliding over the ids, so every step faults rows up and evicts others
    # down, over and over; the number of rows stays the same.
    rng = np.random.default_rng(8)
    step = 100
    for phase in range(6):
        window = everything[(phase * 17_000) % rows:][:12_000]
        for _ in range(4):
            step += 1
            ids = rng.choice(window, size=3000)
            _train(plain, ids, step)
            _train(tiered, ids, step)
            tiers = _tiers(tiered)
            assert tiers["memory_rows"] + tiers["disk_rows"] == rows
            assert tiers["disk_bytes"] <= _churn_bound(rows, cap), (phase, tiers)
            assert tiers["disk_bytes"] <= _general_bound(tiers), (phase, tiers)
    assert _tiers(tiered)["faults"] > 30_000  # rows did move up (and as many down)
    peak = _tiers(tiered)["disk_bytes"]
    # Nine rows in ten leave, wherever they are (the rows on disk are most of them): the space
    # they took is given back.
    leave = lambda ids, *rest: ids % 10 != 0  # noqa: E731
    assert plain.expire_where(leave) == tiered.expire_where(leave) == rows - rows // 10
    tiers = _tiers(tiered)
    assert tiers["disk_bytes"] <= _general_bound(tiers) < peak / 2, tiers
    # Expiry by idle steps, with the hot window trained meanwhile: rows on disk expire too.
    for _ in range(3):
        step += 1
        ids = rng.choice(everything[::10][:2000], size=1500)
        _train(plain, ids, step)
        _train(tiered, ids, step)
    assert plain.expire(max_idle_steps=2) == tiered.expire(max_idle_steps=2) > 0
    tiers = _tiers(tiered)
    assert tiers["disk_bytes"] <= _general_bound(tiers), tiers
    # Churn again over what is left, including ids that come back as new rows.
    for _ in range(6):
        step += 1
        ids = rng.choice(everything[:40_000], size=4000)
        _train(plain, ids, step)
        _train(tiered, ids, step)
        tiers = _tiers(tiered)
        assert tiers["disk_bytes"] <= _general_bound(tiers), tiers
        assert tiers["disk_bytes"] <= _churn_bound(len(tiered), cap) + ROW_BYTES * SLOT_CHUNK * SHARDS
    _assert_same_rows(plain, tiered)  # compaction moved rows inside the file, changed none


def test_threads_train_while_rows_are_removed_rows_stay_exact_and_disk_bounded(tmp_path):
    """Two threads train their own ids through a small budget (rows moving to disk and back
    under them) while the main thread removes a third set of rows: every row ends as a
    single-threaded replay of its own calls leaves it, and the disk bounds hold."""
    cap = 300
    tiered = _budgeted(tmp_path, cap)
    plain = EmbeddingStore(_config())
    own = [np.arange(1, 30_001, dtype=np.int64) * 2 + k for k in (0, 1)]  # even / odd ids
    doomed = np.arange(1, 30_001, dtype=np.int64) * -3  # rows removed while the others train
    for store in (plain, tiered):
        _train(store, doomed, 1)
    rng = [np.random.default_rng(20 + k) for k in (0, 1)]
    calls = [[(rng[k].choice(own[k], size=2000), 10 + i) for i in range(25)] for k in (0, 1)]
    errors = []

    def worker(k):
        try:
            for ids, step in calls[k]:
                _train(tiered, ids, step)
        except Exception as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    removed = 0
    for chunk in np.array_split(doomed, 10):
        removed += tiered.expire_where(lambda ids, *rest, c=chunk: np.isin(ids, c))
        tiers = _tiers(tiered)
        assert tiers["disk_bytes"] <= _general_bound(tiers), tiers
    for t in threads:
        t.join()
    assert not errors, errors
    assert removed == len(doomed)
    # The same calls one thread after the other (each row sees the same calls in the same order:
    # the threads' ids are disjoint and Adagrad depends on nothing else).
    plain.expire_where(lambda ids, *rest: np.isin(ids, doomed))
    for k in (0, 1):
        for ids, step in calls[k]:
            _train(plain, ids, step)
    rows_a, rows_b = plain.to_numpy(), tiered.to_numpy()
    order_a, order_b = np.argsort(rows_a["ids"]), np.argsort(rows_b["ids"])
    # last_steps/last_times: the global step each row saw depends on the interleaving; the rows'
    # bytes of weights, state and counts do not.
    for column in ("ids", "values", "state", "update_counts", "l2_norms"):
        assert rows_a[column][order_a].tobytes() == rows_b[column][order_b].tobytes(), column
    tiers = _tiers(tiered)
    assert tiers["disk_rows"] > 0 and tiers["faults"] > 0
    assert tiers["disk_bytes"] <= _general_bound(tiers), tiers
