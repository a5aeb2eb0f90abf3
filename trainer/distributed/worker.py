"""The data-parallel worker actor (a network and feed builder fed by the shards) and the
batches each worker trains on."""

from __future__ import annotations

import gc
import os
import queue
import threading
import time
from collections import defaultdict

import numpy as np
import pyarrow as pa

import compression
import native
import schemas
from compression import TreeBatch
from schemas import Schema
from trainer import models as models_lib
from trainer.config import TrainConfig
from trainer.data import file_tables
from trainer.distributed.placement import id_shards, own_trees
from trainer.distributed.shard import RESTARTED, held_key, reconstructed
from trainer.units import as_trees, cut_batches


def worker_batches(data, schema: Schema, config: TrainConfig, worker: int, workers: int,
                   pass_index: int = 1, shuffle: bool = False):
    """The TreeBatches worker ``worker`` of ``workers`` trains on in pass ``pass_index`` of
    ``data`` (tree or raw files, a glob, or a pyarrow Table of trees or raw samples): its own
    trees (:func:`tree_shards`), shuffled with the seed ``(config.seed, pass, worker)`` when
    ``shuffle``, in batches of :func:`worker_batch_size` leaves: ``config.batch_size`` is the
    global batch, as in TensorFlow's distribution strategies, so adding workers does not change
    the optimisation (one synchronous step trains on about ``batch_size`` leaves in all)."""
    rng = (np.random.default_rng([config.seed, pass_index, 0x5F, worker]) if shuffle else None)

    def shuffled(table):
        return table if rng is None or table.num_rows < 2 else table.take(
            rng.permutation(table.num_rows))

    if isinstance(data, pa.Table):
        tables = [shuffled(own_trees(as_trees(data, schema), schema, worker, workers))]
    elif isinstance(data, (str, os.PathLike)) or (
            isinstance(data, (list, tuple)) and data and isinstance(data[0], (str, os.PathLike))):
        files = compression.expand_paths(data if isinstance(data, (list, tuple))
                                         else os.fspath(data))
        order = files if rng is None else [files[i] for i in rng.permutation(len(files))]
        tables = (shuffled(own_trees(t, schema, worker, workers))
                  for t in file_tables(order, schema))
    else:
        raise TypeError(f"cannot split a {type(data).__name__} across workers; pass tree or raw "
                        "file paths, a pyarrow.Table, or one list of TreeBatches per worker")
    return cut_batches(tables, schema, worker_batch_size(config.batch_size, worker, workers),
                       config.split_trees)


