"""Serving: a SavedModel of the dense network plus store snapshots, and a Predictor over them.

    trainer.export("export/")                      # dense SavedModel + every store's snapshot
    export_increment(trainer, "export/")           # later: store deltas + new dense weights
    predictor = Predictor("export/")
    predictor.predict(raw_samples)                 # probabilities, in the samples' order
    predictor.update()                             # apply what appeared since, in order

Layout of an export directory::

    export.json                 schema, config, model spec and heads, format version
    saved_model/                tf.saved_model with a ``predict`` function over the feed
    stores/<table>/store.snapshot
    deltas/<table>/delta-NNNNNN.bin, dense.npz    (export_increment, later)

A distributed run (``DistributedTrainer.export`` / ``export_increment``) keeps its shards:
``stores/<table>/shard-SSSS/`` and ``deltas/<table>/shard-SSSS/delta-NNNNNN.bin``, with
``"shards": S`` in export.json; the Predictor then looks every id up on its shard
(:class:`ShardedStore`), so each shard's deltas follow that shard's own sequence.

The SavedModel takes the feed of :mod:`trainer.feed` (ids already turned into embedding rows);
the Predictor does that part with the native stores, so a serving process follows the trainer
through ``apply_delta`` without reloading TensorFlow. Samples are scored one leaf per sample
(every layer's node is the sample itself), which keeps their order.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil

import numpy as np
import pyarrow as pa
import tensorflow as tf

import compression
from compression.cli import replace_directory
import native
import schemas
from compression import LayerBatch, TreeBatch
from schemas.hashing import id_shards
from trainer.checkpoints import dense_name
from trainer.config import TrainConfig
from trainer.feed import FeedBuilder, Layout
from trainer.network import dummy_feed, feed_signature

EXPORT_VERSION = 1
_DELTA = re.compile(r"delta-(\d+)\.bin$")


def export(core, directory: str | os.PathLike, *, step: int, stores: dict | None = None,
           write_stores=None) -> str:
    """Write ``core``'s dense network (a :class:`trainer.model.ModelCore`: a ``Trainer`` or
    a distributed run's model) as a SavedModel and the embedding snapshots, as of ``step``.

    ``stores``: ``{table: EmbeddingStore}`` to snapshot; or ``write_stores(tmp_dir)``, which
    writes the snapshots itself and returns what to add to ``export.json``
    (``DistributedTrainer.export``: one snapshot per shard, ``stores/<table>/shard-NNNN``,
    and ``"shards": S``)."""
    directory = os.path.abspath(os.fspath(directory))
    tmp = f"{directory}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    network = core.network
    # The structured signature over one-sample-per-node batches is what the Predictor feeds.
    signature = feed_signature(core.layout, structured=True)
    serving_network = network.structured_twin()
    module = tf.Module()
    module.variables_ = [getattr(v, "value", v) for v in network.variables]

    @tf.function(input_signature=[signature])
    def predict(feed):
        return serving_network.predict_outputs(feed)[1]

    module.predict = predict
    # A SavedModel gives dict outputs back in its own key order; keep the model's.
    heads = list(serving_network.predict_outputs(dummy_feed(core.layout, True))[1])
    tf.saved_model.save(module, os.path.join(tmp, "saved_model"))
    extra = {}
    if write_stores is not None:
        extra = write_stores(tmp) or {}
    else:
        for table, store in stores.items():
            os.makedirs(os.path.join(tmp, "stores", table))
            store.save(os.path.join(tmp, "stores", table))
    meta = {"version": EXPORT_VERSION, "schema": core.schema.to_dict(),
            "config": core.config.to_dict(), "model": core.spec(), "step": step,
            "tables": list(core.tables), "heads": heads, **extra}
    with open(os.path.join(tmp, "export.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return replace_directory(tmp, directory)


def export_increment(trainer, directory: str | os.PathLike) -> dict:
    """Keep an export directory up to date cheaply: the first call writes a full
    :func:`export`; later calls add every store's delta under ``directory/deltas/<table>/`` and
    replace ``directory/dense.npz`` (the dense weights, atomically). ``Predictor.update``
    applies both."""
    directory = os.fspath(directory)
    if not os.path.exists(os.path.join(directory, "export.json")):
        trainer.export(directory)
        return {"full": directory}
    deltas = trainer.export_delta(os.path.join(directory, "deltas"))
    path = os.path.join(directory, "dense.npz")
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    np.savez(tmp, step=np.int64(trainer.step), **trainer.dense_arrays(optimizer=False))
    os.replace(tmp, path)
    return {"deltas": deltas, "dense": path}


class Predictor:
    """Scores raw samples with an export directory's SavedModel and embedding snapshots."""

    def __init__(self, directory: str | os.PathLike, batch_size: int = 4096):
        self.directory = os.fspath(directory)
        path = os.path.join(self.directory, "export.json")
        try:
            with open(path) as f:
                meta = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.directory}: not a trainer export (export.json "
                                    "missing); write one with Trainer.export") from None
        if meta.get("version") != EXPORT_VERSION:
            raise ValueError(f"{path}: export version {meta.get('version')}, this Predictor "
                             f"reads version {EXPORT_VERSION}")
        self.schema = schemas.from_dict(meta["schema"])
        self.config = TrainConfig.from_dict(meta["config"])
        tables = self.config.check(self.schema)
        dims = {t: self.config.table(t).dim for t in tables}
        poolings = {f.name: self.config.feature(f.name).pooling for f in self.schema.features
                    if f.kind != "dense"}
        self.layout = Layout(self.schema, tables, dims, poolings, dict(self.config.dense))
        self.builder = FeedBuilder(self.layout, structured=True)
        self.shards = meta.get("shards")  # a sharded (distributed) run's export
        if self.shards:
            self.stores = {t: ShardedStore([
                native.EmbeddingStore.load(os.path.join(self.directory, "stores", t,
                                                        f"shard-{i:04d}"))
                for i in range(self.shards)]) for t in tables}
        else:
            self.stores = {t: native.EmbeddingStore.load(
                os.path.join(self.directory, "stores", t)) for t in tables}
        self.model = tf.saved_model.load(os.path.join(self.directory, "saved_model"))
        self.batch_size = batch_size
        self.heads = meta["heads"]   # probability columns, in the model's order
        self.dense_step = meta["step"]

    def _update_dense(self) -> None:
        path = os.path.join(self.directory, "dense.npz")
        if not os.path.exists(path) or _dense_step(path) <= self.dense_step:
            return
        with np.load(path) as arrays:
            for i, variable in enumerate(self.model.variables_):
                variable.assign(arrays[dense_name("model", i)])
            self.dense_step = int(arrays["step"])

    def predict(self, samples) -> np.ndarray:
        """Probabilities for raw samples (a pyarrow Table, a list of row dicts, or raw files),
        in their order: float32[n] for a one-head model, [n, heads] otherwise."""
        if isinstance(samples, list):
            samples = pa.Table.from_pylist(samples)
        elif isinstance(samples, (str, os.PathLike)):
            samples = compression.read_raw(os.fspath(samples), self.schema)
        for label in self.schema.labels:  # serving samples have no labels yet
            if label not in samples.column_names:
                samples = samples.append_column(label, pa.array(np.zeros(samples.num_rows,
                                                                         np.float32)))
        table = compression.validate_raw(samples, self.schema)
        outputs = []
        for start in range(0, table.num_rows, self.batch_size):
            batch = _one_node_per_sample(table.slice(start, self.batch_size), self.schema)
            feed = self.builder.lookup(self.builder.prepare(batch), self.stores, train=False)
            probabilities = self.model.predict(tf.nest.map_structure(tf.convert_to_tensor,
                                                                     feed.feed))
            outputs.append(np.stack([probabilities[h].numpy() for h in self.heads], axis=1))
        if not outputs:
            return np.zeros(0, np.float32)
        out = np.concatenate(outputs)
        return out[:, 0] if out.shape[1] == 1 else out

    def update(self, delta_root: str | os.PathLike | None = None) -> int:
        """Apply, in order, every delta not applied yet from ``delta_root/<table>/`` (written
        by ``Trainer.export_delta``; default: the export's own ``deltas/`` of
        :func:`export_increment`), and newer dense weights from ``dense.npz`` if there are.
        Returns the number of delta files applied."""
        if delta_root is None:
            delta_root = os.path.join(self.directory, "deltas")
        self._update_dense()
        applied = 0
        for table, store in self.stores.items():
            if isinstance(store, ShardedStore):  # deltas/<table>/shard-NNNN/delta-*.bin
                for i, shard in enumerate(store.shards):
                    applied += _apply_deltas(shard, os.path.join(
                        os.fspath(delta_root), table, f"shard-{i:04d}"))
            else:
                applied += _apply_deltas(store, os.path.join(os.fspath(delta_root), table))
        return applied


