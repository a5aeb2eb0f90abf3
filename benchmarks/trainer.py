"""Benchmark of the trainer: structured vs flat compute vs a plain Keras model, same data.

    python -m benchmarks.trainer                          # 300k samples at 1, 10, 57 per user
    python -m benchmarks.trainer --models dien --samples-per-user 57 --quality-samples 0
    python -m benchmarks.trainer --samples 12000 --samples-per-user 10 --batch-size 1000 \\
        --quality-samples 0                               # CI size

The paper's MLP (taobao_like schema: 23 features, embedding dim 18, sum pooling, 200-80-1),
batch 5000, on generated data with about 1, 10 and 57 samples per user, all in one run:
- ``structured``: trainer.Trainer, compute="structured" (per-node lookups, pooling and first
  dense layer part, native stores);
- ``flat``: the same Trainer with compute="flat" (every feature expanded to the samples);
- ``keras``: a plain Keras model, one ``tf.Variable`` table of ``--keras-rows`` rows (ids hashed
  into it per feature), ``tf.nn.embedding_lookup``, Adam on the table and on the dense layers
  (the trainer's default optimizers) inside one ``tf.function`` step (Keras 3 updates the
  table densely).
With ``--models`` (default ``mlp,din,dien``) the structured and flat passes run for each
built-in model named: the MLP on taobao_like as above, DIN and DIEN on taobao_sequence (the
user's clicked categories an ordered sequence, in one table with the ad's category; the models'
defaults with ``--hidden``). Each row reports the step-level ratio (flat/structured ms of the
TF step and the update, measured sequentially: what the multiply-adds count) next to the
model's multiply-add bound (``matmul_bound``: DIEN's GRUs per user and ad node, DIN's
attention per ad node, the first dense layer per node of each layer) and how much of the bound
the step reaches.
Batches are built in memory before timing (reading is benchmarked in benchmarks.compression);
each model trains ``--warmup`` batches first (tracing) and is then timed over the rest.
Reports samples/s, the speed-ups, and where a structured/flat step's time goes (prepare = numpy
feed work, lookup = store lookups, TF step, update = apply_gradients), measured with the three
pipeline stages running sequentially so the parts add up. With ``--quality-samples`` it also
trains the structured MLP (trainer/examples/mlp.yaml) on the first 80% of a 57-samples-per-user
data set and reports its test AUC on the rest next to the Bayes-optimal AUC of the generator's
true probabilities.
End to end (``--e2e-samples``, default 1M; 0 skips): for each model, ``python -m trainer.train``
as a user runs it on a raw Parquet file of generated samples (``--e2e-samples-per-user``, 57),
trees built on the way, ``--e2e-epochs`` (2) passes, ``--compute structured`` and ``flat``
taking turns ``--e2e-rounds`` times: the command's wall time, the fit's time and the trainer's
seconds per stage (trace, read = raw file read, trees built, batches prepared; lookup; step;
update), the ratios flat/structured and the end-to-end ratio over the step-level one.
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np
import pyarrow as pa

import compression
import schemas
from benchmarks import compression as compression_benchmark
from pipelines.generate import generate_tables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = os.path.join(ROOT, "schemas", "examples", "taobao_like.yaml")
# DIN and DIEN read the user's ordered behaviour sequence: taobao_like cut down to a sequence
# model's features (the sequence and the ad's category in one table, as the models want).
SEQUENCE_SCHEMA = os.path.join(ROOT, "schemas", "examples", "taobao_sequence.yaml")
# model -> (schema, the behaviour sequence's feature, the query id); the MLP keeps the paper's
# feature mix, so its rows stay comparable with earlier measurements
MODEL_DATA = {"mlp": (SCHEMA, None, None),
              "din": (SEQUENCE_SCHEMA, "clicked_cats", "cate_id"),
              "dien": (SEQUENCE_SCHEMA, "clicked_cats", "cate_id")}
EXAMPLE_CONFIG = os.path.join(ROOT, "trainer", "examples", "mlp.yaml")  # log1p on price


def machine() -> dict:
    import tensorflow as tf

    return {**compression_benchmark.machine(), "tensorflow": tf.__version__,
            "load_average": os.getloadavg()}


def make_batches(schema, samples: int, spu: float, batch_size: int, seed: int):
    raw = pa.concat_tables(list(generate_tables(schema, samples, seed=seed,
                                                samples_per_user=spu)))
    trees = compression.build_trees(raw, schema, validate=False)
    batches = list(compression.iter_batches(trees, schema, batch_size))
    nodes = np.mean([[layer.size for layer in b.layers] for b in batches[:-1] or batches], 0)
    return batches, [float(x) for x in nodes]


def all_upper_shared(batch):
    """The batch with every upper layer reduced to its first node, all leaves under it: the
    same leaves and dense work per leaf, and the least upper-layer work any data could give
    structured compute (the measured counterpart of ``matmul_bound``'s ceiling)."""
    def first(array):
        if isinstance(array, tuple):
            values, offsets = array
            return values[offsets[0]:offsets[1]], (offsets[:2] - offsets[0]).astype(offsets.dtype)
        return array[:1]

    layers = []
    for level, layer in enumerate(batch.layers):
        if level == len(batch.layers) - 1:
            layers.append(dataclasses.replace(layer, parent=np.zeros(layer.size, np.int32)))
        else:
            layers.append(dataclasses.replace(
                layer, size=1, parent=None if level == 0 else np.zeros(1, np.int32),
                features={name: first(a) for name, a in layer.features.items()}))
    shared = dataclasses.replace(batch, layers=layers)
    shared.check()
    return shared



def keras_input_spec(schema) -> dict:
    """The ``tf.TensorSpec`` of a plain Keras baseline's inputs: per feature int64 ids,
    (values, offsets) of an ids list, or float32 dense values."""
    import tensorflow as tf

    spec = {}
    for f in schema.features:
        if f.kind == "id":
            spec[f.name] = tf.TensorSpec([None], tf.int64)
        elif f.kind == "ids":
            spec[f.name] = (tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64))
        else:
            spec[f.name] = tf.TensorSpec([None, f.dim], tf.float32)
    return spec

