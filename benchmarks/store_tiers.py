"""Benchmark of the two-tier store (docs/tiered-store.md): a memory budget over a disk tier
against the all-DRAM store, on the same ids in the same run.

    python -m benchmarks.store --tiers                                   # 2M rows, dim 16
    python -m benchmarks.store --tiers --rows 20000 --batch 2000 --prefill 20 --batches 4 --warmup 4 \\
        --calibration-batches 3 --rss-batches 2                          # CI size

Training steps as the trainer runs them: ``lookup(ids, train=True)`` then Adagrad
``apply_gradients(ids, grads, step)``, on batches of ``--batch`` ids drawn from a Zipf
distribution truncated at ``--rows`` ranks (P(rank r) ~ r^-s, s = ``--zipf``; ranks scattered
over the id space). The table is what ``--prefill`` such steps leave (the ids seen so far, each
with its own update count and last step, as in a trained table); every store starts from the
same snapshot of it. Ids never seen before keep arriving (``new_rows``): they are inserts in
both stores, never faults.

- Hit rate: 1 - faults / looked-up ids, the faults (rows read back from disk) from
  ``tier_stats()`` over the measured batches, the ids counted with their repeats (a batch's
  repeated id is one row). ``hit_rate_distinct`` counts each batch's distinct ids instead.
- Budgets: for each target hit rate (``--targets``) and eviction policy, the budget is found by
  calibration: the Zipf CDF gives the memory rows k a static cache of the hottest ranks needs;
  a short run measures the policy's hit rate at k, which reads on the CDF as an effective static
  size c * k; the next k is the CDF's k over c (at most ``--calibration-passes`` runs, stopping
  within a quarter of the target's miss rate). The budget is k * (row bytes + 5), the
  store's own price of a memory row (docs/tiered-store.md).
- Throughput: after ``--warmup`` batches on both stores (not timed), ``--rounds`` rounds each
  time one chunk of the measured batches on the unbounded store and on the budgeted one, back
  to back (which goes first alternates); the ratio is budgeted ids/s over unbounded ids/s over
  all rounds (targets: >= 0.8x at 99%, >= 0.5x at 95%), with the per-round range. Afterwards
  both stores' rows are compared bit for bit (ids, weights, optimizer state, counts, steps).
- Disk: bytes on disk per disk row against the payload (8-byte id + weights + optimizer state),
  after training, after expiring half of the rows, and after training on (rows moving up and
  down through the holes).
- RSS: in a fresh process per budget, the growth of the process's resident set (VmHWM after a
  reset, /proc/self) from before the store is loaded to the end of the measured batches, against
  the budget and against the budget plus the stated overhead (the tier's index, the per-shard
  partly filled chunk, the two generations of pinned ids, one batch's buffers).
Prints a table and a final JSON line.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

import native
from benchmarks.store_common import machine, row_ids

STATE_WIDTH = {"sgd": 0, "adagrad": 1, "adam": 2, "ftrl": 2}
HEADER_BYTES = 20      # RowHeader: id, step, time, update count and dirty bit
SLOT_BYTES = 5         # a memory row's table slot at the table's highest load (4 / 0.85)
CHUNK_BYTES = 2 << 20  # a shard's rows live in 2 MiB chunks; one is partly filled
PIN_BYTES_PER_ID = 64  # a pinned id in a hash set (node + bucket), two generations are kept


def row_bytes(dim: int, optimizer: str) -> int:
    """Bytes of one row in either tier: header + weights + optimizer state."""
    return HEADER_BYTES + 4 * dim * (1 + STATE_WIDTH[optimizer])


def memory_row_bytes(dim: int, optimizer: str) -> int:
    """A memory row's share of the budget (MemoryRowBytes in embedding_store.cc)."""
    return row_bytes(dim, optimizer) + SLOT_BYTES


