"""Benchmark of object storage and of the Beam job on a Dask cluster, each a ratio
against a baseline of the same run.

    python -m benchmarks.cloud --samples 2000000 --train-samples 2000000 --repeats 2

The servers are the tests' real components, started here: moto's S3 server on a loopback port
(``tests/support/s3_server.py``) and a Dask ``LocalCluster`` of ``--dask-workers`` worker
processes (``tests/support/dask_cluster.py``). The raw data are ``pipelines.generate``'s
Parquet files (taobao_like, seed 7).

1. **Beam job on s3://**: ``pipelines.compress`` on the FnApiRunner, input read from and trees
   written to local disk, then to ``s3://`` on the server (the protocol's cost: the server is a
   Python process on the same 2 cores, not a network); wall-time ratio, and the CPU of the job
   and of the server per million samples.
2. **DaskRunner**: the same job on the local files, FnApiRunner against the DaskRunner on the
   cluster; wall-time ratio and CPU seconds per million samples of every process that works
   (this one, which holds the Dask scheduler, and the workers and their nannies).
3. **trainer.train from s3://**: one epoch of the paper's MLP on the job's trees, read from
   local files and from ``s3://``; wall-time ratio of the training (target at most 1.1x: the
   reading overlaps the training).

Runs are interleaved ``--repeats`` times; medians reported, and the ratio of the best runs
(``*_best``: on a machine other work shares, the least disturbed run of each). Prints a table
and a final JSON line.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import schemas
from benchmarks.compression import cpu_seconds, machine, tree_cpu_seconds
from compression import fs

SCHEMA = "schemas/examples/taobao_like.yaml"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASK_RUNNER = "--runner=apache_beam.runners.dask.dask_runner.DaskRunner"
_STATS_KEYS = ("samples", "trees", "nodes", "ids_flat", "ids_in_trees")


def _support(name: str):
    """A module of the tests' real components (the S3 server, the Dask cluster)."""
    support = os.path.join(ROOT, "tests", "support")
    if support not in sys.path:
        sys.path.insert(0, support)
    return __import__(name)


def _descendants_cpu() -> float:
    """CPU seconds of every live descendant process (Dask workers and nannies, the server)."""
    return tree_cpu_seconds(include_root=False)


def _timed(fn, others=None) -> tuple[float, float, float, object]:
    """``(wall seconds, this process's CPU seconds, others()'s CPU seconds, fn())``."""
    start, cpu, other = time.perf_counter(), cpu_seconds(), others() if others else 0.0
    result = fn()
    return (time.perf_counter() - start, cpu_seconds() - cpu,
            (others() - other) if others else 0.0, result)


def _job(raw: str, out: str, shards: int, *extra: str) -> dict:
    from pipelines import compress as job

    return job.run(["--schema", SCHEMA, "--input", raw, "--output", out, "--shards",
                    str(shards), "--overwrite", *extra])


def _warm_up(raw_dir: str, work: str, shards: int) -> None:
    """One untimed job on one input file: the first runs of a process pay for imports and
    Beam's set-up, which the first timed run would otherwise carry alone."""
    first = sorted(glob.glob(os.path.join(raw_dir, "*.parquet")))[0]
    _job(first, os.path.join(work, "warm-up"), shards)


def _check(summary: dict, reference: dict, what: str) -> None:
    for key in _STATS_KEYS:
        if summary[key] != reference[key]:
            raise AssertionError(f"{what}: {key} {summary[key]} != {reference[key]}")


def bench_beam_s3(raw_dir: str, bucket: str, work: str, shards: int, repeats: int,
                  server_pid: int) -> dict:
    """The job on local files against the job on s3:// (the same files uploaded)."""
    fs.upload_directory(raw_dir, f"{bucket}/raw")
    _warm_up(raw_dir, work, shards)
    local, remote = {"wall": [], "cpu": []}, {"wall": [], "cpu": [], "server_cpu": []}
    reference = None
    server = lambda: cpu_seconds(server_pid)  # noqa: E731
    for _ in range(repeats):
        wall, cpu, _, summary = _timed(lambda: _job(os.path.join(raw_dir, "*.parquet"),
                                                    os.path.join(work, "trees"), shards))
        reference = reference or summary
        local["wall"].append(wall)
        local["cpu"].append(cpu)
        wall, cpu, server_cpu, summary = _timed(
            lambda: _job(f"{bucket}/raw/*.parquet", f"{bucket}/trees", shards), server)
        _check(summary, reference, "s3")
        remote["wall"].append(wall)
        remote["cpu"].append(cpu)
        remote["server_cpu"].append(server_cpu)
    samples = reference["samples"]
    per_million = 1e6 / samples
    med = statistics.median
    return {"samples": samples, "shards": shards,
            "local_seconds": med(local["wall"]), "s3_seconds": med(remote["wall"]),
            "s3_over_local": med(remote["wall"]) / med(local["wall"]),
            "s3_over_local_best": min(remote["wall"]) / min(local["wall"]),
            "s3_over_local_cpu": (med(remote["cpu"]) + med(remote["server_cpu"]))
            / med(local["cpu"]),
            "local_cpu_s_per_million": med(local["cpu"]) * per_million,
            "s3_job_cpu_s_per_million": med(remote["cpu"]) * per_million,
            "s3_server_cpu_s_per_million": med(remote["server_cpu"]) * per_million,
            "runs_local": local["wall"], "runs_s3": remote["wall"]}


