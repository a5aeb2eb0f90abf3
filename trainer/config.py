"""TrainConfig: how a schema's features map to embedding tables and how the trainer runs.

A YAML file (every key optional; see ``trainer/examples/mlp.yaml``)::

    batch_size: 5000
    compute: structured            # or flat: the same model on samples expanded to the leaves
    seed: 0
    row_gradients: sum             # or mean: see TrainConfig
    dense_optimizer: {name: adam, lr: 0.003, epochs: 1}   # epochs: the passes of a fit that
                                   # train the dense network (later: rows only); null: all
    embedding:                     # defaults of every table
      dim: 18
      optimizer: {name: adagrad, lr: 0.05, initial_accumulator: 0.1}  # or sgd / adam / ftrl
      initializer: {name: normal, stddev: 0.01}
      filter: {name: counter, min_count: 2}           # or probability / bloom; null admits all
      expire: {every_steps: 1000, max_idle_steps: 100000}
      # or a user function of the row statistics: {every_steps: 1000, function: "mod:fn"}
      l2: 7.0                      # rows' L2 weight per pass, applied lazily; 0: none
      # memory_budget: 512MiB      # rows kept in memory per table, the rest on local disk
      # eviction: lru              # or lfu: which rows go to disk first (see tiered-store.md)
      # export_format: int8        # how serving exports write the table: float32 (default),
                                   # float16, int8 or int4 (README, "Smaller exports")
      # cold_buckets: 1000         # ids the filter has not admitted read and train one of
                                   # 1000 shared rows (table <name>__cold), not zeros
      # multi_hash: {buckets: [12, 4500], combine: sum}   # or product: every id reads two
                                   # rows of Q + R, memory fixed (trainer/compact.py)
    features:                      # per feature: its table (default: its own) and pooling
      clicked_cats: {table: cate, pooling: sum}    # ids lists pool by mean unless told
      cate_id: {table: cate}
    tables:                        # per table: any key of `embedding`, over the defaults;
      cate: {dim: 18}              # a feature's own table has its name: {age_level: {dim: 4}}
    memory_budget: 4GiB            # the whole model's rows in memory (tables without their
                                   # own budget share it in proportion to their row bytes)
    tier_dir: /mnt/ssd/tiers       # local disk for the rows beyond the budgets; default:
                                   # next to trainer.train's run directory, removed at its end
    dense:                         # per dense feature: a transform, then standardization
      price: {transform: log1p}    # sign(x) * log(1 + |x|); none; or auto (the default):
                                   # log1p for values >= 0 whose p99 is over 10x their median
      # standardize: true (default): (x - mean) / std, both measured on the first training
      # batch (weighted per sample) and stored in the config of the checkpoint

``TrainConfig.load(path)`` checks the file on its own; ``config.check(schema)`` (called by
``Trainer``) checks it against a schema, before any data is read.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import yaml

import native
from schemas import Schema, stable_hash
from trainer import compact, tiers

COMPUTE_MODES = ("structured", "flat")
DENSE_TRANSFORMS = ("auto", "none", "log1p")
ROW_GRADIENTS = ("sum", "mean")
POOLINGS = ("sum", "mean")
DENSE_OPTIMIZERS = ("adam", "adagrad", "sgd")
EVICTIONS = ("lru", "lfu")
EXPORT_FORMATS = native.quantized.FORMATS  # float32 (the store's files), float16, int8, int4
STORE_OPTIMIZERS = {"sgd": native.SGD, "adagrad": native.Adagrad, "adam": native.Adam,
                    "ftrl": native.FTRL}
INITIALIZERS = {"zeros": native.Zeros, "uniform": native.Uniform, "normal": native.Normal}
FILTERS = {"probability": native.ProbabilityFilter, "bloom": native.CountingBloomFilter,
           "counter": native.CounterFilter}


class ConfigError(ValueError):
    """A training config that cannot work; the message names the key (and feature) and the fix."""


@dataclass(frozen=True)
class ExpiryConfig:
    """Every ``every_steps`` steps, drop rows idle for more than ``max_idle_steps`` steps or
    ``max_idle_seconds`` seconds (either suffices), and the rows ``function`` selects.

    ``function`` names a user function as ``module:function`` (importable from the working
    directory or PYTHONPATH). It is called with numpy arrays of the table's rows — ``ids,
    update_counts, last_steps, last_times, l2_norms`` — and the keyword ``step`` (the trainer's
    current step), and returns a bool mask of the rows to drop."""

    every_steps: int = 1000
    max_idle_steps: int | None = None
    max_idle_seconds: float | None = None
    function: str | None = None


@dataclass(frozen=True)
class MultiHashConfig:
    """A table of quotient-remainder (multi-hash) embeddings (``trainer/compact.py``): each id
    reads two rows, one of ``buckets[0]`` quotient rows and one of ``buckets[1]`` remainder
    rows of the same store, combined element-wise by ``combine`` (``product`` or ``sum``)."""

    buckets: tuple[int, int]
    combine: str = "product"


@dataclass(frozen=True)
class TableConfig:
    """One embedding table: a native store and its settings."""

    dim: int = 18
    # Per-row Adagrad on row gradients summed over the batch's samples (``row_gradients:
    # sum``), the CTR norm for sparse rows: a rarely seen id takes small steps until its
    # accumulator has seen its gradients, where per-row Adam steps about lr * sign(g) from the
    # first sighting and fits noise. Measured on the demo's data (400k train / 100k eval, one
    # epoch, mean pooling): eval AUC 0.665 against 0.650 with Adam(0.01); see RESULTS.md.
    optimizer: native.Optimizer = native.Adagrad(lr=0.05, initial_accumulator=0.1)
    initializer: native.Initializer = native.Normal(0.01)
    entry_filter: native.EntryFilter | None = None
    max_rows: int | None = None
    expire: ExpiryConfig | None = None
    # L2 regularization of the rows, as a prior: one pass over the data adds
    # ``(l2 / 2) * |w|^2`` of every row to the summed loss, spread over the pass's steps
    # (each step its share, l2 * step samples / pass samples) and applied lazily: a row takes
    # the decay of every step since its last update in its next update (the store's
    # ``apply_gradients(l2=...)``). The pass's samples are counted from the data's metadata
    # where that is cheap (Parquet, tables, TreeBatch lists); otherwise the fit's first pass
    # counts them and the L2 starts with the second. Online training makes no passes and
    # applies none. With the dense network frozen after the first pass this is what lets the
    # rows keep learning over more passes instead of overfitting from the third: generated
    # data (taobao_like, time split), eval AUC at 400k samples 0.6526 (pass 2, then falling)
    # without it, 0.6562 (pass 5) with it; at 1M 0.6797 (pass 2) and 0.6821 (pass 8). 7 is
    # between the best values there (10 at 400k, 5 at 1M); see RESULTS.md ("Learning quality").
    l2: float = 7.0
    # Two tiers (docs/tiered-store.md): about this many bytes of the table's rows (with their
    # optimizer state) stay in memory, the rest move to local disk and come back when looked
    # up; results are the same as without a budget. None: every row in memory. ``eviction``:
    # which rows go to disk first, ``lru`` (least recently updated) or ``lfu`` (fewest
    # updates). Run-time settings: a snapshot does not keep them.
    memory_budget_bytes: int | None = None
    eviction: str = "lru"
    # How a serving export writes the table's rows (native/quantized.py): float32 (the store's
    # own snapshot and deltas, unchanged), float16, int8 or int4 (a scale and a bias a row).
    # Training keeps float32 rows whatever it is. None: float32. The --export-format of
    # trainer.train and trainer.online sets every table's (TrainConfig.with_export_format).
    export_format: str | None = None
    # Compact tables (trainer/compact.py). ``cold_buckets``: ids the entry filter has not
    # admitted read and train a shared row of ``<table>__cold`` (one of this many, by a hash
    # of the id) instead of zeros. ``multi_hash``: every id reads two rows of small tables
    # combined (at most Q + R rows whatever the ids).
    cold_buckets: int | None = None
    multi_hash: MultiHashConfig | None = None

    @property
    def memory_row_bytes(self) -> int:
        """A memory row's share of a budget (row, optimizer state, header, table slot)."""
        return tiers.memory_row_bytes(self.dim, self.optimizer)

    def store_config(self, seed: int, num_threads: int = 0, *, disk_dir: str | None = None,
                     memory_budget_bytes: int | None = None) -> native.StoreConfig:
        """The table's store config; with a memory budget (``memory_budget_bytes``, else the
        table's own) its disk tier goes under ``disk_dir`` (required then)."""
        budget = memory_budget_bytes if memory_budget_bytes is not None else \
            self.memory_budget_bytes
        if budget is not None and disk_dir is None:
            raise ConfigError("a table with a memory budget needs a directory on local disk "
                              "for the rows beyond it (tier_dir)")
        return native.StoreConfig(dim=self.dim, optimizer=self.optimizer,
                                  initializer=self.initializer, seed=seed,
                                  entry_filter=self.entry_filter, max_rows=self.max_rows,
                                  num_threads=num_threads, memory_budget_bytes=budget,
                                  disk_dir=None if budget is None else disk_dir,
                                  eviction=self.eviction)


