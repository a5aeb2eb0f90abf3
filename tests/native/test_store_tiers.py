"""Two tiers (docs/tiered-store.md): a store with a small memory budget gives the same lookups
and updates, bit for bit, as an unbounded store on the same calls; the budget's settings are
checked where StoreConfig is built."""
import numpy as np
import pytest

from native import Adagrad, CounterFilter, EmbeddingStore, StoreConfig
from native.errors import InvalidInputError


def _config(**extra) -> StoreConfig:
    return StoreConfig(dim=8, optimizer=Adagrad(0.05), entry_filter=CounterFilter(2), seed=3,
                       num_shards=4, num_threads=2, **extra)


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_budgeted_store_equals_unbounded_store(tmp_path, eviction):
    row_share = 20 + 4 * 16 + 5  # header + 8 values + 8 accumulators + its table slot
    plain = EmbeddingStore(_config())
    tiered = EmbeddingStore(_config(memory_budget_bytes=4 * 50 * row_share,
                                    disk_dir=str(tmp_path / "tiers"), eviction=eviction))
    rng = np.random.default_rng(41)
    for step in range(1, 81):
        # Skewed ids over 4000: hot ones stay in memory, the tail keeps moving to disk and back.
        n = 5000 if step % 25 == 0 else int(rng.integers(1, 300))
        ids = (4000 * rng.random(n) ** 3).astype(np.int64)
        now = 1.8e9 + step
        a = plain.lookup(ids, train=True, now=now)
        b = tiered.lookup(ids, train=True, now=now)
        assert a.tobytes() == b.tobytes(), f"training lookup differs at step {step}"
        grads = rng.standard_normal((n, 8)).astype(np.float32)
        plain.apply_gradients(ids, grads, step, now=now)
        tiered.apply_gradients(ids, grads, step, now=now)
        if step % 5 == 0:
            read = (4000 * rng.random(400) ** 3).astype(np.int64)
            assert (plain.lookup(read, train=False, now=now).tobytes()
                    == tiered.lookup(read, train=False, now=now).tobytes())
        assert len(plain) == len(tiered)
    stats = tiered._native.stats()
    sp = plain.stats()
    assert (stats["rows"], stats["admitted"], stats["rejected"], stats["updates"]) == (
        sp.rows, sp.admitted, sp.rejected, sp.updates)
    tiers = tiered._native.tier_stats()
    assert tiers["disk_rows"] > 0 and tiers["faults"] > 0  # the budget was felt both ways
    assert tiers["memory_rows"] + tiers["disk_rows"] == stats["rows"]
    assert plain._native.tier_stats()["disk_rows"] == 0
    # One tier directory per shard.
    assert sorted(p.name for p in (tmp_path / "tiers").iterdir()) == [
        f"shard-{s:04d}" for s in range(4)]
    # Saved with rows on disk, loaded into a budget again: the unbounded store's rows.
    plain.save(tmp_path / "snap-plain")
    tiered.save(tmp_path / "snap-tiered")
    reloaded = EmbeddingStore.load(tmp_path / "snap-tiered", _config(
        memory_budget_bytes=4 * 50 * row_share, disk_dir=str(tmp_path / "reloaded"),
        eviction=eviction))
    assert reloaded._native.tier_stats()["disk_rows"] > 0
    unbounded = EmbeddingStore.load(tmp_path / "snap-plain")
    assert reloaded.config.memory_budget_bytes == 4 * 50 * row_share
    assert unbounded.config.memory_budget_bytes is None
    rows_a, rows_b = unbounded.to_numpy(), reloaded.to_numpy()
    order_a, order_b = np.argsort(rows_a["ids"]), np.argsort(rows_b["ids"])
    for column in rows_a:
        assert rows_a[column][order_a].tobytes() == rows_b[column][order_b].tobytes(), column
    everything = np.arange(4000, dtype=np.int64)
    assert (plain.lookup(everything, train=False).tobytes()
            == tiered.lookup(everything, train=False).tobytes())
    assert tiered.config.memory_budget_bytes == 4 * 50 * row_share
    assert tiered.config.eviction == eviction


@pytest.mark.parametrize("extra, message", [
    ({"memory_budget_bytes": 1 << 20}, "needs disk_dir"),
    ({"disk_dir": "/tmp/x"}, "disk_dir is set but memory_budget_bytes is not"),
    ({"memory_budget_bytes": 0, "disk_dir": "/tmp/x"}, "memory_budget_bytes"),
    ({"eviction": "fifo"}, "eviction must be 'lru' or 'lfu'"),
    ({"memory_budget_bytes": 1 << 20, "disk_dir": "/tmp/x", "max_rows": 10},
     "max_rows is not supported yet"),
])
def test_budget_settings_are_checked(extra, message):
    with pytest.raises(InvalidInputError, match=message):
        _config(**extra)


def test_budget_below_a_row_a_shard_is_refused(tmp_path):
    with pytest.raises(InvalidInputError, match="at least one row a shard"):
        EmbeddingStore(_config(memory_budget_bytes=100, disk_dir=str(tmp_path)))
