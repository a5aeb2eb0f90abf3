"""Benchmark of tree building, on-disk size and time-to-batches against flat formats.

    python -m benchmarks.compression --samples 2000000

Everything is measured in the same run on the same generated data (taobao_like schema):
- ``build_trees`` against a plain pyarrow sort of the same table by the layer keys (the target
  is a ratio of at most 1.5), median of ``--repeats`` interleaved runs;
- bytes of tree Parquet against flat Parquet (unsorted, and sorted by the keys) and TFRecord
  files of ``tf.train.Example`` (all zstd/gzip compressed as noted);
- seconds from each file to training-ready batches of ``--batch-size`` samples.
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import compression
import schemas
from pipelines.generate import generate_tables

SCHEMA = "schemas/examples/taobao_like.yaml"


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "pyarrow": pa.__version__, "numpy": np.__version__}


def tree_cpu_seconds(pid: int | None = None, include_root: bool = True) -> float:
    """CPU seconds of process ``pid`` (default: this one) and every live descendant (a
    command's children, Dask workers, a local server); processes that exit meanwhile are
    skipped. Raises psutil.NoSuchProcess when ``pid`` itself is gone."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for p in ([root] if include_root else []) + root.children(recursive=True):
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) of this process, or of process ``pid``. This
    process's comes from the process CPU clock (nanoseconds): os.times counts 10 ms ticks, and
    a stage shorter than a tick (decoding the tiny benchmark's 12k samples) read as 0."""
    if pid is None:
        return time.process_time()
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _write_tfrecord(table: pa.Table, schema: schemas.Schema, path: str) -> None:
    import tensorflow as tf  # only this benchmark needs TensorFlow

    columns = {name: table.column(name).to_pylist() for name in table.column_names}
    kinds = {f.name: f for f in schema.features}
    options = tf.io.TFRecordOptions(compression_type="GZIP")
    with tf.io.TFRecordWriter(path, options) as writer:
        for i in range(table.num_rows):
            feature = {}
            for name, values in columns.items():
                value = values[i]
                f = kinds.get(name)
                if f is None or f.kind == "dense":
                    floats = value if isinstance(value, list) else [value]
                    feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=floats))
                else:
                    items = value if isinstance(value, list) else [value]
                    if f.dtype == "string":
                        feature[name] = tf.train.Feature(bytes_list=tf.train.BytesList(
                            value=[s.encode() for s in items]))
                    else:
                        feature[name] = tf.train.Feature(int64_list=tf.train.Int64List(
                            value=items))
            example = tf.train.Example(features=tf.train.Features(feature=feature))
            writer.write(example.SerializeToString())


def _tfrecord_batches(path: str, schema: schemas.Schema, batch_size: int) -> int:
    import tensorflow as tf

    spec = {}
    for f in schema.features:
        dtype = tf.string if f.dtype == "string" else tf.int64
        if f.kind == "id":
            spec[f.name] = tf.io.FixedLenFeature([], dtype)
        elif f.kind == "ids":
            spec[f.name] = tf.io.RaggedFeature(dtype)
        else:
            spec[f.name] = tf.io.FixedLenFeature([f.dim], tf.float32)
    for label in schema.labels:
        spec[label] = tf.io.FixedLenFeature([], tf.float32)
    dataset = (tf.data.TFRecordDataset(path, compression_type="GZIP")
               .batch(batch_size)
               .map(lambda x: tf.io.parse_example(x, spec), num_parallel_calls=2)
               .prefetch(2))
    leaves = 0
    for batch in dataset:
        leaves += int(batch[schema.labels[0]].shape[0])
    return leaves


def _batches_from_trees(path: str, schema, batch_size: int) -> int:
    return sum(b.num_leaves for b in compression.iter_batches(
        compression.iter_trees(path, rows=8192), schema, batch_size))