@dataclass(frozen=True)
class FeatureConfig:
    """How one id/ids feature is embedded: its table (``None``: a table named after the feature)
    and how an ``ids`` list is pooled per node (``mean``, the default, or ``sum``; empty lists
    pool to zeros). Mean keeps a pooled vector's scale independent of the list's length
    (behaviour lists are heavy-tailed: 0 to 400 items here); sum pooling made the first dense
    layer's input grow with it and cost 0.01 AUC on the demo's data."""

    table: str | None = None
    pooling: str = "mean"


@dataclass(frozen=True)
class DenseConfig:
    """How one dense feature's values reach the model: ``transform`` (``auto``, ``none`` or
    ``log1p``) then, with ``standardize``, ``(x - mean) / std`` per dimension. ``auto``,
    ``mean`` and ``std`` are resolved from the first training batch (see
    :meth:`resolve`) and stored resolved, so evaluation, serving and a restored run transform
    exactly as training did."""

    transform: str = "auto"
    standardize: bool = True
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    @property
    def resolved(self) -> bool:
        return self.transform != "auto" and (not self.standardize or self.mean is not None)

    def resolve(self, values: np.ndarray, weights: np.ndarray) -> "DenseConfig":
        """This config with ``auto`` decided and the statistics measured on ``values``
        ``[n, dim]`` (each row counted ``weights`` times: the samples a node stands for)."""
        values = np.asarray(values, np.float64).reshape(len(values), -1)
        weights = np.asarray(weights, np.float64)
        transform = self.transform
        if transform == "auto":
            transform = "none"
            if len(values) and values.min() >= 0:
                p50, p99 = _weighted_quantiles(values.ravel(),
                                               np.repeat(weights, values.shape[1]), (0.5, 0.99))
                if p99 > 10 * max(p50, 1e-12):
                    transform = "log1p"
        mean = std = None
        if self.standardize:
            x = transform_values(values, transform)
            total = max(weights.sum(), 1e-12)
            mu = (x * weights[:, None]).sum(axis=0) / total
            var = (((x - mu) ** 2) * weights[:, None]).sum(axis=0) / total
            sd = np.sqrt(var)
            mean = tuple(float(m) for m in mu)
            std = tuple(float(s) if s > 1e-6 else 1.0 for s in sd)  # constant: centre only
        return DenseConfig(transform, self.standardize, mean, std)


