"""Distributed training on Ray: embedding-store shards and data-parallel workers as actors.

    from trainer.distributed import DistributedTrainer
    with DistributedTrainer(schema, models.MLP(), TrainConfig(batch_size=5000),
                            workers=2, shards=2) as dt:           # a local Ray cluster
        dt.fit("trees/*.parquet")
        print(dt.evaluate("test_trees/*.parquet"))
        dt.save("run/checkpoint")

    # on an existing cluster (`ray start --head` on one machine, `ray start --address=HEAD:6379`
    # on the others, the project installed on every node):
    DistributedTrainer(schema, model, config, workers=8, shards=4, ray_address="HEAD:6379")

Design (synchronous data parallelism over a sharded parameter server, all on Ray actors):

- **Store shards** (one actor each) own one native :class:`native.EmbeddingStore` per table,
  built with the table's settings (optimizer, initializer, seed, entry filter, expiry). An id
  lives on shard :func:`shard_of` ``(id, S)``. The pybind11 stores never leave their actor; only
  numpy arrays cross processes.
- **Workers** (one actor each) hold the TensorFlow network, built from the same schema, model
  and config (same seed), so their initial dense weights are equal. Trees are dealt to workers by
  a hash of their root key (:func:`tree_workers`), so no tree crosses workers.
- **One synchronous step** ``k``, as a graph of actor calls whose arrays flow between the
  actors through Ray's object store (the driver passes references and reads small metadata):

  1. every worker applies step ``k-1``'s dense update (all workers' dense gradients, their
     leaf-weighted mean in worker order: the same numbers on every worker, so their weights
     stay identical) and hands out its next batch, which its reader thread has prepared,
     deduplicated per table and split by shard ahead: one request per shard, all tables in
     it (``_Worker.next_step``);
  2. every shard receives the requests of all workers in one call, runs ONE ``lookup_unique``
     per table over their concatenation (so an entry filter counts an id once per step, as the
     single store does for the union batch) and sends each worker its rows (``_Shard.lookup``);
  3. every worker computes its loss, dense gradients and row gradients, and sends each shard
     the row gradients of its ids (``_Worker.train_step``);
  4. every shard concatenates the gradients of all workers per table and calls
     ``apply_gradients`` once per table with step ``k`` (the store sums a row's gradients over
     the workers), then runs the configured expiry when ``k`` is a multiple of ``every_steps``
     (``_Shard.apply``).

  The driver submits step ``k+1``'s calls before it reads step ``k``'s results; Ray runs an
  actor's calls in the order one caller submitted them, so a shard's lookups of step ``k+1``
  still follow its updates of step ``k``. A step submitted past the end of the data changes
  nothing (its shards skip the update) and carries the last dense update.
- **Checkpoints** (:meth:`DistributedTrainer.save`): after the step's calls are done, every
  shard writes its snapshots, worker 0 gives the dense weights and optimizer state, and the
  driver writes ``manifest.json`` last; :meth:`DistributedTrainer.restore` reads the manifest
  and may use another number of workers or shards (resharding moves every row exactly).

**Exactness.** With workers holding ``n_w`` leaves (``N = sum n_w``), the single-process loss
of the union batch is the mean over its ``N`` leaves, so ``L = sum_w (n_w / N) L_w`` and every
gradient of ``L`` is the ``n_w / N``-weighted sum of the workers' gradients. Workers therefore
send ``n_w * grad`` (the per-sample sums); the dense update divides their sum by ``N``; row
gradients in ``row_gradients: sum`` mode are exactly the summed per-sample gradients (the
single trainer multiplies the mean loss's gradient by ``N``), and in ``mean`` mode the shard
divides by ``N``. Synchronous training is therefore equal to single-process training on the
union of the workers' batches up to float rounding (summation order), which
``tests/trainer/test_distributed.py`` checks: per-step loss, dense weights, and every row of the
stores (values, optimizer state, update counts, last steps).

What is exact and what is not: the counter entry filter, expiry by steps and by a function of
the row statistics, rows, optimizer state and counters are exact (every shard receives an
``apply_gradients`` every step, so its global step equals the single store's). The probability
filter draws from per-store random streams and a counting Bloom filter's false positives
depend on which ids share a filter: both are statistically, not bitwise, equal to one store.
``max_rows`` caps each shard at ``ceil(max_rows / S)`` rows. The store's ``lookups`` counter
counts each worker's distinct ids (workers deduplicate before sending). Dropout draws
different masks in different processes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import shutil
import socket
import sys
import threading
import time
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

import compression
from compression.cli import replace_directory
import native
import schemas
from compression import TreeBatch
from schemas import Schema, stable_hash_strings
from trainer import models as models_lib
from trainer.config import ConfigError, TrainConfig, resolve_function
from trainer.data import _file_tables, is_tree_table
from trainer.metrics import StreamingAUC, auc, logloss

MANIFEST_VERSION = 1
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


# -- placement: ids to shards, trees to workers ---------------------------------------------

def mix64(values) -> np.ndarray:
    """SplitMix64's finalizer of 64-bit values (the int64 bits read as uint64), as uint64::

        x ^= x >> 30; x *= 0xbf58476d1ce4e5b9; x ^= x >> 27; x *= 0x94d049bb133111eb; x ^= x >> 31

    (arithmetic mod 2**64). It depends on nothing but the value: every process, machine and
    language computes the same number (unlike Python's ``hash``)."""
    x = np.array(values, dtype=np.int64, copy=True).view(np.uint64)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= _MIX1
        x ^= x >> np.uint64(27)
        x *= _MIX2
        x ^= x >> np.uint64(31)
    return x


def shard_of(ids, shards: int) -> np.ndarray:
    """The shard of every id: ``mix64(id) mod shards`` (int64[n]). Ids are often hashes
    already, but many are small sequential integers; mixing spreads both evenly."""
    return (mix64(ids) % np.uint64(shards)).astype(np.int64)


def tree_workers(trees: pa.Table, schema: Schema, workers: int) -> np.ndarray:
    """The worker of every tree (row) of a tree table: the hash of the root layer's key
    columns that the Beam job shards by (``pipelines/_shards.py``: string keys through
    :func:`schemas.stable_hash`, ``h = mix64((h * 0x9E3779B97F4A7C15) ^ mix64(key))`` column
    by column from ``h = 0``), mod ``workers``. All trees of one root key go to one worker, and
    when the job wrote N shards with N a multiple of ``workers``, every file's trees belong to
    one worker. A one-layer schema deals its rows (single samples) round robin."""
    if len(schema.layers) == 1:
        return np.arange(trees.num_rows, dtype=np.int64) % workers
    h = np.zeros(trees.num_rows, np.uint64)
    for name in schema.layers[0].key:
        column = trees.column(name)
        if schema.feature(name).dtype == "string":
            values = stable_hash_strings(column)
        else:
            values = pc.cast(column, pa.int64()).to_numpy()
        with np.errstate(over="ignore"):
            h = mix64(((h * _GOLDEN) ^ mix64(values)).view(np.int64))
    return (h % np.uint64(workers)).astype(np.int64)


def _own_trees(table: pa.Table, schema: Schema, worker: int, workers: int) -> pa.Table:
    if workers == 1:
        return table
    return table.filter(pa.array(tree_workers(table, schema, workers) == worker))


def worker_batches(data, schema: Schema, config: TrainConfig, worker: int, workers: int,
                   pass_index: int = 1, shuffle: bool = False):
    """The TreeBatches worker ``worker`` of ``workers`` trains on in pass ``pass_index`` of
    ``data`` (tree or raw files, a glob, or a pyarrow Table of trees or raw samples): its own
    trees (:func:`tree_workers`), shuffled with the seed ``(config.seed, pass, worker)`` when
    ``shuffle``, in batches of ``config.batch_size`` leaves."""
    rng = (np.random.default_rng([config.seed, pass_index, 0x5F, worker]) if shuffle else None)

    def shuffled(table):
        return table if rng is None or table.num_rows < 2 else table.take(
            rng.permutation(table.num_rows))

    if isinstance(data, pa.Table):
        if not is_tree_table(data.schema, schema):
            data = compression.build_trees(data, schema)
        tables = [shuffled(_own_trees(data, schema, worker, workers))]
    elif isinstance(data, (str, os.PathLike)) or (
            isinstance(data, (list, tuple)) and data and isinstance(data[0], (str, os.PathLike))):
        files = compression.expand_paths(data if isinstance(data, (list, tuple))
                                         else os.fspath(data))
        order = files if rng is None else [files[i] for i in rng.permutation(len(files))]
        tables = (shuffled(_own_trees(t, schema, worker, workers))
                  for t in _file_tables(order, schema))
    else:
        raise TypeError(f"cannot split a {type(data).__name__} across workers; pass tree or raw "
                        "file paths, a pyarrow.Table, or one list of TreeBatches per worker")
    return compression.iter_batches(tables, schema, config.batch_size, config.split_trees)


def _per_worker_lists(data, workers: int) -> bool:
    """Whether ``data`` is one list of TreeBatches per worker."""
    if not isinstance(data, (list, tuple)) or not data:
        return False
    if not all(isinstance(part, (list, tuple)) for part in data):
        if isinstance(data[0], TreeBatch):
            raise TypeError("a list of TreeBatches cannot be split across workers without "
                            "cutting trees; pass one list of TreeBatches per worker "
                            f"({workers} lists), or files or a table")
        return False
    if len(data) != workers:
        raise ValueError(f"data: {len(data)} lists of batches for {workers} workers")
    for w, part in enumerate(data):
        for i, batch in enumerate(part):
            if not isinstance(batch, TreeBatch):
                raise TypeError(f"data[{w}][{i}] is a {type(batch).__name__}, not a TreeBatch")
    return True


def dense_sample(batch: TreeBatch, schema: Schema, names) -> dict:
    """Per dense feature: its values on its layer's nodes and each node's leaf count, what
    ``Trainer`` measures the standardization statistics on."""
    out = {}
    last = len(batch.layers) - 1
    for name in names:
        level = schema.layer_index(name)
        values = batch.layers[level].features[name]
        weights = (np.ones(len(values)) if level == last else
                   np.bincount(batch.leaf_ancestors(level), minlength=len(values)))
        out[name] = (values, weights)
    return out


def _unresolved_dense(schema: Schema, config: TrainConfig) -> list[str]:
    return [f.name for f in schema.features
            if f.kind == "dense" and not config.dense_config(f.name).resolved]


def resolve_dense(schema: Schema, config: TrainConfig, samples: list[dict | None]
                  ) -> TrainConfig:
    """``config`` with every unresolved dense feature resolved on the workers' first batches
    taken together (worker order), i.e. on the first batch of the union, as the single-process
    trainer resolves them on its first batch."""
    samples = [s for s in samples if s]
    for name in _unresolved_dense(schema, config):
        if not samples:
            break
        values = np.concatenate([s[name][0] for s in samples])
        weights = np.concatenate([s[name][1] for s in samples])
        config = config.with_dense(name, config.dense_config(name).resolve(values, weights))
    return config


# -- the shard actor ----------------------------------------------------------------------

def _shard_class():
    """The store shard's class, made inside a function so that Ray pickles it by value: a
    shard process then imports numpy and ``native`` only, not TensorFlow (importing anything
    of the ``trainer`` package loads TensorFlow)."""

    class Shard:
        """One shard of every table: ``stores[table]`` holds the ids ``i`` with
        ``shard_of(i, shards) == index``."""

        def __init__(self, index: int, shards: int, tables: dict, restore=None):
            """``restore``: None (empty stores), ``(snapshot dir,)`` (this shard's own
            snapshots) or a list of several: the snapshots of a checkpoint with another
            number of shards, of which this shard keeps its own ids (resharding)."""
            import native as native_

            self.index, self.shards = index, shards
            self.expiry = {t: spec["expire"] for t, spec in tables.items()}
            self.expired = 0
            self.timings = {"lookup": 0.0, "apply": 0.0}
            if restore is None:
                self.stores = {t: native_.EmbeddingStore(spec["store"])
                               for t, spec in tables.items()}
            elif isinstance(restore, tuple):
                self.stores = {t: native_.EmbeddingStore.load(os.path.join(restore[0], t),
                                                             spec["store"])
                               for t, spec in tables.items()}
            else:
                self.stores = {t: self._reshard(native_, t, spec["store"], restore)
                               for t, spec in tables.items()}

        def _owned(self, ids):
            """``shard_of(ids, shards) == index`` (the same mix64 as the module's)."""
            x = np.array(ids, dtype=np.int64, copy=True).view(np.uint64)
            with np.errstate(over="ignore"):
                x ^= x >> np.uint64(30)
                x *= np.uint64(0xBF58476D1CE4E5B9)
                x ^= x >> np.uint64(27)
                x *= np.uint64(0x94D049BB133111EB)
                x ^= x >> np.uint64(31)
            return (x % np.uint64(self.shards)) == np.uint64(self.index)

        def _reshard(self, native_, table, config, directories):
            """A store of this shard's ids of ``table`` from the snapshots of another
            sharding, through the store's own delta format: each old snapshot is loaded, its
            other ids removed, and its rows (all unexported since the snapshot: deltas carry
            rows changed since the previous delta) moved over as one delta, numbered in
            sequence with empty deltas. Rows, optimizer state, update counts, last steps and
            times, and the global step move exactly; entry-filter counts of ids without a row
            and the admitted/rejected counters start over."""
            import shutil as shutil_
            import tempfile

            store = native_.EmbeddingStore(config)
            scratch = native_.EmbeddingStore(config)  # source of empty deltas 1, 2, ...
            tmp = tempfile.mkdtemp(prefix=f"reshard-{table}-")
            empties = []
            try:
                for i, directory in enumerate(directories):
                    old = native_.EmbeddingStore.load(os.path.join(directory, table), config)
                    if old.stats().delta_sequence != 0:
                        raise ValueError(f"{directory}/{table}: this snapshot's store exported "
                                         "deltas, so its delta would miss rows; resharding "
                                         "needs snapshots of a run without delta exports")
                    while len(empties) < i:
                        os.makedirs(os.path.join(tmp, f"empty-{len(empties)}"))
                        empties.append(scratch.export_delta(
                            os.path.join(tmp, f"empty-{len(empties)}")))
                    for path in empties[:i]:
                        old.apply_delta(path)
                    old.expire_where(lambda ids, *rows: ~self._owned(ids))
                    os.makedirs(os.path.join(tmp, f"part-{i}"))
                    store.apply_delta(old.export_delta(os.path.join(tmp, f"part-{i}")))
                    del old
            finally:
                shutil_.rmtree(tmp, ignore_errors=True)
            return store

        def ping(self):
            return self.index

        def get_timings(self):
            return dict(self.timings)

        def lookup(self, train: bool, *requests):
            """``requests[w]``: ``{table: int64 ids}`` of worker ``w`` (distinct per worker).
            One ``lookup_unique`` per table over all workers; returns one ``{table: rows}``
            per worker (a list when there are several)."""
            import time as time_

            t0 = time_.perf_counter()
            out = [{} for _ in requests]
            empty = np.zeros(0, np.int64)
            for table, store in self.stores.items():
                parts = [r.get(table, empty) for r in requests]
                ids = parts[0] if len(parts) == 1 else np.concatenate(parts)
                _, inverse, rows = store.lookup_unique(ids, train)
                at = 0
                for w, part in enumerate(parts):
                    out[w][table] = rows[inverse[at:at + len(part)]]
                    at += len(part)
            self.timings["lookup"] += time_.perf_counter() - t0
            return out if len(out) > 1 else out[0]

        def apply(self, step: int, mean: bool, *messages):
            """``messages[w] = (leaves, {table: (ids, per-sample-summed row gradients)})``.
            One ``apply_gradients`` per table (every table, every step), then the expiry
            due at ``step``; returns the rows expired."""
            import time as time_

            t0 = time_.perf_counter()
            total = sum(n for n, _ in messages)
            if not total:  # a step past the end of the data: nothing happened
                return 0
            removed = 0
            for table, store in self.stores.items():
                parts = [m[table] for _, m in messages if table in m]
                if parts:
                    ids = np.concatenate([p[0] for p in parts])
                    grads = np.concatenate([p[1] for p in parts])
                else:
                    ids, grads = np.zeros(0, np.int64), np.zeros((0, store.dim), np.float32)
                if mean and total:
                    grads = grads / np.float32(total)
                store.apply_gradients(ids, grads, step)
                expiry = self.expiry[table]
                if expiry is not None and step % expiry["every_steps"] == 0:
                    removed += self._expire(table, step)
            self.expired += removed
            self.timings["apply"] += time_.perf_counter() - t0
            return removed

        def _expire(self, table: str, step: int) -> int:
            import importlib

            expiry, store = self.expiry[table], self.stores[table]
            removed = 0
            if expiry["max_idle_steps"] is not None or expiry["max_idle_seconds"] is not None:
                removed += store.expire(expiry["max_idle_steps"], expiry["max_idle_seconds"])
            if expiry["function"] is not None:
                module, name = expiry["function"].split(":")
                fn = getattr(importlib.import_module(module), name)
                removed += store.expire_where(lambda *rows: fn(*rows, step=step))
            return removed

        def stats(self) -> dict:
            return {t: s.stats().as_dict() for t, s in self.stores.items()}

        def rows(self) -> dict:
            return {t: s.to_numpy() for t, s in self.stores.items()}

        def save(self, directory: str) -> dict:
            paths = {}
            for table, store in self.stores.items():
                os.makedirs(os.path.join(directory, table), exist_ok=True)
                paths[table] = store.save(os.path.join(directory, table))
            return {"expired": self.expired, "paths": paths,
                    "rows": {t: len(s) for t, s in self.stores.items()}}

        def set_expired(self, expired: int):
            self.expired = expired

    return Shard


# -- the worker actor ---------------------------------------------------------------------

_END = "__end__"


class _FixedRows:
    """Stands in for a store in ``FeedBuilder.lookup``: the rows the shards sent."""

    def __init__(self, unique, inverse, rows):
        self.result = (unique, inverse, rows)

    def lookup_unique(self, ids, train):
        return self.result


class _Worker:
    """A data-parallel worker: a Trainer's network and feed builder (its own stores unused),
    fed by the shards."""

    def __init__(self, index: int, workers: int, shards: int, schema_dict: dict, model,
                 config_dict: dict):
        import tensorflow as tf

        from trainer.network import _FlatCall
        from trainer.trainer import Trainer

        self.index, self.workers, self.shards = index, workers, shards
        self.schema = schemas.from_dict(schema_dict)
        model = models_lib.from_spec(model) if isinstance(model, dict) else model()
        self.trainer = Trainer(self.schema, model, TrainConfig.from_dict(config_dict))
        network = self.trainer.network
        variables = network.variables

        def gradients(feed):
            loss, outputs, dense, row_grads = network._loss_and_grads(feed)
            dense = [tf.zeros_like(v) if g is None else g for g, v in zip(dense, variables)]
            return loss, dense, row_grads, network.model.probabilities(outputs)

        def apply_dense(grads):
            network.optimizer.apply_gradients(zip(grads, variables))
            return tf.constant(0)

        self._gradients = _FlatCall(tf.function(gradients, input_signature=[network.signature]))
        self._apply = tf.function(apply_dense, input_signature=[
            [tf.TensorSpec(v.shape, v.dtype) for v in variables]])
        self._dedupe = native.EmbeddingStore(native.StoreConfig(dim=1))
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread = None
        self._current = None
        self.timings = defaultdict(float)

    # data ---------------------------------------------------------------------------------

    def start(self, data, pass_index: int, shuffle: bool, train: bool) -> None:
        """Start reading a pass: ``data`` as ``worker_batches`` takes it, or this worker's
        list of TreeBatches. The reader prepares batches ahead once the dense statistics are
        resolved (``release``)."""
        self.close_pass()
        self._stop = threading.Event()
        self._queue = queue.Queue(max(self.trainer.config.pipeline_depth, 1))
        self._first = None
        self._first_ready = threading.Event()
        self._released = threading.Event()
        if isinstance(data, (list, tuple)) and (not data or isinstance(data[0], TreeBatch)):
            batches = iter(list(data))
        else:
            batches = worker_batches(data, self.schema, self.trainer.config, self.index,
                                     self.workers, pass_index, shuffle)
        self._thread = threading.Thread(target=self._read, args=(batches,), daemon=True,
                                        name=f"worker{self.index}-read")
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def _read(self, batches):
        try:
            for i, batch in enumerate(batches):
                if i == 0:
                    self._first = batch
                    self._first_ready.set()
                while not self._released.wait(0.05):
                    if self._stop.is_set():
                        return
                t0 = time.perf_counter()
                item = self._split(self.trainer.prepare_numpy(batch))
                self.timings["prepare"] += time.perf_counter() - t0
                if not self._put(item):
                    return
        except BaseException as e:  # raised in next_step, in the driver's call
            self._put(e)
        finally:
            self._first_ready.set()
            self._put(_END)

    def dense_sample(self, names):
        """The first batch's dense values and leaf weights (None: no batch this pass)."""
        self._first_ready.wait()
        return None if self._first is None else dense_sample(self._first, self.schema, names)

    def set_config(self, config_dict: dict) -> None:
        config = TrainConfig.from_dict(config_dict)
        self.trainer.config = config
        for name, dense in config.dense:
            self.trainer.layout.dense_configs[name] = dense

    def release(self) -> None:
        self._released.set()

    def close_pass(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._thread = None

    # steps --------------------------------------------------------------------------------

    def _split(self, prepared):
        """A prepared batch's ids deduplicated per table and split by shard (reader thread)."""
        requests = [{} for _ in range(self.shards)]
        tables = {}
        for table, ids in prepared.table_ids.items():
            # dedupe in C++ without the GIL: a non-training lookup of an empty store
            unique, inverse, _ = self._dedupe.lookup_unique(ids, train=False)
            owner = shard_of(unique, self.shards)
            positions = [np.flatnonzero(owner == s) for s in range(self.shards)]
            for s, pos in enumerate(positions):
                requests[s][table] = unique[pos]
            tables[table] = (unique, inverse.reshape(-1), positions)
        dims = self.trainer.layout.dims
        meta = {"n": prepared.num_leaves, "ids": sum(len(t[0]) for t in tables.values()),
                "request_bytes": sum(a.nbytes for r in requests for a in r.values()),
                "rows_bytes": sum(len(t[0]) * dims[name] * 4 for name, t in tables.items())}
        return prepared, tables, requests, meta

    def next_step(self, dense_messages: int = 0, *messages):
        """First the previous step's dense update (``messages``: every worker's dense message,
        see :meth:`apply_dense`; here it runs while the shards apply that step's rows), then
        the next batch: returns ``(meta, request for shard 0, ..., request for shard S-1)``,
        its ids deduplicated per table and split by shard."""
        if dense_messages:
            self.apply_dense(*messages)
        t0 = time.perf_counter()
        item = self._queue.get() if self._queue is not None else _END
        if isinstance(item, BaseException):
            raise item
        self.timings["wait_data"] += time.perf_counter() - t0
        if isinstance(item, str) and item == _END:
            self._current = None
            self._queue.put(_END)  # later calls see the end too
            return ({"n": 0},) + tuple({} for _ in range(self.shards))
        prepared, tables, requests, meta = item
        self._current = (prepared, tables)
        return (meta,) + tuple(requests)

    def _feed(self, shard_rows):
        prepared, tables = self._current
        stores = {}
        for table, (unique, inverse, positions) in tables.items():
            dim = self.trainer.layout.dims[table]
            rows = np.empty((len(unique), dim), np.float32)
            for s, pos in enumerate(positions):
                rows[pos] = shard_rows[s][table]
            stores[table] = _FixedRows(unique, inverse, rows)
        return self.trainer.builder.lookup(prepared, stores, train=True)

    def train_step(self, *shard_rows):
        """The loss and gradients of the current batch on the rows the shards sent (one
        message per shard). Returns ``(meta, dense message, message for shard 0, ..., shard
        S-1)``. Messages hold per-sample sums (``n * gradient of the mean loss``) and the
        leaf count ``n``."""
        from trainer.network import sum_row_slices

        if self._current is None:
            return ({"n": 0}, (0, None)) + tuple((0, {}) for _ in range(self.shards))
        t0 = time.perf_counter()
        feed = self._feed(shard_rows)
        n = feed.num_leaves
        loss, dense, row_slices, probabilities = self._gradients(feed.feed)
        rows = sum_row_slices(row_slices, feed.feed["rows"])
        scale = np.float32(n)
        messages = [{} for _ in range(self.shards)]
        _, tables = self._current
        for table, (dim, a, b) in feed.row_ranges.items():
            unique, _, positions = tables[table]
            grads = rows[str(dim)][a:b]
            grads *= scale
            for s, pos in enumerate(positions):
                messages[s][table] = (unique[pos], grads[pos])
        dense = [g.numpy() * scale for g in dense]
        meta = {"n": n, "loss": float(loss),
                "probabilities": {k: v.numpy() for k, v in probabilities.items()},
                "labels": feed.labels, "ids_fed": feed.ids_fed, "leaf_ids": feed.leaf_ids,
                "dense_bytes": sum(g.nbytes for g in dense),
                "grad_bytes": sum(i.nbytes + g.nbytes for m in messages for i, g in m.values())}
        self.timings["step"] += time.perf_counter() - t0
        return (meta, (n, dense)) + tuple((n, m) for m in messages)

    def apply_dense(self, *messages) -> None:
        """Apply the leaf-weighted mean of all workers' dense gradients (in worker order)."""
        t0 = time.perf_counter()
        total = sum(n for n, _ in messages)
        summed = None
        for n, grads in messages:
            if grads is None:
                continue
            summed = list(grads) if summed is None else [a + g for a, g in zip(summed, grads)]
        if summed is not None and total:
            self._apply([g / np.float32(total) for g in summed])
        self.timings["apply_dense"] += time.perf_counter() - t0

    def predict_step(self, *shard_rows):
        if self._current is None:
            return {"n": 0}
        feed = self._feed(shard_rows)
        loss, probabilities = self.trainer.network.predict_step(feed.feed)
        return {"n": feed.num_leaves, "loss": float(loss),
                "probabilities": {k: v.numpy() for k, v in probabilities.items()},
                "labels": feed.labels}

    # state ----------------------------------------------------------------------------------

    def dense_state(self) -> dict:
        network = self.trainer.network
        arrays = {f"model/{i:04d}": v.numpy() for i, v in enumerate(network.variables)}
        arrays.update({f"optimizer/{i:04d}": np.asarray(v.numpy())
                       for i, v in enumerate(network.optimizer.variables)})
        return {"arrays": arrays, "variables": [v.path for v in network.variables]}

    def set_dense_state(self, arrays: dict) -> None:
        network = self.trainer.network
        for i, v in enumerate(network.variables):
            v.assign(arrays[f"model/{i:04d}"])
        for i, v in enumerate(network.optimizer.variables):
            v.assign(arrays[f"optimizer/{i:04d}"])

    def get_timings(self) -> dict:
        return dict(self.timings)


# -- the driver ---------------------------------------------------------------------------

def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a whole number >= 1, got {value!r}")
    return value


def check_ray_address(address: str, timeout: float = 10.0) -> None:
    """Raise ConnectionError naming ``address`` when nothing answers there within
    ``timeout`` seconds (``ray.init`` itself would retry for a long time)."""
    if address in ("auto", "local"):
        return
    target = address.split("://", 1)[-1]
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"Ray address {address!r}: expected HOST:PORT (the head node's GCS "
                         "port, 6379 by default), ray://HOST:PORT, or auto")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise ConnectionError(f"Ray address {address!r} does not answer ({e}; waited up to "
                              f"{timeout:g} s); start a cluster there with `ray start --head "
                              f"--port {port}` or omit the address for a local cluster") from None


def _table_specs(config: TrainConfig, tables, shards: int) -> dict:
    from trainer.trainer import _table_seed

    specs = {}
    for table in tables:
        tc = config.table(table)
        if tc.max_rows is not None and shards > 1:
            tc = dataclasses.replace(tc, max_rows=math.ceil(tc.max_rows / shards))
        expire = tc.expire
        specs[table] = {"store": tc.store_config(seed=_table_seed(config.seed, table)),
                        "expire": None if expire is None else {
                            "every_steps": expire.every_steps,
                            "max_idle_steps": expire.max_idle_steps,
                            "max_idle_seconds": expire.max_idle_seconds,
                            "function": expire.function}}
    return specs


def _restore_for(directory, shard: int, shards: int):
    """What shard ``shard`` of ``shards`` restores from a checkpoint ``directory``."""
    if directory is None:
        return None
    with open(os.path.join(directory, "manifest.json")) as f:
        saved = json.load(f)
    dirs = [os.path.join(directory, d) for d in saved["shard_dirs"]]
    return (dirs[shard],) if saved["shards"] == shards else dirs


def _refs(value, n: int) -> list:
    """``num_returns=n`` gives a single ref for n == 1, a list otherwise."""
    return [value] if n == 1 else list(value)


class DistributedTrainer:
    """Synchronous data-parallel training on Ray with the embedding tables sharded over
    ``shards`` store actors and the TensorFlow steps on ``workers`` worker actors; equal to
    :class:`trainer.Trainer` on the union of the workers' batches (see the module docstring).

    ``model``: a built-in DenseNet (rebuilt in each worker from its ``spec()``) or a function
    returning a fresh DenseNet (pickled to the workers). Without ``ray_address`` a local Ray
    cluster is started and stopped by :meth:`close`; with one (``HOST:PORT`` of a running
    cluster's head, or ``auto``) the trainer connects to it, failing within
    ``connect_timeout`` seconds when nothing answers. If Ray is already initialised in this
    process, that cluster is used and left running. ``actor_cpus``: CPUs each actor reserves."""

    def __init__(self, schema: Schema, model=None, config: TrainConfig | None = None, *,
                 workers: int = 2, shards: int = 2, ray_address: str | None = None,
                 num_cpus: int | None = None, actor_cpus: float = 1.0,
                 connect_timeout: float = 10.0, runtime_env: dict | None = None,
                 _restore_dir: str | None = None):
        if not isinstance(schema, Schema):
            raise TypeError(f"schema: expected a schemas.Schema, got {type(schema).__name__}")
        self.workers = _check_count("workers", workers)
        self.shards = _check_count("shards", shards)
        self.schema = schema
        self.config = config = config or TrainConfig()
        self.tables = config.check(schema)
        for table in self.tables:
            expiry = config.table(table).expire
            if expiry is not None and expiry.function is not None:
                resolve_function(expiry.function, f"tables.{table}.expire.function")
        model = model if model is not None else models_lib.MLP()
        if isinstance(model, models_lib.DenseNet):
            if hasattr(model, "check"):
                model.check(schema)
            try:
                self._model = model.spec()
            except NotImplementedError:
                raise ValueError("model: this DenseNet has no spec(); pass a function that "
                                 "returns a fresh instance instead (it is pickled to the "
                                 "workers)") from None
        elif callable(model):
            self._model = model
        else:
            raise TypeError(f"model: expected a DenseNet or a function returning one, got "
                            f"{type(model).__name__}")
        self.model_spec = self._model if isinstance(self._model, dict) else None
        self.step = 0
        self.samples = 0
        self.expired = 0
        self.passes = 0        # training passes started (the input position between fits)
        self.bytes = defaultdict(int)  # bytes moved, summed over steps
        self.losses: list[float] = []  # the union batch's loss of every step
        self.ids_fed = 0       # ids looked up (per node in structured compute), all workers
        self.leaf_ids = 0      # ids the same samples hold expanded to the leaves
        self._owns_ray = False
        self._closed = False
        if ray_address is not None:
            check_ray_address(ray_address, connect_timeout)
        if ray_address is None and self.workers + self.shards > 8 * (os.cpu_count() or 1):
            raise ValueError(
                f"{self.workers} workers + {self.shards} shards on a local Ray cluster of "
                f"{os.cpu_count()} cores: each is a process; use at most "
                f"{8 * (os.cpu_count() or 1)} in all here, or a cluster (ray_address)")
        if not ray.is_initialized():
            kwargs = dict(include_dashboard=False, log_to_driver=False,
                          runtime_env=runtime_env)
            if ray_address is None:
                needed = math.ceil((self.workers + self.shards) * actor_cpus)
                kwargs["num_cpus"] = num_cpus or max(os.cpu_count() or 1, needed)
                self._owns_ray = True
            else:
                kwargs["address"] = ray_address
            ray.init(**kwargs)
        try:
            cpus = ray.cluster_resources().get("CPU", 0)
            needed = (self.workers + self.shards) * actor_cpus
            if needed > cpus:
                raise ValueError(
                    f"the Ray cluster{'' if ray_address is None else ' at ' + ray_address} "
                    f"has {cpus:g} CPUs; {self.workers} workers + {self.shards} shards at "
                    f"{actor_cpus:g} CPU each need {needed:g} (lower actor_cpus or add nodes)")
            specs = _table_specs(config, self.tables, self.shards)
            shard_cls = ray.remote(_shard_class())
            self._shards = [
                shard_cls.options(num_cpus=actor_cpus, name=None).remote(
                    s, self.shards, specs, _restore_for(_restore_dir, s, self.shards))
                for s in range(self.shards)]
            worker_cls = ray.remote(_Worker)
            self._workers = [worker_cls.options(num_cpus=actor_cpus).remote(
                w, self.workers, self.shards, schema.to_dict(), self._model, config.to_dict())
                for w in range(self.workers)]
            # fail here, not in the first step, when an actor cannot start
            ray.get([s.ping.remote() for s in self._shards]
                    + [w.get_timings.remote() for w in self._workers])
        except BaseException:
            self.close()
            raise

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Kill the actors; stop the Ray cluster if this trainer started it."""
        if self._closed:
            return
        self._closed = True
        for actor in getattr(self, "_workers", []) + getattr(self, "_shards", []):
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- steps ----------------------------------------------------------------------------

    def _start_pass(self, data, pass_index: int, shuffle: bool, train: bool) -> None:
        if _per_worker_lists(data, self.workers):
            parts = [ray.put(list(part)) for part in data]
        else:
            if isinstance(data, pa.Table):
                data = ray.put(data)
            elif not isinstance(data, (str, os.PathLike, list, tuple)):
                raise TypeError(f"cannot train on a {type(data).__name__} across workers; pass "
                                "tree or raw file paths, a pyarrow.Table, or one list of "
                                "TreeBatches per worker")
            elif isinstance(data, (str, os.PathLike)):
                compression.expand_paths(os.fspath(data))  # a clear error for a bad path
            parts = [data] * self.workers
        ray.get([w.start.remote(p, pass_index, shuffle, train)
                 for w, p in zip(self._workers, parts)])
        names = _unresolved_dense(self.schema, self.config)
        if names:
            samples = ray.get([w.dense_sample.remote(names) for w in self._workers])
            self.config = resolve_dense(self.schema, self.config, samples)
            ray.get([w.set_config.remote(self.config.to_dict()) for w in self._workers])
        ray.get([w.release.remote() for w in self._workers])

    def _submit_step(self, step: int, mean: bool, dense_refs):
        """Submit one training step's calls: returns (meta refs per worker, the workers'
        train_step refs, the shards' apply refs). ``dense_refs``: the previous step's dense
        messages, applied by every worker before this step's gradients."""
        W, S = self.workers, self.shards
        nxt = self._next(dense_refs)
        rows = [_refs(shard.lookup.options(num_returns=W).remote(
            True, *[nxt[w][1 + s] for w in range(W)]), W)
            for s, shard in enumerate(self._shards)]
        outs = [_refs(worker.train_step.options(num_returns=S + 2).remote(
            *[rows[s][w] for s in range(S)]), S + 2)
            for w, worker in enumerate(self._workers)]
        applied = [shard.apply.remote(step, mean, *[outs[w][2 + s] for w in range(W)])
                   for s, shard in enumerate(self._shards)]
        return [refs[0] for refs in nxt], outs, applied

    def _next(self, dense_refs=None):
        dense_refs = list(dense_refs or [])
        return [_refs(w.next_step.options(num_returns=self.shards + 1).remote(
            len(dense_refs), *dense_refs), self.shards + 1) for w in self._workers]

    def fit(self, data, epochs: int = 1, *, progress: bool = False,
            log_dir: str | None = None, shuffle: bool = True, callback=None) -> dict:
        """Train ``epochs`` synchronous passes over ``data``: tree or raw files (a path, glob
        or list), a pyarrow Table (each worker keeps its own trees, :func:`worker_batches`),
        or one list of TreeBatches per worker. Returns what ``Trainer.fit`` returns (samples,
        steps, seconds, samples_per_sec, loss, train_auc, store_rows) plus
        ``bytes_per_step`` (per worker and per shard). ``callback(trainer, loss)`` runs after
        every step with the union batch's loss."""
        from trainer.trainer import _progress_bar, write_scalars

        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs: expected a positive integer, got {epochs!r}")
        mean = self.config.row_gradients == "mean"
        bar = _progress_bar(progress, None, "train")
        writer = None
        if log_dir:
            import tensorflow as tf

            writer = tf.summary.create_file_writer(os.path.join(log_dir, "train"))
        train_auc, window_auc = StreamingAUC(), StreamingAUC()
        started = time.perf_counter()
        samples0, steps0, ids0, leaf_ids0 = self.samples, self.step, self.ids_fed, self.leaf_ids
        bytes0 = dict(self.bytes)
        mark_time, mark_samples = started, self.samples
        loss = float("nan")
        label = None
        try:
            for _ in range(epochs):
                self.passes += 1
                self._start_pass(data, self.passes, shuffle, train=True)
                # Each step's calls are submitted before the previous step's results are read
                # (Ray runs an actor's calls in the order one caller submitted them, so the
                # shards' lookups of step k+1 still follow their updates of step k). A step
                # past the end of the data changes nothing and flushes the last dense update.
                current = self._submit_step(self.step + 1, mean, None)
                while True:
                    following = self._submit_step(self.step + 2, mean,
                                                  [o[1] for o in current[1]])
                    metas = ray.get(current[0])
                    if not any(m["n"] for m in metas):
                        ray.get(following[0] + [o[0] for o in following[1]] + following[2]
                                + [o[0] for o in current[1]] + current[2])
                        break
                    results = ray.get([o[0] for o in current[1]])
                    self.expired += sum(ray.get(current[2]))
                    self.step += 1
                    current = following
                    n = sum(r["n"] for r in results)
                    loss = sum(r["loss"] * r["n"] for r in results if r["n"]) / n
                    self.losses.append(loss)
                    self.samples += n
                    self.ids_fed += sum(r.get("ids_fed", 0) for r in results)
                    self.leaf_ids += sum(r.get("leaf_ids", 0) for r in results)
                    self._count_bytes(metas, results)
                    for r in results:
                        if r["n"]:
                            label = label or next(iter(r["probabilities"]))
                            train_auc.add(r["probabilities"][label], r["labels"][label])
                            window_auc.add(r["probabilities"][label], r["labels"][label])
                    bar.update(n)
                    if callback is not None:
                        callback(self, loss)
                    if self.step % self.config.log_every == 0:
                        now = time.perf_counter()
                        rate = (self.samples - mark_samples) / max(now - mark_time, 1e-9)
                        mark_time, mark_samples = now, self.samples
                        bar.set_postfix(loss=f"{loss:.4f}", auc=f"{window_auc.result():.4f}",
                                        refresh=False)
                        if writer is not None:
                            stats = self.store_stats()
                            scalars = {"loss": loss, "samples_per_sec": rate,
                                       **{f"store/{k}": stats.get(k, 0)
                                          for k in ("rows", "admitted", "rejected", "expired")}}
                            if np.isfinite(window_auc.result()):
                                scalars["auc"] = window_auc.result()
                            write_scalars(writer, self.step, scalars)
                        window_auc.reset()
        finally:
            bar.close()
            if writer is not None:
                writer.flush()
                writer.close()
        seconds = time.perf_counter() - started
        steps = self.step - steps0
        samples = self.samples - samples0
        per_step = {k: (v - bytes0.get(k, 0)) / max(steps, 1) for k, v in self.bytes.items()}
        return {"samples": samples, "steps": steps, "seconds": seconds,
                "samples_per_sec": samples / max(seconds, 1e-9), "loss": loss,
                "train_auc": train_auc.result(), "store_rows": self.store_rows(),
                "id_compression": (self.leaf_ids - leaf_ids0) / max(self.ids_fed - ids0, 1),
                "bytes_per_step": {
                    "per_worker": (per_step.get("worker_sent", 0)
                                   + per_step.get("worker_received", 0)) / self.workers,
                    "per_shard": (per_step.get("shard_sent", 0)
                                  + per_step.get("shard_received", 0)) / self.shards,
                    **per_step}}

    def _count_bytes(self, metas, results) -> None:
        """Bytes each step moves between actors (array payloads, not Ray's framing): ids out
        and rows back, row gradients to the shards, dense gradients to every worker."""
        W = self.workers
        request = sum(m.get("request_bytes", 0) for m in metas)
        rows = sum(m.get("rows_bytes", 0) for m in metas)
        grads = sum(r.get("grad_bytes", 0) for r in results)
        dense = sum(r.get("dense_bytes", 0) for r in results)
        self.bytes["worker_sent"] += request + grads + dense * (W - 1)
        self.bytes["worker_received"] += rows + dense * (W - 1)
        self.bytes["shard_received"] += request + grads
        self.bytes["shard_sent"] += rows

    def evaluate(self, data, *, progress: bool = False) -> dict:
        """AUC and log loss over ``data`` (no update, no admission), as ``Trainer.evaluate``:
        each worker scores its own trees, the driver joins the predictions."""
        from trainer.trainer import _progress_bar

        W, S = self.workers, self.shards
        started = time.perf_counter()
        bar = _progress_bar(progress, None, "eval")
        probabilities, labels = defaultdict(list), defaultdict(list)
        loss_sum, n_total = 0.0, 0
        try:
            self._start_pass(data, 0, False, train=False)
            while True:
                nxt = self._next()
                metas = ray.get([refs[0] for refs in nxt])
                if not any(m["n"] for m in metas):
                    break
                rows = [_refs(shard.lookup.options(num_returns=W).remote(
                    False, *[nxt[w][1 + s] for w in range(W)]), W)
                    for s, shard in enumerate(self._shards)]
                results = ray.get([worker.predict_step.remote(*[rows[s][w] for s in range(S)])
                                   for w, worker in enumerate(self._workers)])
                for r in results:
                    if not r["n"]:
                        continue
                    for k, v in r["probabilities"].items():
                        probabilities[k].append(v)
                    for k, v in r["labels"].items():
                        labels[k].append(v)
                    loss_sum += r["loss"] * r["n"]
                    n_total += r["n"]
                    bar.update(r["n"])
        finally:
            bar.close()
        seconds = time.perf_counter() - started
        out = {"samples": n_total, "loss": loss_sum / max(n_total, 1), "seconds": seconds,
               "samples_per_sec": n_total / max(seconds, 1e-9)}
        for i, (name, parts) in enumerate(probabilities.items()):
            p, y = np.concatenate(parts), np.concatenate(labels[name])
            out[f"auc/{name}"], out[f"logloss/{name}"] = auc(p, y), logloss(p, y)
            if i == 0:
                out["auc"], out["logloss"] = out[f"auc/{name}"], out[f"logloss/{name}"]
        return out

    # -- state ----------------------------------------------------------------------------

    def store_stats(self) -> dict:
        """Counters summed over tables and shards: rows, admitted, rejected, expired, ..."""
        out = defaultdict(int)
        for shard in ray.get([s.stats.remote() for s in self._shards]):
            for stats in shard.values():
                for k, v in stats.items():
                    if k in ("rows", "bytes", "admitted", "rejected", "expired", "evicted",
                             "lookups", "updates"):
                        out[k] += v
        return dict(out)

    def store_rows(self) -> int:
        return self.store_stats().get("rows", 0)

    def table_rows(self) -> dict:
        """Every table's rows gathered from all shards (``EmbeddingStore.to_numpy`` columns,
        concatenated shard after shard)."""
        out = {}
        parts = ray.get([s.rows.remote() for s in self._shards])
        for table in self.tables:
            out[table] = {k: np.concatenate([p[table][k] for p in parts])
                          for k in parts[0][table]}
        return out

    def lookup(self, table: str, ids) -> np.ndarray:
        """Rows of ``ids`` in ``table`` as float32[n, dim], read from their shards without
        training (zeros for ids without a row)."""
        ids = np.asarray(ids, np.int64)
        unique, inverse = np.unique(ids, return_inverse=True)
        owner = shard_of(unique, self.shards)
        rows = np.zeros((len(unique), self.config.table(table).dim), np.float32)
        positions = [np.flatnonzero(owner == s) for s in range(self.shards)]
        got = ray.get([shard.lookup.remote(False, {table: unique[pos]})
                       for shard, pos in zip(self._shards, positions)])
        for pos, part in zip(positions, got):
            rows[pos] = part[table]
        return rows[inverse.reshape(-1)]

    def dense_weights(self, worker: int = 0) -> list[np.ndarray]:
        """The dense variables of one worker (all workers hold the same values)."""
        state = ray.get(self._workers[worker].dense_state.remote())
        return [state["arrays"][f"model/{i:04d}"] for i in range(len(state["variables"]))]

    def timings(self) -> dict:
        """Seconds spent so far in each part of the steps, per worker and per shard."""
        return {"workers": ray.get([w.get_timings.remote() for w in self._workers]),
                "shards": ray.get([s.get_timings.remote() for s in self._shards])}

    def save(self, directory) -> str:
        """A checkpoint across processes: after the last step's calls are done (the barrier),
        every shard writes its snapshot to ``shard-NNNN/<table>``, worker 0 gives its dense
        weights and optimizer state (``dense.npz``), and the driver writes ``manifest.json``
        last; the directory is replaced atomically."""
        directory = os.path.abspath(os.fspath(directory))
        tmp = f"{directory}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        saved = ray.get([s.save.remote(os.path.join(tmp, f"shard-{i:04d}"))
                         for i, s in enumerate(self._shards)])
        state = ray.get(self._workers[0].dense_state.remote())
        np.savez(os.path.join(tmp, "dense.npz"), **state["arrays"])
        manifest = {
            "version": MANIFEST_VERSION, "kind": "prefixrec-distributed", "step": self.step,
            "samples": self.samples, "expired": self.expired, "shards": self.shards,
            # every worker's input position: passes done (a pass k deals worker w's trees in
            # the order of seed (config.seed, k, w)); checkpoints are taken between passes
            "passes": self.passes,
            "workers": self.workers, "placement": "mix64(id) % shards",
            "shard_dirs": [f"shard-{i:04d}" for i in range(self.shards)],
            "shard_rows": [s["rows"] for s in saved],
            "shard_expired": [s["expired"] for s in saved],
            "tables": list(self.tables), "variables": state["variables"],
            "model": self.model_spec, "config": self.config.to_dict(),
            "schema": self.schema.to_dict()}
        with open(os.path.join(tmp, "manifest.json.tmp"), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(tmp, "manifest.json.tmp"), os.path.join(tmp, "manifest.json"))
        return replace_directory(tmp, directory)

    @classmethod
    def restore(cls, directory, model=None, *, workers: int | None = None,
                shards: int | None = None, **kwargs) -> "DistributedTrainer":
        """The run saved in ``directory`` (read from its manifest only), continuing where it
        stopped. ``workers`` may differ from the checkpoint's; so may ``shards``
        (resharding: every id then looks up the same row; see ``Shard._reshard`` for what
        starts over)."""
        directory = os.path.abspath(os.fspath(directory))
        path = os.path.join(directory, "manifest.json")
        try:
            with open(path) as f:
                manifest = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{directory}: no distributed checkpoint (manifest.json "
                                    "missing; a checkpoint without one was not finished)") from None
        if manifest.get("kind") != "prefixrec-distributed" or \
                manifest.get("version") != MANIFEST_VERSION:
            raise ValueError(f"{path}: not a version-{MANIFEST_VERSION} distributed checkpoint")
        shards = manifest["shards"] if shards is None else _check_count("shards", shards)
        if model is None:
            if manifest["model"] is None:
                raise ValueError(f"{directory}: the checkpoint's model is not built in; pass "
                                 "model= (a function returning a fresh DenseNet)")
            model = models_lib.from_spec(manifest["model"])
        schema = schemas.from_dict(manifest["schema"])
        config = TrainConfig.from_dict(manifest["config"])
        trainer = cls(schema, model, config, workers=workers or manifest["workers"],
                      shards=shards, _restore_dir=directory, **kwargs)
        with np.load(os.path.join(directory, "dense.npz")) as npz:
            arrays = {k: npz[k] for k in npz.files}
        expired = manifest["shard_expired"]
        if shards != manifest["shards"]:  # resharded: the total on shard 0
            expired = [sum(expired)] + [0] * (shards - 1)
        ray.get([w.set_dense_state.remote(arrays) for w in trainer._workers]
                + [s.set_expired.remote(e) for s, e in zip(trainer._shards, expired)])
        trainer.step, trainer.samples = manifest["step"], manifest["samples"]
        trainer.expired, trainer.passes = manifest["expired"], manifest["passes"]
        return trainer