class TrainerRun:
    """One Trainer (structured or flat) and its timed passes."""

    def __init__(self, schema, batches, mode: str, warmup: int, hidden, model: str = "mlp"):
        import trainer

        config = trainer.TrainConfig(compute=mode, batch_size=batches[0].num_leaves)
        _, behaviour, query = MODEL_DATA[model]
        kwargs = {"hidden": hidden}
        if behaviour is not None:
            kwargs.update(behaviour=behaviour, query=query)
            from trainer.config import FeatureConfig

            shared = FeatureConfig(table="shared_" + query)
            config = config.replace(features=((behaviour, shared), (query, shared)))
        self.trainer = trainer.Trainer(schema, trainer.models.MODELS[model](**kwargs), config)
        self.trainer.fit(batches[:warmup])
        self.timed = batches[warmup:]

    def pipelined(self) -> float:
        """Seconds of ``fit`` (the three-stage pipeline) over the timed batches."""
        return self.trainer.fit(self.timed)["seconds"]

    def sequential(self) -> dict:
        """ms per step of each stage, run one after another on one thread."""
        t = self.trainer
        t.timings.clear()
        for batch in self.timed:
            t0 = time.perf_counter()
            prepared = t.prepare_numpy(batch)
            t1 = time.perf_counter()
            feed = t.builder.lookup(prepared, t.stores, train=True)
            t.timings["prepare"] += t1 - t0
            t.timings["lookup"] += time.perf_counter() - t1
            t._train_on(feed)
        return {k: 1000 * v / len(self.timed) for k, v in t.timings.items()}