def payload_bytes(dim: int, optimizer: str) -> int:
    """What a row must hold: its 8-byte id, weights and optimizer state."""
    return 8 + 4 * dim * (1 + STATE_WIDTH[optimizer])


class Zipf:
    """Ranks 0..rows-1 with P(r) ~ (r + 1)^-s."""

    def __init__(self, rows: int, exponent: float):
        weights = np.arange(1, rows + 1, dtype=np.float64) ** -exponent
        self.cdf = np.cumsum(weights) / weights.sum()
        self.rows = rows
        self.table_rows = rows  # rows the table holds (the ids the prefill saw), set by run()

    def batches(self, batch: int, count: int, seed: int) -> list[np.ndarray]:
        rng = np.random.default_rng(seed)
        return [row_ids(np.minimum(np.searchsorted(self.cdf, rng.random(batch)), self.rows - 1))
                for _ in range(count)]

    def rows_for(self, hit_rate: float) -> int:
        """Memory rows a static cache of the hottest ranks needs for this hit rate (at most
        the table's rows)."""
        return int(min(self.table_rows, np.searchsorted(self.cdf, hit_rate) + 1))

    def static_hit_rate(self, k: float) -> float:
        k = int(round(min(max(k, 1), self.rows)))
        return float(self.cdf[k - 1])


def config(args, **extra) -> native.StoreConfig:
    optimizer = {"sgd": lambda: native.SGD(0.05), "adagrad": lambda: native.Adagrad(0.05),
                 "adam": lambda: native.Adam(0.001), "ftrl": lambda: native.FTRL(0.05)}[args.optimizer]
    return native.StoreConfig(dim=args.dim, optimizer=optimizer(), seed=1, num_shards=args.shards,
                              **extra)


def budget_for(args, k: int) -> int:
    return max(k, args.shards) * memory_row_bytes(args.dim, args.optimizer)


def tiered(args, snapshot: str, k: int, policy: str, directory: str) -> native.EmbeddingStore:
    shutil.rmtree(directory, ignore_errors=True)
    return native.EmbeddingStore.load(snapshot, config(
        args, memory_budget_bytes=budget_for(args, k), disk_dir=directory, eviction=policy))


class Stepper:
    """Training steps (training lookup, Adagrad update) with the same gradients for every store."""

    def __init__(self, batches: list[np.ndarray], dim: int, seed: int):
        rng = np.random.default_rng(seed)
        self.batches = batches
        self.grads = [rng.normal(size=(len(b), dim)).astype(np.float32) * np.float32(0.01)
                      for b in batches]

    def run(self, store, first_step: int, indices) -> float:
        start = time.perf_counter()
        for i in indices:
            store.lookup(self.batches[i], train=True, now=1.8e9 + first_step + i)
            store.apply_gradients(self.batches[i], self.grads[i], first_step + i,
                                  now=1.8e9 + first_step + i)
        return time.perf_counter() - start


def faults(store) -> int:
    return store._native.tier_stats()["faults"]


def measure_hit_rate(store, stepper: Stepper, first_step: int, indices) -> tuple[float, float]:
    before = faults(store)
    stepper.run(store, first_step, indices)
    missed = faults(store) - before
    ids = sum(len(stepper.batches[i]) for i in indices)
    distinct = sum(len(np.unique(stepper.batches[i])) for i in indices)
    return 1 - missed / ids, 1 - missed / distinct


