"""Benchmark of distributed training on Ray against the in-process trainer, same batches.

    python -m benchmarks.distributed                       # 100k samples, batch 5000
    python -m benchmarks.distributed --samples 3000 --batch-size 500 --hidden 16  # CI size

The paper's MLP (taobao_like schema, embedding dim 18, 200-80-1, the trainer's default
config) on generated data (10 samples per user), on a local Ray cluster:
- ``overhead``: 1 worker + 1 shard on Ray against ``trainer.Trainer`` in this process on the
  very same batches (the worker's batches): time per step, and their ratio (target <= 1.3);
- ``2x2``: 2 workers + 2 shards (each worker half the trees): samples/s, and the bytes each step
  moves per worker and per shard (ids, rows, row gradients, dense gradients; array payloads);
- ``transport``: Ray alone, no training, the least Ray's object transfers add to a step. One
  actor calls another directly (no driver between them), idling the worker's compute time
  before each step as in training: ``whole``, one call with the bytes a 1x1 step sends its
  shard and the bytes the shard sends back; ``split``, the best schedule of the same bytes:
  only the rows both this batch and the next hold (``touched``, measured on the batches) and
  their gradients wait for the round trip after the compute, the other gradients go without
  waiting, and the next batch's other rows were fetched during the compute. The ratios
  ``(in-process step + exposed transport) / in-process step`` are what a design of each
  schedule would reach with no cost besides Ray's transfers (the shard's lookups and updates
  are in the in-process step too).
Every run trains ``--warmup`` batches first (tracing, actor start) and is then timed. The step
time is the steady state: from the end of a fit's first step to the end of its last, over the
steps between (a fit's start, the same in every run, is a fixed cost: starting the readers,
and on Ray one round of calls to every actor); the whole fit's time is reported too.
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import pyarrow as pa

import compression
import schemas
from pipelines.generate import generate_tables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = os.path.join(ROOT, "schemas", "examples", "taobao_like.yaml")


class StepClock:
    """Step end times of a fit, from its per-step callback."""

    def __init__(self):
        self.ends: list[float] = []

    def __call__(self, *_):
        self.ends.append(time.perf_counter())

    def steady(self) -> float:
        """Seconds per step from the first step's end to the last's."""
        if len(self.ends) < 2:
            raise SystemExit("--samples too small: time steps need 2 timed batches at least")
        return (self.ends[-1] - self.ends[0]) / (len(self.ends) - 1)


def _floats(nbytes: int) -> np.ndarray:
    return np.ones(max(int(nbytes) // 4, 1), np.float32)


def _transport_actors(ray):
    """Two plain actors: ``Caller`` (the worker) calls ``Echo`` (the shard)."""

    @ray.remote(num_cpus=0)
    class Echo:
        def __init__(self, back: int, touched: float):
            self.whole = _floats(back)
            self.touched = _floats(back * touched)
            self.other = _floats(back * (1 - touched))

        def step(self, gradients):
            return self.whole

        def critical(self, gradients):
            return self.touched

        def rest(self, gradients):
            return None

        def prefetch(self, request):
            return self.other

    @ray.remote(num_cpus=0)
    class Caller:
        def __init__(self, echo, send: int, touched: float):
            self.echo = echo
            self.whole = _floats(send)
            self.touched = _floats(send * touched)
            self.other = _floats(send * (1 - touched))
            self.request = np.ones(max(int(send * (1 - touched)) // 80, 1), np.int64)

        def trips(self, n: int, idle: float, split: bool) -> list[float]:
            """Exposed seconds of each step: from the end of its compute (``idle``) until
            the next step's rows are all here."""
            times = []
            prefetched = self.echo.prefetch.remote(self.request) if split else None
            for _ in range(n):
                time.sleep(idle)  # the worker's compute; the receiving threads go idle too
                t0 = time.perf_counter()
                if split:
                    critical = self.echo.critical.remote(self.touched)
                    self.echo.rest.remote(self.other)
                    ray.get([critical, prefetched])
                    prefetched = self.echo.prefetch.remote(self.request)
                else:
                    ray.get(self.echo.step.remote(self.whole))
                times.append(time.perf_counter() - t0)
            if prefetched is not None:
                ray.get(prefetched)
            return times

    return Echo, Caller


