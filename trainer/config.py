"""TrainConfig: how a schema's features map to embedding tables and how the trainer runs.

A YAML file (every key optional; see ``trainer/examples/mlp.yaml``)::

    batch_size: 5000
    compute: structured            # or flat: the same model on samples expanded to the leaves
    seed: 0
    dense_optimizer: {name: adam, lr: 0.003}
    embedding:                     # defaults of every table
      dim: 18
      optimizer: {name: adam, lr: 0.01}              # or sgd / adagrad / ftrl
      initializer: {name: normal, stddev: 0.01}
      filter: {name: counter, min_count: 2}           # or probability / bloom; null admits all
      expire: {every_steps: 1000, max_idle_steps: 100000}
      # or a user function of the row statistics: {every_steps: 1000, function: "mod:fn"}
    features:                      # per feature: its table (default: its own) and pooling
      clicked_cats: {table: cate, pooling: mean}
      cate_id: {table: cate}
    tables:                        # per table: any key of `embedding`, over the defaults;
      cate: {dim: 18}              # a feature's own table has its name: {age_level: {dim: 4}}
    dense:                         # per dense feature: a transform applied to its values
      price: {transform: log1p}    # sign(x) * log(1 + |x|); default none

``TrainConfig.load(path)`` checks the file on its own; ``config.check(schema)`` (called by
``Trainer``) checks it against a schema, before any data is read.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

import yaml

import native
from schemas import Schema

COMPUTE_MODES = ("structured", "flat")
DENSE_TRANSFORMS = ("none", "log1p")
POOLINGS = ("sum", "mean")
DENSE_OPTIMIZERS = ("adam", "adagrad", "sgd")
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
class TableConfig:
    """One embedding table: a native store and its settings."""

    dim: int = 18
    # Per-row (lazy) Adam: its step does not shrink with the tiny per-row gradients of a mean
    # loss over 5000 samples, which Adagrad's initial accumulator of 0.1 does (measured on the
    # generated data: one epoch of 320k samples, test AUC 0.63 with Adam(0.01), 0.50 with
    # Adagrad(0.05, 0.1), 0.61 with Adagrad(0.05, 1e-6)).
    optimizer: native.Optimizer = native.Adam(lr=0.01)
    initializer: native.Initializer = native.Normal(0.01)
    entry_filter: native.EntryFilter | None = None
    max_rows: int | None = None
    expire: ExpiryConfig | None = None

    def store_config(self, seed: int, num_threads: int = 0) -> native.StoreConfig:
        return native.StoreConfig(dim=self.dim, optimizer=self.optimizer,
                                  initializer=self.initializer, seed=seed,
                                  entry_filter=self.entry_filter, max_rows=self.max_rows,
                                  num_threads=num_threads)


@dataclass(frozen=True)
class FeatureConfig:
    """How one id/ids feature is embedded: its table (``None``: a table named after the feature)
    and how an ``ids`` list is pooled per node (``sum`` or ``mean``; empty lists pool to zeros)."""

    table: str | None = None
    pooling: str = "sum"


@dataclass(frozen=True)
class DenseOptimizerConfig:
    """The Keras optimizer of the dense network."""

    name: str = "adam"
    lr: float = 0.003


@dataclass(frozen=True)
class TrainConfig:
    """Everything about a training run except the schema, the model and the data.

    ``pipeline_depth`` is the size of the bounded queues between the three input stages (read and
    batch / store lookup / train step). With ``stale_lookups=False`` (default) the lookup of a
    batch waits for the update of the previous one, so results equal a sequential run; with
    ``True`` lookups run ahead of updates by up to ``pipeline_depth`` batches (faster, rows one
    or more updates stale, as in asynchronous parameter-server training).
    """

    batch_size: int = 5000
    compute: str = "structured"
    seed: int = 0
    embedding: TableConfig = TableConfig()
    features: tuple[tuple[str, FeatureConfig], ...] = ()
    tables: tuple[tuple[str, TableConfig], ...] = ()
    dense_optimizer: DenseOptimizerConfig = DenseOptimizerConfig()
    dense: tuple[tuple[str, str], ...] = ()   # dense feature -> transform (none / log1p)
    split_trees: bool = True
    pipeline_depth: int = 2
    stale_lookups: bool = False
    threads: int = 0          # TensorFlow intra-op threads; 0 = one per core
    log_every: int = 20       # steps between TensorBoard points

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
        for name, transform in self.dense:
            if transform not in DENSE_TRANSFORMS:
                raise ConfigError(f"dense.{name}.transform: {transform!r} is not a transform; "
                                  f"use one of {', '.join(DENSE_TRANSFORMS)}")
        for name, feature in self.features:
            if feature.pooling not in POOLINGS:
                raise ConfigError(f"features.{name}.pooling: {feature.pooling!r} is not a "
                                  f"pooling; use one of {', '.join(POOLINGS)}")

    # -- reading and writing --------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TrainConfig":
        """Read and check a YAML config file."""
        path = os.fspath(path)
        try:
            with open(path) as f:
                data = yaml.safe_load(f)
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
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
                 "log_every")
        _no_unknown(data, known, "config")
        defaults = _table(data.get("embedding") or {}, "embedding", TableConfig())
        features = []
        for name, raw in (data.get("features") or {}).items():
            if not isinstance(raw, Mapping):
                raise ConfigError(f"features.{name}: expected a mapping like "
                                  "`{table: t, pooling: sum}`")
            _no_unknown(raw, ("table", "pooling"), f"features.{name}")
            features.append((str(name), FeatureConfig(table=raw.get("table"),
                                                      pooling=raw.get("pooling", "sum"))))
        tables = [(str(name), _table(raw or {}, f"tables.{name}", defaults))
                  for name, raw in (data.get("tables") or {}).items()]
        dense_transforms = []
        for name, raw in (data.get("dense") or {}).items():
            if not isinstance(raw, Mapping):
                raise ConfigError(f"dense.{name}: expected a mapping like `{{transform: log1p}}`")
            _no_unknown(raw, ("transform",), f"dense.{name}")
            dense_transforms.append((str(name), raw.get("transform", "none")))
        raw_dense = data.get("dense_optimizer") or {}
        if not isinstance(raw_dense, Mapping):
            raise ConfigError("dense_optimizer: expected a mapping like `{name: adam, lr: 0.001}`")
        _no_unknown(raw_dense, ("name", "lr"), "dense_optimizer")
        lr = raw_dense.get("lr", DenseOptimizerConfig.lr)
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr <= 0:
            raise ConfigError(f"dense_optimizer.lr: expected a positive number, got {lr!r}")
        dense = DenseOptimizerConfig(name=raw_dense.get("name", "adam"), lr=float(lr))
        scalars = {k: data[k] for k in ("batch_size", "compute", "seed", "split_trees",
                                        "pipeline_depth", "stale_lookups", "threads",
                                        "log_every") if k in data}
        return cls(embedding=defaults, features=tuple(features), tables=tuple(tables),
                   dense=tuple(dense_transforms), dense_optimizer=dense, **scalars)

    def to_dict(self) -> dict:
        """A dict that ``from_dict`` turns back into an equal config (what checkpoints store)."""
        out = {k: getattr(self, k) for k in ("batch_size", "compute", "seed", "split_trees",
                                             "pipeline_depth", "stale_lookups", "threads",
                                             "log_every")}
        out["dense_optimizer"] = dataclasses.asdict(self.dense_optimizer)
        out["embedding"] = _table_dict(self.embedding)
        out["features"] = {name: {"table": f.table, "pooling": f.pooling}
                           for name, f in self.features}
        out["tables"] = {name: _table_dict(t) for name, t in self.tables}
        out["dense"] = {name: {"transform": t} for name, t in self.dense}
        return out

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    # -- against a schema -----------------------------------------------------------------

    def feature(self, name: str) -> FeatureConfig:
        return dict(self.features).get(name, FeatureConfig())

    def table_of(self, name: str) -> str:
        return self.feature(name).table or name

    def table(self, table: str) -> TableConfig:
        return dict(self.tables).get(table, self.embedding)

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

    def check(self, schema: Schema) -> dict[str, list[str]]:
        """Check the config against ``schema``; returns table -> its features (schema order)."""
        sparse = [f.name for f in schema.features if f.kind != "dense"]
        for name, _ in self.features:
            if name not in schema._by_name:
                raise ConfigError(f"features.{name}: the schema {schema.name!r} has no feature "
                                  f"{name!r}; features are {', '.join(sparse)}")
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
        return tables


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
                          f"{', '.join(args)}") from None
    except native.InvalidInputError as e:
        raise ConfigError(f"{where}: {e}") from None


def _table(raw, where: str, base: TableConfig) -> TableConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping like `{{dim: 18}}`")
    _no_unknown(raw, ("dim", "optimizer", "initializer", "filter", "max_rows", "expire"), where)
    changes: dict[str, Any] = {}
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
    return dataclasses.replace(base, **changes)


def _table_dict(t: TableConfig) -> dict:
    def named(obj, names):
        kind = next(k for k, cls in names.items() if isinstance(obj, cls))
        return {"name": kind, **dataclasses.asdict(obj)}

    return {"dim": t.dim, "optimizer": named(t.optimizer, STORE_OPTIMIZERS),
            "initializer": named(t.initializer, INITIALIZERS),
            "filter": None if t.entry_filter is None else named(t.entry_filter, FILTERS),
            "max_rows": t.max_rows,
            "expire": None if t.expire is None else dataclasses.asdict(t.expire)}