def calibrate(args, zipf: Zipf, snapshot: str, policy: str, target: float, directory: str) -> dict:
    """The memory rows giving `target` hit rate under `policy` (see the module docstring)."""
    warm = Stepper(zipf.batches(args.batch, args.warmup, seed=101), args.dim, seed=102)
    probe = Stepper(zipf.batches(args.batch, args.calibration_batches, seed=103), args.dim, seed=104)
    k = zipf.rows_for(target)
    passes = []
    for _ in range(args.calibration_passes):
        store = tiered(args, snapshot, k, policy, directory)
        warm.run(store, 1 + args.prefill, range(len(warm.batches)))
        hit, _ = measure_hit_rate(store, probe, 1 + args.prefill + len(warm.batches),
                                  range(len(probe.batches)))
        del store
        passes.append({"memory_rows": k, "hit_rate": hit})
        if abs(hit - target) <= 0.25 * (1 - target):
            break
        k_next = next_guess(zipf, passes, target, args.shards)
        if k_next in {p["memory_rows"] for p in passes}:
            break
        k = k_next
    best = min(passes, key=lambda p: abs(p["hit_rate"] - target))
    return {"memory_rows": best["memory_rows"], "passes": passes}


def next_guess(zipf: Zipf, passes: list[dict], target: float, low: int) -> int:
    """The next memory rows to try: between the closest passes on either side of the target
    (interpolated in log rows against log miss rate), else from the CDF: the last pass behaved
    as a static cache of c * k rows, so try the CDF's rows for the target over c."""
    below = [p for p in passes if p["hit_rate"] < target]
    above = [p for p in passes if p["hit_rate"] >= target]
    if below and above:
        a = max(below, key=lambda p: p["memory_rows"])
        b = min(above, key=lambda p: p["memory_rows"])
        miss_a, miss_b = 1 - a["hit_rate"], max(1 - b["hit_rate"], 1e-9)
        if miss_a <= miss_b or b["memory_rows"] - a["memory_rows"] <= 1:
            return b["memory_rows"]
        t = np.log(miss_a / (1 - target)) / np.log(miss_a / miss_b)
        k = np.exp(np.log(a["memory_rows"]) + t * np.log(b["memory_rows"] / a["memory_rows"]))
        return int(min(b["memory_rows"] - 1, max(a["memory_rows"] + 1, round(k))))
    last = passes[-1]
    c = zipf.rows_for(min(last["hit_rate"], 1.0)) / last["memory_rows"]
    k = zipf.rows_for(target) / max(c, 1e-3)
    if below:  # never less than the largest size that fell short
        k = max(k, 1.25 * last["memory_rows"])
    return int(min(zipf.table_rows, max(low, round(k))))


def compare_rows(a, b) -> None:
    rows_a, rows_b = a.to_numpy(), b.to_numpy()
    order_a, order_b = np.argsort(rows_a["ids"]), np.argsort(rows_b["ids"])
    for column in rows_a:
        if rows_a[column][order_a].tobytes() != rows_b[column][order_b].tobytes():
            raise AssertionError(f"budgeted and unbounded stores differ in {column}")


def disk_figures(store, args) -> dict:
    tiers = store._native.tier_stats()
    payload = payload_bytes(args.dim, args.optimizer)
    per_row = tiers["disk_bytes"] / tiers["disk_rows"] if tiers["disk_rows"] else 0.0
    return {"disk_rows": tiers["disk_rows"], "disk_bytes": tiers["disk_bytes"],
            "disk_bytes_per_row": per_row, "disk_vs_payload": per_row / payload}