def worker_batch_size(batch_size: int, worker: int, workers: int) -> int:
    """Worker ``worker``'s share of a global batch of ``batch_size`` leaves: the shares of the
    ``workers`` workers differ by at most one and add up to ``batch_size`` (at least 1 each)."""
    return max(1, batch_size // workers + (1 if worker < batch_size % workers else 0))


def per_worker_lists(data, workers: int) -> bool:
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


def unresolved_dense(schema: Schema, config: TrainConfig) -> list[str]:
    return [f.name for f in schema.features
            if f.kind == "dense" and not config.dense_config(f.name).resolved]


def resolve_dense(schema: Schema, config: TrainConfig, samples: list[dict | None]
                  ) -> TrainConfig:
    """``config`` with every unresolved dense feature resolved on the workers' first batches
    taken together (worker order), i.e. on the first batch of the union, as the single-process
    trainer resolves them on its first batch."""
    samples = [s for s in samples if s]
    for name in unresolved_dense(schema, config):
        if not samples:
            break
        values = np.concatenate([s[name][0] for s in samples])
        weights = np.concatenate([s[name][1] for s in samples])
        config = config.with_dense(name, config.dense_config(name).resolve(values, weights))
    return config


_END = "__end__"
# a table's positions per shard when one shard owns every id (no split, no copies)
_ALL = (slice(None),)


class _FixedRows:
    """Stands in for a store in ``FeedBuilder.lookup``: the rows the shards sent (and for a
    table with a cold table, which of its ids have a row)."""

    def __init__(self, unique, inverse, rows, held=None):
        self.result = (unique, inverse, rows)
        self.held = held

    def lookup_unique(self, ids, train):
        return self.result

    def contains(self, ids):
        return self.held


class _Stream:
    """One pass being read by a worker's reader thread into a bounded queue."""

    def __init__(self, depth: int):
        self.queue: queue.Queue = queue.Queue(depth)
        self.stop = threading.Event()
        self.first = None                     # the pass's first batch (dense statistics)
        self.first_ready = threading.Event()
        self.released = threading.Event()     # batches are prepared once this is set
        self.thread: threading.Thread | None = None

    def put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()


class Worker:
    """A data-parallel worker: a :class:`~trainer.model_core.ModelCore` (the network and feed
    builder, no stores) fed the rows by the shards."""

    def __init__(self, index: int, workers: int, shards: int, schema_dict: dict, model,
                 config_dict: dict):
        from trainer.model_core import ModelCore

        self.index, self.workers, self.shards = index, workers, shards
        self.schema = schemas.from_dict(schema_dict)
        model = models_lib.from_spec(model) if isinstance(model, dict) else model()
        self.core = ModelCore(self.schema, model, TrainConfig.from_dict(config_dict))
        self._dedupe = native.EmbeddingStore(native.StoreConfig(dim=1))
        self._streams: dict[str, _Stream] = {}
        self._current: dict = {}  # stream -> the batch taken from it last (None: its end)
        self._own_dense = None  # this worker's dense message of the last step
        self._frozen = False  # gc.freeze() done (after the first training step)
        self.timings = defaultdict(float)
        # a process Ray restarted has fresh weights: refuse steps until ``reset``
        self.restarted = reconstructed()

    def _check(self):
        if self.restarted:
            raise RuntimeError(f"{RESTARTED}: worker {self.index} was restarted and holds "
                               "fresh weights until a checkpoint is loaded")

    def pid(self):
        return os.getpid()

    # data ---------------------------------------------------------------------------------

    def start(self, stream: str, data, pass_index: int, shuffle: bool, skip: int = 0) -> None:
        """Start reading a pass into ``stream`` ("train" or "eval", so that an evaluation
        between steps leaves the training pass where it is): ``data`` as ``worker_batches``
        takes it, or this worker's list of TreeBatches, less its first ``skip`` batches (a
        pass resumed from a checkpoint). The reader prepares batches ahead once the dense
        statistics are resolved (``release``)."""
        self.close_pass(stream)
        if isinstance(data, (list, tuple)) and (not data or isinstance(data[0], TreeBatch)):
            batches = iter(list(data)[skip:])
        else:
            batches = worker_batches(data, self.schema, self.core.config, self.index,
                                     self.workers, pass_index, shuffle)
            for _ in zip(range(skip), batches):  # batched again, not prepared or trained
                pass
        state = self._streams[stream] = _Stream(max(self.core.config.pipeline_depth, 1))
        state.thread = threading.Thread(target=self._read, args=(state, batches), daemon=True,
                                        name=f"worker{self.index}-{stream}")
        state.thread.start()

    def _read(self, state, batches):
        try:
            for i, batch in enumerate(batches):
                if i == 0:
                    state.first = batch
                    state.first_ready.set()
                while not state.released.wait(0.05):
                    if state.stop.is_set():
                        return
                t0 = time.perf_counter()
                item = self._split(self.core.prepare_numpy(batch))
                self.timings["prepare"] += time.perf_counter() - t0
                if not state.put(item):
                    return
        except BaseException as e:  # raised in next_step, in the driver's call
            state.put(e)
        finally:
            state.first_ready.set()
            state.put(_END)

    def dense_sample(self, stream: str, names):
        """The first batch's dense values and leaf weights (None: no batch this pass)."""
        state = self._streams[stream]
        state.first_ready.wait()
        return None if state.first is None else dense_sample(state.first, self.schema, names)

    def set_config(self, config_dict: dict) -> None:
        self.core.set_config(TrainConfig.from_dict(config_dict))

    def release(self, stream: str) -> None:
        self._streams[stream].released.set()

    def close_pass(self, stream: str | None = None) -> None:
        """Stop reading ``stream`` (every stream when None)."""
        for name in ([stream] if stream is not None else list(self._streams)):
            state = self._streams.pop(name, None)
            if state is not None:
                state.close()

    def reset(self, config_dict: dict, dense_arrays: dict) -> int:
        """Back to a checkpoint: its config and dense state, no pass open."""
        self.close_pass()
        self._current = {}
        self.set_config(config_dict)
        self.set_dense_state(dense_arrays)
        self.restarted = False
        return self.index

    # steps --------------------------------------------------------------------------------

    def _split(self, prepared):
        """A prepared batch's ids deduplicated per table and split by shard (reader thread)."""
        requests = [{} for _ in range(self.shards)]
        tables = {}
        for table, ids in prepared.table_ids.items():
            # dedupe in C++ without the GIL: a non-training lookup of an empty store
            unique, inverse, _ = self._dedupe.lookup_unique(ids, train=False)
            if self.shards == 1:
                requests[0][table], positions = unique, _ALL
            else:
                owner = id_shards(unique, self.shards)
                positions = [np.flatnonzero(owner == s) for s in range(self.shards)]
                for s, pos in enumerate(positions):
                    requests[s][table] = unique[pos]
            tables[table] = (unique, inverse.reshape(-1), positions)
        dims = self.core.layout.dims
        meta = {"n": prepared.num_leaves, "ids": sum(len(t[0]) for t in tables.values()),
                "request_bytes": sum(a.nbytes for r in requests for a in r.values()),
                "rows_bytes": sum(len(t[0]) * dims[name] * 4 for name, t in tables.items())}
        return prepared, tables, requests, meta

    def next_step(self, stream: str, dense_messages: int = 0, *messages):
        """First the previous step's dense update (``messages``: every worker's dense message,
        see :meth:`apply_dense`; here it runs while the shards apply that step's rows), then
        the next batch of ``stream``: returns ``(meta, request for shard 0, ..., request for
        shard S-1)``, its ids deduplicated per table and split by shard."""
        self._check()
        if dense_messages:
            self.apply_dense(*messages)
        t0 = time.perf_counter()
        state = self._streams.get(stream)
        item = state.queue.get() if state is not None else _END
        if isinstance(item, BaseException):
            raise item
        self.timings["wait_data"] += time.perf_counter() - t0
        if isinstance(item, str) and item == _END:
            self._current[stream] = None
            if state is not None:
                state.queue.put(_END)  # later calls see the end too
            return ({"n": 0},) + tuple({} for _ in range(self.shards))
        prepared, tables, requests, meta = item
        self._current[stream] = (prepared, tables, meta)
        return (meta,) + tuple(requests)

    def _feed(self, current, shard_rows):
        prepared, tables, _ = current
        stores = {}
        for table, (unique, inverse, positions) in tables.items():
            dim = self.core.layout.dims[table]
            key = held_key(table)
            held = None
            if positions is _ALL:  # one shard: its rows are the table's, in order
                rows = shard_rows[0][table]
                held = shard_rows[0].get(key)
            else:
                rows = np.empty((len(unique), dim), np.float32)
                for s, pos in enumerate(positions):
                    rows[pos] = shard_rows[s][table]
                if key in shard_rows[0]:
                    held = np.empty(len(unique), bool)
                    for s, pos in enumerate(positions):
                        held[pos] = shard_rows[s][key]
            stores[table] = _FixedRows(unique, inverse, rows, held)
        return self.core.builder.lookup(prepared, stores, train=True)

    def train_step(self, *shard_rows, dense_messages: int = 0, dense: bool = True):
        """The loss and gradients of the current training batch on the rows the shards sent
        (one message per shard), then the next batch taken from the training stream. With
        ``dense_messages`` d, the first d arguments are instead the previous step's dense
        messages, applied first (:meth:`apply_dense`: one call per step instead of two).
        Returns ``(result, dense message, message for shard 0, ..., shard S-1)``: the
        result (loss, predictions, the batch's ``meta``) for the driver; the dense message
        for the other workers (None with one worker: a worker keeps its own, see
        :meth:`apply_dense`); shard ``s``'s message ``(n, {table: (ids, gradients)}, next
        request)`` with per-sample sums (``n * gradient of the mean loss``), the leaf count
        ``n`` and the next batch's ids this shard owns (as :meth:`next_step`). One call per
        step: the shards then apply this step and look the next one up in one call too
        (``Shard.step``).

        ``dense``: whether this pass trains the dense weights (False: the rows only, no dense
        message). A lone worker applies its dense gradients in the step itself, as a single
        process does (its dense message is None and there is nothing to :meth:`apply_dense`)."""
        if dense_messages:
            self.apply_dense(*shard_rows[:dense_messages])
            shard_rows = shard_rows[dense_messages:]
        out = self._gradient_messages(shard_rows, dense)
        _, *requests = self.next_step("train")
        return out[:2] + tuple((n, grads, request)
                               for (n, grads), request in zip(out[2:], requests))

    def _gradient_messages(self, shard_rows, dense: bool = True) -> tuple:
        from trainer.network import sum_row_slices

        self._check()
        current = self._current.get("train")
        if current is None:
            self._own_dense = (0, None)
            return ({"n": 0}, None) + tuple((0, {}) for _ in range(self.shards))
        t0 = time.perf_counter()
        feed = self._feed(current, shard_rows)
        n = feed.num_leaves
        network = self.core.network
        scale = np.float32(n)
        if not dense:  # a pass that trains the rows only
            loss, row_slices, probabilities = network.train_rows_step(feed.feed)
            dense = None
        elif self.workers == 1:  # nobody to average with: the update in the step, in process
            loss, row_slices, probabilities = network.train_step(feed.feed)
            dense = None
        else:
            loss, dense, row_slices, probabilities = network.gradients(feed.feed)
            dense = [g.numpy() * scale for g in dense]
        rows = sum_row_slices(row_slices, feed.feed["rows"])
        messages = [{} for _ in range(self.shards)]
        _, tables, batch_meta = current
        for table, (dim, a, b) in feed.row_ranges.items():
            unique, _, positions = tables[table]
            grads = rows[str(dim)][a:b]
            grads *= scale
            if feed.unique_ids[table] is not unique:
                # a cold table: only the buckets some id read train, a subset of those asked
                unique = feed.unique_ids[table]
                if positions is not _ALL:
                    owner = id_shards(unique, self.shards)
                    positions = [np.flatnonzero(owner == s) for s in range(self.shards)]
            for s, pos in enumerate(positions):
                # one shard owns every id: its message is the table's whole slice, uncopied
                messages[s][table] = ((unique, grads) if positions is _ALL
                                      else (unique[pos], grads[pos]))
        meta = {"n": n, "loss": float(loss), "meta": batch_meta,
                "probabilities": {k: v.numpy() for k, v in probabilities.items()},
                "labels": feed.labels, "ids_fed": feed.ids_fed, "leaf_ids": feed.leaf_ids,
                "dense_bytes": sum(g.nbytes for g in dense or ()),
                "grad_bytes": sum(i.nbytes + g.nbytes for m in messages for i, g in m.values())}
        self.timings["step"] += time.perf_counter() - t0
        if not self._frozen:
            # as trainer.online does: the objects alive after the first step (TensorFlow's,
            # hundreds of thousands, its traces among them) live as long as the process; out
            # of the cyclic collector's full passes, which the steps' allocations trigger
            # (measured over 80 online steps: 0.34-0.45 s of collection, 0.08 s frozen)
            self._frozen = True
            gc.freeze()
        self._own_dense = (n, dense)
        return (meta, (n, dense) if self.workers > 1 else None) + tuple(
            (n, m) for m in messages)

    def apply_dense(self, *messages) -> None:
        """Apply the leaf-weighted mean of all workers' dense gradients of the last step, in
        worker order (the same sums on every worker, so their weights stay equal):
        ``messages[w]``, worker ``w``'s dense message, or None for this worker's own, which
        it kept (it does not travel)."""
        self._check()
        t0 = time.perf_counter()
        messages = [self._own_dense if m is None else m for m in messages]
        total = sum(n for n, _ in messages)
        summed = None
        for n, grads in messages:
            if grads is None:
                continue
            summed = list(grads) if summed is None else [a + g for a, g in zip(summed, grads)]
        if summed is not None and total:
            self.core.network.apply_dense([g / np.float32(total) for g in summed])
        self.timings["apply_dense"] += time.perf_counter() - t0

    def calibration_outputs(self, *shard_rows):
        """``(outputs, labels)`` of the current training batch (numpy per output and per
        label) on ``shard_rows``, rows the shards looked up without admitting anything;
        None without a batch. A new online run's driver gathers them into the first step's
        union batch (:meth:`shift_output_biases`)."""
        self._check()
        current = self._current.get("train")
        if current is None:
            return None
        feed = self._feed(current, shard_rows)
        outputs = {k: v.numpy() for k, v in self.core.network.outputs(feed.feed).items()}
        return outputs, feed.labels

    def shift_output_biases(self, outputs: dict, labels: dict) -> dict:
        """:meth:`trainer.model_core.ModelCore.shift_output_biases` of this worker's copy: every
        worker given the same union batch's outputs and labels shifts its biases alike."""
        self._check()
        return self.core.shift_output_biases(outputs, labels)

    def predict_step(self, *shard_rows):
        self._check()
        current = self._current.get("eval")
        if current is None:
            return {"n": 0}
        feed = self._feed(current, shard_rows)
        loss, probabilities = self.core.network.predict_step(feed.feed)
        return {"n": feed.num_leaves, "loss": float(loss),
                "probabilities": {k: v.numpy() for k, v in probabilities.items()},
                "labels": feed.labels}

    # state ----------------------------------------------------------------------------------

    def ping(self):
        return self.index

    def dense_state(self) -> dict:
        self._check()
        return {"arrays": self.core.dense_arrays(), "variables": self.core.variable_paths()}

    def variable_shapes(self) -> dict:
        """``model/NNNN`` and ``optimizer/NNNN`` -> shape: what a checkpoint must hold."""
        return self.core.dense_shapes()

    def set_dense_state(self, arrays: dict) -> None:
        self.core.set_dense_arrays(arrays)

    def get_timings(self) -> dict:
        return dict(self.timings)