def _batches_from_flat(path: str, schema, batch_size: int) -> int:
    flat = compression.read_raw(path, schema)
    trees = compression.build_trees(flat, schema, validate=False)
    return sum(b.num_leaves for b in compression.iter_batches(trees, schema, batch_size))


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compression",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=2_000_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved timing runs of build vs sort (median reported)")
    parser.add_argument("--batch-size", type=int, default=5000)
    parser.add_argument("--tfrecord-samples", type=int, default=200_000,
                        help="write TFRecord for only the first this many samples and scale its "
                             "bytes and times to all samples (per-row protobuf building in "
                             "Python is the slowest part; default 200000)")
    parser.add_argument("--workdir", help="where files go (default: a temp dir, removed)")
    args = parser.parse_args(argv)

    schema = schemas.load(SCHEMA)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-compression-")
    os.makedirs(workdir, exist_ok=True)
    try:
        gen_s, table = _timed(lambda: pa.concat_tables(
            generate_tables(schema, args.samples, seed=args.seed)))
        table = table.combine_chunks()
        n = table.num_rows
        keys = [(k, "ascending") for layer in schema.layers for k in layer.key]

        sort_times, build_times = [], []
        for _ in range(args.repeats):
            sort_times.append(_timed(lambda: table.sort_by(keys))[0])
            build_times.append(_timed(lambda: compression.build_trees(table, schema,
                                                                       validate=False))[0])
        validate_s = _timed(lambda: compression.validate_raw(table, schema))[0]
        sort_s, build_s = statistics.median(sort_times), statistics.median(build_times)
        trees = compression.build_trees(table, schema, validate=False)
        ratio = compression.TreeStats(schema).add(trees).summary()["id_compression_ratio"]

        paths = {name: os.path.join(workdir, name) for name in
                 ("flat_unsorted.parquet", "flat_sorted.parquet", "trees.parquet",
                  "flat.tfrecord.gz")}
        pq.write_table(table, paths["flat_unsorted.parquet"], compression="zstd")
        pq.write_table(table.sort_by(keys), paths["flat_sorted.parquet"], compression="zstd")
        compression.write_trees(trees, paths["trees.parquet"])
        tf_rows = min(args.tfrecord_samples, n)
        tf_write_s = _timed(lambda: _write_tfrecord(table.slice(0, tf_rows), schema,
                                                    paths["flat.tfrecord.gz"]))[0]
        scale = n / tf_rows
        size = {name: os.path.getsize(p) for name, p in paths.items()}
        size["flat.tfrecord.gz"] = int(size["flat.tfrecord.gz"] * scale)

        to_batches = {
            "trees.parquet": _timed(lambda: _batches_from_trees(
                paths["trees.parquet"], schema, args.batch_size)),
            "flat_sorted.parquet": _timed(lambda: _batches_from_flat(
                paths["flat_sorted.parquet"], schema, args.batch_size)),
            "flat_unsorted.parquet": _timed(lambda: _batches_from_flat(
                paths["flat_unsorted.parquet"], schema, args.batch_size)),
            "flat.tfrecord.gz": _timed(lambda: _tfrecord_batches(
                paths["flat.tfrecord.gz"], schema, args.batch_size)),
        }
        for name, (seconds, leaves) in to_batches.items():
            expected = tf_rows if name == "flat.tfrecord.gz" else n
            assert leaves == expected, (name, leaves, expected)
        batch_seconds = {name: s * (scale if name == "flat.tfrecord.gz" else 1)
                         for name, (s, _) in to_batches.items()}
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    result = {
        "benchmark": "compression", "samples": n, "seed": args.seed,
        "generate_s": round(gen_s, 3),
        "sort_s": round(sort_s, 3), "build_trees_s": round(build_s, 3),
        "build_over_sort": round(build_s / sort_s, 3),
        "build_samples_per_s": round(n / build_s),
        "validate_s": round(validate_s, 3),
        "id_compression_ratio": round(ratio, 2),
        "bytes": size,
        "trees_over_sorted_flat_bytes": round(size["trees.parquet"]
                                              / size["flat_sorted.parquet"], 3),
        "to_batches_s": {k: round(v, 3) for k, v in batch_seconds.items()},
        "tfrecord_samples_written": tf_rows,
        "tfrecord_write_s": round(tf_write_s * scale, 3),
        "machine": machine(),
    }
    print(f"samples {n:,}  (schema taobao_like, seed {args.seed}, {os.cpu_count()} cpus)")
    print(f"  pyarrow sort by layer keys   {sort_s:8.3f} s")
    print(f"  build_trees                  {build_s:8.3f} s   {n / build_s:,.0f} samples/s   "
          f"{build_s / sort_s:.2f}x the sort (target <= 1.5x)")
    print(f"  ids stored flat / in trees   {ratio:8.2f}x")
    print(f"  {'file':<24}{'bytes':>14}{'to batches (s)':>18}")
    for name in paths:
        note = " (scaled)" if name == "flat.tfrecord.gz" and scale != 1 else ""
        print(f"  {name:<24}{size[name]:>14,}{batch_seconds[name]:>18.3f}{note}")
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    run()