def _weighted_quantiles(values: np.ndarray, weights: np.ndarray, qs) -> list[float]:
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    return [float(values[order][min(np.searchsorted(cumulative, q * cumulative[-1]),
                                    len(values) - 1)]) for q in qs]


def transform_values(values: np.ndarray, transform: str) -> np.ndarray:
    """A dense feature's values after its transform (elementwise: the same per node or leaf)."""
    if transform == "log1p":
        return np.sign(values) * np.log1p(np.abs(values))
    return values


@dataclass(frozen=True)
class DenseOptimizerConfig:
    """The Keras optimizer of the dense network, and ``epochs``: in how many of a ``fit``'s
    passes over its data the dense network trains (``None``: every pass; ``0``: none, the
    network stays frozen). From pass ``epochs + 1`` of a fit on, a step trains the embedding
    rows only, through the frozen network. It counts per fit, so training on new data (a new
    day, a restored checkpoint) trains the network again; a loop of one-pass fits over the same
    data trains it every time, which is what ``fit(data, epochs=N)`` avoids. Online training
    makes no passes and always trains both.

    Why one: CTR networks overfit from their second pass on (the "one-epoch phenomenon",
    Zhang et al., CIKM 2022). Measured on generated data (taobao_like, 1M samples, time split):
    a second pass that trains everything drops eval AUC from 0.673 to below 0.62, even with a
    10x smaller dense learning rate; a second pass that trains only the rows raises it to
    0.680. See benchmarks/RESULTS.md ("Learning quality").
    """

    name: str = "adam"
    lr: float = 0.003
    epochs: int | None = 1


