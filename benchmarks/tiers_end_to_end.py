"""End to end with tables larger than their memory budget: trainer.train and trainer.serve.

    python -m benchmarks.tiers_end_to_end                    # 400k train / 100k eval samples
    python -m benchmarks.tiers_end_to_end --samples 6000 --eval-samples 2000 --serve-seconds 2 \\
        --rounds 1                                            # CI size

On generated data (taobao_like, seeds 0 and 1), in the same run:
- ``trainer.train`` as a user runs it (raw Parquet in, trees built on the way, one epoch, eval,
  serving export), without a budget and with every table that has at least 64 rows given a
  memory budget of a quarter of its rows (``--fraction``; the rows counted in the training data,
  a row's bytes by the README's formula ``20 + 4 * dim * (1 + k) + 5``; tables of fewer rows are
  left unbounded: a budget must hold a row per store shard). Runs alternate (unbounded,
  budgeted, budgeted, unbounded... ``--rounds``), each in a process of its own; reported:
  samples/s from result.json, their ratio (target >= 0.7x), eval AUC of each (equal: the
  budgeted store is exact), the hit rate (1 - rows read back from disk / ids looked up, over
  the budgeted tables; the reads counted whether the pipeline's prefetch or the lookup made
  them) and peak RSS of each run.
- ``trainer.serve`` on the unbounded run's export, all in memory and with ``--memory-budget`` a
  quarter of its tables' rows: 1 user x ``--candidates`` candidates ranking requests built from
  the eval data (so most users' rows are not in memory at first) from ``--clients`` locust
  clients for ``--serve-seconds``: p50/p99 and candidates/s (target p99 <= 2x).
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq

import schemas
from benchmarks import serving as serving_benchmark
from benchmarks.compression import machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = os.path.join(ROOT, "schemas", "examples", "taobao_like.yaml")
# Adagrad (the default optimizer): one state vector a row.
STATE_VECTORS = 1


def row_bytes(dim: int, state_vectors: int = STATE_VECTORS) -> int:
    """A memory row's bytes of the budget (README, "Sizing a memory budget")."""
    return 20 + 4 * dim * (1 + state_vectors) + 5


def table_rows(schema, directory: str) -> dict[str, int]:
    """Distinct ids of every id/ids feature in the training files: the rows of the table named
    after it (the default config: a table per feature, no entry filter)."""
    table = pq.read_table(directory)
    rows = {}
    for layer in schema.layers:
        for feature in layer.features:
            if feature.kind not in ("id", "ids"):
                continue
            column = table.column(feature.name).combine_chunks()
            if feature.kind == "ids":
                column = column.flatten()
            values = column.drop_null().to_numpy(zero_copy_only=False)
            rows[feature.name] = int(len(np.unique(values)))
    return rows


def _run(command: list[str]) -> dict:
    """Runs a command in a process of its own; its peak RSS (MiB) and exit status."""
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    _, status, usage = os.wait4(child.pid, 0)
    out, err = child.stdout.read(), child.stderr.read()
    child.stdout.close()
    child.stderr.close()
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({child.returncode}):\n{err[-3000:]}")
    return {"peak_rss_mib": usage.ru_maxrss / 1024, "stdout": out}