def compare(args, zipf: Zipf, snapshot: str, policy: str, target: float, k: int,
            directory: str) -> dict:
    """Unbounded and budgeted stores on the same batches: throughput, hit rate, exactness, disk."""
    warm = Stepper(zipf.batches(args.batch, args.warmup, seed=201), args.dim, seed=202)
    measured = Stepper(zipf.batches(args.batch, args.batches, seed=203), args.dim, seed=204)
    plain = native.EmbeddingStore.load(snapshot, config(args))
    budgeted = tiered(args, snapshot, k, policy, directory)
    for store in (plain, budgeted):
        warm.run(store, 1 + args.prefill, range(len(warm.batches)))
    first = 1 + args.prefill + len(warm.batches)
    rows_before = len(plain)
    chunks = np.array_split(np.arange(len(measured.batches)), args.rounds)
    plain_s, tiered_s = [], []
    before = faults(budgeted)
    for r, chunk in enumerate(chunks):
        sides = [(plain, plain_s), (budgeted, tiered_s)][:: 1 if r % 2 == 0 else -1]
        for store, times in sides:
            times.append(measured.run(store, first, chunk))
    missed = faults(budgeted) - before
    new_rows = len(plain) - rows_before
    ids = sum(len(b) for b in measured.batches)
    distinct = sum(len(np.unique(b)) for b in measured.batches)
    compare_rows(plain, budgeted)  # raises if any row differs
    ratios = [p / t for p, t in zip(plain_s, tiered_s)]
    result = {
        "policy": policy, "target": target, "memory_rows": k,
        "memory_budget_bytes": budget_for(args, k), "table_rows": rows_before,
        "budget_share_of_rows": k / rows_before, "new_rows": new_rows,
        "hit_rate": 1 - missed / ids, "hit_rate_distinct": 1 - missed / distinct,
        "unbounded_ids_per_s": ids / sum(plain_s), "tiered_ids_per_s": ids / sum(tiered_s),
        "exact": True,
    }
    result["throughput_ratio"] = sum(plain_s) / sum(tiered_s)
    result["ratio_min"], result["ratio_max"] = min(ratios), max(ratios)
    result["disk_after_training"] = disk_figures(budgeted, args)
    # Expire half of the rows (wherever they are), then train on: the holes must be reused or
    # given back.
    for store in (plain, budgeted):
        store.expire_where(lambda i, *rest: (i % 2) == 0)
    result["disk_after_expiry"] = disk_figures(budgeted, args)
    measured.run(plain, first + len(measured.batches), range(len(measured.batches)))
    measured.run(budgeted, first + len(measured.batches), range(len(measured.batches)))
    result["disk_after_churn"] = disk_figures(budgeted, args)
    compare_rows(plain, budgeted)
    del plain, budgeted
    gc.collect()
    return result


# -- RSS, in a fresh process per budget ---------------------------------------------------------

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def rss_child(args) -> dict:
    """Runs in a fresh process: RSS growth of loading the snapshot and training on it."""
    zipf = Zipf(args.rows, args.zipf)
    stepper = Stepper(zipf.batches(args.batch, args.rss_batches, seed=301), args.dim, seed=302)
    first = 1 + args.prefill
    k = args.rss_memory_rows
    extra = {}
    if k > 0:
        extra = dict(memory_budget_bytes=budget_for(args, k), disk_dir=args.rss_disk_dir,
                     eviction=args.rss_policy)
    gc.collect()
    base_kib = _status_kib("VmRSS")
    peak_reset = _reset_peak()
    store = native.EmbeddingStore.load(args.rss_snapshot, config(args, **extra))
    stepper.run(store, first, range(len(stepper.batches)))
    peak_kib = _status_kib("VmHWM")
    end_kib = _status_kib("VmRSS")
    stats = store.stats()
    tiers = store._native.tier_stats()
    return {"memory_rows_cap": k, "budget_bytes": extra.get("memory_budget_bytes", 0),
            "rss_growth_bytes": (end_kib - base_kib) * 1024,
            "peak_rss_growth_bytes": (peak_kib - base_kib) * 1024 if peak_reset else None,
            "store_bytes": stats.bytes, "rows": stats.rows, "memory_rows": tiers["memory_rows"],
            "disk_rows": tiers["disk_rows"]}


def overhead_bound(args, disk_rows: int) -> int:
    """What a budgeted store may hold in RAM beyond its budget (README, "Sizing a memory
    budget"): the tier's index (18 B a disk row at most), one partly filled and one spare 2 MiB
    chunk a shard, two generations of pinned ids, and eight batches of ids + embeddings: the
    calls' arrays and gradients, the store's copies, and the freed ones the allocator keeps
    (glibc raises its mmap threshold to the size of a freed block, so later batch buffers come
    from the heap and stay)."""
    batch_bytes = args.batch * (8 + 4 * args.dim) * 8
    return (18 * disk_rows + 2 * CHUNK_BYTES * args.shards + 2 * PIN_BYTES_PER_ID * args.batch
            + batch_bytes)