@dataclass(frozen=True)
class TrainConfig:
    """Everything about a training run except the schema, the model and the data.

    ``pipeline_depth`` is the size of the bounded queues between the three input stages (read and
    batch / store lookup / train step). With ``stale_lookups=False`` (default) the lookup of a
    batch waits for the update of the previous one, so results equal a sequential run; with
    ``True`` lookups run ahead of updates by up to ``pipeline_depth`` batches (faster, rows one
    or more updates stale, as in asynchronous parameter-server training).

    ``row_gradients`` is what the stores' optimizers receive for a row: ``sum`` (default), the
    sum of the gradients of the samples that use it, or ``mean``, the gradient of the batch's
    mean loss (``sum / batch size``). The dense network always trains on the mean loss. With
    ``sum`` a row's step does not depend on how many other samples share its batch, so the
    per-row learning rates hold for any batch size (and for a short last batch).
    """

    batch_size: int = 5000
    compute: str = "structured"
    seed: int = 0
    embedding: TableConfig = TableConfig()
    features: tuple[tuple[str, FeatureConfig], ...] = ()
    tables: tuple[tuple[str, TableConfig], ...] = ()
    dense_optimizer: DenseOptimizerConfig = DenseOptimizerConfig()
    dense: tuple[tuple[str, DenseConfig], ...] = ()   # dense feature -> its DenseConfig
    row_gradients: str = "sum"
    split_trees: bool = True
    pipeline_depth: int = 2
    stale_lookups: bool = False
    threads: int = 0          # TensorFlow intra-op threads; 0 = one per core
    log_every: int = 20       # steps between TensorBoard points
    # the whole model's memory budget (bytes), split over the tables without a budget of
    # their own (see table_budgets); None: only the tables' own budgets
    memory_budget_bytes: int | None = None
    tier_dir: str | None = None  # local directory of the disk tiers (see tier_dirs)

    def __post_init__(self):
        _check_int("batch_size", self.batch_size, 1)
        if self.compute not in COMPUTE_MODES:
            raise ConfigError(f"compute: {self.compute!r} is not a compute mode; use one of "
                              f"{', '.join(COMPUTE_MODES)}")
        _check_int("seed", self.seed, 0)
        _check_int("pipeline_depth", self.pipeline_depth, 1)
        _check_int("threads", self.threads, 0)
        _check_int("log_every", self.log_every, 1)
        if self.dense_optimizer.name not in DENSE_OPTIMIZERS:
            raise ConfigError(f"dense_optimizer.name: {self.dense_optimizer.name!r} is not "
                              f"supported; use one of {', '.join(DENSE_OPTIMIZERS)}")
        if self.dense_optimizer.epochs is not None:
            _check_int("dense_optimizer.epochs", self.dense_optimizer.epochs, 0)
        if self.row_gradients not in ROW_GRADIENTS:
            raise ConfigError(f"row_gradients: {self.row_gradients!r} is not known; use one of "
                              f"{', '.join(ROW_GRADIENTS)}")
        for name, dense in self.dense:
            if dense.transform not in DENSE_TRANSFORMS:
                raise ConfigError(f"dense.{name}.transform: {dense.transform!r} is not a "
                                  f"transform; use one of {', '.join(DENSE_TRANSFORMS)}")
        for name, feature in self.features:
            if feature.pooling not in POOLINGS:
                raise ConfigError(f"features.{name}.pooling: {feature.pooling!r} is not a "
                                  f"pooling; use one of {', '.join(POOLINGS)}")
        if self.memory_budget_bytes is not None:
            _check_int("memory_budget", self.memory_budget_bytes, 1)
        if self.tier_dir is not None and (not isinstance(self.tier_dir, str)
                                          or not self.tier_dir):
            raise ConfigError(f"tier_dir: expected a local directory, got {self.tier_dir!r}")
        for where, table in (("embedding", self.embedding),
                             *((f"tables.{n}", t) for n, t in self.tables)):
            _check_tiers(table, where)
            _check_compact(table, where)

    # -- reading and writing --------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TrainConfig":
        """Read and check a YAML config file."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at "
                              f"offset {e.start}); save the config file as UTF-8") from None
        except RecursionError:
            raise ConfigError(f"{path}: nested too deeply to be a training config (a config "
                              "nests a few levels: tables, their optimizer...)") from None
        try:
            return cls.from_dict(data or {})
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, data: Any) -> "TrainConfig":
        if not isinstance(data, Mapping):
            raise ConfigError("a training config is a mapping, e.g. `batch_size: 5000`")
        known = ("batch_size", "compute", "seed", "embedding", "features", "tables", "dense",
                 "dense_optimizer", "split_trees", "pipeline_depth", "stale_lookups", "threads",
                 "log_every", "row_gradients", "memory_budget", "tier_dir")
        _no_unknown(data, known, "config")
        defaults = _table(data.get("embedding") or {}, "embedding", TableConfig())
        for key, example in (("features", "{clicked_cats: {pooling: mean}}"),
                             ("tables", "{cate: {dim: 18}}"),
                             ("dense", "{price: {transform: log1p}}")):
            if not isinstance(data.get(key) or {}, Mapping):
                raise ConfigError(f"{key}: expected a mapping by name like `{example}`, got "
                                  f"{type(data.get(key)).__name__}")
        features = []
        for name, raw in (data.get("features") or {}).items():
            if not isinstance(raw, Mapping):
                raise ConfigError(f"features.{name}: expected a mapping like "
                                  "`{table: t, pooling: sum}`")
            _no_unknown(raw, ("table", "pooling"), f"features.{name}")
            if raw.get("table") is not None and not isinstance(raw.get("table"), str):
                raise ConfigError(f"features.{name}.table: expected a table name, got "
                                  f"{raw.get('table')!r}")
            features.append((str(name), FeatureConfig(table=raw.get("table"),
                                                      pooling=raw.get("pooling", "mean"))))
        tables = [(str(name), _table(raw or {}, f"tables.{name}", defaults))
                  for name, raw in (data.get("tables") or {}).items()]
        dense_transforms = []
        for name, raw in (data.get("dense") or {}).items():
            dense_transforms.append((str(name), _dense(raw, f"dense.{name}")))
        raw_dense = data.get("dense_optimizer") or {}
        if not isinstance(raw_dense, Mapping):
            raise ConfigError("dense_optimizer: expected a mapping like `{name: adam, lr: 0.001}`")
        _no_unknown(raw_dense, ("name", "lr", "epochs"), "dense_optimizer")
        lr = raw_dense.get("lr", DenseOptimizerConfig.lr)
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr <= 0:
            raise ConfigError(f"dense_optimizer.lr: expected a positive number, got {lr!r}")
        epochs = raw_dense.get("epochs", DenseOptimizerConfig.epochs)
        if epochs is not None:
            _check_int("dense_optimizer.epochs", epochs, 0)
        dense = DenseOptimizerConfig(name=raw_dense.get("name", "adam"), lr=float(lr),
                                     epochs=epochs)
        scalars = {k: data[k] for k in ("batch_size", "compute", "seed", "split_trees",
                                        "pipeline_depth", "stale_lookups", "threads",
                                        "log_every", "row_gradients", "tier_dir") if k in data}
        if data.get("memory_budget") is not None:
            scalars["memory_budget_bytes"] = _size(data["memory_budget"], "memory_budget")
        return cls(embedding=defaults, features=tuple(features), tables=tuple(tables),
                   dense=tuple(dense_transforms), dense_optimizer=dense, **scalars)

    def to_dict(self) -> dict:
        """A dict that ``from_dict`` turns back into an equal config (what checkpoints store)."""
        out = {k: getattr(self, k) for k in ("batch_size", "compute", "seed", "split_trees",
                                             "pipeline_depth", "stale_lookups", "threads",
                                             "log_every", "row_gradients")}
        out["dense_optimizer"] = dataclasses.asdict(self.dense_optimizer)
        out["embedding"] = _table_dict(self.embedding)
        out["features"] = {name: {"table": f.table, "pooling": f.pooling}
                           for name, f in self.features}
        out["tables"] = {name: _table_dict(t) for name, t in self.tables}
        out["dense"] = {name: {k: list(v) if isinstance(v, tuple) else v
                               for k, v in dataclasses.asdict(d).items()}
                        for name, d in self.dense}
        # memory budgets only when set: a config without them writes what it always wrote
        if self.memory_budget_bytes is not None:
            out["memory_budget"] = self.memory_budget_bytes
        if self.tier_dir is not None:
            out["tier_dir"] = self.tier_dir
        return out

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    # -- against a schema -----------------------------------------------------------------

    def feature(self, name: str) -> FeatureConfig:
        return dict(self.features).get(name, FeatureConfig())

    def table_of(self, name: str) -> str:
        return self.feature(name).table or name

    def table(self, table: str) -> TableConfig:
        entries = dict(self.tables)
        if table not in entries and table.endswith(compact.COLD_SUFFIX):
            base = self.table(table[:-len(compact.COLD_SUFFIX)])
            if base.cold_buckets is not None:
                return cold_table_config(base)
        return entries.get(table, self.embedding)

    def dense_config(self, name: str) -> DenseConfig:
        return dict(self.dense).get(name, DenseConfig())

    def with_dense(self, name: str, dense: DenseConfig) -> "TrainConfig":
        """This config with dense feature ``name``'s config replaced (e.g. resolved)."""
        entries = dict(self.dense)
        entries[name] = dense
        return dataclasses.replace(self, dense=tuple(entries.items()))

    def with_expire_every(self, steps: int) -> "TrainConfig":
        """This config with every configured expiry running every ``steps`` steps (the online
        trainer's ``--expire-every``); a ConfigError when no table has an ``expire`` section."""
        _check_int("--expire-every", steps, 1)

        def every(t: TableConfig) -> TableConfig:
            return t if t.expire is None else dataclasses.replace(
                t, expire=dataclasses.replace(t.expire, every_steps=steps))

        changed = dataclasses.replace(self, embedding=every(self.embedding),
                                      tables=tuple((n, every(t)) for n, t in self.tables))
        if changed.embedding.expire is None and all(t.expire is None for _, t in changed.tables):
            raise ConfigError("--expire-every: no table has an expiry to schedule; add "
                              "`embedding: {expire: {max_idle_steps: N}}` (or max_idle_seconds, "
                              "or function: module:function) to the config")
        return changed

    def with_export_format(self, export_format: str | None) -> "TrainConfig":
        """This config with ``export_format`` for every table, over what the config names (the
        ``--export-format`` of trainer.train and trainer.online, which overrides the config
        as ``--batch-size`` does); as it is for None."""
        if export_format is None:
            return self
        _check_export_format(export_format, "--export-format")

        def fill(t: TableConfig) -> TableConfig:
            return dataclasses.replace(t, export_format=export_format)

        return dataclasses.replace(self, embedding=fill(self.embedding),
                                   tables=tuple((n, fill(t)) for n, t in self.tables))

    def export_format(self, table: str) -> str:
        """How serving exports write ``table``: its config's ``export_format``, else float32."""
        return self.table(table).export_format or "float32"

    def check(self, schema: Schema) -> dict[str, list[str]]:
        """Check the config against ``schema``; returns table -> its features (schema order)."""
        sparse = [f.name for f in schema.embedded_features]  # a time column is not embedded
        for name, _ in self.features:
            if name not in schema._by_name:
                raise ConfigError(f"features.{name}: the schema {schema.name!r} has no feature "
                                  f"{name!r}; features are {', '.join(sparse)}")
            if name in schema.time_columns:
                raise ConfigError(f"features.{name}: {name!r} is a sequence's time column and "
                                  "has no embedding table; remove it from `features`")
            if schema.feature(name).kind == "dense":
                raise ConfigError(f"features.{name}: {name!r} is a dense feature and has no "
                                  "embedding table; remove it from `features`")
        for name, _ in self.dense:
            if name not in schema._by_name or schema.feature(name).kind != "dense":
                dense = [f.name for f in schema.features if f.kind == "dense"]
                raise ConfigError(f"dense.{name}: the schema {schema.name!r} has no dense feature "
                                  f"{name!r}; dense features are {', '.join(dense) or 'none'}")
        tables: dict[str, list[str]] = {}
        for name in sparse:
            tables.setdefault(self.table_of(name), []).append(name)
        for name, _ in self.tables:
            if name not in tables:
                raise ConfigError(f"tables.{name}: no feature uses table {name!r}; set "
                                  f"`features: {{<feature>: {{table: {name}}}}}` or remove it")
        tables = self._with_cold_tables(tables)
        self.table_budgets(tables)
        return tables

    def _with_cold_tables(self, tables: dict[str, list[str]]) -> dict[str, list[str]]:
        """``tables`` with each table's cold table (no features of its own) right after it."""
        if all(self.table(t).cold_buckets is None for t in tables):
            return tables
        out: dict[str, list[str]] = {}
        for table, names in tables.items():
            out[table] = names
            if self.table(table).cold_buckets is None:
                continue
            cold = compact.cold_table_name(table)
            if cold in tables:
                raise ConfigError(f"tables.{table}.cold_buckets: its cold table is named "
                                  f"{cold!r}, which is already a table of features "
                                  f"({', '.join(tables[cold])}); rename that table")
            out[cold] = []
        return out

    def compact_tables(self, tables) -> dict[str, TableConfig]:
        """The tables of ``tables`` (``check``'s) that have a compact option, with their
        config."""
        return {t: self.table(t) for t in tables
                if self.table(t).cold_buckets is not None or self.table(t).multi_hash is not None}

    # -- memory budgets (two tiers: docs/tiered-store.md) ------------------------------------

    def table_budgets(self, tables, shards: int = 1) -> dict[str, int | None]:
        """Each table's memory budget in bytes (None: unbounded), per store when a table is
        split over ``shards`` stores (the table's budget / shards each).

        A table's own ``memory_budget`` (in ``tables`` or the ``embedding`` defaults) is its
        budget. The model's ``memory_budget`` less the tables' own is split over the other
        tables in proportion to their bytes a row (dim and optimizer state), so each of them
        can hold the same number of rows in memory. ConfigError naming the table and the
        fix when a share cannot hold one row per store shard."""
        own = {t: self.table(t).memory_budget_bytes for t in tables}
        out = dict(own)
        if self.memory_budget_bytes is not None:
            rest = [t for t in tables if own[t] is None]
            if not rest:
                raise ConfigError("memory_budget: every table has a memory_budget of its own, "
                                  "so the model's is not used; remove one of them")
            taken = sum(b for b in own.values() if b is not None)
            left = self.memory_budget_bytes - taken
            if left <= 0:
                raise ConfigError(
                    f"memory_budget: {self.memory_budget_bytes} bytes, but the tables' own "
                    f"budgets take {taken} ({', '.join(t for t in tables if own[t])}); raise "
                    "memory_budget or lower the tables' budgets")
            out.update(tiers.split_budget(left, {t: self.table(t).memory_row_bytes
                                                 for t in rest}))
        for table, budget in out.items():
            if budget is None:
                continue
            tc = self.table(table)
            if tc.max_rows is not None:
                raise ConfigError(f"tables.{table}: max_rows and a memory budget together are "
                                  "not supported yet; remove max_rows or give the table no "
                                  "share of memory_budget")
            each = tiers.split_over_shards(budget, shards)
            least = tiers.min_budget(tc.dim, tc.optimizer)
            if each < least:
                whose = ("its share of memory_budget" if own[table] is None
                         else f"tables.{table}.memory_budget")
                per = f" over {shards} shards" if shards > 1 else ""
                raise ConfigError(
                    f"table {table}: {whose} is {budget} bytes{per}, below one row per store "
                    f"shard ({least} bytes a store at dim {tc.dim}); raise it to at least "
                    f"{tiers.format_size(least * shards)}")
            out[table] = each
        return out

    def with_memory_budget(self, budget: int | None, tier_dir: str | None = None
                           ) -> "TrainConfig":
        """This config with ``budget`` bytes for the whole model (the tables' own budgets
        dropped: the model's is split over all of them) and ``tier_dir`` when given (the
        ``--memory-budget``/``--tier-dir`` of trainer.online and trainer.serve); as it is
        when ``budget`` is None."""
        if budget is None:
            return self if tier_dir is None else dataclasses.replace(self, tier_dir=tier_dir)
        _check_int("--memory-budget", budget, 1)
        unbudgeted = lambda t: dataclasses.replace(t, memory_budget_bytes=None)  # noqa: E731
        return dataclasses.replace(
            self, memory_budget_bytes=int(budget), tier_dir=tier_dir or self.tier_dir,
            embedding=unbudgeted(self.embedding),
            tables=tuple((n, unbudgeted(t)) for n, t in self.tables))

    def with_table_budgets(self, budgets: dict[str, int], tier_dir: str | None = None
                           ) -> "TrainConfig":
        """This config with exactly ``budgets`` (table -> bytes) as the tables' memory budgets
        and no model budget (how trainer.serve splits ``--memory-budget`` once it knows the
        tables' sizes)."""
        entries = dict(self.tables)
        for table, budget in budgets.items():
            _check_int(f"tables.{table}.memory_budget", budget, 1)
            entries[table] = dataclasses.replace(self.table(table),
                                                 memory_budget_bytes=int(budget))
        return dataclasses.replace(self, memory_budget_bytes=None,
                                   tier_dir=tier_dir or self.tier_dir,
                                   tables=tuple(entries.items()))

    @property
    def budgeted(self) -> bool:
        """Whether some table has a memory budget (so the run needs a tier directory)."""
        return self.memory_budget_bytes is not None or any(
            t.memory_budget_bytes is not None for t in (self.embedding,
                                                        *(t for _, t in self.tables)))

    def store_configs(self, tables, tier_dir: str | None, shards: int = 1,
                      num_threads: int = 0, index: int | None = None
                      ) -> dict[str, native.StoreConfig]:
        """Every table's store config (its seed and its memory budget): a budgeted table's
        disk tiers under ``tier_dir/<table>`` (``tier_dir/<table>/shard-<index>`` for store
        shard ``index`` of ``shards``)."""
        budgets = self.table_budgets(tables, shards)
        out = {}
        for table in tables:
            disk_dir = None
            if budgets[table] is not None:
                if tier_dir is None:
                    raise ConfigError(f"table {table} has a memory budget but no tier_dir is "
                                      "set; set tier_dir (a directory on local disk)")
                disk_dir = os.path.join(tier_dir, table)
                if index is not None:
                    disk_dir = os.path.join(disk_dir, f"shard-{index:04d}")
            out[table] = self.table(table).store_config(
                table_seed(self.seed, table), num_threads, disk_dir=disk_dir,
                memory_budget_bytes=budgets[table])
        return out