class KerasBaseline:
    """The plain Keras model: a tf.Variable table and tf.nn.embedding_lookup."""

    def __init__(self, schema, rows: int, dim: int, hidden, seed: int):
        import keras
        import tensorflow as tf

        self.tf = tf
        self.schema, self.rows = schema, rows
        keras.utils.set_random_seed(seed)
        self.table = tf.Variable(tf.random.normal([rows, dim], stddev=0.01), name="table")
        layers = [keras.layers.Dense(u, activation="relu") for u in hidden]
        self.model = keras.Sequential(layers + [keras.layers.Dense(1)])
        # Adam(0.003) on the dense layers, Adam(0.01) on the table (a plain Keras setup)
        self.dense_optimizer = keras.optimizers.Adam(0.003)
        self.table_optimizer = keras.optimizers.Adam(0.01)
        self.salts = {f.name: (i + 1) * 0x9E3779B1 for i, f in enumerate(schema.features)}
        spec = keras_input_spec(schema)
        self.step = tf.function(self._step, input_signature=[spec, tf.TensorSpec([None])])

    def inputs(self, batch):
        """Leaf features with ids hashed into the table's rows (part of the timed work)."""
        out = {}
        for name, array in batch.leaf_features().items():
            f = self.schema.feature(name)
            if f.kind == "dense":
                out[name] = array
                continue
            values = array[0] if f.kind == "ids" else array
            index = ((values.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
                      + np.uint64(self.salts[name])) % np.uint64(self.rows)).astype(np.int64)
            out[name] = (index, array[1].astype(np.int64)) if f.kind == "ids" else index
        return out

    def _step(self, features, labels):
        tf = self.tf
        with tf.GradientTape() as tape:
            parts = []
            for f in self.schema.features:
                x = features[f.name]
                if f.kind == "id":
                    parts.append(tf.nn.embedding_lookup(self.table, x))
                elif f.kind == "ids":
                    ragged = tf.RaggedTensor.from_row_splits(x[0], x[1], validate=False)
                    parts.append(tf.reduce_sum(tf.nn.embedding_lookup(self.table, ragged), 1))
                else:
                    parts.append(x)
            logits = self.model(tf.concat(parts, 1))[:, 0]
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels, logits))
        variables = self.model.trainable_variables
        grads = tape.gradient(loss, variables + [self.table])
        self.dense_optimizer.apply_gradients(zip(grads[:-1], variables))
        self.table_optimizer.apply_gradients([(grads[-1], self.table)])
        return loss

    def fit(self, batches) -> float:
        label = self.schema.labels[0]
        started = time.perf_counter()
        for batch in batches:
            self.step(self.inputs(batch), batch.labels[label])
        return time.perf_counter() - started


def quality(schema, samples: int, batch_size: int, hidden, seed: int) -> dict:
    import trainer
    from trainer.metrics import auc

    raw = pa.concat_tables(list(generate_tables(schema, samples, seed=seed,
                                                samples_per_user=57,
                                                with_probabilities=True)))
    cut = int(samples * 0.8)
    train = raw.slice(0, cut).drop_columns([f"p_{n}" for n in schema.labels])
    test = raw.slice(cut)
    config = trainer.TrainConfig.load(EXAMPLE_CONFIG).replace(batch_size=batch_size)
    t = trainer.Trainer(schema, trainer.models.MLP(hidden=hidden), config)
    history = t.fit(train)
    result = t.evaluate(test.drop_columns([f"p_{n}" for n in schema.labels]))
    label = schema.labels[0]
    bayes = auc(test[f"p_{label}"].to_numpy(), test[label].to_numpy())
    return {"train_samples": cut, "test_samples": samples - cut, "test_auc": result["auc"],
            "test_logloss": result["logloss"], "bayes_auc": bayes,
            "gap": bayes - result["auc"], "train_samples_per_sec": history["samples_per_sec"]}


