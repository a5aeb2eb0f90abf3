"""Compact embedding tables in training: model bytes against AUC, in one run.

    python -m benchmarks.compact_tables                       # 500k generated samples
    python -m benchmarks.compact_tables --samples 1000000 --json compact.json
    python -m benchmarks.compact_tables --tiny                # CI size: seconds

Generated data (``pipelines.generate``, taobao_like schema, data seed ``--data-seed``) split in
time order, 80% train / 20% eval. Every variant of :data:`VARIANTS` trains the default model
(``models.MLP()``) with ``TrainConfig`` defaults plus the variant's config overrides, for
``--epochs`` passes with the same seed, and is scored on the eval part. The table gives per
variant:

- ``rows``: the rows of every table after training (a cold table's bucket rows included);
- ``model MB``: the bytes of those rows' values (rows x dim x 4: what an export serves);
- ``snapshot MB``: the bytes of the tables' snapshots (values, optimizer state, entry filter);
- ``x smaller``: the default's model bytes over the variant's;
- ``AUC``, ``logloss`` (the first label, ``click``), ``AUC loss``: ``(default AUC - AUC) /
  default AUC``, the relative loss against the default trained in the same run;
- ``samples/s`` of training.

``VARIANTS`` (``(name, config overrides)``, the overrides merged into the config dict per
table) is importable, so other benchmarks can train the same variants. The big tables of the
taobao_like schema are the ones the variants compress; its small ones (gender, hour...) hold a
handful of rows and stay as they are.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = os.path.join(ROOT, "schemas", "examples", "taobao_like.yaml")

# The taobao_like tables with many ids (distinct ids in 400k generated train samples, data
# seed 2: creative 92k, ad 54k, clicked_items 35k, clicked_brands 13k, campaign 12k, brand
# 10k, customer 9k, user 8k); the other 14 tables hold 2 to 625 rows each (1.4k in all).
BIG_TABLES = ("creative_id", "ad_id", "clicked_items", "clicked_brands", "campaign_id",
              "brand_id", "customer_id", "user_id")
# Multi-hash buckets [Q, R] per big table: Q * R about its distinct ids (an id's pair of rows
# is nearly its own), Q + R about 1/12 of them (a remainder row shared by ~12 ids, a quotient
# row by 1/12 of them). Measured at 400k train samples (1 pass, seed 0): with Q = 4 the
# remainder rows are shared by 4x fewer ids but the table holds 2.4x the rows (-0.6% AUC at
# 4x smaller); a sum beat the product q * (1 + r) at every size tried (-1.0% / -3.0%).
MULTI_HASH_BUCKETS = {"creative_id": [12, 7700], "ad_id": [12, 4530],
                      "clicked_items": [12, 2880], "clicked_brands": [12, 1060],
                      "campaign_id": [12, 1000], "brand_id": [12, 850],
                      "customer_id": [12, 750], "user_id": [12, 650]}


# Distinct ids per big table in 400k generated train samples (data seed 2), rounded.
DISTINCT_IDS = {"creative_id": 92000, "ad_id": 54000, "clicked_items": 35000,
                "clicked_brands": 13000, "campaign_id": 12000, "brand_id": 10000,
                "customer_id": 9000, "user_id": 8000}


def _multi_hash(combine: str, tables=BIG_TABLES, q: int | None = None) -> dict:
    """Multi-hash on ``tables``: MULTI_HASH_BUCKETS, or with ``q`` buckets [q, ids / q] (Q * R
    about the table's distinct ids, Q + R about 1/q of them)."""
    return {"tables": {t: {"multi_hash": {
        "buckets": MULTI_HASH_BUCKETS[t] if q is None else [q, -(-DISTINCT_IDS[t] // q)],
        "combine": combine}} for t in tables}}


def _cold(min_count: int, buckets: int | None, tables=BIG_TABLES) -> dict:
    counter = {"name": "counter", "min_count": min_count}
    return {"tables": {t: {"filter": counter, **({} if buckets is None else
                                                  {"cold_buckets": buckets})}
                       for t in tables}}


VARIANTS = [
    ("default", {}),
    ("multi_hash sum", _multi_hash("sum")),
    ("multi_hash product", _multi_hash("product")),
    ("multi_hash sum, user_id own rows", _multi_hash("sum", BIG_TABLES[:-1])),
    # Q = 4: the 7 ad-side tables 4x smaller, each remainder row shared by ~4 ids
    ("multi_hash sum Q=4, user_id own rows", _multi_hash("sum", BIG_TABLES[:-1], q=4)),
    ("filter min_count 10", _cold(10, None)),
    ("filter min_count 10 + cold 1000", _cold(10, 1000)),
    # a counter filter counts an id once per batch it is in: a user (one tree a batch) seldom
    # reaches 10 in one pass, so the variants above drop every user's row
    ("filter min_count 10, user_id own rows", _cold(10, None, BIG_TABLES[:-1])),
    ("filter min_count 15, user_id own rows", _cold(15, None, BIG_TABLES[:-1])),
]


# Online learning on a stream of mostly new users (``--online``): the big tables with a counter
# filter as a production table has one (an id gets its row at its third sighting), without
# and with a cold table; and the defaults (no filter: every id its own row at once).
ONLINE_MIN_COUNT = 3
ONLINE_VARIANTS = [
    ("filter min_count 3 (zeros until admitted)", _cold(ONLINE_MIN_COUNT, None)),
    ("filter min_count 3 + cold 2000", _cold(ONLINE_MIN_COUNT, 2000)),
    ("default (no filter)", {}),
]


def merged_config(overrides: dict, base: dict | None = None) -> dict:
    """``base`` (a config dict) with ``overrides`` merged in: ``tables`` and ``features``
    per entry, ``embedding`` per key, the rest replaced."""
    out = json.loads(json.dumps(base or {}))
    for key, value in overrides.items():
        if key in ("tables", "features"):
            entries = out.setdefault(key, {})
            for name, entry in value.items():
                entries[name] = {**entries.get(name, {}), **entry}
        elif key == "embedding":
            out[key] = {**out.get(key, {}), **value}
        else:
            out[key] = value
    return out


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _data(samples: int, seed: int):
    import compression
    import schemas
    from pipelines.generate import generate_tables

    schema = schemas.load(SCHEMA)
    table = pa.concat_tables(list(generate_tables(schema, samples, seed=seed)))
    table = table.drop_columns([c for c in table.column_names if c.startswith(("p_", "h_"))])
    cut = int(table.num_rows * 0.8)  # generated rows are in time order
    return schema, compression.build_trees(table.slice(0, cut), schema), table.slice(cut)


def table_bytes(trainer) -> dict:
    """Rows, their values' bytes and the snapshots' bytes of every table of ``trainer``."""
    rows = {t: len(s) for t, s in trainer.stores.items()}
    values = sum(rows[t] * s.dim * 4 for t, s in trainer.stores.items())
    with tempfile.TemporaryDirectory(prefix="compact-tables-") as tmp:
        snapshot = 0
        for table, store in trainer.stores.items():
            path = os.path.join(tmp, table)
            os.makedirs(path)
            snapshot += os.path.getsize(store.save(path))
    return {"rows": sum(rows.values()), "model_bytes": values, "snapshot_bytes": snapshot,
            "tables": rows}


def run_variant(schema, train, test, overrides: dict, epochs: int, seed: int,
                batch_size: int | None = None) -> dict:
    from trainer import Trainer, TrainConfig, models

    base = {"seed": seed}
    if batch_size is not None:
        base["batch_size"] = batch_size
    config = TrainConfig.from_dict(merged_config(overrides, base))
    trainer = Trainer(schema, models.MLP(), config)
    started = time.perf_counter()
    fit = trainer.fit(train, epochs=epochs)
    seconds = time.perf_counter() - started
    evaluation = trainer.evaluate(test)
    return {"auc": evaluation["auc"], "logloss": evaluation["logloss"],
            "samples_per_sec": fit["samples"] / seconds, "train_seconds": seconds,
            **table_bytes(trainer)}


def run(argv=None) -> dict:
    args = _parser().parse_args(argv)
    if args.tiny:
        args.samples, args.batch_size = 4000, 500
    names = [n for n, _ in VARIANTS]
    chosen = args.variants.split(",") if args.variants else names
    unknown = [v for v in chosen if v not in names]
    if unknown:
        raise SystemExit(f"--variants: unknown variant {unknown[0]!r}; known: "
                         f"{', '.join(names)}")
    if "default" not in chosen:
        chosen = ["default"] + chosen
    log(f"generating {args.samples} samples...")
    schema, train, test = _data(args.samples, args.data_seed)
    results = {}
    for name, overrides in VARIANTS:
        if name not in chosen:
            continue
        log(f"training {name}...")
        results[name] = run_variant(schema, train, test, overrides, args.epochs, args.seed,
                                    args.batch_size)
    default = results["default"]
    for r in results.values():
        r["x_smaller"] = default["model_bytes"] / max(r["model_bytes"], 1)
        r["snapshot_x_smaller"] = default["snapshot_bytes"] / max(r["snapshot_bytes"], 1)
        r["auc_loss"] = (default["auc"] - r["auc"]) / default["auc"]
    return {"samples": args.samples, "train_samples": args.samples - test.num_rows,
            "eval_samples": test.num_rows, "epochs": args.epochs,
        "seed": args.seed, "data_seed": args.data_seed, "machine": platform.processor() or
        platform.machine(), "results": results}


def online_compare(samples: int, samples_per_user: float, seed: int, batch_size: int,
                   variants=None, bootstrap: str | None = None) -> dict:
    """Each online variant's ``trainer.online`` engine (the single-process OnlineTrainer, a
    new run: output calibrated on its first batch) over the same topic of ``samples`` JSON
    samples on a local Tansu broker (or the one at ``bootstrap``): its progressive-validation AUC and logloss (every sample
    scored before it trains) and the rows its tables hold at the end."""
    import schemas
    from benchmarks.online import _produce, create_topic
    from pipelines import local_broker
    from pipelines.generate import generate_tables
    from pipelines.replay import json_lines, message_keys
    from trainer import Trainer, TrainConfig, models
    from trainer.checkpoints import CheckpointManager
    from trainer.kafka_source import KafkaSampleSource, group_id
    from trainer.online_process import OnlineTrainer

    schema = schemas.load(SCHEMA)
    table = pa.concat_tables(generate_tables(schema, samples, seed=seed,
                                             samples_per_user=samples_per_user))
    users = len(np.unique(table["user_id"].to_numpy()))
    messages = list(zip(message_keys(table, schema).to_pylist(),
                        json_lines(table, schema).to_pylist()))
    out = {"samples": samples, "samples_per_user": samples_per_user, "users": users,
           "seed": seed, "batch_size": batch_size, "results": {}}
    broker = (contextlib.nullcontext((bootstrap, None, None)) if bootstrap
              else local_broker.tansu())
    with broker as (bootstrap, _, _), \
            tempfile.TemporaryDirectory(prefix="compact-online-") as work:
        topic = create_topic(bootstrap, 1)
        _produce(bootstrap, topic, messages)
        for name, overrides in variants or ONLINE_VARIANTS:
            log(f"online: {name}...")
            config = TrainConfig.from_dict(merged_config(overrides, {"seed": seed,
                                                                     "batch_size": batch_size}))
            trainer = Trainer(schema, models.MLP(), config)
            source = KafkaSampleSource(schema, bootstrap, topic, group_id(),
                                       config=dict(local_broker.CLIENT_OPTIONS))
            run_dir = os.path.join(work, f"run-{len(out['results'])}")
            online = OnlineTrainer(schema, trainer, source, CheckpointManager(run_dir),
                                   checkpoint_every=1e9, max_samples=samples, idle_exit=10,
                                   calibrate=True)
            started = time.perf_counter()
            try:
                summary = online.run()
            finally:
                source.close()
            pv = summary["pv"]
            out["results"][name] = {"pv_logloss": pv["logloss"], "pv_auc": pv["auc"],
                                    "samples": pv["samples"],
                                    "rows": sum(len(s) for s in trainer.stores.values()),
                                    "seconds": time.perf_counter() - started}
    return out


def online_table(result: dict) -> str:
    lines = [f"{result['samples']:,} samples, {result['users']:,} users "
             f"({result['samples_per_user']} samples a user on average), seed {result['seed']}",
             "", "| online variant | PV logloss | PV AUC | rows at the end |",
             "| --- | --- | --- | --- |"]
    for name, r in result["results"].items():
        lines.append(f"| {name} | {r['pv_logloss']:.5f} | {r['pv_auc']:.4f} | {r['rows']:,} |")
    return "\n".join(lines)


def table(result: dict) -> str:
    lines = ["| variant | rows | model MB | x smaller | snapshot MB | x smaller | AUC | "
             "AUC loss | logloss | samples/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in result["results"].items():
        lines.append(
            f"| {name} | {r['rows']:,} | {r['model_bytes'] / 1e6:.2f} | {r['x_smaller']:.1f} | "
            f"{r['snapshot_bytes'] / 1e6:.2f} | {r['snapshot_x_smaller']:.1f} | "
            f"{r['auc']:.4f} | {100 * r['auc_loss']:+.2f}% | {r['logloss']:.4f} | "
            f"{r['samples_per_sec']:,.0f} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compact_tables",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=500_000,
                        help="generated samples, 80%% train / 20%% eval (default 500000)")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the train part")
    parser.add_argument("--seed", type=int, default=0, help="the models' seed")
    parser.add_argument("--data-seed", type=int, default=2, help="the generator's seed")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="training batch (default: TrainConfig's)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated names of VARIANTS to train (default: all; "
                             "default is always trained)")
    parser.add_argument("--online", action="store_true",
                        help="instead: online learning (trainer.online's engine, a local "
                             "Tansu broker) on a stream of mostly new users, with and without "
                             "the cold table (ONLINE_VARIANTS); progressive-validation logloss")
    parser.add_argument("--bootstrap-servers", default=None,
                        help="--online: use this broker instead of starting Tansu")
    parser.add_argument("--samples-per-user", type=float, default=3.0,
                        help="--online: the stream's samples per user on average (default 3)")
    parser.add_argument("--tiny", action="store_true", help="CI size: 4000 samples")
    parser.add_argument("--json", default=None, help="also write the result as JSON here")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.online:
        samples = 4000 if args.tiny else (args.samples if "--samples" in (argv or sys.argv)
                                          else 100_000)
        result = online_compare(samples, args.samples_per_user, args.data_seed,
                                args.batch_size or 1000, bootstrap=args.bootstrap_servers)
        print(online_table(result))
    else:
        result = run(argv)
        print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items()}, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