def measure_rss(args, snapshot: str, k: int, policy: str, directory: str) -> dict:
    shutil.rmtree(directory, ignore_errors=True)
    command = [sys.executable, "-m", "benchmarks.store_tiers", "--rss-child",
               "--rows", str(args.rows), "--dim", str(args.dim), "--optimizer", args.optimizer,
               "--shards", str(args.shards), "--batch", str(args.batch), "--zipf", str(args.zipf),
               "--rss-batches", str(args.rss_batches), "--prefill", str(args.prefill),
               "--rss-snapshot", snapshot,
               "--rss-memory-rows", str(k), "--rss-policy", policy, "--rss-disk-dir", directory]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    shutil.rmtree(directory, ignore_errors=True)
    if k > 0:
        result["overhead_bound_bytes"] = overhead_bound(args, result["disk_rows"])
        growth = result["peak_rss_growth_bytes"] or result["rss_growth_bytes"]
        result["growth_vs_budget"] = growth / result["budget_bytes"]
        result["within_budget_plus_overhead"] = (
            growth <= result["budget_bytes"] + result["overhead_bound_bytes"])
    else:
        result["rss_bytes_per_row"] = result["rss_growth_bytes"] / result["rows"]
    return result


# -- the run ------------------------------------------------------------------------------------