def matmul_bound(schema, nodes: list[float], hidden, dim: int = 18, model: str = "mlp",
                 sequence: dict | None = None) -> dict:
    """What structured compute can save at most, counting the dense layers' multiply-adds:
    flat runs every layer on every leaf; structured runs the first layer's part of layer l on
    that layer's ``nodes[l]`` nodes and the rest on the leaves. ``at_these_nodes`` is the
    flat/structured ratio at the measured node counts, ``all_upper_shared`` the ratio if every
    upper layer cost nothing (the ceiling of any sharing). The backward pass scales both sides
    alike.

    ``model`` ``din`` and ``dien`` (the behaviour sequence on the first layer, the query on the
    second, the defaults of trainer.models) add their sequence work from ``sequence``
    (:func:`sequence_shape`): DIN's attention MLP per (ad node, behaviour) pair and its interest
    vector in the first layer; DIEN's extractor GRU and auxiliary network per user node over the
    batch's padded steps, its attention and AUGRU per ad node, its evolved interest in the first
    layer. Flat runs all of it per leaf."""
    widths = [sum(f.dim if f.kind == "dense" else dim for f in layer.features)
              for layer in schema.layers]
    widths = [w - dim * sum(1 for f in layer.features if f.name in schema.time_columns)
              for w, layer in zip(widths, schema.layers)]   # a time column is not embedded
    per_node = [0.0] * len(widths)      # sequence work per node of each layer
    if model == "din":
        attention = 4 * dim * 36 + 36 + dim     # attention MLP 4d -> 36 -> 1, weighted sum
        widths[1] += dim                        # the interest vector joins the ad's inputs
        per_node[1] = attention * sequence["pairs_per_node"][1]
        flat_sequence = attention * sequence["pairs_per_node"][-1]
    elif model == "dien":
        u, steps = 36, sequence["steps"]
        gru_in = 3 * u * (dim + u)              # input and recurrent projections of a step
        aux = 2 * ((u + dim) * 36 + 36)         # a positive and a negative per step
        extractor = steps * gru_in + max(steps - 1, 0) * aux
        evolution = u * dim + steps * u + steps * 3 * u * (u + u)   # W q, scores, AUGRU
        widths[1] += u
        per_node[0], per_node[1] = extractor, evolution
        flat_sequence = extractor + evolution
    elif model == "mlp":
        flat_sequence = 0.0
    else:
        raise ValueError(f"matmul_bound: no count for model {model!r}")
    sizes = [*hidden, 1]
    rest = sum(a * b for a, b in zip(sizes, sizes[1:]))  # every layer after the first
    leaves = nodes[-1]
    flat = leaves * (sum(widths) * sizes[0] + rest + flat_sequence)
    structured = (sum(n * (w * sizes[0] + c) for n, w, c in zip(nodes, widths, per_node))
                  + leaves * rest)
    ceiling = leaves * (widths[-1] * sizes[0] + rest) + sum(per_node[:-1])
    return {"at_these_nodes": flat / structured, "all_upper_shared": flat / ceiling}


def sequence_shape(batches, schema, behaviour: str) -> dict:
    """The shape of a behaviour sequence (on the first layer) in ``batches``, averaged over the
    batches: ``steps``, the padded length a batch runs (its longest sequence after the schema's
    ``max_length``), and ``pairs_per_node[l]``, the (node, behaviour) pairs per node of layer
    l (every node sees its user's sequence)."""
    limit = schema.feature(behaviour).sequence.max_length
    steps, pairs = [], []
    for batch in batches:
        _, offsets = batch.layers[0].features[behaviour]
        lengths = np.diff(offsets)
        if limit is not None:
            lengths = np.minimum(lengths, limit)
        steps.append(max(int(lengths.max(initial=0)), 1))
        per_level, current = [], lengths
        for level, layer in enumerate(batch.layers):
            if level:
                current = current[layer.parent]
            per_level.append(float(current.mean()) if len(current) else 0.0)
        pairs.append(per_level)
    return {"steps": float(np.mean(steps)),
            "pairs_per_node": [float(x) for x in np.mean(pairs, 0)]}