_FUNCTION_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def resolve_function(spec, key: str):
    """The callable a ``module:function`` string names; a ConfigError naming ``key`` when the
    string is malformed, the module cannot be imported or the name is not a function."""
    if not isinstance(spec, str) or not _FUNCTION_SPEC.match(spec):
        raise ConfigError(f"{key}: expected `module:function` (e.g. `my_rules:stale_rows`), "
                          f"got {spec!r}")
    module_name, name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key}: cannot import module {module_name!r} ({e}); put it on "
                          "PYTHONPATH or in the working directory") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{key}: module {module_name!r} has no function {name!r}")
    return fn


def _check_int(key: str, value, low: int):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{key}: expected an integer >= {low}, got {value!r}")


def _no_unknown(data: Mapping, known, where: str):
    for key in data:
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r}; known keys are {', '.join(known)}")


def _named(raw, where: str, choices: Mapping, what: str):
    """A ``{name: x, arg: value...}`` mapping as the native dataclass ``choices[x](**args)``."""
    if not isinstance(raw, Mapping) or "name" not in raw:
        raise ConfigError(f"{where}: expected a mapping like `{{name: "
                          f"{next(iter(choices))}, ...}}`")
    args = {k: v for k, v in raw.items() if k != "name"}
    kind = raw["name"]
    if kind not in choices:
        raise ConfigError(f"{where}.name: {kind!r} is not a known {what}; use one of "
                          f"{', '.join(choices)}")
    try:
        return choices[kind](**args)
    except TypeError:
        fields = [f.name for f in dataclasses.fields(choices[kind])]
        raise ConfigError(f"{where}: {kind} takes {', '.join(fields) or 'no arguments'}, got "
                          f"{', '.join(str(a) for a in args)}") from None
    except native.InvalidInputError as e:
        raise ConfigError(f"{where}: {e}") from None


