"""The evaluation command: score files with a run's checkpoint and report AUC and log loss.

    python -m trainer.evaluate --run runs/mlp --data 'test/*.parquet'

Restores ``RUN_DIR/checkpoint`` (written by ``python -m trainer.train``), shows a progress bar on
stderr, adds the scalars to ``RUN_DIR/eval``, prints a summary line on stderr and the result as
one JSON line on stdout. ``--run`` may be on an object store (``s3://...``, as ``trainer.train
--out`` publishes it): it is read from a local copy, which is published back with the eval
logs, all or nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from compression import cli, fs
from trainer.runs import json_number, load_tensorflow

PROG = "python -m trainer.evaluate"


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=cli.epilog(f"{PROG} --run runs/mlp --data 'test/*.parquet'"))
    parser.add_argument("--run", required=True, help="run directory of python -m trainer.train")
    parser.add_argument("--data", required=True,
                        help="tree Parquet or raw Parquet/CSV/JSON lines files (path or glob)")
    parser.add_argument("--batch-size", type=int, help="default: the run's batch size")
    parser.add_argument("--no-progress", action="store_true")
    cli.add_debug_flag(parser)
    args = parser.parse_args(argv)
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size: expected a number >= 1, got {args.batch_size}")
    if fs.is_local(args.run):
        return _evaluate(parser, args, args.run)
    fs.check_bucket(args.run)
    with fs.working_copy(args.run) as local:  # the published run, with the eval logs added
        result = _evaluate(parser, args, local)
        fs.publish_directory(local, args.run, flag="--run")
    return result


def _evaluate(parser, args, run_dir: str) -> dict:
    """The evaluation with the run in the local directory ``run_dir`` (``--run`` itself, or a
    working copy of it on an object store); messages name ``--run``."""
    checkpoint = os.path.join(run_dir, "checkpoint")
    if not os.path.exists(os.path.join(checkpoint, "trainer.json")):
        parser.error(f"--run {args.run}: no checkpoint in {fs.join(args.run, 'checkpoint')}; "
                     "train with python -m trainer.train --out RUN_DIR first")
    cli.check_inputs(args.data, "--data")  # before any work: missing, unreadable, empty
    load_tensorflow(args.debug)
    from trainer.trainer import Trainer

    trainer = Trainer.restore(checkpoint)
    if args.batch_size:
        trainer.config = trainer.config.replace(batch_size=args.batch_size)
    result = trainer.evaluate(args.data, progress=not args.no_progress, log_dir=run_dir)
    result["store_rows"] = trainer.store_rows()
    result["step"] = trainer.step
    return {k: json_number(v) for k, v in result.items()}


def summary_line(result: dict) -> str:
    """The human summary on stderr, e.g. ``eval AUC 0.6312 | logloss 0.45120 | 20,000 samples |
    81,503 samples/s | checkpoint step 400``."""
    auc, logloss = result.get("auc"), result.get("logloss")
    return (f"eval AUC {'n/a' if auc is None else f'{auc:.4f}'} | "
            f"logloss {'n/a' if logloss is None else f'{logloss:.5f}'} | "
            f"{result['samples']:,} samples | {result['samples_per_sec']:,.0f} samples/s | "
            f"checkpoint step {result['step']:,}")


def _main(argv) -> int:
    result = run(argv)
    print(summary_line(result), file=sys.stderr, flush=True)
    print(json.dumps(result), flush=True)
    return 0


def main(argv=None) -> int:
    return cli.run_command(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())