def time_model(args, model: str, schema, batches, nodes, spu: float, hidden,
               behaviour: str | None) -> dict:
    """One model's structured and flat (and with the MLP, Keras) passes over ``batches``."""
    warmup = min(args.warmup, max(len(batches) - 1, 1))
    timed_samples = sum(b.num_leaves for b in batches[warmup:])
    run_ = {"model": model, "samples_per_user": spu, "nodes_per_batch": nodes,
            "batches": len(batches), "timed_samples": timed_samples}
    runs = {mode: TrainerRun(schema, batches, mode, warmup, hidden, model)
            for mode in ("structured", "flat")}
    if args.ceiling:
        runs["ceiling"] = TrainerRun(schema, [all_upper_shared(b) for b in batches],
                                     "structured", warmup, hidden, model)
    keras_model = None
    if not args.skip_keras and model == "mlp":
        keras_model = KerasBaseline(schema, args.keras_rows, 18, hidden, seed=0)
        keras_model.fit(batches[:warmup])
    # Modes take turns, best of --rounds: other jobs on the machine hit all of them alike.
    best = {}
    for _ in range(args.rounds):
        for mode, r in runs.items():
            best[mode] = min(best.get(mode, float("inf")), r.pipelined())
        if keras_model is not None:
            best["keras"] = min(best.get("keras", float("inf")),
                                keras_model.fit(batches[warmup:]))
    for mode, seconds in best.items():
        run_[mode] = {"samples_per_sec": timed_samples / seconds, "seconds": seconds}
    for mode, r in runs.items():
        run_[mode]["ms_per_step_sequential"] = r.sequential()
        run_[mode]["store_rows"] = r.trainer.store_rows()
    s, f = run_["structured"]["samples_per_sec"], run_["flat"]["samples_per_sec"]
    if "ceiling" in run_:
        run_["ceiling_over_flat"] = run_["ceiling"]["samples_per_sec"] / f
    k = run_.get("keras", {}).get("samples_per_sec", float("nan"))
    run_["structured_over_flat"] = s / f
    # the step level: the TF step and the update, what the multiply-adds count
    step = {mode: sum(run_[mode]["ms_per_step_sequential"].get(key, 0.0)
                      for key in ("step", "update")) for mode in ("structured", "flat")}
    run_["step_structured_over_flat"] = step["flat"] / step["structured"]
    if behaviour is not None:
        run_["sequence"] = sequence_shape(batches[:-1] or batches, schema, behaviour)
    run_["matmul_bound"] = matmul_bound(schema, nodes, hidden, model=model,
                                        sequence=run_.get("sequence"))
    run_["step_over_bound"] = (run_["step_structured_over_flat"]
                               / run_["matmul_bound"]["at_these_nodes"])
    run_["flat_over_keras"] = f / k

    def parts(mode):
        p = run_[mode]["ms_per_step_sequential"]
        return " ".join(f"{p.get(key, 0):5.1f}" for key in ("prepare", "lookup", "step",
                                                             "update"))
    bound = run_["matmul_bound"]
    print(f"{model:>5} {spu:8.0f} {'/'.join(f'{n:.0f}' for n in nodes):>27} {s:11,.0f} "
          f"{f:9,.0f} {k:9,.0f} {s / f:7.2f}x {f / k:9.2f}x   {parts('structured')} | "
          f"{parts('flat')}   step (TF step + update) {run_['step_structured_over_flat']:.2f}x, "
          f"matmul bound {bound['at_these_nodes']:.2f}x "
          f"(ceiling {bound['all_upper_shared']:.2f}x): {run_['step_over_bound']:.2f} of it",
          flush=True)
    if "ceiling" in run_:
        print(f"{'':14} every upper layer shared (one user, one ad per batch): structured "
              f"{run_['ceiling']['samples_per_sec']:,.0f}/s = "
              f"{run_['ceiling_over_flat']:.2f}x flat; {parts('ceiling')}", flush=True)
    return run_


# The child process of an end-to-end run: ``trainer.train`` itself, with the trainer's
# seconds per stage (read = raw files read, trees built, batches cut and prepared; lookup;
# step; update) printed as a last JSON line on stderr when its fit returns.
E2E_CHILD = """
import json, sys
import trainer.trainer as t
fit = t.Trainer.fit
def timed(self, *args, **kwargs):
    try:
        return fit(self, *args, **kwargs)
    finally:
        print(json.dumps({"stages": dict(self.timings)}), file=sys.stderr, flush=True)
t.Trainer.fit = timed
from trainer.train import main
sys.exit(main(sys.argv[1:]))
"""


def write_raw(schema, samples: int, spu: float, seed: int, path: str) -> str:
    """``samples`` generated raw samples (time order, as the generator writes them) in one
    Parquet file, written chunk by chunk."""
    import pyarrow.parquet as pq

    writer = None
    for table in generate_tables(schema, samples, seed=seed, samples_per_user=spu):
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()
    return path


