"""The README's memory figures ("Sizing a memory budget") against the process's resident set,
each measured in a fresh Python process (so no earlier test's heap is in it):

- bytes per row in memory, for every optimizer and two dims: a store filled with N rows grows
  the RSS by N * (20 + 4 * dim * (1 + k) + 5) within 10%, plus at most one 2 MiB chunk a shard
  (the partly filled one, which the kernel may back with a whole huge page);
- a budgeted store holding several times its budget in rows (the rest on disk) and training on
  them grows the RSS (peak) by no more than the budget plus the stated overhead: the disk
  tier's index (18 B a disk row at most), two 2 MiB chunks a shard, two generations of pinned
  ids (64 B an id) and the batch buffers.

The children run with glibc's default mmap threshold pinned (MALLOC_MMAP_THRESHOLD_=131072,
which turns off its dynamic raise): otherwise freed batch buffers stay in the heap and add a
few batches' worth of noise that belongs to no row (the benchmark, `python -m benchmarks.store
--tiers`, measures with the allocator's defaults).
Here and not in tests/native: RSS under ASan's shadow memory would measure the sanitizer."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
STATE_WIDTH = {"sgd": 0, "adagrad": 1, "adam": 2, "ftrl": 2}
SHARDS = 4
CHUNK = 2 << 20

CHILD = r"""
import gc, json, sys
import numpy as np
import native

args = json.loads(sys.argv[1])
if not args["huge_pages"]:  # PR_SET_THP_DISABLE: the store's madvise(MADV_HUGEPAGE) is then moot
    import ctypes
    assert ctypes.CDLL(None).prctl(41, 1, 0, 0, 0) == 0

def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])

optimizer = {"sgd": native.SGD(0.1), "adagrad": native.Adagrad(0.1), "adam": native.Adam(0.01),
             "ftrl": native.FTRL(0.1)}[args["optimizer"]]
extra = {}
if args.get("budget"):
    extra = dict(memory_budget_bytes=args["budget"], disk_dir=args["disk_dir"], eviction="lru")
config = native.StoreConfig(dim=args["dim"], optimizer=optimizer, seed=1,
                            num_shards=args["shards"], num_threads=2, **extra)
n, batch = args["rows"], args["batch"]
ids = np.arange(1, n + 1, dtype=np.int64) * 7919
rng = np.random.default_rng(4)
steps = [ids[np.minimum((rng.pareto(1.0, batch) * 50).astype(np.int64), n - 1)]
         for _ in range(args["steps"])]
grads = np.full((batch, args["dim"]), 0.01, np.float32)
native.EmbeddingStore(native.StoreConfig(dim=4, seed=1)).lookup(ids[:10])  # the module's own
gc.collect()
base = status_kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
store = native.EmbeddingStore(config)
half = None
for begin in range(0, n, batch):
    if begin >= n // 2 and half is None:
        gc.collect()
        half = (status_kib("VmRSS") - base) * 1024, len(store)
    store.lookup(ids[begin:begin + batch], train=True, now=1.8e9)
for step, b in enumerate(steps, 1):
    store.lookup(b, train=True, now=1.8e9 + step)
    store.apply_gradients(b, grads, step, now=1.8e9 + step)
gc.collect()
end, peak = status_kib("VmRSS"), status_kib("VmHWM")
tiers = store._native.tier_stats()
print(json.dumps({"growth": (end - base) * 1024, "peak_growth": (peak - base) * 1024,
                  "half_growth": half[0], "half_rows": half[1],
                  "rows": len(store), "memory_rows": tiers["memory_rows"],
                  "disk_rows": tiers["disk_rows"], "disk_bytes": tiers["disk_bytes"],
                  "store_bytes": store.stats().bytes}))
"""


def _child(**args) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def memory_row_bytes(dim: int, optimizer: str) -> int:
    """The README's bytes per row in memory: 20-byte header + weights and optimizer state
    (4 * dim * (1 + k) bytes, k = 0 SGD, 1 Adagrad, 2 Adam and FTRL) + 5 bytes of table slot."""
    return 20 + 4 * dim * (1 + STATE_WIDTH[optimizer]) + 5


@pytest.mark.parametrize("optimizer", sorted(STATE_WIDTH))
@pytest.mark.parametrize("dim", [8, 64])
def test_bytes_per_row_formula_matches_rss(optimizer, dim):
    per_row = memory_row_bytes(dim, optimizer)
    rows = 40_000_000 // per_row  # ~40 MB of rows
    batch = 20_000
    got = _child(optimizer=optimizer, dim=dim, shards=SHARDS, rows=rows, batch=batch, steps=0,
                 huge_pages=False)
    assert got["rows"] == rows
    # The second half of the rows, against what the first half left (the batch buffers the
    # allocator keeps are in both): the bytes a row adds.
    slope = (got["growth"] - got["half_growth"]) / (rows - got["half_rows"])
    assert 0.9 * per_row <= slope <= 1.1 * per_row, f"{slope:.1f} B a row, formula {per_row}"
    # All of it, from an empty process: the rows plus a fixed part no larger than the chunk a
    # shard fills (2 MiB) and three batches' buffers (ids, output, the store's scratch).
    fixed = SHARDS * CHUNK + 3 * batch * (8 + 4 * dim * (1 + STATE_WIDTH[optimizer]))
    assert 0.9 * rows * per_row <= got["growth"] <= 1.1 * rows * per_row + fixed, (
        f"{got['growth'] / rows:.1f} B of RSS a row, formula {per_row}")


def test_huge_pages_add_at_most_a_chunk_a_shard():
    """With transparent huge pages (the store asks for them: madvise), a shard's partly
    filled 2 MiB chunk may be backed whole: at most 2 MiB a shard more than without."""
    dim, optimizer = 16, "adagrad"
    per_row = memory_row_bytes(dim, optimizer)
    rows = 30_000_000 // per_row
    fixed = SHARDS * CHUNK + 3 * 20_000 * (8 + 8 * dim)
    got = _child(optimizer=optimizer, dim=dim, shards=SHARDS, rows=rows, batch=20_000, steps=0,
                 huge_pages=True)
    assert 0.9 * rows * per_row <= got["growth"] <= 1.1 * rows * per_row + SHARDS * CHUNK + fixed


def test_budgeted_store_rss_stays_under_budget_plus_overhead(tmp_path):
    dim, optimizer, batch = 16, "adagrad", 20_000
    budget = 24 << 20
    rows = 6 * budget // memory_row_bytes(dim, optimizer)  # six times the budget in rows
    got = _child(optimizer=optimizer, dim=dim, shards=SHARDS, rows=rows, batch=batch, steps=30,
                 budget=budget, disk_dir=str(tmp_path / "tiers"), huge_pages=True)
    assert got["rows"] == rows and got["disk_rows"] > 4 * got["memory_rows"]
    overhead = (18 * got["disk_rows"] + 2 * CHUNK * SHARDS + 2 * 64 * batch
                + 3 * batch * (8 + 4 * dim))
    assert got["peak_growth"] <= budget + overhead, (got, overhead)
    # What the same rows take without a budget, from the formula checked above.
    assert got["peak_growth"] < 0.4 * rows * memory_row_bytes(dim, optimizer)