class ShardedStore:
    """The stores of one table's shards read as one (a distributed run's export): an id is
    looked up on shard ``mix64(id) % len(shards)``, as in training
    (:func:`schemas.hashing.id_shards`)."""

    def __init__(self, shards: list):
        self.shards = shards
        self.dim = shards[0].dim

    def lookup_unique(self, ids, train: bool = False):
        """``(unique_ids, inverse, rows)`` as ``EmbeddingStore.lookup_unique``; never
        trains."""
        if train:
            raise ValueError("a serving store does not train")
        unique, inverse = np.unique(np.asarray(ids, np.int64), return_inverse=True)
        rows = np.empty((len(unique), self.dim), np.float32)
        owner = id_shards(unique, len(self.shards))
        for s, store in enumerate(self.shards):
            pos = np.flatnonzero(owner == s)
            rows[pos] = store.lookup(unique[pos], train=False)
        return unique, inverse.reshape(-1), rows

    def lookup(self, ids, train: bool = False) -> np.ndarray:
        _, inverse, rows = self.lookup_unique(ids, train)
        return rows[inverse]

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)


def _apply_deltas(store, directory: str) -> int:
    """Apply, in order, the deltas in ``directory`` newer than ``store``'s; their number."""
    current = store.stats().delta_sequence
    found = []
    for path in glob.glob(os.path.join(directory, "delta-*.bin")):
        match = _DELTA.search(path)
        if match and int(match.group(1)) > current:
            found.append((int(match.group(1)), path))
    for _, path in sorted(found):
        store.apply_delta(path)
    return len(found)


def _dense_step(path: str) -> int:
    with np.load(path) as arrays:
        return int(arrays["step"])


def _one_node_per_sample(table: pa.Table, schema) -> TreeBatch:
    """A batch in which every layer has one node per sample (parent i -> i): the samples keep
    their order and no grouping work is done at serving time."""
    n = table.num_rows
    identity = np.arange(n, dtype=np.int32)
    flat = TreeBatch.from_trees(_as_one_layer(table, schema), _one_layer_schema(schema))
    features = flat.layers[0].features
    layers = []
    for level, layer in enumerate(schema.layers):
        layers.append(LayerBatch(layer.name, n, None if level == 0 else identity,
                                 {f.name: features[f.name] for f in layer.features}))
    return TreeBatch(layers, flat.labels)


def _one_layer_schema(schema):
    return schemas.from_dict({"name": schema.name, "labels": list(schema.labels),
                              "layers": [{"name": "sample", "key": [], "features": [
                                  f.to_dict() for f in schema.features]}]})


def _as_one_layer(table: pa.Table, schema) -> pa.Table:
    return table.select([f.name for f in schema.features] + list(schema.labels))