def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows of the table (Zipf ranks)")
    parser.add_argument("--dim", "--dims", type=int, default=16, help="embedding dim")
    parser.add_argument("--optimizer", default="adagrad", choices=sorted(STATE_WIDTH))
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--batch", type=int, default=50_000, help="ids per training step")
    parser.add_argument("--batches", type=int, default=40, help="measured steps per budget")
    parser.add_argument("--prefill", type=int, default=200,
                        help="training steps that make the table (its rows: the ids they saw)")
    parser.add_argument("--warmup", type=int, default=40, help="untimed steps before measuring")
    parser.add_argument("--rounds", type=int, default=4, help="alternating timed rounds")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent s")
    parser.add_argument("--targets", default="0.99,0.95,0.9", help="target hit rates")
    parser.add_argument("--policies", default="lru,lfu", help="eviction policies")
    parser.add_argument("--calibration-batches", type=int, default=10)
    parser.add_argument("--calibration-passes", type=int, default=4)
    parser.add_argument("--rss-batches", type=int, default=20, help="steps of each RSS run (0: none)")
    parser.add_argument("--dir", default=None, help="directory for snapshots and disk tiers")
    parser.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rss-snapshot", help=argparse.SUPPRESS)
    parser.add_argument("--rss-memory-rows", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rss-policy", default="lru", help=argparse.SUPPRESS)
    parser.add_argument("--rss-disk-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def run(argv=None) -> dict:
    args = parse(argv)
    if args.rss_child:
        result = rss_child(args)
        print(json.dumps(result))
        return result
    directory = args.dir or tempfile.mkdtemp(prefix="store-tiers-bench-")
    os.makedirs(directory, exist_ok=True)
    targets = [float(t) for t in args.targets.split(",")]
    policies = args.policies.split(",")
    zipf = Zipf(args.rows, args.zipf)
    results, calibration, rss = [], {}, []
    try:
        snapshot = os.path.join(directory, "base")
        base = native.EmbeddingStore(config(args))
        Stepper(zipf.batches(args.batch, args.prefill, seed=11), args.dim, seed=12).run(
            base, 1, range(args.prefill))
        zipf.table_rows = len(base)
        base.save(snapshot)
        del base
        gc.collect()
        tiers = os.path.join(directory, "tiers")
        for policy in policies:
            for target in targets:
                found = calibrate(args, zipf, snapshot, policy, target, tiers)
                calibration[f"{policy}@{target}"] = found
                entry = compare(args, zipf, snapshot, policy, target, found["memory_rows"], tiers)
                results.append(entry)
                print_entry(entry, header=len(results) == 1)
        if args.rss_batches > 0:
            rss.append(dict(measure_rss(args, snapshot, 0, "lru", tiers), policy=None, target=None))
            for entry in results:
                rss.append(dict(measure_rss(args, snapshot, entry["memory_rows"], entry["policy"],
                                            tiers), policy=entry["policy"], target=entry["target"]))
            print_rss(rss)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    summary = {"benchmark": "store_tiers", "machine": machine(), "rows": args.rows,
               "table_rows": zipf.table_rows, "prefill": args.prefill, "dim": args.dim,
               "optimizer": args.optimizer, "shards": args.shards, "batch": args.batch,
               "batches": args.batches, "warmup": args.warmup, "zipf": args.zipf,
               "row_bytes": row_bytes(args.dim, args.optimizer),
               "memory_row_bytes": memory_row_bytes(args.dim, args.optimizer),
               "payload_bytes": payload_bytes(args.dim, args.optimizer),
               "static_rows_for": {str(t): zipf.rows_for(t) for t in targets},
               "calibration": calibration, "results": results, "rss": rss}
    print(json.dumps(summary))
    return summary


def print_entry(entry: dict, header: bool) -> None:
    if header:
        print(f"{'policy':6} {'target':>6} {'rows in RAM':>12} {'share':>7} {'hit':>7} "
              f"{'hit(dist)':>9} {'DRAM ids/s':>11} {'tiered ids/s':>12} {'ratio':>6} "
              f"{'range':>11} {'disk/payload':>13} {'after expiry':>12} {'after churn':>11}")
    m = lambda x: f"{x / 1e6:.2f}M"  # noqa: E731
    print(f"{entry['policy']:6} {entry['target']:6.0%} {entry['memory_rows']:12,} "
          f"{entry['budget_share_of_rows']:7.2%} {entry['hit_rate']:7.2%} "
          f"{entry['hit_rate_distinct']:9.2%} {m(entry['unbounded_ids_per_s']):>11} "
          f"{m(entry['tiered_ids_per_s']):>12} {entry['throughput_ratio']:5.2f}x "
          f"{entry['ratio_min']:4.2f}-{entry['ratio_max']:4.2f}x "
          f"{entry['disk_after_training']['disk_vs_payload']:12.2f}x "
          f"{entry['disk_after_expiry']['disk_vs_payload']:11.2f}x "
          f"{entry['disk_after_churn']['disk_vs_payload']:10.2f}x", flush=True)


def print_rss(rss: list[dict]) -> None:
    print(f"\n{'RSS run':14} {'budget MB':>10} {'growth MB':>10} {'peak MB':>8} {'x budget':>9} "
          f"{'bound MB':>9} {'memory rows':>12} {'disk rows':>10}")
    for r in rss:
        name = "unbounded" if r["policy"] is None else f"{r['policy']}@{r['target']:.0%}"
        peak = r["peak_rss_growth_bytes"]
        bound = (r["budget_bytes"] + r["overhead_bound_bytes"]) / 1e6 if r["policy"] else None
        print(f"{name:14} {r['budget_bytes'] / 1e6:10.1f} {r['rss_growth_bytes'] / 1e6:10.1f} "
              f"{(peak or 0) / 1e6:8.1f} "
              f"{r.get('growth_vs_budget', float('nan')):8.2f}x "
              f"{bound if bound is not None else float('nan'):9.1f} {r['memory_rows']:12,} "
              f"{r['disk_rows']:10,}")
        if r["policy"] is None:
            print(f"{'':14} unbounded: {r['rss_bytes_per_row']:.1f} B of RSS a row")


if __name__ == "__main__":
    run()