def train(args, work: str, data: dict, config: str | None, name: str) -> dict:
    out = os.path.join(work, f"run-{name}")
    export = os.path.join(work, f"export-{name}")
    command = [sys.executable, "-m", "trainer.train", "--schema", SCHEMA, "--train-data",
               data["train"], "--eval-data", data["eval"], "--epochs", str(args.epochs),
               "--batch-size", str(args.batch_size), "--out", out, "--export-dir", export,
               "--overwrite", "--no-progress"]
    if config:
        command += ["--config", config]
    started = time.perf_counter()
    ran = _run(command)
    seconds = time.perf_counter() - started
    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    tiers = result.get("tiers") or {}
    lookups = sum(t["lookups"] for t in tiers.values() if t.get("budget_bytes"))
    # rows read back from disk, by a lookup or update (faults) or ahead of it (prefetched)
    faults = sum(t["faults"] + t["prefetched"] for t in tiers.values() if t.get("budget_bytes"))
    prefetched = sum(t["prefetched"] for t in tiers.values() if t.get("budget_bytes"))
    summary = {"samples_per_sec": result["samples_per_sec"], "auc": result["auc"],
               "logloss": result["logloss"], "store_rows": result["store_rows"],
               "wall_seconds": seconds, "peak_rss_mib": ran["peak_rss_mib"],
               "hit_rate": 1 - faults / lookups if lookups else None,
               "prefetched_share": prefetched / faults if faults else None,
               "disk_rows": sum(t["disk_rows"] for t in tiers.values()) if tiers else 0}
    shutil.rmtree(out, ignore_errors=True)
    return {"summary": summary, "export": export}


def serve(args, work: str, export: str, budget: int | None, bodies: str) -> dict:
    flags = [] if budget is None else ["--memory-budget", str(budget)]
    service = serving_benchmark.Service(export, *flags)
    try:
        serving_benchmark.locust_load(service, bodies, 1, 1, work)  # warm: the model traced
        result = serving_benchmark.locust_load(service, bodies, args.clients,
                                               args.serve_seconds, work)
    finally:
        service.stop()
    result["candidates_per_sec"] = result["requests_per_sec"] * args.candidates
    return result


def ranking_bodies(schema, directory: str, candidates: int, path: str, count: int = 64) -> None:
    """``count`` ranking requests, each one user of the eval data with ``candidates`` ad parts
    of other eval samples, as trainer.serve takes them."""
    from pipelines.replay import json_lines

    table = pq.read_table(directory)
    rows = [json.loads(line) for line in json_lines(table, schema).to_pylist()]
    users = [f.name for f in schema.layers[0].features]
    rng = np.random.default_rng(3)
    with open(path, "w") as f:
        for _ in range(count):
            picks = rng.choice(len(rows), candidates + 1, replace=False)
            root = {n: rows[picks[0]][n] for n in users}
            parts = [{n: v for n, v in rows[i].items()
                      if n not in users and n not in schema.labels} for i in picks[1:]]
            f.write(json.dumps({"root": root, "candidates": parts}) + "\n")


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tiers_end_to_end",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=400_000, help="training samples")
    parser.add_argument("--eval-samples", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=5000)
    parser.add_argument("--fraction", type=float, default=0.25,
                        help="each budgeted table's budget as a fraction of its rows' bytes")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternations of the unbounded and budgeted training runs")
    parser.add_argument("--clients", type=int, default=8, help="locust clients of the service")
    parser.add_argument("--candidates", type=int, default=100)
    parser.add_argument("--serve-seconds", type=float, default=20)
    parser.add_argument("--work", help="working directory (default: a temporary one)")
    args = parser.parse_args(argv)
    if not 0 < args.fraction < 1:
        parser.error(f"--fraction must be in (0, 1), got {args.fraction}")

    schema = schemas.load(SCHEMA)
    work = args.work or tempfile.mkdtemp(prefix="tiers-e2e-")
    os.makedirs(work, exist_ok=True)
    data = {"train": os.path.join(work, "train"), "eval": os.path.join(work, "eval")}
    for name, samples, seed in (("train", args.samples, 0), ("eval", args.eval_samples, 1)):
        if not os.path.exists(os.path.join(data[name], "_truth.json")):
            subprocess.run([sys.executable, "-m", "pipelines.generate", "--schema", SCHEMA,
                            "--samples", str(samples), "--seed", str(seed), "--out", data[name],
                            "--no-progress", "--overwrite"], cwd=ROOT, check=True,
                           capture_output=True)
    dim = 18  # TableConfig's default dim
    rows = table_rows(schema, data["train"])
    budgets = {t: max(int(n * row_bytes(dim) * args.fraction), 16 * row_bytes(dim))
               for t, n in rows.items() if n >= 64}
    config = os.path.join(work, "budgets.yaml")
    with open(config, "w") as f:
        f.write("tables:\n")
        for table, budget in budgets.items():
            f.write(f"  {table}: {{memory_budget: {budget}}}\n")
    budgeted_rows = sum(rows[t] for t in budgets)
    result = {"machine": machine(), "samples": args.samples, "eval_samples": args.eval_samples,
              "epochs": args.epochs, "fraction": args.fraction, "table_rows": rows,
              "budgets": budgets, "budgeted_rows": budgeted_rows,
              "budgeted_row_bytes": budgeted_rows * row_bytes(dim),
              "budget_bytes": sum(budgets.values()), "train": {"unbounded": [], "budgeted": []}}

    exports = {}
    for k in range(args.rounds):
        order = ("unbounded", "budgeted") if k % 2 == 0 else ("budgeted", "unbounded")
        for name in order:
            done = train(args, work, data, config if name == "budgeted" else None, name)
            result["train"][name].append(done["summary"])
            exports[name] = done["export"]
            print(f"train {name}: {done['summary']}", file=sys.stderr, flush=True)
    plain = np.median([r["samples_per_sec"] for r in result["train"]["unbounded"]])
    tiered = np.median([r["samples_per_sec"] for r in result["train"]["budgeted"]])
    result["train_ratio"] = float(tiered / plain)
    result["auc_difference"] = max(
        abs(a["auc"] - b["auc"]) for a in result["train"]["unbounded"]
        for b in result["train"]["budgeted"])

    bodies = os.path.join(work, "bodies.jsonl")
    ranking_bodies(schema, data["eval"], args.candidates, bodies)
    serve_budget = int(sum(rows.values()) * row_bytes(dim) * args.fraction)
    result["serve_budget_bytes"] = serve_budget
    result["serve"] = {"in_memory": serve(args, work, exports["unbounded"], None, bodies),
                       "budgeted": serve(args, work, exports["unbounded"], serve_budget, bodies)}
    result["serve_p99_ratio"] = (result["serve"]["budgeted"]["p99_ms"]
                                 / result["serve"]["in_memory"]["p99_ms"])
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return result