def bench_dask(raw_dir: str, work: str, shards: int, repeats: int, workers: int) -> dict:
    """FnApiRunner against the DaskRunner on a local cluster, on the same local files."""
    dask_cluster = _support("dask_cluster")
    raw = os.path.join(raw_dir, "*.parquet")
    _warm_up(raw_dir, work, shards)
    fnapi, dask = {"wall": [], "cpu": []}, {"wall": [], "cpu": []}
    with dask_cluster.local_dask_cluster(workers=workers) as cluster:
        reference = None
        for _ in range(repeats):
            wall, cpu, _, summary = _timed(lambda: _job(raw, os.path.join(work, "fnapi"),
                                                        shards, "--runner=FnApiRunner"))
            reference = reference or summary
            fnapi["wall"].append(wall)
            fnapi["cpu"].append(cpu)
            wall, cpu, others, summary = _timed(
                lambda: _job(raw, os.path.join(work, "dask"), shards, DASK_RUNNER,
                             f"--dask_client_address={cluster.scheduler_address}"),
                _descendants_cpu)
            _check(summary, reference, "dask")
            dask["wall"].append(wall)
            dask["cpu"].append(cpu + others)
    samples = reference["samples"]
    med = statistics.median
    return {"samples": samples, "shards": shards, "workers": workers,
            "fnapi_seconds": med(fnapi["wall"]), "dask_seconds": med(dask["wall"]),
            "dask_over_fnapi": med(dask["wall"]) / med(fnapi["wall"]),
            "dask_over_fnapi_best": min(dask["wall"]) / min(fnapi["wall"]),
            "fnapi_cpu_s_per_million": med(fnapi["cpu"]) * 1e6 / samples,
            "dask_cpu_s_per_million": med(dask["cpu"]) * 1e6 / samples,
            "runs_fnapi": fnapi["wall"], "runs_dask": dask["wall"]}


def bench_train_s3(trees_dir: str, bucket: str, work: str, repeats: int,
                   batch_size: int) -> dict:
    """One epoch of trainer.train on the same trees, local and on s3://."""
    from trainer import train

    fs.upload_directory(trees_dir, f"{bucket}/train-trees")
    sources = {"local": os.path.join(trees_dir, "*.parquet"),
               "s3": f"{bucket}/train-trees/*.parquet"}
    def trained(data: str, out: str) -> dict:
        return train.run(["--schema", SCHEMA, "--train-data", data, "--model", "mlp",
                          "--batch-size", str(batch_size), "--epochs", "1", "--seed", "3",
                          "--no-progress", "--out", out])

    # untimed, on one file: TensorFlow's import and first traces are not the store's cost
    trained(sorted(glob.glob(sources["local"]))[0], os.path.join(work, "run-warm-up"))
    walls = {name: [] for name in sources}
    train_seconds = {name: [] for name in sources}
    results = {}
    for i in range(repeats):
        for name, data in sources.items():
            out = os.path.join(work, f"run-{name}-{i}")
            wall, _, _, result = _timed(lambda: trained(data, out))
            walls[name].append(wall)
            train_seconds[name].append(result["train_seconds"])
            results[name] = result
            shutil.rmtree(out, ignore_errors=True)
    if results["local"]["samples"] != results["s3"]["samples"] or \
            results["local"]["loss"] != results["s3"]["loss"]:
        raise AssertionError(f"s3 and local runs differ: {results}")
    med = statistics.median
    return {"samples": results["local"]["samples"], "batch_size": batch_size,
            "local_seconds": med(walls["local"]), "s3_seconds": med(walls["s3"]),
            "s3_over_local": med(walls["s3"]) / med(walls["local"]),
            "s3_over_local_best": min(walls["s3"]) / min(walls["local"]),
            "local_train_seconds": med(train_seconds["local"]),
            "s3_train_seconds": med(train_seconds["s3"]),
            "s3_over_local_train": med(train_seconds["s3"]) / med(train_seconds["local"]),
            "runs_local": walls["local"], "runs_s3": walls["s3"]}


