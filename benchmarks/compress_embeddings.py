"""Smaller embedding tables, and what they cost: bytes against eval quality and speed.

    python -m benchmarks.compress_embeddings [--samples 400000] [--datasets generated,movielens]

For each data set (``pipelines.generate`` rows and MovieLens 100K, split in time order 80/20 as
``benchmarks.quality`` splits them) and each TRAINING VARIANT (a name and config overrides over
the default model's config: MLP 200-80-1, dim 18, Adagrad), one model is trained once; then it
is exported in every EXPORT FORMAT (float32, float16, int8, int4: ``--export-format``) and each
export is served by a Predictor on the eval part. A row per (variant, format):

- bytes of the tables: in memory (training stores; serving stores as loaded), on disk (the
  training snapshots, what a checkpoint holds), exported (``stores/`` of the export), and the
  float32 *values-only* payload (ids + dim float32 values a row, no optimizer state, header or
  filter): the two baselines the ratios are against, so neither flatters the formats;
- eval AUC and log loss of the served export, and their difference from the float32 export of
  the same run (the same trained model: only the export differs);
- training samples/s (the variant's; the same for every format of it) and seconds to export;
- service latency p50/p99 of LiveModel over the same requests, the formats measured in
  rotation so a slower moment of a shared machine hits them all alike (every request
  answered ``--repeats`` times by each: p50/p99 over all answers, and over each request's
  fastest answer).

Add a variant by appending ``(name, overrides)`` to TRAINING_VARIANTS (overrides: a dict merged
into the TrainConfig dict, e.g. ``{"embedding": {"dim": 8}}``); every variant gets the same
rows. ``--tiny`` runs everything at a size for CI.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

from benchmarks import compact_tables, datasets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "python -m benchmarks.compress_embeddings"

# (name, TrainConfig overrides): the models trained; each is exported in every format.
# The compact variants are two of benchmarks.compact_tables' (multi-hash rows at no AUC cost
# on its data; a filter that keeps only hot ids' rows, the smallest): on the data sets whose
# schema has their tables (taobao_like), exported in every format, so the table shows compact
# tables and quantized exports together.
_COMPACT = dict(compact_tables.VARIANTS)
TRAINING_VARIANTS: list[tuple[str, dict]] = [
    ("default", {}),
    ("compact: multi_hash sum Q=4, user_id own rows",
     _COMPACT["multi_hash sum Q=4, user_id own rows"]),
    ("compact: filter min_count 15, user_id own rows",
     _COMPACT["filter min_count 15, user_id own rows"]),
]
EXPORT_FORMATS = ("float32", "float16", "int8", "int4")


def log(message: str) -> None:
    print(f"[compress_embeddings] {message}", file=sys.stderr, flush=True)


def merged(base: dict, overrides: dict) -> dict:
    """``base`` with ``overrides`` merged in, mappings key by key."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_datasets(args) -> list[tuple[str, object, object, object]]:
    """``(name, schema, train raw rows, eval raw rows)`` per data set (time split 80/20)."""
    import schemas

    out = []
    for name in args.datasets:
        if name == "generated":
            schema = schemas.load(datasets.GENERATED_SCHEMA)
            table = datasets.generated(schema, args.samples, args.data_seed)
            label = f"generated-{args.samples // 1000}k"
        elif name == "movielens":
            schema = schemas.load(datasets.MOVIELENS_SCHEMA)
            table = datasets.movielens_100k(args.movielens_dir, schema=schema)
            if args.movielens_rows:
                table = table.slice(0, args.movielens_rows)
            label = "movielens-100k"
        else:
            raise SystemExit(f"--datasets: unknown data set {name!r}; use generated, movielens")
        extra = [c for c in table.column_names if c.startswith(("p_", "h_"))]
        train, test = datasets.time_split(table.drop_columns(extra), 0.8)
        out.append((label, schema, train, test))
    return out


def missing_tables(overrides: dict, schema) -> list[str]:
    """The tables a variant's overrides name that ``schema`` has no feature of (a variant made
    for another schema is not run on it)."""
    names = {f.name for f in schema.features}
    return sorted(set(overrides.get("tables", {})) - names)


def against_default(entry: dict) -> None:
    """Every row against the default variant's float32 export of the same data set: how many
    times smaller its export is, its AUC's relative loss."""
    base = entry["variants"].get("default", {}).get("formats", {}).get("float32")
    if base is None:
        return
    for variant in entry["variants"].values():
        for r in variant["formats"].values():
            r["smaller_than_default_float32"] = base["export_bytes"] / r["export_bytes"]
            r["relative_auc_loss_vs_default"] = (base["auc"] - r["auc"]) / base["auc"]


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path)
               for f in files)


def values_only_bytes(stores: dict) -> int:
    """ids + dim float32 values a row: the float32 payload without any overhead."""
    return sum(len(s) * (8 + 4 * s.dim) for s in stores.values())


def percentile(values, q) -> float:
    return float(np.percentile(np.asarray(values), q)) if len(values) else float("nan")