# -- the command line (trainer/train.py dispatches here) ----------------------------------

def run_cli(args, parser, schema: Schema, config: TrainConfig, model) -> dict:
    """``python -m trainer.train ... --workers W --shards S [--ray-address ADDR]``: train on
    Ray, evaluate, checkpoint to ``OUT/checkpoint``; returns the result dict train.py prints."""
    for name in ("workers", "shards"):
        value = getattr(args, name)
        if value < 1:
            parser.error(f"--{name}: expected a number >= 1, got {value}")
    if args.shards > 4096:
        parser.error(f"--shards {args.shards}: more than 4096 shards is not sensible (each "
                     "shard is a process holding a part of every table)")
    if args.eval_every:
        parser.error("--eval-every is not supported with --workers/--shards yet")
    try:
        trainer = DistributedTrainer(schema, model, config, workers=args.workers,
                                     shards=args.shards, ray_address=args.ray_address)
    except (ConnectionError, ValueError, ConfigError) as e:
        parser.error(str(e))
    try:
        epochs = args.epochs or 1
        os.makedirs(args.out, exist_ok=True)
        history = trainer.fit(args.train_data, epochs=epochs, progress=not args.no_progress,
                              log_dir=args.out)
        stats = trainer.store_stats()
        rows = stats.get("rows", 0)
        if history["samples"] and rows and args.shards > rows:
            print(f"warning: {args.shards} shards for {rows} rows: most shards hold nothing; "
                  "use fewer shards", file=sys.stderr)
        result = {"samples": history["samples"], "samples_per_sec": history["samples_per_sec"],
                  "steps": history["steps"], "train_seconds": history["seconds"],
                  "train_auc": history["train_auc"], "loss": history["loss"],
                  "id_compression": history["id_compression"], "workers": args.workers,
                  "shards": args.shards, "bytes_per_step": history["bytes_per_step"]}
        if args.eval_data:
            evaluation = trainer.evaluate(args.eval_data)
            result.update(auc=evaluation["auc"], logloss=evaluation["logloss"],
                          eval_samples=evaluation["samples"], checkpoint_epoch=epochs,
                          checkpoint_step=trainer.step)
        else:
            result.update(auc=None, logloss=None, eval_samples=0)
        trainer.save(os.path.join(args.out, "checkpoint"))
        result.update(store_rows=rows, admitted=stats.get("admitted", 0),
                      rejected=stats.get("rejected", 0), expired=stats.get("expired", 0),
                      compute=config.compute, batch_size=config.batch_size, epochs=epochs,
                      run_dir=os.path.abspath(args.out))
        return result
    finally:
        trainer.close()
