"""The ``inspect`` command: what a directory of tree Parquet files holds and how well it compresses.

    python -m compression.inspect out/trees            # a human-readable table
    python -m compression.inspect 'out/trees/*.parquet' --json
"""

from __future__ import annotations

import argparse
import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq

import schemas
from compression import cli, fs
from compression.io import expand_paths
from compression.stats import TreeStats, format_summary


def inspect_paths(path_or_glob, schema: schemas.Schema | None = None) -> dict:
    """The summary of :class:`compression.stats.TreeStats` over the tree files, plus their size."""
    files = expand_paths(path_or_glob)
    stats = None
    for path in files:
        try:
            with fs.source(path) as source:
                table = pq.read_table(source)
        except (pa.ArrowException, OSError) as e:  # e.g. "Parquet file size is 0 bytes"
            raise cli.UsageError(f"{path}: cannot read the file as parquet: {e}") from None
        file_schema = schema or schemas.from_arrow_metadata(table.schema)
        if file_schema is None:
            raise cli.UsageError(f"{path}: no prefixrec schema in the file's metadata; "
                                 "pass --schema SCHEMA.yaml")
        missing = [layer.name for layer in file_schema.layers[1:2]
                   if layer.name not in table.column_names]
        if missing:
            raise cli.UsageError(
                f"{path}: not a tree file of schema {file_schema.name!r} (no {missing[0]!r} "
                "column): it looks like raw samples; compress it first with python -m "
                "compression.compress (or pipelines.compress) and inspect the output")
        stats = stats or TreeStats(file_schema)
        stats.add(table)
        stats.bytes_on_disk += fs.size(path)
    summary = stats.summary()
    summary["files"] = len(files)
    return summary


PROG = "python -m compression.inspect"


def _main(argv) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Summarise tree Parquet files: samples, trees, nodes per layer, samples per "
                    "root, ids stored flat vs in trees (the compression ratio), bytes on disk.",
        epilog=cli.epilog(f"{PROG} trees/", f"{PROG} 'trees/*.parquet' --json"))
    parser.add_argument("path", help="a tree Parquet file, a directory of them, or a glob")
    parser.add_argument("--schema", help="schema YAML (default: the one stored in the files)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    cli.add_debug_flag(parser)
    args = parser.parse_args(argv)
    schema = schemas.load(args.schema) if args.schema else None
    try:
        files = expand_paths(args.path)
    except FileNotFoundError as e:
        parser.error(str(e))
    summary = inspect_paths(files, schema)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(format_summary(summary))
        print(f"files                 {summary['files']}")
    return 0


def main(argv=None) -> int:
    return cli.run_command(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