def serve_latencies(exports: dict, eval_raw, args) -> dict:
    """Milliseconds per request of a LiveModel on each export over the same requests
    (``args.requests`` requests of ``args.request_samples`` eval samples), each request
    answered ``args.repeats`` times by every format in rotation: p50/p99 over every answer,
    and p50/p99 over each request's fastest answer (its own cost with the shared host's
    interruptions left out)."""
    from trainer.live import LiveModel

    models = {f: LiveModel(path) for f, path in exports.items()}
    try:
        rng = np.random.default_rng(0)
        n = eval_raw.num_rows
        size = min(args.request_samples, n)
        starts = rng.integers(0, max(1, n - size), args.requests + args.warmup)
        requests = [eval_raw.slice(int(s), size) for s in starts]
        every = {f: [] for f in models}
        best = {f: [] for f in models}
        order = list(models)
        turn = 0
        for i, request in enumerate(requests):
            mine = {f: [] for f in models}
            for _ in range(args.repeats):
                turn += 1
                for f in order[turn % len(order):] + order[:turn % len(order)]:
                    started = time.perf_counter()
                    models[f].predict(request)
                    mine[f].append(1000 * (time.perf_counter() - started))
            if i >= args.warmup:
                for f, t in mine.items():
                    every[f] += t
                    best[f].append(min(t))
        return {f: {"p50_ms": percentile(every[f], 50), "p99_ms": percentile(every[f], 99),
                    "best_p50_ms": percentile(best[f], 50),
                    "best_p99_ms": percentile(best[f], 99), "requests": len(best[f])}
                for f in models}
    finally:
        for model in models.values():
            model.close()


def run_variant(name: str, overrides: dict, schema, train, test, args, work: str) -> dict:
    import compression
    from trainer import TrainConfig, Trainer, models
    from trainer.metrics import auc, logloss
    from trainer.serving import Predictor

    config = TrainConfig.from_dict(merged(TrainConfig().replace(seed=args.seed).to_dict(),
                                          overrides))
    trainer = Trainer(schema, models.MLP(), config)
    train_trees = compression.build_trees(train, schema)
    started = time.perf_counter()
    history = trainer.fit(train_trees)
    fit_seconds = time.perf_counter() - started
    snapshot_dir = os.path.join(work, f"{name}-snapshots")
    for table, store in trainer.stores.items():
        os.makedirs(os.path.join(snapshot_dir, table))
        store.save(os.path.join(snapshot_dir, table))
    training = {"samples_per_sec": history["samples_per_sec"], "fit_seconds": fit_seconds,
                "rows": trainer.store_rows(),
                "memory_bytes": sum(s.stats().bytes for s in trainer.stores.values()),
                "snapshot_bytes": dir_bytes(snapshot_dir),
                "values_only_bytes": values_only_bytes(trainer.stores)}
    shutil.rmtree(snapshot_dir)
    labels = test[schema.labels[0]].to_numpy()
    samples = test.drop_columns(list(schema.labels))
    rows, exports = {}, {}
    trained = trainer.config  # with the dense statistics the first batch resolved
    for export_format in EXPORT_FORMATS:
        trainer.config = trained.with_export_format(export_format)
        path = os.path.join(work, f"{name}-{export_format}")
        started = time.perf_counter()
        trainer.export(path)
        export_seconds = time.perf_counter() - started
        exports[export_format] = path
        predictor = Predictor(path)
        p = predictor.predict(samples)
        p = p if p.ndim == 1 else p[:, 0]
        rows[export_format] = {
            "export_bytes": dir_bytes(os.path.join(path, "stores")),
            "serving_memory_bytes": sum(s.stats().bytes for s in predictor.stores.values()),
            "export_seconds": export_seconds,
            "auc": auc(p, labels), "logloss": logloss(p, labels)}
        del predictor
    base = rows["float32"]
    for r in rows.values():
        r["auc_delta"] = r["auc"] - base["auc"]
        r["logloss_delta"] = r["logloss"] - base["logloss"]
        r["smaller_than_float32_export"] = base["export_bytes"] / r["export_bytes"]
        r["smaller_than_values_only"] = training["values_only_bytes"] / r["export_bytes"]
    latency = serve_latencies(exports, test, args)
    for f, r in rows.items():
        r.update(latency[f])
        r["p99_vs_float32"] = r["p99_ms"] / latency["float32"]["p99_ms"]
        r["best_p99_vs_float32"] = r["best_p99_ms"] / latency["float32"]["best_p99_ms"]
    return {"training": training, "formats": rows, "overrides": overrides}