def _dense(raw, where: str) -> DenseConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping like `{{transform: log1p}}`")
    _no_unknown(raw, ("transform", "standardize", "mean", "std"), where)
    standardize = raw.get("standardize", True)
    if not isinstance(standardize, bool):
        raise ConfigError(f"{where}.standardize: expected true or false, got {standardize!r}")
    stats = {}
    for key in ("mean", "std"):
        value = raw.get(key)
        if value is None:
            stats[key] = None
            continue
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{where}.{key}: expected a list of numbers (one per dimension), "
                              f"got {value!r}")
        if key == "std" and any(v <= 0 for v in value):
            raise ConfigError(f"{where}.std: every value must be > 0, got {value!r}")
        stats[key] = tuple(float(v) for v in value)
    if (stats["mean"] is None) != (stats["std"] is None) or (
            stats["mean"] is not None and len(stats["mean"]) != len(stats["std"])):
        raise ConfigError(f"{where}: give mean and std together, one number per dimension "
                          "each (or neither: they are then measured on the training data)")
    return DenseConfig(raw.get("transform", "auto"), standardize, stats["mean"], stats["std"])


def _table(raw, where: str, base: TableConfig) -> TableConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping like `{{dim: 18}}`")
    _no_unknown(raw, ("dim", "optimizer", "initializer", "filter", "max_rows", "expire", "l2",
                      "memory_budget", "eviction", "export_format", "cold_buckets",
                      "multi_hash"), where)
    changes: dict[str, Any] = {}
    if "export_format" in raw:
        if raw["export_format"] is not None:
            _check_export_format(raw["export_format"], f"{where}.export_format")
        changes["export_format"] = raw["export_format"]
    if "cold_buckets" in raw:
        if raw["cold_buckets"] is not None:
            _check_int(f"{where}.cold_buckets", raw["cold_buckets"], 1)
        changes["cold_buckets"] = raw["cold_buckets"]
    if "multi_hash" in raw:
        changes["multi_hash"] = _multi_hash(raw["multi_hash"], f"{where}.multi_hash")
    if "memory_budget" in raw:
        changes["memory_budget_bytes"] = (None if raw["memory_budget"] is None else
                                          _size(raw["memory_budget"], f"{where}.memory_budget"))
    if "eviction" in raw:
        changes["eviction"] = raw["eviction"]
    if "l2" in raw:
        l2 = raw["l2"]
        if isinstance(l2, bool) or not isinstance(l2, (int, float)) or not math.isfinite(l2) \
                or l2 < 0:
            raise ConfigError(f"{where}.l2: expected a number >= 0 (the rows' L2 weight per "
                              f"pass; 0 turns it off), got {l2!r}")
        changes["l2"] = float(l2)
    if "dim" in raw:
        dim = raw["dim"]
        if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= 4096:
            raise ConfigError(f"{where}.dim: expected an integer in [1, 4096], got {dim!r}")
        changes["dim"] = dim
    if "optimizer" in raw:
        changes["optimizer"] = _named(raw["optimizer"], f"{where}.optimizer", STORE_OPTIMIZERS,
                                      "store optimizer")
    if "initializer" in raw:
        changes["initializer"] = _named(raw["initializer"], f"{where}.initializer",
                                        INITIALIZERS, "initializer")
    if "filter" in raw:
        changes["entry_filter"] = (None if raw["filter"] is None else
                                   _named(raw["filter"], f"{where}.filter", FILTERS,
                                          "entry filter"))
    if "max_rows" in raw:
        if raw["max_rows"] is not None:
            _check_int(f"{where}.max_rows", raw["max_rows"], 1)
        changes["max_rows"] = raw["max_rows"]
    if "expire" in raw:
        exp = raw["expire"]
        if exp is None:
            changes["expire"] = None
        else:
            if not isinstance(exp, Mapping):
                raise ConfigError(f"{where}.expire: expected a mapping like "
                                  "`{every_steps: 1000, max_idle_steps: 100000}`")
            _no_unknown(exp, ("every_steps", "max_idle_steps", "max_idle_seconds", "function"),
                        f"{where}.expire")
            if all(exp.get(k) is None for k in ("max_idle_steps", "max_idle_seconds",
                                                 "function")):
                raise ConfigError(f"{where}.expire: give max_idle_steps, max_idle_seconds or "
                                  "function (`module:function`)")
            if exp.get("function") is not None:
                resolve_function(exp["function"], f"{where}.expire.function")
            _check_int(f"{where}.expire.every_steps", exp.get("every_steps", 1000), 1)
            if exp.get("max_idle_steps") is not None:
                _check_int(f"{where}.expire.max_idle_steps", exp["max_idle_steps"], 0)
            changes["expire"] = ExpiryConfig(**exp)
    table = dataclasses.replace(base, **changes)
    _check_tiers(table, where)
    return table