def e2e_config(model: str, batch_size: int, path: str) -> str:
    """The run's TrainConfig as the step-level runs use it: defaults, the batch size and, for
    the sequence models, the behaviour sequence and the query in one table."""
    _, behaviour, query = MODEL_DATA[model]
    lines = [f"batch_size: {batch_size}"]
    if behaviour is not None:
        lines += ["features:", f"  {behaviour}: {{table: shared_{query}}}",
                  f"  {query}: {{table: shared_{query}}}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def end_to_end(args, model: str, data: str, workdir: str, hidden) -> dict:
    """``python -m trainer.train`` as a user runs it on the raw file ``data`` (trees built on
    the way), ``--compute structured`` and ``flat`` taking turns ``--e2e-rounds`` times:
    the command's wall seconds, the fit's seconds (reading and tree building included), the
    trainer's seconds per stage, medians over the rounds."""
    import subprocess
    import sys

    path, _, _ = MODEL_DATA[model]
    config = e2e_config(model, args.batch_size, os.path.join(workdir, f"{model}.yaml"))
    runs = {"structured": [], "flat": []}
    for k in range(args.e2e_rounds):
        for mode in runs:
            out = os.path.join(workdir, f"run-{model}-{mode}-{k}")
            command = [sys.executable, "-c", E2E_CHILD, "--schema", path, "--train-data", data,
                       "--config", config, "--model", model, "--compute", mode,
                       "--hidden", ",".join(map(str, hidden)), "--epochs",
                       str(args.e2e_epochs), "--no-progress", "--out", out]
            t0 = time.perf_counter()
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if done.returncode != 0:
                raise RuntimeError(f"trainer.train --model {model} --compute {mode} failed:\n"
                                   + done.stderr[-3000:])
            result = json.loads(done.stdout.strip().splitlines()[-1])
            stages = [json.loads(line)["stages"] for line in done.stderr.splitlines()
                      if line.startswith('{"stages"')][-1]
            runs[mode].append({"wall_seconds": wall, "fit_seconds": result["train_seconds"],
                               "samples": result["samples"],
                               "id_compression": result["id_compression"],
                               "stages": stages, "load_average": os.getloadavg()})
    out = {"epochs": args.e2e_epochs, "rounds": runs}
    for mode, rs in runs.items():
        out[mode] = {key: float(np.median([r[key] for r in rs]))
                     for key in ("wall_seconds", "fit_seconds", "id_compression")}
        out[mode]["stages"] = {stage: float(np.median([r["stages"].get(stage, 0.0)
                                                       for r in rs]))
                               for stage in ("trace", "read", "lookup", "step", "update")}
        out[mode]["samples_per_sec"] = rs[0]["samples"] / out[mode]["fit_seconds"]
    s, f = out["structured"], out["flat"]
    out["wall_over"] = f["wall_seconds"] / s["wall_seconds"]
    out["fit_over"] = f["fit_seconds"] / s["fit_seconds"]
    # the TF step + update inside the same runs (the pipeline's threads beside them)
    step = {m: out[m]["stages"]["step"] + out[m]["stages"]["update"] for m in runs}
    out["step_over"] = step["flat"] / step["structured"]
    return out


def end_to_end_all(args, models: list[str], hidden, step_runs: list[dict]) -> list[dict]:
    """The end-to-end runs of every model (the models of one schema share their raw file),
    each next to its step-level ratio at the same samples per user (the step-level row of
    that model with ``--e2e-samples-per-user``, else its last one)."""
    import tempfile

    rows = []
    print(f"end to end: python -m trainer.train on {args.e2e_samples:,} raw samples "
          f"({args.e2e_samples_per_user:g} per user), {args.e2e_epochs} epoch(s), trees built "
          f"on the way, median of {args.e2e_rounds} round(s)", flush=True)
    print(f"{'model':>5} {'structured':>11} {'flat':>9} {'wall s/f':>9} {'fit s/f':>8} "
          f"{'step s/f':>8} {'step-level':>10} {'e2e/step-level':>14}   structured | flat "
          "stage seconds (trace read lookup step update)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as workdir:
        files = {}
        for model in models:
            path = MODEL_DATA[model][0]
            if path not in files:
                files[path] = write_raw(schemas.load(path), args.e2e_samples,
                                        args.e2e_samples_per_user, args.seed,
                                        os.path.join(workdir, f"raw-{len(files)}.parquet"))
            e2e = end_to_end(args, model, files[path], workdir, hidden)
            same = [r for r in step_runs if r["model"] == model]
            at = [r for r in same if r["samples_per_user"] == args.e2e_samples_per_user]
            step_level = (at or same or [{}])[-1].get("step_structured_over_flat")
            e2e.update(model=model, samples=args.e2e_samples,
                       samples_per_user=args.e2e_samples_per_user, step_level=step_level,
                       wall_over_step_level=(e2e["wall_over"] / step_level
                                             if step_level else None),
                       fit_over_step_level=(e2e["fit_over"] / step_level
                                            if step_level else None))
            rows.append(e2e)

            def stages(mode):
                st = e2e[mode]["stages"]
                return " ".join(f"{st[k]:6.1f}" for k in ("trace", "read", "lookup", "step",
                                                         "update"))
            level = f"{step_level:9.2f}x" if step_level else f"{'-':>10}"
            share = (f"{e2e['wall_over_step_level']:13.2f}x" if step_level else f"{'-':>14}")
            print(f"{model:>5} {e2e['structured']['samples_per_sec']:9,.0f}/s "
                  f"{e2e['flat']['samples_per_sec']:7,.0f}/s {e2e['wall_over']:8.2f}x "
                  f"{e2e['fit_over']:7.2f}x {e2e['step_over']:7.2f}x {level} {share}   "
                  f"{stages('structured')} | {stages('flat')}", flush=True)
    return rows


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trainer",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=300_000, help="samples per data set")
    parser.add_argument("--samples-per-user", default="1,10,57")
    parser.add_argument("--batch-size", type=int, default=5000)
    parser.add_argument("--hidden", default="200,80")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches per model")
    parser.add_argument("--keras-rows", type=int, default=2_000_000)
    parser.add_argument("--threads", type=int, default=0, help="TF intra-op threads (0: all)")
    parser.add_argument("--quality-samples", type=int, default=1_000_000,
                        help="samples of the AUC-vs-Bayes run (0: skip)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="timed passes per model (best)")
    parser.add_argument("--skip-keras", action="store_true")
    parser.add_argument("--models", default="mlp,din,dien",
                        help="built-in models to time, comma-separated (default mlp,din,dien; "
                             "the Keras baseline runs with the MLP)")
    parser.add_argument("--ceiling", action="store_true",
                        help="also time structured compute on the same batches with every upper "
                             "layer cut to one node (the most any sharing can save)")
    parser.add_argument("--e2e-samples", type=int, default=1_000_000,
                        help="samples of the end-to-end runs: trainer.train on a raw Parquet "
                             "file, structured and flat, per model (0: skip)")
    parser.add_argument("--e2e-epochs", type=int, default=2,
                        help="passes of each end-to-end run (default 2)")
    parser.add_argument("--e2e-rounds", type=int, default=1,
                        help="end-to-end runs per mode and model, taking turns (median)")
    parser.add_argument("--e2e-samples-per-user", type=float, default=57.0,
                        help="samples per user of the end-to-end data (default 57)")
    args = parser.parse_args(argv)
    hidden = tuple(int(x) for x in args.hidden.split(","))
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODEL_DATA:
            parser.error(f"--models: {m!r} is not timed here; use {', '.join(MODEL_DATA)}")
    schema = schemas.load(SCHEMA)
    if args.threads:
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    results = {"machine": machine(), "samples": args.samples, "batch_size": args.batch_size,
               "hidden": list(hidden), "models": models, "runs": []}
    print(f"{'model':>5} {'per user':>8} {'nodes/batch (user/ad/leaf)':>27} {'structured':>11} "
          f"{'flat':>9} {'keras':>9} {'str/flat':>8} {'flat/keras':>10}   structured ms/step "
          "(prepare lookup step update) | flat ms/step", flush=True)
    for spu in [float(x) for x in args.samples_per_user.split(",")]:
        data = {}   # schema path -> (batches, nodes): the models of one schema share them
        for model in models:
            path, behaviour, _ = MODEL_DATA[model]
            model_schema = schemas.load(path)
            if path not in data:
                data[path] = make_batches(model_schema, args.samples, spu, args.batch_size,
                                          args.seed)
            batches, nodes = data[path]
            results["runs"].append(time_model(args, model, model_schema, batches, nodes, spu,
                                              hidden, behaviour))
    if args.e2e_samples:
        results["end_to_end"] = end_to_end_all(args, models, hidden, results["runs"])
    if args.quality_samples:
        results["quality"] = quality(schema, args.quality_samples, args.batch_size, hidden,
                                     args.seed + 1)
        q = results["quality"]
        print(f"MLP test AUC {q['test_auc']:.4f} vs Bayes-optimal {q['bayes_auc']:.4f} "
              f"(gap {q['gap']:.4f}) after one epoch of {q['train_samples']:,} samples",
              flush=True)
    return results


def main(argv=None) -> int:
    print(json.dumps(run(argv)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
