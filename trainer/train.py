"""The training command: fit a model on tree or raw sample files, evaluate, checkpoint.

    python -m trainer.train --schema schemas/examples/taobao_like.yaml \\
        --train-data 'trees/*.parquet' --eval-data 'test/*.parquet' --model mlp \\
        --compute structured --batch-size 5000 --epochs 1 --out runs/mlp

Shows a progress bar on stderr, writes TensorBoard scalars (loss, AUC, samples/s, store rows,
admitted/rejected/expired) to ``RUN_DIR/train`` and ``RUN_DIR/eval``, the checkpoint to
``RUN_DIR/checkpoint`` and the result to ``RUN_DIR/result.json``, and prints the result as one
JSON line on stdout (``id_compression``: ids the samples hold expanded to the leaves over ids
looked up, i.e. what the tree structure saved the trainer).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's start-up chatter quiet

import compression  # noqa: E402
import schemas  # noqa: E402
from trainer import models  # noqa: E402
from trainer.config import ConfigError, TrainConfig  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.split("\n")[0])
    p.add_argument("--schema", required=True, help="schema YAML file")
    p.add_argument("--train-data", required=True,
                   help="training files: tree Parquet or raw Parquet/CSV/JSON lines; a path, "
                        "directory or glob")
    p.add_argument("--eval-data", help="evaluation files, same kinds as --train-data")
    p.add_argument("--config", help="TrainConfig YAML (see trainer/examples/mlp.yaml)")
    p.add_argument("--model", choices=sorted(models.MODELS), default="mlp",
                   help="the dense network (default mlp, the paper's 200-80-1)")
    p.add_argument("--hidden", help="hidden layer sizes, e.g. 200,80 (default: the model's)")
    p.add_argument("--compute", choices=["structured", "flat"],
                   help="overrides the config's compute mode")
    p.add_argument("--batch-size", type=int, help="overrides the config's batch_size")
    p.add_argument("--epochs", type=_positive, default=None,
                   help="passes over the training data at most; default 1, or with --eval-data "
                        f"{DEFAULT_EPOCHS_WITH_EVAL}: the model is evaluated after every pass "
                        "and training stops once the eval AUC has not improved for --patience "
                        "evaluations (CTR models usually overfit after one epoch)")
    p.add_argument("--patience", type=_non_negative, default=1,
                   help="with --eval-data: evaluations without a better AUC before training "
                        "stops and the best checkpoint is kept (default 1; 0 trains every "
                        "epoch and keeps the last model)")
    p.add_argument("--eval-every", type=_positive, default=None, metavar="STEPS",
                   help="with --eval-data: also evaluate every STEPS steps")
    p.add_argument("--seed", type=int, help="overrides the config's seed")
    p.add_argument("--out", required=True, help="run directory (created)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


DEFAULT_EPOCHS_WITH_EVAL = 10


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    return 0 if text.strip() == "0" else _positive(text)


def run(argv=None) -> dict:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        schema = schemas.load(args.schema)
        config = TrainConfig.load(args.config) if args.config else TrainConfig()
        overrides = {k: v for k, v in (("compute", args.compute), ("batch_size", args.batch_size),
                                       ("seed", args.seed)) if v is not None}
        config = config.replace(**overrides)
    except (schemas.SchemaError, ConfigError) as e:
        parser.error(str(e))
    model_args = {}
    if args.hidden:
        try:
            model_args["hidden"] = tuple(int(x) for x in args.hidden.split(","))
        except ValueError:
            parser.error(f"--hidden: expected sizes like 200,80, got {args.hidden!r}")
    try:
        trainer = Trainer(schema, models.MODELS[args.model](**model_args), config)
    except (ConfigError, ValueError) as e:
        parser.error(str(e))
    if args.eval_data:
        try:
            compression.expand_paths(args.eval_data)
        except (FileNotFoundError, ValueError) as e:
            parser.error(f"--eval-data: {e}")
    elif args.eval_every:
        parser.error("--eval-every needs --eval-data")
    epochs = args.epochs or (DEFAULT_EPOCHS_WITH_EVAL if args.eval_data else 1)
    os.makedirs(args.out, exist_ok=True)
    progress = not args.no_progress
    checkpoint = os.path.join(args.out, "checkpoint")
    keep_best = bool(args.eval_data) and args.patience > 0
    history = trainer.fit(args.train_data, epochs=epochs, progress=progress, log_dir=args.out,
                          eval_data=args.eval_data, eval_every=args.eval_every,
                          patience=args.patience if keep_best else None,
                          best_dir=checkpoint if keep_best else None)
    if not keep_best:
        trainer.save(checkpoint)
    stats = trainer.store_stats()
    result = {"samples": history["samples"], "samples_per_sec": history["samples_per_sec"],
              "steps": history["steps"], "train_seconds": history["seconds"],
              "train_auc": history["train_auc"], "loss": history["loss"],
              "id_compression": history["id_compression"]}
    if args.eval_data:
        evaluations = history["evaluations"]
        # the checkpoint's model: the best evaluation, or the last one with --patience 0
        evaluation = history["best"] if keep_best else evaluations[-1]
        result.update(auc=evaluation["auc"], logloss=evaluation["logloss"],
                      eval_samples=evaluation["samples"], checkpoint_epoch=evaluation["epoch"],
                      checkpoint_step=evaluation["step"],
                      stopped_early=history["stopped_early"],
                      evaluations=[{k: _json_number(e[k]) for k in ("epoch", "step", "auc",
                                                                    "logloss")}
                                   for e in evaluations])
        result.update({k: v for k, v in evaluation.items() if k.startswith(("auc/", "logloss/"))})
    else:
        result.update(auc=None, logloss=None, eval_samples=0)
    result.update(store_rows=stats.get("rows", 0), admitted=stats.get("admitted", 0),
                  rejected=stats.get("rejected", 0), expired=stats.get("expired", 0),
                  model=args.model, compute=config.compute, batch_size=config.batch_size,
                  epochs=epochs, run_dir=os.path.abspath(args.out))
    result = {k: _json_number(v) for k, v in result.items()}
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def _json_number(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def main(argv=None) -> int:
    result = run(argv)
    if result["eval_samples"]:
        auc = f"eval AUC {result['auc']:.4f} (epoch {result['checkpoint_epoch']}, kept)"
    else:
        auc = "train AUC " + ("n/a" if result["train_auc"] is None
                              else f"{result['train_auc']:.4f}")
    print(f"{auc} | "
          f"{result['samples_per_sec']:,.0f} samples/s | {result['id_compression']:.2f}x fewer "
          f"ids looked up than flat samples hold | {result['store_rows']:,} store rows",
          file=sys.stderr, flush=True)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