def markdown(results: dict) -> str:
    lines = []
    for data_name, entry in results["datasets"].items():
        lines += ["", f"### {data_name} ({entry['train_samples']:,} train / "
                      f"{entry['eval_samples']:,} eval samples)", "",
                  "| variant | format | memory (train / serve) | on disk (snapshots) | "
                  "exported | x vs f32 export | x vs values-only | x vs default f32 | "
                  "eval AUC (delta) | rel. AUC loss vs default f32 | "
                  "logloss (delta) | train samples/s | export s | serve p50 / p99 ms "
                  "(p99 x f32) | best of repeats p50 / p99 ms (p99 x f32) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, variant in entry["variants"].items():
            t = variant["training"]
            for f, r in variant["formats"].items():
                lines.append(
                    f"| {name} | {f} | {mb(t['memory_bytes'])} / {mb(r['serving_memory_bytes'])}"
                    f" | {mb(t['snapshot_bytes'])} | {mb(r['export_bytes'])} | "
                    f"{r['smaller_than_float32_export']:.2f}x | "
                    f"{r['smaller_than_values_only']:.2f}x | "
                    f"{r.get('smaller_than_default_float32', float('nan')):.2f}x | "
                    f"{r['auc']:.4f} ({r['auc_delta']:+.5f}) | "
                    f"{100 * r.get('relative_auc_loss_vs_default', float('nan')):.2f}% | "
                    f"{r['logloss']:.4f} ({r['logloss_delta']:+.5f}) |"
                    f" {t['samples_per_sec']:,.0f} | {r['export_seconds']:.2f} | "
                    f"{r['p50_ms']:.2f} / {r['p99_ms']:.2f} ({r['p99_vs_float32']:.2f}x) | "
                    f"{r['best_p50_ms']:.2f} / {r['best_p99_ms']:.2f} "
                    f"({r['best_p99_vs_float32']:.2f}x) |")
        for name, why in entry.get("skipped", {}).items():
            lines.append(f"\n{name}: not run here ({why})")
        lines.append("\nvalues-only float32 payload (ids + dim floats a row): "
                     + ", ".join(f"{n} {mb(v['training']['values_only_bytes'])}"
                                 for n, v in entry["variants"].items()))
    return "\n".join(lines)


def mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=400_000,
                   help="generated samples (80%% train, 20%% eval; default 400000)")
    p.add_argument("--datasets", type=lambda s: [x for x in s.split(",") if x],
                   default=["generated", "movielens"],
                   help="comma-separated: generated, movielens (default both)")
    p.add_argument("--data-seed", type=int, default=2, help="pipelines.generate seed")
    p.add_argument("--seed", type=int, default=0, help="the model's seed")
    p.add_argument("--movielens-dir", default=None,
                   help="RecBole's ml-100k atomic files (default: the installed wheel's)")
    p.add_argument("--movielens-rows", type=int, default=0,
                   help="only the first N MovieLens rows (0: all 100,000)")
    p.add_argument("--requests", type=int, default=300,
                   help="measured serving requests per format (default 300)")
    p.add_argument("--warmup", type=int, default=20, help="unmeasured requests first")
    p.add_argument("--repeats", type=int, default=3,
                   help="answers of each request by each format (default 3)")
    p.add_argument("--request-samples", type=int, default=200,
                   help="samples per serving request (default 200)")
    p.add_argument("--tiny", action="store_true",
                   help="a CI-sized run: 3000 generated samples, 3000 MovieLens rows, 10 "
                        "requests")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument("--work-dir", default=None,
                   help="where the exports go (default: a temporary directory, removed)")
    return p


def run(argv=None) -> dict:
    args = _parser().parse_args(argv)
    if args.tiny:
        args.samples = 3000
        args.movielens_rows = args.movielens_rows or 3000
        args.requests, args.warmup, args.request_samples, args.repeats = 10, 2, 50, 2
    from trainer.runs import load_tensorflow

    load_tensorflow(False)
    import tensorflow as tf

    started = time.perf_counter()
    results = {"command": f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:]),
               "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                           "tensorflow": tf.__version__, "load_average": os.getloadavg()},
               "variants": [name for name, _ in TRAINING_VARIANTS],
               "formats": list(EXPORT_FORMATS), "datasets": {}}
    work = args.work_dir or tempfile.mkdtemp(prefix="prefixrec-compress-")
    try:
        for data_name, schema, train, test in load_datasets(args):
            log(f"{data_name}: {train.num_rows:,} train / {test.num_rows:,} eval samples")
            entry = {"train_samples": train.num_rows, "eval_samples": test.num_rows,
                     "variants": {}}
            for name, overrides in TRAINING_VARIANTS:
                missing = missing_tables(overrides, schema)
                if missing:
                    entry.setdefault("skipped", {})[name] = (
                        f"its schema has no feature {', '.join(missing)}")
                    log(f"  {name}: not run on {data_name} ({entry['skipped'][name]})")
                    continue
                folder = os.path.join(work, data_name)
                os.makedirs(folder, exist_ok=True)
                entry["variants"][name] = variant = run_variant(name, overrides, schema, train,
                                                                test, args, folder)
                for f, r in variant["formats"].items():
                    log(f"  {name} {f}: {r['export_bytes']:,} bytes exported "
                        f"({r['smaller_than_float32_export']:.2f}x smaller), AUC {r['auc']:.4f} "
                        f"({r['auc_delta']:+.5f}), p99 {r['p99_ms']:.2f} ms")
                shutil.rmtree(folder, ignore_errors=True)
            against_default(entry)
            results["datasets"][data_name] = entry
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    results["seconds"] = time.perf_counter() - started
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def main(argv=None) -> int:
    results = run(argv)
    print(markdown(results), flush=True)
    print(f"\n({results['seconds'] / 60:.1f} minutes; {results['command']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
