"""Online learning on Ray against one process: CPU per sample of every process, samples/s, and
the per-step costs that scale it on paper (``python -m benchmarks.online --workers W --shards S``).

Every run is the command a user runs, ``python -m trainer.online`` over the same preloaded
backlog (one topic, a group per run), in a process tree of its own whose CPU is counted whole:
the driver and, on Ray, the local cluster it starts (GCS, raylet, the actors). The count is a
cgroup v1 ``cpuacct`` group when this machine lets the benchmark make one (exact, processes
that ended included), else psutil over the live tree. Start-up (TensorFlow, Ray, the actors)
and the final checkpoint are left out: CPU and samples are read at the run's report lines
(every 0.5 s) and the rate is taken between the first line with trained samples and the last.
The broker's CPU is in neither (it is the same broker for every run).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid

from benchmarks.compression import cpu_seconds, tree_cpu_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = os.path.join(ROOT, "schemas", "examples", "taobao_like.yaml")
CONFIG = os.path.join(ROOT, "trainer", "examples", "mlp.yaml")
CGROUPS = "/sys/fs/cgroup/cpuacct"
REPORT = re.compile(r"trainer\.online ([\d,]+) samples")
NIC_BYTES_PER_SEC = 1.25e9  # a 10 Gb/s network interface per node


class TreeCpu:
    """CPU seconds of a process and every process it starts."""

    def __init__(self, label: str):
        self.group = os.path.join(CGROUPS, f"bench-online-{os.getpid()}-{label}")
        try:
            os.makedirs(self.group, exist_ok=True)
            self.method = "cgroup v1 cpuacct"
        except OSError:
            self.group, self.method = None, "psutil over the process tree"
        self.pid = None

    def enter(self) -> None:
        """In the child, before it runs the command: join the group (inherited by its
        descendants)."""
        if self.group is not None:
            with open(os.path.join(self.group, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    def seconds(self) -> float:
        if self.group is not None:
            with open(os.path.join(self.group, "cpuacct.usage")) as f:
                return int(f.read()) / 1e9
        import psutil

        try:
            return tree_cpu_seconds(self.pid)
        except psutil.NoSuchProcess:
            return float("nan")

    def close(self) -> None:
        if self.group is not None:
            try:
                os.rmdir(self.group)
            except OSError:
                pass


def run_online(bootstrap: str, topic: str, run_dir: str, samples: int, label: str,
               *extra: str) -> dict:
    """``python -m trainer.online`` over ``samples`` samples of ``topic``: its summary plus
    ``steady`` (samples/s, CPU-s per 100k samples of the whole tree and of the driver alone,
    between the first and the last report line with trained samples)."""
    argv = [sys.executable, "-m", "trainer.online", "--schema", SCHEMA, "--config", CONFIG,
            "--bootstrap-servers", bootstrap, "--topic", topic, "--group",
            f"bench-{label}-{uuid.uuid4().hex[:6]}", "--run-dir", run_dir,
            "--max-samples", str(samples), "--idle-exit", "10", "--report-every", "0.5",
            "--checkpoint-every", "1e9", "-X", "fetch.max.bytes=67108864", *extra]
    cpu = TreeCpu(label)
    points, log = [], []
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, preexec_fn=cpu.enter, cwd=ROOT)
    cpu.pid = process.pid

    def read_reports():
        for line in process.stderr:
            log.append(line)
            found = REPORT.search(line)
            if found:
                n = int(found.group(1).replace(",", ""))
                try:
                    points.append((time.monotonic(), cpu.seconds(),
                                   cpu_seconds(process.pid), n))
                except (FileNotFoundError, ProcessLookupError):
                    pass

    reader = threading.Thread(target=read_reports, daemon=True)
    reader.start()
    stdout, _ = process.communicate()
    reader.join()
    cpu.close()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {process.returncode}:\n"
                           + "".join(log[-30:]))
    summary = json.loads(stdout.strip().splitlines()[-1])
    steady = [p for p in points if p[3] > 0]
    if len(steady) < 2 or steady[-1][3] == steady[0][3]:
        raise RuntimeError(f"{label}: fewer than two report lines while training; use more "
                           "--samples. Its log:\n" + "".join(log[-20:]))
    (t0, c0, d0, n0), (t1, c1, d1, n1) = steady[0], steady[-1]
    summary["points"] = steady  # (time, CPU, driver CPU, samples) at every report line
    summary["steady"] = {"samples": n1 - n0, "seconds": round(t1 - t0, 3),
                         "samples_per_sec": round((n1 - n0) / (t1 - t0), 1),
                         "cpu_s_per_100k": round((c1 - c0) / (n1 - n0) * 1e5, 3),
                         "driver_cpu_s_per_100k": round((d1 - d0) / (n1 - n0) * 1e5, 3),
                         "cpu_counted_by": cpu.method}
    return summary


def _at(points: list, n: float) -> tuple[float, float, float]:
    """(time, CPU, driver CPU) when the run had trained ``n`` samples, interpolated between
    its report lines."""
    for (t0, c0, d0, n0), (t1, c1, d1, n1) in zip(points, points[1:]):
        if n0 <= n <= n1 and n1 > n0:
            f = (n - n0) / (n1 - n0)
            return t0 + f * (t1 - t0), c0 + f * (c1 - c0), d0 + f * (d1 - d0)
    raise ValueError(f"{n} samples: outside the run's report lines")


def same_samples(runs: dict) -> dict:
    """Each run's CPU per 100k samples over the same samples of the backlog: from the latest
    of the runs' first report lines with trained samples to the earliest of their last.

    A run's own steady window (``steady``) starts at its first report line, which comes at
    different points of the backlog in different runs (over three runs on a 400k backlog the
    single process's first line came after 21-56% of it, Ray's 1 x 1 after 3-23%), and the
    per-sample cost is not the same along the backlog (early samples make most of the
    store's new rows): so the ratio is taken over one window for all runs."""
    lo = max(run["points"][0][3] for run in runs.values())
    hi = min(run["points"][-1][3] for run in runs.values())
    if hi <= lo:
        raise RuntimeError(f"the runs' report lines share no samples ({lo}-{hi}); use more "
                           "--samples")
    out = {"from_samples": round(lo), "to_samples": round(hi)}
    for name, run in runs.items():
        (t0, c0, d0), (t1, c1, d1) = _at(run["points"], lo), _at(run["points"], hi)
        out[name] = {"cpu_s_per_100k": round((c1 - c0) / (hi - lo) * 1e5, 3),
                     "driver_cpu_s_per_100k": round((d1 - d0) / (hi - lo) * 1e5, 3),
                     "samples_per_sec": round((hi - lo) / (t1 - t0), 1)}
    return out


def on_paper(one: dict, many: dict, batch_size: int, workers=(8, 32, 128)) -> dict:
    """Samples/s and network bytes/s at ``workers`` workers (as many shards, one worker and one
    shard per node of this machine's cores, the worker batch of the W x S run kept, 1B rows),
    from the measured per-step costs: the 1 x 1 run's CPU per sample (what a node trains),
    and from the W x S run its bytes per sample (ids out, rows back, row gradients: grow
    with the samples), its dense bytes per worker and step (each worker sends its dense
    gradients to every other and receives theirs: grows with the workers) and the driver's
    CPU per actor call."""
    W = many["workers"]
    cores = os.cpu_count() or 1
    node_rate = cores / (one["steady"]["cpu_s_per_100k"] / 1e5)  # samples/s a node trains
    moved = many["bytes_per_step"]
    # ids out and rows back (shard_received also counts the row gradients): per sample
    sparse_per_sample = (moved["shard_received"] + moved["shard_sent"]) / batch_size
    worker_batch = batch_size / W
    # the rest of what the workers send: W (W - 1) copies of one worker's dense gradients
    dense = (moved["worker_sent"] - moved["shard_received"]) / (W * (W - 1)) if W > 1 else 0.0
    steps_per_100k = 1e5 / batch_size
    # a train_step per worker (it applies the previous step's dense update first) and a
    # step per shard; the apply_dense calls of the steps before checkpoints are left out
    calls = W + many["shards"]
    per_call = many["steady"]["driver_cpu_s_per_100k"] / steps_per_100k / calls
    row_bytes = many["store_bytes"] / max(many["store_rows"], 1)
    rows = []
    for w in workers:
        compute = w * node_rate
        step_rate = node_rate / worker_batch  # steps/s each worker could do
        per_worker_dense = 2 * (w - 1) * dense  # sent + received per step
        # the node's worker moves its batch's ids, rows and gradients, its shard as much
        per_worker_sparse = 2 * sparse_per_sample * worker_batch
        network_rate = NIC_BYTES_PER_SEC / (per_worker_dense + per_worker_sparse)  # steps/s
        driver_rate = 1 / (per_call * (2 * w))  # steps/s: w worker calls + w shard calls
        steps = min(step_rate, network_rate, driver_rate)
        limit = {step_rate: "compute", network_rate: "network (dense all-to-all)",
                 driver_rate: "driver (actor calls)"}[steps]
        samples = steps * w * worker_batch
        rows.append({"workers": w, "shards": w, "compute_bound_samples_per_sec": round(compute),
                     "samples_per_sec": round(samples), "limited_by": limit,
                     "network_bytes_per_sec_per_node": round(
                         steps * (per_worker_dense + per_worker_sparse)),
                     "network_bytes_per_sec_total": round(
                         steps * w * (per_worker_dense + per_worker_sparse)),
                     "rows_per_shard_at_1b": round(1e9 / w),
                     "shard_memory_gib_at_1b": round(1e9 / w * row_bytes / 2**30, 1)})
    return {"inputs": {"node_samples_per_sec": round(node_rate), "cores_per_node": cores,
                       "sparse_bytes_per_sample": round(sparse_per_sample, 1),
                       "dense_bytes_per_worker_step": round(dense),
                       "worker_batch": worker_batch,
                       "driver_cpu_s_per_call": round(per_call, 6),
                       "store_bytes_per_row": round(row_bytes, 1),
                       "nic_bytes_per_sec": NIC_BYTES_PER_SEC},
            "rows": rows}


def compare(bootstrap: str, topic: str, work: str, samples: int, workers: int,
            shards: int, batch_size: int) -> dict:
    """Single process, 1 x 1 on Ray and ``workers`` x ``shards`` on Ray over ``topic``."""
    single = run_online(bootstrap, topic, os.path.join(work, "single"), samples, "single")
    one = run_online(bootstrap, topic, os.path.join(work, "ray1x1"), samples, "ray1x1",
                     "--workers", "1", "--shards", "1")
    many = one if (workers, shards) == (1, 1) else run_online(  # the same run: once
        bootstrap, topic, os.path.join(work, "ray"), samples, "ray",
        "--workers", str(workers), "--shards", str(shards))
    keep = ("samples", "steady", "rate", "bytes_per_step", "timings", "steps", "store_rows")
    window = same_samples({"single": single, "ray_1x1": one})
    return {"single": {k: single[k] for k in keep if k in single},
            "ray_1x1": {k: one[k] for k in keep if k in one},
            f"ray_{workers}x{shards}": {k: many[k] for k in keep if k in many},
            "same_samples": window,
            "cpu_ratio_1x1_vs_single": round(window["ray_1x1"]["cpu_s_per_100k"]
                                             / window["single"]["cpu_s_per_100k"], 3),
            "cpu_ratio_1x1_vs_single_own_windows": round(
                one["steady"]["cpu_s_per_100k"] / single["steady"]["cpu_s_per_100k"], 3),
            "on_paper": on_paper(one, many, batch_size)}


def export_delay(bootstrap: str, topic: str, work: str, samples: int, workers: int,
                 shards: int, export_every: float) -> dict:
    """The ``workers`` x ``shards`` run with ``--export-dir`` over ``samples`` samples of
    ``topic`` while the caller's producer sends them at its rate: every sample's delay from
    its Kafka arrival to the published export that holds it (the run's whole, and of the
    samples that arrived after its first step: the steady state, without the backlog of
    Ray's and the actors' start-up)."""
    run = run_online(bootstrap, topic, os.path.join(work, "ray-delay"), samples, "ray-delay",
                     "--workers", str(workers), "--shards", str(shards),
                     "--export-dir", os.path.join(work, "ray-export"),
                     "--export-every", str(export_every))
    return {"samples": run["samples"], "export_every": export_every,
            "exports": run["exports"], "samples_per_sec": run["steady"]["samples_per_sec"],
            "delay_p50_s": run["delay_s"]["p50"], "delay_p99_s": run["delay_s"]["p99"],
            "steady_delay_p50_s": run["steady_delay_s"]["p50"],
            "steady_delay_p99_s": run["steady_delay_s"]["p99"]}
