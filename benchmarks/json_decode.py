"""Benchmark of JSON sample decoding for online learning: the native decoder vs pyarrow.json.

    python -m benchmarks.json_decode --samples 200000        # RESULTS.md size
    python -m benchmarks.json_decode --samples 2000 --repeats 1 --batch 500   # CI size

Generates taobao_like samples (pipelines.generate), turns them into the JSON messages that
pipelines.replay sends to Kafka, and decodes the same messages, in the same run, in batches of
``--batch`` messages (what one Kafka poll hands the decoder) with:

- pyarrow: ``pyarrow.json.read_json`` with the schema over the values joined by newlines +
  ``compression.split_bad_rows`` (the project's decoder before the native one; pyarrow uses
  its own thread pool; no per-message verdicts, so this is its fast path on good messages);
- ``compression.decode_json_samples`` (the native decoder) with 1 thread and with 2 threads.

Both give the same table (checked on the first repeat). Reports samples/s and input MB/s (best
of ``--repeats``), samples per CPU second (the per-core cost, whatever the threads), the
native/pyarrow ratios, the machine's load, and a final JSON line.

JSON-lines files go through the same native decoder (``compression.read_raw``, as every command
that reads files): the same samples written as one file are also read with it and with
``pyarrow.json.read_json`` + ``compression.validate_raw`` (the file reader before), same table
checked (``file_rows_per_s``, ``file_native_over_pyarrow``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.json as pajson

import compression
import schemas
from compression import decode_json_samples as native_decode
from pipelines.generate import generate_tables
from pipelines.replay import json_lines

SCHEMA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "schemas", "examples", "taobao_like.yaml")


def messages(schema, samples: int, seed: int) -> list[bytes]:
    out: list[bytes] = []
    for table in generate_tables(schema, samples, seed=seed):
        out += [v.as_py().encode() for v in json_lines(table, schema)]
    return out


def pyarrow_decode(values: list[bytes], schema) -> pa.Table:
    """Good messages decoded by pyarrow.json in bulk, then the row checks."""
    block = max(1 << 19, max(map(len, values)) + 1)
    table = pajson.read_json(
        pa.BufferReader(b"\n".join(values)),
        read_options=pajson.ReadOptions(use_threads=True, block_size=block),
        parse_options=pajson.ParseOptions(explicit_schema=schema.raw_arrow_schema(),
                                          unexpected_field_behavior="error"))
    good, rejected = compression.split_bad_rows(table, schema)
    if rejected.num_rows:
        raise AssertionError(f"pyarrow baseline: {rejected.num_rows} rows rejected")
    return good


def _time(fn, batches, repeats: int) -> tuple[float, float]:
    """Best wall-clock seconds and best CPU seconds (all threads of the process) of a pass."""
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        for batch in batches:
            fn(batch)
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - start_cpu)
    return best, best_cpu


def _time_files(values: list[bytes], schema, repeats: int) -> dict[str, float]:
    """Best seconds to read the messages as one JSON-lines file, validated: the project's
    reader (the native decoder) and pyarrow's JSON reader + validate_raw."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "samples.jsonl")
        with open(path, "wb") as f:
            f.write(b"\n".join(values) + b"\n")

        def with_pyarrow():
            table = pajson.read_json(path, parse_options=pajson.ParseOptions(
                explicit_schema=schema.raw_arrow_schema(), unexpected_field_behavior="infer"))
            return compression.validate_raw(table, schema, source=path)

        if not compression.read_raw(path, schema).equals(with_pyarrow()):
            raise AssertionError("reading the JSON-lines file: native differs from pyarrow")
        return {"pyarrow": _time(lambda _: with_pyarrow(), [None], repeats)[0],
                "native": _time(lambda _: compression.read_raw(path, schema), [None],
                                repeats)[0]}


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=20_000,
                        help="messages per decode call (one Kafka poll)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args(argv)

    schema = schemas.load(SCHEMA)
    values = messages(schema, args.samples, args.seed)
    batches = [values[i:i + args.batch] for i in range(0, len(values), args.batch)]
    total_bytes = sum(map(len, values))

    for batch in batches[:1]:  # same rows, no dead letters
        expected = pyarrow_decode(batch, schema)
        for threads in (1, 2):
            got, dead = native_decode(batch, schema, threads=threads)
            if not (got.equals(expected) and dead == []):
                raise AssertionError(f"native decoder ({threads} threads) differs from pyarrow")

    load_before = os.getloadavg()[0]
    timed = {
        "pyarrow": _time(lambda b: pyarrow_decode(b, schema), batches, args.repeats),
        "native_1_thread": _time(lambda b: native_decode(b, schema, with_index=True, threads=1),
                                 batches, args.repeats),
        "native_2_threads": _time(lambda b: native_decode(b, schema, with_index=True, threads=2),
                                  batches, args.repeats),
    }
    files = _time_files(values, schema, args.repeats)
    seconds = {k: wall for k, (wall, _) in timed.items()}
    cpu = {k: c for k, (_, c) in timed.items()}
    result = {
        "samples": len(values),
        "batch": args.batch,
        "mean_message_bytes": round(total_bytes / max(1, len(values)), 1),
        "samples_per_s": {k: round(len(values) / s) for k, s in seconds.items()},
        "mb_per_s": {k: round(total_bytes / s / 1e6, 1) for k, s in seconds.items()},
        # per core: samples per CPU second, whatever the number of threads
        "samples_per_cpu_s": {k: round(len(values) / max(c, 1e-9)) for k, c in cpu.items()},
        "native_1_thread_over_pyarrow": round(seconds["pyarrow"] / seconds["native_1_thread"], 2),
        "native_2_threads_over_pyarrow": round(seconds["pyarrow"] / seconds["native_2_threads"], 2),
        "file_rows_per_s": {k: round(len(values) / s) for k, s in files.items()},
        "file_native_over_pyarrow": round(files["pyarrow"] / files["native"], 2),
        "cpus": os.cpu_count(),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    return result


def main(argv=None) -> int:
    result = run(argv)
    print(f"{result['samples']} messages of {result['mean_message_bytes']} bytes, batches of "
          f"{result['batch']}, load {result['load_average_1min']}", file=sys.stderr)
    for name, rate in result["samples_per_s"].items():
        print(f"  {name:18s} {rate:>10,d} samples/s  {result['mb_per_s'][name]:7.1f} MB/s",
              file=sys.stderr)
    for name, rate in result["samples_per_cpu_s"].items():
        print(f"  {name:18s} {rate:>10,d} samples per CPU second", file=sys.stderr)
    print(f"  native/pyarrow: {result['native_1_thread_over_pyarrow']}x (1 thread), "
          f"{result['native_2_threads_over_pyarrow']}x (2 threads)", file=sys.stderr)
    print(f"  JSON-lines file, read and validated: native {result['file_rows_per_s']['native']:,d}"
          f" rows/s, pyarrow {result['file_rows_per_s']['pyarrow']:,d} rows/s "
          f"({result['file_native_over_pyarrow']}x)", file=sys.stderr)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