def _check_export_format(value, key: str) -> None:
    if value not in EXPORT_FORMATS:
        raise ConfigError(f"{key}: {value!r} is not an export format; use one of "
                          f"{', '.join(EXPORT_FORMATS)}")


def _size(value, key: str) -> int:
    try:
        return tiers.parse_size(value, key)
    except tiers.BudgetError as e:
        raise ConfigError(str(e)) from None


def _check_tiers(table: TableConfig, where: str) -> None:
    """A table's budget settings, on their own (against the model: ``table_budgets``)."""
    if table.eviction not in EVICTIONS:
        raise ConfigError(f"{where}.eviction: {table.eviction!r} is not an eviction policy; "
                          f"use one of {', '.join(EVICTIONS)}")
    budget = table.memory_budget_bytes
    if budget is None:
        return
    _check_int(f"{where}.memory_budget", budget, 1)
    if table.max_rows is not None:
        raise ConfigError(f"{where}: max_rows and memory_budget together are not supported "
                          "yet; keep one (memory_budget keeps every row, on disk beyond it)")
    least = tiers.min_budget(table.dim, table.optimizer)
    if budget < least:
        raise ConfigError(f"{where}.memory_budget: {budget} bytes is below one row per store "
                          f"shard ({least} bytes at dim {table.dim} with "
                          f"{type(table.optimizer).__name__}); give at least "
                          f"{tiers.format_size(least)}, or no memory_budget")


