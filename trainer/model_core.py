"""ModelCore: a model without its embedding stores.

What every engine that runs the DenseNet shares: the feed layout and builder, the
:class:`~trainer.network.Network` (the DenseNet, its dense optimizer, the compiled steps), the
dense features' statistics (resolved on the first batch seen) and the dense weights under
their checkpoint names ``model/NNNN`` and ``optimizer/NNNN``. The in-process
:class:`trainer.trainer.Trainer` adds stores to it, a distributed worker
(:class:`trainer.distributed.worker.Worker`) is fed rows by the store shards, and a serving
export traces its network.

    core = ModelCore(schema, models.MLP(), TrainConfig())
    prepared = core.prepare_numpy(batch)               # numpy feed work, stats resolved
    feed = core.builder.lookup(prepared, stores, train=True)
    loss, dense, row_slices, probabilities = core.network.gradients(feed.feed)
"""

from __future__ import annotations

import re
import threading

import keras
import numpy as np
import tensorflow as tf

from compression import TreeBatch
from schemas import Schema
from trainer import models as models_lib
from trainer.checkpoints import dense_name
from trainer.config import ConfigError, TrainConfig, resolve_function
from trainer.feed import FeedBuilder, Layout, Prepared
from trainer.network import Network

_TABLE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class ModelCore:
    """The layout, feed builder and network of ``model`` on data of ``schema`` as ``config``
    says; checks all three against each other first (before any data)."""

    def __init__(self, schema: Schema, model: models_lib.DenseNet | None = None,
                 config: TrainConfig | None = None):
        if not isinstance(schema, Schema):
            raise TypeError(f"schema: expected a schemas.Schema, got {type(schema).__name__}; "
                            "load one with schemas.load(path)")
        self.schema = schema
        self.config = config = config or TrainConfig()
        self.model = model if model is not None else models_lib.MLP()
        self.tables = config.check(schema)
        for table in self.tables:
            if not _TABLE_NAME.match(table):
                raise ConfigError(f"table name {table!r}: use letters, digits, _ . - only")
        if hasattr(self.model, "check"):
            self.model.check(schema)
        for table in self.tables:
            expiry = config.table(table).expire
            if expiry is not None and expiry.function is not None:  # fail before any data
                resolve_function(expiry.function, f"tables.{table}.expire.function")
        configure_threads(config.threads)
        dims = {t: config.table(t).dim for t in self.tables}
        poolings = {f.name: config.feature(f.name).pooling for f in schema.features
                    if f.kind != "dense"}
        structured = config.compute == "structured"
        self.layout = Layout(schema, self.tables, dims, poolings, dict(config.dense),
                             config.compact_tables(self.tables))
        self.builder = FeedBuilder(self.layout, structured)
        # Same seed, same initial dense weights, whatever the compute mode.
        keras.utils.set_random_seed(config.seed)
        self.network = Network(self.layout, self.model, dense_optimizer(config), structured)
        self._dense_lock = threading.Lock()

    # -- the model ----------------------------------------------------------------------------

    def spec(self) -> dict | None:
        """The model's spec (a built-in model is rebuilt from it), or None for a model of
        one's own."""
        try:
            return self.model.spec()
        except NotImplementedError:
            return None

    # -- feeds --------------------------------------------------------------------------------

    def prepare(self, batch: TreeBatch) -> Prepared:
        """The part of a step that needs neither the stores nor the dense weights (numpy feed
        work, tensors made from it), so a reader thread can do it ahead of the step."""
        prepared = self.prepare_numpy(batch)
        prepared.feed = tf.nest.map_structure(tf.convert_to_tensor, prepared.feed)
        return prepared

    def prepare_numpy(self, batch: TreeBatch) -> Prepared:
        """``prepare`` without making tensors (the feed builder's numpy work), after resolving
        the dense features' statistics if this is the first batch seen."""
        if not self.dense_resolved:
            self.resolve_dense(batch)
        return self.builder.prepare(batch)

    @property
    def dense_resolved(self) -> bool:
        return all(c.resolved for c in self.layout.dense_configs.values())

    def resolve_dense(self, batch: TreeBatch) -> None:
        """Decide ``auto`` transforms and measure the standardization statistics of every
        unresolved dense feature on ``batch`` (the first one seen), each node weighted by the
        samples under it so structured and flat compute agree. The resolved values go into
        ``self.config``, so checkpoints and exports keep them."""
        with self._dense_lock:
            for name, dense in list(self.layout.dense_configs.items()):
                if dense.resolved:
                    continue
                level = self.schema.layer_index(name)
                values = batch.layers[level].features[name]
                if level == len(batch.layers) - 1:
                    weights = np.ones(len(values))
                else:
                    weights = np.bincount(batch.leaf_ancestors(level), minlength=len(values))
                resolved = dense.resolve(values, weights)
                self.config = self.config.with_dense(name, resolved)
                self.layout.dense_configs[name] = resolved

    def shift_output_biases(self, outputs: dict, labels: dict) -> dict:
        """Shift each head's output bias so that the mean probability of ``outputs`` (the
        model's outputs, numpy, on some batch) equals the rate of that head's label in
        ``labels`` (the same batch's); returns ``{label: (rate, shift)}``. Deterministic: the
        same outputs and labels give the same shifts in every process (the workers of a Ray
        run each shift their copy by the union batch's)."""
        outputs = dict(outputs)
        biases = self.model.output_biases(outputs)
        heads = list(self.model.probabilities(outputs))  # the heads' labels, in output order
        shifted = {}
        for (name, bias), label in zip(biases.items(), heads):
            rate = float(np.clip(np.mean(labels[label]), 1e-4, 1 - 1e-4))

            def mean_probability(shift):
                trial = {**outputs, name: outputs[name] + np.float32(shift)}
                return float(np.mean(self.model.probabilities(trial)[label]))

            low, high = -30.0, 30.0  # the mean probability rises with the shift
            for _ in range(60):
                mid = (low + high) / 2
                low, high = (mid, high) if mean_probability(mid) < rate else (low, mid)
            shift = (low + high) / 2
            outputs[name] = outputs[name] + np.float32(shift)
            bias.assign(bias + shift)
            shifted[label] = (rate, shift)
        return shifted

    def set_config(self, config: TrainConfig) -> None:
        """Take ``config`` (the same tables and model; e.g. a checkpoint's, with its resolved
        dense statistics)."""
        self.config = config
        for name, dense in config.dense:
            self.layout.dense_configs[name] = dense

    # -- the dense weights under their checkpoint names ----------------------------------------

    def dense_names(self, optimizer: bool = True) -> list[str]:
        """``model/NNNN`` per dense variable, then (with ``optimizer``) ``optimizer/NNNN``
        per optimizer variable: the names in ``dense.npz``."""
        names = [dense_name("model", i) for i in range(len(self.network.variables))]
        if optimizer:
            names += [dense_name("optimizer", i)
                      for i in range(len(self.network.optimizer.variables))]
        return names

    def _dense_variables(self, optimizer: bool = True) -> list:
        return [*self.network.variables,
                *(self.network.optimizer.variables if optimizer else [])]

    def dense_arrays(self, optimizer: bool = True) -> dict:
        """``{name: array}`` of :meth:`dense_names`."""
        return {name: np.asarray(v.numpy()) for name, v in
                zip(self.dense_names(optimizer), self._dense_variables(optimizer))}

    def dense_shapes(self) -> dict:
        """``{name: shape}`` of :meth:`dense_names`: what a checkpoint must hold."""
        return {name: tuple(v.shape) for name, v in
                zip(self.dense_names(), self._dense_variables())}

    def variable_paths(self) -> list[str]:
        return [v.path for v in self.network.variables]

    def check_dense_arrays(self, arrays: dict, path: str, damaged) -> None:
        """Raise unless ``arrays`` holds every dense name with this model's shapes (``path``
        names the file; ``damaged`` is the error class for a wrong array)."""
        variables = self._dense_variables()
        names = self.dense_names()
        missing = [n for n in names if n not in arrays]
        if missing:
            raise ValueError(f"{path}: no array {missing[0]} for this model")
        for name, v in zip(names, variables):
            array = arrays[name]
            if tuple(array.shape) != tuple(v.shape) or not (
                    np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
                raise damaged(
                    f"{path}: array {name} is {array.dtype}{list(array.shape)}, this "
                    f"model's {v.path} is {v.dtype.name}{list(v.shape)}; the checkpoint is "
                    "damaged or of another model")

    def set_dense_arrays(self, arrays: dict, optimizer: bool = True) -> None:
        """Assign every variable of :meth:`dense_names` from ``arrays``."""
        for name, v in zip(self.dense_names(optimizer), self._dense_variables(optimizer)):
            v.assign(arrays[name])


def dense_optimizer(config: TrainConfig):
    opt = config.dense_optimizer
    if opt.name == "adam":
        return keras.optimizers.Adam(learning_rate=opt.lr)
    if opt.name == "adagrad":
        return keras.optimizers.Adagrad(learning_rate=opt.lr)
    return keras.optimizers.SGD(learning_rate=opt.lr)


_threads_set = []


def configure_threads(threads: int):
    """Size TensorFlow's pools once per process (it refuses after its first op)."""
    if threads <= 0 or _threads_set:
        return
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
        _threads_set.append(threads)
    except RuntimeError:
        pass  # TensorFlow already started: its pools keep their size
