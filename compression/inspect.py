"""The ``inspect`` command: what a directory of tree Parquet files holds and how well it compresses.

    python -m compression.inspect out/trees            # a human-readable table
    python -m compression.inspect 'out/trees/*.parquet' --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import pyarrow.parquet as pq

import schemas
from compression.io import expand_paths
from compression.stats import TreeStats, format_summary


def inspect_paths(path_or_glob, schema: schemas.Schema | None = None) -> dict:
    """The summary of :class:`compression.stats.TreeStats` over the tree files, plus their size."""
    files = expand_paths(path_or_glob)
    stats = None
    for path in files:
        table = pq.read_table(path)
        file_schema = schema or schemas.from_arrow_metadata(table.schema)
        if file_schema is None:
            raise SystemExit(f"{path}: no prefixrec schema in the file's metadata; "
                             "pass --schema SCHEMA.yaml")
        stats = stats or TreeStats(file_schema)
        stats.add(table)
        stats.bytes_on_disk += os.path.getsize(path)
    summary = stats.summary()
    summary["files"] = len(files)
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m compression.inspect",
        description="Summarise tree Parquet files: samples, trees, nodes per layer, samples per "
                    "root, ids stored flat vs in trees (the compression ratio), bytes on disk.")
    parser.add_argument("path", help="a tree Parquet file, a directory of them, or a glob")
    parser.add_argument("--schema", help="schema YAML (default: the one stored in the files)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)
    schema = schemas.load(args.schema) if args.schema else None
    try:
        summary = inspect_paths(args.path, schema)
    except FileNotFoundError as e:
        parser.error(str(e))
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(format_summary(summary))
        print(f"files                 {summary['files']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
