"""A trained run next to the field's floor on the same data: hashed one-hot logistic regression.

    python -m benchmarks.baseline --schema schemas/examples/taobao_like.yaml \\
        --train 'demo_out/raw/part-0000[0-3].parquet' --eval demo_out/raw/part-00004.parquet \\
        --run demo_out/run

Fits the logistic regression of ``benchmarks.quality`` (scikit-learn, L2, C chosen by AUC on the
last 10% of the training rows) on the raw training files and scores it on the eval files; with
``--run`` it prints the run's eval AUC (``RUN_DIR/result.json``) beside it. ``make demo`` ends
with it. Raw files only (Parquet, CSV, JSON lines): the baseline needs flat samples.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

import pyarrow as pa

import compression
import schemas
from benchmarks import quality


def _read(pattern: str, schema) -> pa.Table:
    return compression.read_raw(pattern, schema)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.baseline",
                                description=__doc__.split("\n")[0])
    p.add_argument("--schema", required=True, help="schema YAML file")
    p.add_argument("--train", required=True, help="raw training files (path or glob)")
    p.add_argument("--eval", required=True, help="raw evaluation files (path or glob)")
    p.add_argument("--run", help="a trainer.train run directory to compare with")
    p.add_argument("--lr-c", default="0.03,0.1,0.3",
                   help="inverse L2 strengths to choose from (default 0.03,0.1,0.3)")
    p.add_argument("--lr-bits", type=int, default=22, help="hashed columns: 2^bits")
    p.add_argument("--lr-max-iter", type=int, default=300)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    schema = schemas.load(args.schema)
    train, test = _read(args.train, schema), _read(args.eval, schema)
    data = types.SimpleNamespace(schema=schema, train=train, eval=test, label=schema.labels[0])
    options = types.SimpleNamespace(lr_c=[float(c) for c in args.lr_c.split(",")],
                                    lr_bits=args.lr_bits, lr_max_iter=args.lr_max_iter)
    lr = quality.run_lr(data, options)
    out = {"label": data.label, "train_samples": train.num_rows, "eval_samples": test.num_rows,
           "logistic_regression": {k: lr[k] for k in ("auc", "logloss", "C", "seconds")}}
    line = (f"logistic regression (hashed one-hot, C={lr['C']:g}) eval AUC {lr['auc']:.4f} "
            f"logloss {lr['logloss']:.5f}")
    if args.run:
        with open(os.path.join(args.run, "result.json")) as f:
            result = json.load(f)
        out["run"] = {"model": result["model"], "auc": result["auc"],
                      "logloss": result["logloss"]}
        line = (f"{result['model']} eval AUC {result['auc']:.4f} logloss "
                f"{result['logloss']:.5f} | {line} | difference "
                f"{result['auc'] - lr['auc']:+.4f} AUC on the same {test.num_rows:,} samples")
    print(line, file=sys.stderr, flush=True)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