def run(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cloud", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=2_000_000,
                   help="samples of the Beam jobs (1, 2)")
    p.add_argument("--train-samples", type=int, default=2_000_000,
                   help="samples trained on (3): the trees of the first this many samples")
    p.add_argument("--shards", type=int, default=8, help="the job's --shards")
    p.add_argument("--dask-workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=5000, help="trainer.train --batch-size")
    p.add_argument("--repeats", type=int, default=1, help="interleaved runs (median)")
    p.add_argument("--skip", default="", help="parts to skip, e.g. 'dask,train'")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    from pipelines.generate import generate

    s3_server = _support("s3_server")
    work = tempfile.mkdtemp(prefix="bench-cloud-")
    result = {"benchmark": "cloud", "machine": machine(), "load_average": os.getloadavg()}
    try:
        raw = os.path.join(work, "raw")
        generate(schemas.load(SCHEMA), args.samples, raw, seed=args.seed)
        with s3_server.moto_s3_server() as server, server.environment():
            bucket = server.create_bucket()
            if "beam" not in skip:
                result["beam_s3"] = bench_beam_s3(raw, bucket, work, args.shards,
                                                  args.repeats, server.process.pid)
            if "dask" not in skip:
                result["dask"] = bench_dask(raw, work, args.shards, args.repeats,
                                            args.dask_workers)
            if "train" not in skip:
                trees = os.path.join(work, "train-trees")
                raw_train = os.path.join(work, "raw-train")
                if args.train_samples == args.samples:
                    raw_train = raw
                else:
                    generate(schemas.load(SCHEMA), args.train_samples, raw_train,
                             seed=args.seed)
                _job(os.path.join(raw_train, "*.parquet"), trees, args.shards)
                result["train_s3"] = bench_train_s3(trees, bucket, work, args.repeats,
                                                    args.batch_size)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["load_average_after"] = os.getloadavg()
    return result


def report(result: dict) -> None:
    beam, dask, train = (result.get(k) for k in ("beam_s3", "dask", "train_s3"))
    print("| measure | baseline | measured | ratio |\n| --- | --- | --- | --- |")
    if beam:
        print(f"| pipelines.compress, {beam['samples']:,} samples: local files vs s3:// "
              f"(moto) | {beam['local_seconds']:.2f} s | {beam['s3_seconds']:.2f} s | "
              f"**{beam['s3_over_local']:.2f}x** (best {beam['s3_over_local_best']:.2f}x, "
              f"CPU {beam['s3_over_local_cpu']:.2f}x) |")
        print(f"| CPU s per million samples: job local vs job on s3 (+ S3 server) | "
              f"{beam['local_cpu_s_per_million']:.2f} | "
              f"{beam['s3_job_cpu_s_per_million']:.2f} "
              f"(+ {beam['s3_server_cpu_s_per_million']:.2f}) | |")
    if dask:
        print(f"| pipelines.compress, {dask['samples']:,} samples: FnApiRunner vs DaskRunner "
              f"({dask['workers']} workers) | {dask['fnapi_seconds']:.2f} s | "
              f"{dask['dask_seconds']:.2f} s | **{dask['dask_over_fnapi']:.2f}x** "
              f"(best {dask['dask_over_fnapi_best']:.2f}x) |")
        print(f"| CPU s per million samples, all processes | "
              f"{dask['fnapi_cpu_s_per_million']:.2f} | {dask['dask_cpu_s_per_million']:.2f} "
              f"| {dask['dask_cpu_s_per_million'] / dask['fnapi_cpu_s_per_million']:.2f}x |")
    if train:
        print(f"| trainer.train, 1 epoch, {train['samples']:,} samples: local trees vs s3:// "
              f"| {train['local_seconds']:.2f} s | {train['s3_seconds']:.2f} s | "
              f"**{train['s3_over_local']:.2f}x** (best {train['s3_over_local_best']:.2f}x, "
              f"training alone "
              f"{train['s3_over_local_train']:.2f}x) |")
    print(json.dumps(result))


def main(argv=None) -> int:
    report(run(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
