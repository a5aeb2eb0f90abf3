"""The in-process compression command: raw sample files -> tree Parquet files on one machine.

    python -m compression.compress --schema S --input 'raw/*.parquet' --output trees/

For data larger than memory use the Beam job (``python -m pipelines.compress``), which shards by
the root key first; this command is the single-machine path and the reference it is tested
against.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import schemas
from compression.io import expand_paths, read_raw, write_trees
from compression.stats import TreeStats, format_summary
from compression.trees import build_trees


def compress_files(schema: schemas.Schema, inputs, output_dir: str, format: str | None = None,
                   roots_per_file: int = 200_000) -> dict:
    """Read and validate raw files, build trees, write ``part-NNNNN.parquet`` + ``_stats.json``."""
    files = expand_paths(inputs)
    flat = read_raw(files, schema, format)
    trees = build_trees(flat, schema, validate=False)
    os.makedirs(output_dir, exist_ok=True)
    stats = TreeStats(schema)
    for shard, start in enumerate(range(0, max(trees.num_rows, 1), roots_per_file)):
        part = trees.slice(start, roots_per_file)
        path = write_trees(part, os.path.join(output_dir, f"part-{shard:05d}.parquet"))
        stats.add(part)
        stats.bytes_on_disk += os.path.getsize(path)
    summary = stats.summary()
    summary["input_files"] = len(files)
    with open(os.path.join(output_dir, "_stats.json"), "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m compression.compress",
        description="Compress raw samples (Parquet, CSV or JSON lines) into multi-prefix-tree "
                    "Parquet files in this process. For large data use pipelines.compress.")
    parser.add_argument("--schema", required=True, help="schema YAML file")
    parser.add_argument("--input", required=True, help="raw files: a path, directory or glob")
    parser.add_argument("--output", required=True, help="output directory for tree files")
    parser.add_argument("--format", choices=["parquet", "csv", "json"],
                        help="input format (default: from each file's extension)")
    parser.add_argument("--roots-per-file", type=int, default=200_000,
                        help="root nodes (e.g. users) per output file (default 200000)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also print the full summary (as compression.inspect does)")
    args = parser.parse_args(argv)
    schema = schemas.load(args.schema)
    started = time.perf_counter()
    try:
        summary = compress_files(schema, args.input, args.output, args.format,
                                 args.roots_per_file)
    except FileNotFoundError as e:
        parser.error(str(e))
    seconds = time.perf_counter() - started
    if args.verbose:
        print(format_summary(summary))
    print(f"compressed {summary['samples']:,} samples into {summary['trees']:,} trees "
          f"({summary['id_compression_ratio']:.2f}x fewer ids) in {seconds:.1f} s "
          f"({summary['samples'] / max(seconds, 1e-9):,.0f} samples/s) -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
