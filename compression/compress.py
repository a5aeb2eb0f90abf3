"""The in-process compression command: raw sample files -> tree Parquet files on one machine.

    python -m compression.compress --schema S --input 'raw/*.parquet' --output trees/

For data larger than memory use the Beam job (``python -m pipelines.compress``), which shards by
the root key first; this command is the single-machine path and the reference it is tested
against.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import schemas
from compression import cli, fs, outputs
from compression.io import expand_paths, read_raw, write_trees
from compression.stats import TreeStats, format_summary
from compression.trees import build_trees


def compress_files(schema: schemas.Schema, inputs, output_dir: str, format: str | None = None,
                   roots_per_file: int = 200_000, overwrite: bool = False) -> dict:
    """Read and validate raw files, build trees, write ``part-NNNNN.parquet`` + ``_stats.json``.

    ``output_dir`` must be missing or empty unless ``overwrite`` (then it is replaced whole);
    it is written through a temporary directory next to it, renamed into place at the end (on
    an object store: published by a manifest written last), so a failure leaves nothing
    behind (:class:`compression.outputs.StagedOutput`)."""
    files = expand_paths(inputs)
    with outputs.StagedOutput(output_dir, overwrite, inputs=files) as staged:
        summary = _compress_into(schema, files, staged.tmp, format, roots_per_file)
        staged.commit()
    return summary


def _compress_into(schema, inputs, output_dir, format, roots_per_file) -> dict:
    files = expand_paths(inputs)
    flat = read_raw(files, schema, format)
    trees = build_trees(flat, schema, validate=False)
    stats = TreeStats(schema)
    for shard, start in enumerate(range(0, max(trees.num_rows, 1), roots_per_file)):
        part = trees.slice(start, roots_per_file)
        path = write_trees(part, fs.join(output_dir, f"part-{shard:05d}.parquet"))
        stats.add(part)
        stats.bytes_on_disk += fs.size(path)
    summary = stats.summary()
    summary["input_files"] = len(files)
    fs.write_text(fs.join(output_dir, "_stats.json"), json.dumps(summary, indent=2,
                                                                 sort_keys=True))
    return summary


PROG = "python -m compression.compress"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compress raw samples (Parquet, CSV or JSON lines) into multi-prefix-tree "
                    "Parquet files in this process. For large data use pipelines.compress.",
        epilog=cli.epilog(f"{PROG} --schema schemas/examples/taobao_like.yaml "
                          "--input 'raw/*.parquet' --output trees/"))
    parser.add_argument("--schema", required=True, help="schema YAML file")
    parser.add_argument("--input", required=True, help="raw files: a path, directory or glob")
    parser.add_argument("--output", required=True,
                        help="output directory for tree files (part-NNNNN.parquet, _stats.json); "
                             "written through a temporary directory next to it, renamed into "
                             "place when done")
    cli.add_overwrite_flag(parser)
    parser.add_argument("--format", choices=["parquet", "csv", "json"],
                        help="input format (default: from each file's extension)")
    parser.add_argument("--roots-per-file", type=int, default=200_000,
                        help="root nodes (e.g. users) per output file (default 200000)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also print the full summary (as compression.inspect does)")
    cli.add_debug_flag(parser)
    return parser


def _main(argv) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.roots_per_file < 1:
        parser.error(f"--roots-per-file: expected a number >= 1, got {args.roots_per_file}")
    schema = schemas.load(args.schema)
    files = cli.check_inputs(args.input, "--input", args.format)
    started = time.perf_counter()
    summary = compress_files(schema, files, args.output, args.format, args.roots_per_file,
                             overwrite=args.overwrite)
    seconds = time.perf_counter() - started
    if args.verbose:
        print(format_summary(summary))
    print(f"compressed {summary['samples']:,} samples into {summary['trees']:,} trees "
          f"({summary['id_compression_ratio']:.2f}x fewer ids) in {seconds:.1f} s "
          f"({summary['samples'] / max(seconds, 1e-9):,.0f} samples/s) -> {args.output}")
    return 0


def main(argv=None) -> int:
    return cli.run_command(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