def _multi_hash(raw, where: str) -> MultiHashConfig | None:
    if raw is None:
        return None
    example = "`{buckets: [1000, 1000], combine: product}`"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping like {example}")
    _no_unknown(raw, ("buckets", "combine"), where)
    buckets = raw.get("buckets")
    if not isinstance(buckets, (list, tuple)) or len(buckets) != 2:
        raise ConfigError(f"{where}.buckets: expected two bucket counts [Q, R] (quotient and "
                          f"remainder rows), got {buckets!r}; e.g. {example}")
    for i, b in enumerate(buckets):
        _check_int(f"{where}.buckets[{i}]", b, 1)
    if buckets[0] * buckets[1] >= 2**62:
        raise ConfigError(f"{where}.buckets: Q * R = {buckets[0] * buckets[1]} is too large; "
                          "keep it below 2**62")
    combine = raw.get("combine", "product")
    if combine not in compact.COMBINES:
        raise ConfigError(f"{where}.combine: {combine!r} is not a combine; use one of "
                          f"{', '.join(compact.COMBINES)}")
    return MultiHashConfig((int(buckets[0]), int(buckets[1])), combine)


def _check_compact(table: TableConfig, where: str) -> None:
    """A table's compact options (``cold_buckets``, ``multi_hash``), on their own."""
    if table.cold_buckets is not None:
        _check_int(f"{where}.cold_buckets", table.cold_buckets, 1)
        if table.multi_hash is not None:
            raise ConfigError(f"{where}: cold_buckets and multi_hash together are not "
                              "supported; keep one (a multi-hash table has no cold ids)")
        if table.entry_filter is None:
            raise ConfigError(f"{where}.cold_buckets: the table has no entry filter, so every "
                              "id is admitted at once and none would read the cold table; "
                              "add a filter (e.g. `filter: {name: counter, min_count: 3}`) "
                              "or remove cold_buckets")
    if table.multi_hash is not None:
        mh = table.multi_hash
        if (not isinstance(mh, MultiHashConfig) or len(mh.buckets) != 2
                or mh.combine not in compact.COMBINES):
            raise ConfigError(f"{where}.multi_hash: expected buckets [Q, R] and a combine "
                              f"({', '.join(compact.COMBINES)}), got {mh!r}")
        for i, b in enumerate(mh.buckets):
            _check_int(f"{where}.multi_hash.buckets[{i}]", b, 1)
        if table.entry_filter is not None:
            raise ConfigError(f"{where}.multi_hash: a multi-hash table's rows are shared by "
                              "many ids, so an entry filter only delays them; set "
                              "`filter: null` for this table")


def cold_table_config(base: TableConfig) -> TableConfig:
    """The config of the cold table of a table configured as ``base``: its dim, optimizer,
    initializer and L2; no entry filter, row cap, expiry or memory budget (it holds at most
    ``cold_buckets`` rows)."""
    return dataclasses.replace(base, entry_filter=None, max_rows=None, expire=None,
                               memory_budget_bytes=None, cold_buckets=None, multi_hash=None)


def _table_dict(t: TableConfig) -> dict:
    def named(obj, names):
        kind = next(k for k, cls in names.items() if isinstance(obj, cls))
        return {"name": kind, **dataclasses.asdict(obj)}

    return {"dim": t.dim, "optimizer": named(t.optimizer, STORE_OPTIMIZERS),
            "initializer": named(t.initializer, INITIALIZERS),
            "filter": None if t.entry_filter is None else named(t.entry_filter, FILTERS),
            "max_rows": t.max_rows,
            "expire": None if t.expire is None else dataclasses.asdict(t.expire),
            "l2": t.l2,
            # only when set: a table without a budget writes what it always wrote
            **({} if t.memory_budget_bytes is None else {
                "memory_budget": t.memory_budget_bytes}),
            **({} if t.eviction == "lru" else {"eviction": t.eviction}),
            **({} if t.export_format is None else {"export_format": t.export_format}),
            # compact options only when set: a table without them writes what it always wrote
            **({} if t.cold_buckets is None else {"cold_buckets": t.cold_buckets}),
            **({} if t.multi_hash is None else {"multi_hash": {
                "buckets": list(t.multi_hash.buckets), "combine": t.multi_hash.combine}})}


def resolve_tier_dir(config: TrainConfig, tier_dir: str | None) -> str | None:
    """Where the disk tiers of ``config``'s budgeted tables go: ``tier_dir``, else the
    config's ``tier_dir``, else a temporary directory removed at exit; None without a budget.
    Checked to be a writable local directory (ConfigError naming the setting)."""
    if not config.budgeted:
        return None
    key = "tier_dir" if tier_dir is None else "the tier directory"
    tier_dir = tier_dir or config.tier_dir
    try:
        return (tiers.check_tier_dir(tier_dir, key) if tier_dir is not None
                else tiers.temporary_tier_dir())
    except tiers.BudgetError as e:
        raise ConfigError(str(e)) from None


def table_seed(seed: int, table: str) -> int:
    """Per-table store seeds, so two tables do not start an id at the same vector."""
    return (seed * 0x9E3779B97F4A7C15 ^ (stable_hash(table) & (2**63 - 1))) % (2**63)


def row_l2(l2: float, samples: int, scale: float) -> float:
    """A step's L2 weight for the rows (``TableConfig.l2``): the table's ``l2`` per pass times
    this step's share of the pass, ``samples * scale`` (scale: 1 / samples of a pass, or 0
    while that is not known). The in-process trainer and the Ray shards both call it."""
    return float(l2) * float(samples) * float(scale)