def main(argv=None) -> int:
    result = run(argv)
    t = result["train"]
    print(f"| trainer.train, {result['samples']:,} samples, {result['epochs']} epoch(s) "
          f"| unbounded | budget {result['fraction']:.2f}x of the rows |")
    print("| --- | --- | --- |")
    print("| samples/s (each run) | "
          + ", ".join(f"{r['samples_per_sec']:,.0f}" for r in t["unbounded"]) + " | "
          + ", ".join(f"{r['samples_per_sec']:,.0f}" for r in t["budgeted"]) + " |")
    print(f"| **ratio (medians)** | | **{result['train_ratio']:.2f}x** |")
    print("| eval AUC | " + ", ".join(f"{r['auc']:.6f}" for r in t["unbounded"]) + " | "
          + ", ".join(f"{r['auc']:.6f}" for r in t["budgeted"]) + " |")
    print("| hit rate | | " + ", ".join(f"{r['hit_rate']:.4f}" for r in t["budgeted"]) + " |")
    print("| peak RSS MiB | " + ", ".join(f"{r['peak_rss_mib']:.0f}" for r in t["unbounded"])
          + " | " + ", ".join(f"{r['peak_rss_mib']:.0f}" for r in t["budgeted"]) + " |")
    s = result["serve"]
    print(f"\n| trainer.serve, {s['in_memory']['users']} clients | in memory | budget |")
    print("| --- | --- | --- |")
    for key in ("p50_ms", "p99_ms", "candidates_per_sec", "non_200"):
        print(f"| {key} | {s['in_memory'][key]:,.1f} | {s['budgeted'][key]:,.1f} |")
    print(f"| **p99 ratio** | | **{result['serve_p99_ratio']:.2f}x** |")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