def round_trip(ray, send: int, back: int, idle: float, trips: int, *, touched: float = 0.0,
               split: bool = False) -> dict:
    """Median and minimum ms a step waits for Ray after its compute: one direct call carrying
    ``send`` bytes there and ``back`` bytes back, or with ``split`` the schedule of
    :func:`_transport_actors`' ``Caller.trips``; after ``trips // 5`` untimed steps."""
    Echo, Caller = _transport_actors(ray)
    echo = Echo.remote(back, touched)
    caller = Caller.remote(echo, send, touched)
    try:
        warm = max(trips // 5, 1)
        times = ray.get(caller.trips.remote(warm + trips, idle, split))[warm:]
    finally:
        ray.kill(caller)
        ray.kill(echo)
    return {"median_ms": 1000 * float(np.median(times)), "min_ms": 1000 * float(min(times))}


def touched_fraction(trainer, batches) -> float:
    """Of each batch's distinct rows (table, id), the share the previous batch holds too: the
    rows whose update must land before the next step can look them up."""
    previous, shared, total = None, 0, 0
    for batch in batches:
        ids = {t: np.unique(v) for t, v in trainer.builder.prepare(batch).table_ids.items()}
        if previous is not None:
            for table, unique in ids.items():
                total += len(unique)
                shared += len(np.intersect1d(unique, previous.get(table, unique[:0]),
                                             assume_unique=True))
        previous = ids
    return shared / total if total else 0.0


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.distributed",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--samples-per-user", type=float, default=10.0)
    parser.add_argument("--batch-size", type=int, default=5000)
    parser.add_argument("--hidden", default="200,80")
    parser.add_argument("--warmup", type=int, default=2, help="untimed batches per run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed passes of the in-process and 1x1 runs, alternating (best)")
    parser.add_argument("--num-cpus", type=int, default=4,
                        help="logical CPUs of the local Ray cluster (actors mostly wait)")
    parser.add_argument("--trips", type=int, default=30,
                        help="timed round trips of the transport probe")
    args = parser.parse_args(argv)

    import ray

    from trainer import TrainConfig, Trainer, models
    from trainer.distributed import DistributedTrainer, worker_batches

    schema = schemas.load(SCHEMA)
    raw = pa.concat_tables(list(generate_tables(schema, args.samples, seed=args.seed,
                                                samples_per_user=args.samples_per_user)))
    trees = compression.build_trees(raw, schema, validate=False)
    hidden = tuple(int(x) for x in args.hidden.split(","))
    config = TrainConfig(batch_size=args.batch_size, seed=args.seed)
    batches = list(worker_batches(trees, schema, config, 0, 1))
    warm, timed = batches[:args.warmup], batches[args.warmup:]
    if not timed:
        raise SystemExit("--samples too small: no batch left after --warmup")
    timed_samples = sum(b.num_leaves for b in timed)

    trainer = Trainer(schema, models.MLP(hidden=hidden), config)
    trainer.fit(warm, shuffle=False)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        inproc, one = float("inf"), None
        inproc_step = one_step = float("inf")
        with DistributedTrainer(schema, models.MLP(hidden=hidden), config, workers=1,
                                shards=1) as dt:
            dt.fit([warm], shuffle=False)
            # alternate the two so that both see the same load on a shared machine
            for _ in range(max(args.rounds, 1)):
                clock = StepClock()
                parts = dict(trainer.timings)
                t0 = time.perf_counter()
                trainer.fit(timed, shuffle=False, callback=clock)
                seconds = time.perf_counter() - t0
                if seconds < inproc:
                    inproc_timings = {k: v - parts.get(k, 0.0)
                                      for k, v in trainer.timings.items()}
                inproc = min(inproc, seconds)
                inproc_step = min(inproc_step, clock.steady())
                before = dt.timings()
                clock = StepClock()
                result = dt.fit([timed], shuffle=False, callback=clock)
                one_step = min(one_step, clock.steady())
                after = dt.timings()
                if one is None or result["seconds"] < one["seconds"]:
                    one = result
                    one_timings = {f"{kind}_{k}": v - before[kind + "s"][0].get(k, 0.0)
                                   for kind in ("worker", "shard")
                                   for k, v in after[kind + "s"][0].items()}
        # 2 x 2: each worker its own half of the trees (by root key)
        parts = [list(worker_batches(trees, schema, config, w, 2)) for w in range(2)]
        with DistributedTrainer(schema, models.MLP(hidden=hidden), config, workers=2,
                                shards=2) as dt:
            dt.fit([p[:1] for p in parts], shuffle=False)
            two = dt.fit([p[1:] for p in parts], shuffle=False)
        # Ray's transport alone: the 1x1 step's bytes, worker -> shard -> worker
        sent = one["bytes_per_step"]
        idle = one_timings.get("worker_step", 0.0) / max(one["steps"], 1)
        send, back = int(sent["worker_sent"]), int(sent["shard_sent"])
        touched = touched_fraction(trainer, batches)
        transport = {"send_bytes": send, "back_bytes": back, "idle_ms": 1000 * idle,
                     "touched": touched,
                     "empty": round_trip(ray, 0, 0, idle, args.trips),
                     "whole": round_trip(ray, send, back, idle, args.trips),
                     "split": round_trip(ray, send, back, idle, args.trips, touched=touched,
                                         split=True)}
    finally:
        if started:
            ray.shutdown()

    steps = len(timed)
    result = {
        "samples": args.samples, "batch_size": args.batch_size, "hidden": list(hidden),
        "cores": os.cpu_count(),
        "inproc": {"steps": steps, "seconds": inproc, "step_ms": 1000 * inproc_step,
                   "fit_ms_per_step": 1000 * inproc / steps,
                   "samples_per_sec": timed_samples / inproc,
                   "seconds_by_part": inproc_timings},
        "ray_1x1": {"steps": one["steps"], "seconds": one["seconds"],
                    "step_ms": 1000 * one_step,
                    "fit_ms_per_step": 1000 * one["seconds"] / max(one["steps"], 1),
                    "samples_per_sec": one["samples_per_sec"],
                    "bytes_per_step": one["bytes_per_step"],
                    "seconds_by_part": one_timings},
        "ray_2x2": {"steps": two["steps"], "seconds": two["seconds"],
                    "samples_per_sec": two["samples_per_sec"],
                    "bytes_per_step_per_worker": two["bytes_per_step"]["per_worker"],
                    "bytes_per_step_per_shard": two["bytes_per_step"]["per_shard"]},
    }
    result["transport"] = transport
    result["overhead_ratio"] = result["ray_1x1"]["step_ms"] / result["inproc"]["step_ms"]
    for kind in ("whole", "split"):
        transport[kind]["ratio"] = ((result["inproc"]["step_ms"] + transport[kind]["median_ms"])
                                    / result["inproc"]["step_ms"])
    result["fit_ratio"] = (result["ray_1x1"]["fit_ms_per_step"]
                           / result["inproc"]["fit_ms_per_step"])
    print(f"in process      {result['inproc']['step_ms']:8.1f} ms/step "
          f"{result['inproc']['samples_per_sec']:10,.0f} samples/s")
    print(f"Ray 1w x 1s     {result['ray_1x1']['step_ms']:8.1f} ms/step "
          f"{result['ray_1x1']['samples_per_sec']:10,.0f} samples/s   "
          f"ratio {result['overhead_ratio']:.2f} (target <= 1.3; whole fits "
          f"{result['fit_ratio']:.2f})")
    print(f"Ray 2w x 2s     {'':8s}         {result['ray_2x2']['samples_per_sec']:10,.0f} "
          f"samples/s   {result['ray_2x2']['bytes_per_step_per_worker'] / 1e6:.2f} MB/step per "
          f"worker, {result['ray_2x2']['bytes_per_step_per_shard'] / 1e6:.2f} MB/step per shard")
    print(f"Ray transport alone, worker -> shard -> worker directly "
          f"({transport['send_bytes'] / 1e6:.2f} MB there, {transport['back_bytes'] / 1e6:.2f} MB "
          f"back; empty {transport['empty']['median_ms']:.1f} ms):")
    print(f"  whole         {transport['whole']['median_ms']:8.1f} ms/step   ratio at best "
          f"{transport['whole']['ratio']:.2f}")
    print(f"  split         {transport['split']['median_ms']:8.1f} ms/step   ratio at best "
          f"{transport['split']['ratio']:.2f} (only the {transport['touched']:.0%} of rows the "
          f"next batch shares wait)")
    return result


def main(argv=None) -> int:
    print(json.dumps(run(argv)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
