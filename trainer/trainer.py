"""Trainer: a DenseNet plus native embedding stores, trained on multi-prefix-tree batches.

    schema = schemas.load("schemas/examples/taobao_like.yaml")
    trainer = Trainer(schema, models.MLP(), TrainConfig(batch_size=5000))
    trainer.fit("trees/*.parquet", epochs=1)
    print(trainer.evaluate("test_trees/*.parquet"))    # {'auc': ..., 'logloss': ..., ...}
    trainer.save("run/checkpoint"); trainer = Trainer.restore("run/checkpoint")

Each step runs three overlapping stages on bounded queues (XDL section 4.2): read and batch
(plus the numpy work of the feed), store lookup, and the TensorFlow step followed by
``apply_gradients`` on the stores. By default the lookup of a batch waits for the update of the
previous one, so a run equals the sequential one exactly (``TrainConfig.stale_lookups``).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import sys
import threading
import time
from collections import defaultdict

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

import native
import schemas
from compression import TreeBatch
from compression.cli import replace_directory
from schemas import Schema
from trainer import models as models_lib
from trainer.config import ConfigError, TrainConfig, resolve_function
from trainer.data import batch_source, count_samples
from trainer.feed import Feed, FeedBuilder, Layout, Prepared
from trainer.metrics import StreamingAUC, auc, logloss
from trainer.network import Network, sum_row_slices

CHECKPOINT_VERSION = 2
_END = object()
_TABLE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class Trainer:
    """Trains ``model`` on data of ``schema`` as ``config`` says (see :class:`TrainConfig`)."""

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
        _configure_threads(config.threads)
        self.stores = {t: native.EmbeddingStore(config.table(t).store_config(
            seed=_table_seed(config.seed, t))) for t in self.tables}
        dims = {t: config.table(t).dim for t in self.tables}
        poolings = {f.name: config.feature(f.name).pooling for f in schema.features
                    if f.kind != "dense"}
        structured = config.compute == "structured"
        self.layout = Layout(schema, self.tables, dims, poolings, dict(config.dense))
        self.builder = FeedBuilder(self.layout, structured)
        # Same seed, same initial dense weights, whatever the compute mode.
        keras.utils.set_random_seed(config.seed)
        self.network = Network(self.layout, self.model, _dense_optimizer(config), structured)
        self.step = 0          # training steps so far (the step apply_gradients receives)
        self.samples = 0       # training samples so far
        self.expired = 0       # rows removed by the configured expiry
        self.ids_fed = 0       # ids looked up in training (per node in structured compute)
        self.leaf_ids = 0      # ids the same samples hold expanded to the leaves
        self.timings = defaultdict(float)  # seconds per stage: read, lookup, step, update
        self._dense_lock = threading.Lock()

    # -- training ---------------------------------------------------------------------------

    def fit(self, data, epochs: int = 1, *, progress: bool = False, log_dir: str | None = None,
            callback=None, eval_data=None, eval_every: int | None = None,
            patience: int | None = None, best_dir: str | None = None,
            shuffle: bool = True) -> dict:
        """Train up to ``epochs`` passes over ``data`` (tree/raw file paths or glob, a pyarrow
        Table, or TreeBatches). ``log_dir`` gets TensorBoard scalars; ``progress`` shows a bar on
        stderr; ``callback(trainer, loss, probabilities, labels)`` runs after every step.

        ``shuffle`` deals the trees of each pass in a new order (seeded by the config's seed and
        the pass). With ``eval_data`` the model is evaluated after every pass, and every
        ``eval_every`` steps if given; ``best_dir`` then always holds the checkpoint of the
        best evaluation AUC so far, and with ``patience`` training stops after that many
        evaluations without a better AUC and the trainer goes back to the best checkpoint
        (CTR models tend to overfit after one epoch, so a run need not guess ``epochs``).

        Returns samples, steps, samples_per_sec, loss (last step), a streaming train AUC and,
        with ``eval_data``, ``evaluations`` (one dict per evaluation) and ``best``."""
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs: expected a positive integer, got {epochs!r}")
        for key, value in (("eval_every", eval_every), ("patience", patience)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{key}: expected a positive integer or None, got {value!r}")
        if (eval_every or patience or best_dir) and eval_data is None:
            raise ValueError("eval_every, patience and best_dir need eval_data")
        source = batch_source(data, self.schema, self.config.batch_size, self.config.split_trees,
                              shuffle_seed=self.config.seed if shuffle else None)
        total = count_samples(data, self.schema)
        bar = _progress_bar(progress, None if total is None else total * epochs, "train")
        writer = tf.summary.create_file_writer(os.path.join(log_dir, "train")) if log_dir else None
        train_auc = StreamingAUC()
        window_auc = StreamingAUC()
        label = None
        started = time.perf_counter()
        samples0, steps0, ids0, leaf_ids0 = self.samples, self.step, self.ids_fed, self.leaf_ids
        mark_time, mark_samples = started, self.samples
        loss = float("nan")
        evaluations: list[dict] = []
        best: dict | None = None
        stale = 0  # evaluations since the best one

        def evaluate(epoch: int) -> bool:
            """Evaluate now; True when training should stop."""
            nonlocal best, stale
            result = self.evaluate(eval_data, log_dir=log_dir)
            result.update(epoch=epoch, step=self.step, samples_trained=self.samples - samples0)
            evaluations.append(result)
            if progress:
                bar.write(f"eval after epoch {epoch} (step {self.step}): AUC {result['auc']:.4f}"
                          f" logloss {result['logloss']:.5f}", file=sys.stderr)
            if best is None or result["auc"] > best["auc"]:
                best, stale = result, 0
                if best_dir:
                    self.save(best_dir)
            else:
                stale += 1
            return patience is not None and stale >= patience

        stopped = False
        logged_step = self.step  # the last step whose scalars went to the bar and TensorBoard

        def log_scalars():
            nonlocal mark_time, mark_samples, logged_step
            now = time.perf_counter()
            rate = (self.samples - mark_samples) / max(now - mark_time, 1e-9)
            mark_time, mark_samples = now, self.samples
            bar.set_postfix(loss=f"{loss:.4f}", auc=f"{window_auc.result():.4f}",
                            rows=self.store_rows(), refresh=False)
            if writer is not None:
                self._write_scalars(writer, loss, window_auc.result(), rate)
            window_auc.reset()
            logged_step = self.step

        completed = False
        try:
            for epoch in range(1, epochs + 1):
                for feed in self._pipeline(source, train=True):
                    loss, probabilities = self._train_on(feed)
                    label = label or next(iter(probabilities))
                    p = probabilities[label]
                    train_auc.add(p, feed.labels[label])
                    window_auc.add(p, feed.labels[label])
                    bar.update(feed.num_leaves)
                    if callback is not None:
                        callback(self, loss, probabilities, feed.labels)
                    if self.step % self.config.log_every == 0:
                        log_scalars()
                    if eval_every and self.step % eval_every == 0 and evaluate(epoch):
                        stopped = True
                        break
                if stopped or (eval_data is not None and (
                        not evaluations or evaluations[-1]["step"] != self.step)
                        and evaluate(epoch)):
                    break
            completed = True
        finally:
            try:
                if self.step != logged_step:
                    # the last step's scalars, so a run shorter than log_every has some too
                    try:
                        log_scalars()
                    except Exception:
                        if completed:
                            raise  # otherwise the error that stopped training is the one shown
            finally:
                _close_bar(bar, completed)
                if writer is not None:
                    writer.flush()
                    writer.close()
        seconds = time.perf_counter() - started
        samples = self.samples - samples0
        out = {"samples": samples, "steps": self.step - steps0, "seconds": seconds,
               "id_compression": (self.leaf_ids - leaf_ids0) / max(self.ids_fed - ids0, 1),
               "samples_per_sec": samples / max(seconds, 1e-9), "loss": loss,
               "train_auc": train_auc.result(), "store_rows": self.store_rows()}
        if eval_data is not None:
            out.update(evaluations=evaluations, best=best, stopped_early=stopped or (
                patience is not None and stale >= patience))
            if best_dir and best is not None and best is not evaluations[-1]:
                self.load(best_dir)  # back to the best model
        return out

    def _train_on(self, feed: Feed):
        t0 = time.perf_counter()
        loss, row_slices, probabilities = self.network.train_step(feed.feed)
        row_grads = sum_row_slices(row_slices, feed.feed["rows"])
        if self.config.row_gradients == "sum":  # per-sample sums, not the batch mean's share
            for grads in row_grads.values():
                grads *= feed.num_leaves
        probabilities = {k: v.numpy() for k, v in probabilities.items()}
        t1 = time.perf_counter()
        self.step += 1
        for table, (dim, start, stop) in feed.row_ranges.items():
            self.stores[table].apply_gradients(feed.unique_ids[table],
                                               row_grads[str(dim)][start:stop], self.step)
        for table in self.tables:
            expiry = self.config.table(table).expire
            if expiry is not None and self.step % expiry.every_steps == 0:
                self.expire(table)
        self.samples += feed.num_leaves
        self.ids_fed += feed.ids_fed
        self.leaf_ids += feed.leaf_ids
        t2 = time.perf_counter()
        self.timings["step"] += t1 - t0
        self.timings["update"] += t2 - t1
        return float(loss), probabilities

    def expire(self, table: str) -> int:
        """Run ``table``'s configured expiry now (idle steps/seconds, then its function);
        returns the rows removed."""
        expiry = self.config.table(table).expire
        store = self.stores[table]
        removed = 0
        if expiry.max_idle_steps is not None or expiry.max_idle_seconds is not None:
            removed += store.expire(expiry.max_idle_steps, expiry.max_idle_seconds)
        if expiry.function is not None:
            fn = resolve_function(expiry.function, f"tables.{table}.expire.function")
            step = self.step
            removed += store.expire_where(lambda *rows: fn(*rows, step=step))
        self.expired += removed
        return removed

    def trace(self) -> None:
        """Trace the training step now; otherwise the first batch does it (for the paper's MLP,
        ~2.2 s of a ~2.8 s first step). Online learning calls it while its reader joins the
        consumer group, so the first unit waits ~2 s less."""
        self.network.train_step.trace()

    def prepare(self, batch: TreeBatch) -> Prepared:
        """The part of a step that needs neither the stores nor the dense weights (numpy feed
        work, tensors made from it), so a reader thread can do it ahead of the step."""
        prepared = self.prepare_numpy(batch)
        prepared.feed = tf.nest.map_structure(tf.convert_to_tensor, prepared.feed)
        return prepared

    def prepare_numpy(self, batch: TreeBatch) -> Prepared:
        """``prepare`` without making tensors (the feed builder's numpy work), after resolving
        the dense features' statistics if this is the first batch the trainer sees."""
        if not self._dense_resolved:
            self._resolve_dense(batch)
        return self.builder.prepare(batch)

    @property
    def _dense_resolved(self) -> bool:
        return all(c.resolved for c in self.layout.dense_configs.values())

    def _resolve_dense(self, batch: TreeBatch) -> None:
        """Decide ``auto`` transforms and measure the standardization statistics of every
        unresolved dense feature on ``batch`` (the first one the trainer sees), each node
        weighted by the samples under it so structured and flat compute agree. The resolved
        values go into ``self.config``, so checkpoints and exports keep them."""
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

    def train_batch(self, batch: TreeBatch | Prepared, *, predictions: bool = False):
        """One training step on one batch (or one ``prepare``-d ahead), on the caller's thread
        (for callers that batch themselves, e.g. online learning); returns the loss.

        With ``predictions=True`` it returns ``(loss, probabilities, labels)``, both dicts of
        numpy arrays per label in the batch's leaf order. The probabilities are the step's own
        forward pass, computed with the dense weights and store rows *before* this step's
        update (the update uses their gradients): progressive-validation predictions, at no
        extra cost."""
        t0 = time.perf_counter()
        prepared = batch if isinstance(batch, Prepared) else self.prepare_numpy(batch)
        feed = self.builder.lookup(prepared, self.stores, train=True)
        self.timings["lookup"] += time.perf_counter() - t0
        loss, probabilities = self._train_on(feed)
        return (loss, probabilities, feed.labels) if predictions else loss

    def compute_gradients(self, batch: TreeBatch) -> dict:
        """Loss and gradients of one batch without applying them (rows are looked up, and
        admitted, as in training): ``{"loss", "dense": [grad per dense variable],
        "embeddings": {table: (unique_ids, grads)}}``."""
        feed = self.builder.lookup(self.prepare_numpy(batch), self.stores, train=True)
        loss, dense, row_slices = self.network.gradients(feed.feed)
        rows = sum_row_slices(row_slices, feed.feed["rows"])
        return {"loss": float(loss), "dense": [g.numpy() for g in dense],
                "embeddings": {t: (feed.unique_ids[t], rows[str(d)][a:b])
                               for t, (d, a, b) in feed.row_ranges.items()}}

    # -- evaluation -------------------------------------------------------------------------

    def evaluate(self, data, *, progress: bool = False, log_dir: str | None = None) -> dict:
        """Exact AUC and log loss of every predicted label over ``data`` (no update, no
        admission): ``{"samples", "loss", "auc", "logloss", "auc/<label>", ...}``; ``auc`` and
        ``logloss`` are of the model's first head."""
        started = time.perf_counter()
        probabilities, labels, loss = self._predict_all(data, progress)
        seconds = time.perf_counter() - started
        n = len(next(iter(labels.values()))) if labels else 0
        out = {"samples": n, "loss": loss, "seconds": seconds,
               "samples_per_sec": n / max(seconds, 1e-9)}
        for i, (name, p) in enumerate(probabilities.items()):
            out[f"auc/{name}"] = auc(p, labels[name])
            out[f"logloss/{name}"] = logloss(p, labels[name])
            if i == 0:
                out["auc"], out["logloss"] = out[f"auc/{name}"], out[f"logloss/{name}"]
        if log_dir:
            writer = tf.summary.create_file_writer(os.path.join(log_dir, "eval"))
            with writer.as_default(step=self.step):
                for key in ("auc", "logloss", "loss"):
                    _scalar(key, out[key])
            writer.close()
        return out

    def predict(self, data, *, progress: bool = False) -> np.ndarray:
        """Probabilities per sample, in the leaf order of the batches (tree order): float32[n]
        for a one-head model, float32[n, heads] otherwise."""
        probabilities, _, _ = self._predict_all(data, progress)
        columns = list(probabilities.values())
        return columns[0] if len(columns) == 1 else np.stack(columns, axis=1)

    def _predict_all(self, data, progress):
        source = batch_source(data, self.schema, self.config.batch_size, self.config.split_trees)
        bar = _progress_bar(progress, count_samples(data, self.schema), "eval")
        probabilities, labels = defaultdict(list), defaultdict(list)
        loss_sum, n = 0.0, 0
        try:
            for feed in self._pipeline(source, train=False):
                loss, probs = self.network.predict_step(feed.feed)
                for k, v in probs.items():
                    probabilities[k].append(v.numpy())
                for k, v in feed.labels.items():
                    labels[k].append(v)
                loss_sum += float(loss) * feed.num_leaves
                n += feed.num_leaves
                bar.update(feed.num_leaves)
        finally:
            bar.close()
        join = lambda d: {k: np.concatenate(v) for k, v in d.items()}  # noqa: E731
        return join(probabilities), join(labels), loss_sum / max(n, 1)

    # -- the three-stage input pipeline -----------------------------------------------------

    def _pipeline(self, source, train: bool):
        """Feeds in order; stage 1 (thread) reads, batches and prepares, stage 2 (thread) looks
        up, the caller trains. In exact mode stage 2 looks batch k+1 up only after the caller
        asks for it, i.e. after batch k's update."""
        depth = self.config.pipeline_depth
        exact = train and not self.config.stale_lookups
        stop = threading.Event()
        prepared_q: queue.Queue = queue.Queue(depth)
        feed_q: queue.Queue = queue.Queue(1 if exact else depth)
        updated = threading.Semaphore(1) if exact else None
        errors: list[BaseException] = []
        timings = self.timings

        def put(q, item):
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    pass
            return False

        def get(q):
            while not stop.is_set():
                try:
                    return q.get(timeout=0.05)
                except queue.Empty:
                    pass
            return _END

        def read():
            try:
                batches = source()
                while True:
                    t0 = time.perf_counter()
                    batch = next(batches, None)
                    if batch is None:
                        break
                    prepared = self.prepare(batch)  # numpy -> tensors off the training thread
                    timings["read"] += time.perf_counter() - t0
                    if not put(prepared_q, prepared):
                        return
            except BaseException as e:  # re-raised in the caller's thread
                errors.append(e)
            finally:
                put(prepared_q, _END)

        def lookup():
            try:
                while True:
                    prepared = get(prepared_q)
                    if prepared is _END:
                        break
                    if updated is not None:
                        while not updated.acquire(timeout=0.05):
                            if stop.is_set():
                                return
                    t0 = time.perf_counter()
                    feed = self.builder.lookup(prepared, self.stores, train)
                    for key in ("rows", "ids", "values"):
                        feed.feed[key] = tf.nest.map_structure(tf.convert_to_tensor,
                                                               feed.feed[key])
                    timings["lookup"] += time.perf_counter() - t0
                    if not put(feed_q, feed):
                        return
            except BaseException as e:
                errors.append(e)
            finally:
                put(feed_q, _END)

        threads = [threading.Thread(target=read, name="trainer-read", daemon=True),
                   threading.Thread(target=lookup, name="trainer-lookup", daemon=True)]
        for t in threads:
            t.start()
        try:
            while True:
                feed = get(feed_q)
                if feed is _END:
                    break
                yield feed
                if updated is not None:
                    updated.release()
        finally:
            stop.set()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]

    # -- state --------------------------------------------------------------------------------

    def store_rows(self) -> int:
        return sum(len(s) for s in self.stores.values())

    def store_stats(self) -> dict:
        """Summed counters of all tables: rows, admitted, rejected, expired, evicted, bytes."""
        out = defaultdict(int)
        for store in self.stores.values():
            for k, v in store.stats().as_dict().items():
                if k in ("rows", "bytes", "admitted", "rejected", "expired", "evicted"):
                    out[k] += v
        return dict(out)

    def _write_scalars(self, writer, loss, window_auc, rate):
        stats = self.store_stats()
        scalars = {"loss": loss, "samples_per_sec": rate,
                   **{f"store/{k}": stats.get(k, 0) for k in ("rows", "admitted", "rejected",
                                                              "expired")}}
        if np.isfinite(window_auc):
            scalars["auc"] = window_auc
        write_scalars(writer, self.step, scalars)

    def save(self, directory: str | os.PathLike) -> str:
        """Write a checkpoint (dense weights, dense optimizer state, every store's snapshot, the
        step, config, schema and model spec) to ``directory``, replacing it atomically."""
        directory = os.path.abspath(os.fspath(directory))
        tmp = f"{directory}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        arrays = {f"model/{i:04d}": v.numpy() for i, v in enumerate(self.network.variables)}
        arrays.update({f"optimizer/{i:04d}": np.asarray(v.numpy())
                       for i, v in enumerate(self.network.optimizer.variables)})
        np.savez(os.path.join(tmp, "dense.npz"), **arrays)
        for table, store in self.stores.items():
            os.makedirs(os.path.join(tmp, "stores", table))
            store.save(os.path.join(tmp, "stores", table))
        try:
            model_spec = self.model.spec()
        except NotImplementedError:
            model_spec = None
        state = {"version": CHECKPOINT_VERSION, "step": self.step, "samples": self.samples,
                 "expired": self.expired, "model": model_spec, "config": self.config.to_dict(),
                 "schema": self.schema.to_dict(), "tables": list(self.tables),
                 "variables": [v.path for v in self.network.variables]}
        with open(os.path.join(tmp, "trainer.json"), "w") as f:
            json.dump(state, f, indent=1)
        return replace_directory(tmp, directory)

    def export(self, directory: str | os.PathLike) -> str:
        """Write a SavedModel of the dense network plus every store's snapshot for
        :class:`trainer.serving.Predictor`."""
        from trainer import serving

        return serving.export(self, directory)

    def export_delta(self, directory: str | os.PathLike) -> dict:
        """Write each store's rows changed since its previous delta (and tombstones of removed
        rows) to ``directory/<table>/delta-NNNNNN.bin``; returns table -> path."""
        paths = {}
        for table, store in self.stores.items():
            os.makedirs(os.path.join(os.fspath(directory), table), exist_ok=True)
            paths[table] = store.export_delta(os.path.join(os.fspath(directory), table))
        return paths

    @classmethod
    def restore(cls, directory: str | os.PathLike,
                model: models_lib.DenseNet | None = None) -> "Trainer":
        """The trainer saved in ``directory``; training continues exactly where it stopped.
        Built-in models are rebuilt from the checkpoint; pass ``model`` for your own."""
        directory = os.fspath(directory)
        path = os.path.join(directory, "trainer.json")
        try:
            with open(path) as f:
                state = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{directory}: no trainer checkpoint (trainer.json missing); "
                                    "write one with Trainer.save") from None
        if state.get("version") not in (1, CHECKPOINT_VERSION):
            raise ValueError(f"{path}: checkpoint version {state.get('version')}, this trainer "
                             f"reads versions 1 and {CHECKPOINT_VERSION}")
        if model is None:
            if state["model"] is None:
                raise ValueError(f"{directory}: the checkpoint's model is not built in; pass "
                                 "model= (a fresh instance of the same DenseNet)")
            model = models_lib.from_spec(state["model"])
        schema = schemas.from_dict(state["schema"])
        if state["version"] == 1:
            state["config"] = _config_v1(state["config"], schema)
        config = TrainConfig.from_dict(state["config"])
        trainer = cls(schema, model, config)
        trainer._load_state(directory, state)
        return trainer

    def load(self, directory: str | os.PathLike) -> None:
        """Load the dense weights, stores and counters of a checkpoint of this same trainer
        (e.g. the best one ``fit`` kept) in place."""
        directory = os.fspath(directory)
        with open(os.path.join(directory, "trainer.json")) as f:
            state = json.load(f)
        self.config = TrainConfig.from_dict(state["config"])
        for name, dense in self.config.dense:
            self.layout.dense_configs[name] = dense
        self._load_state(directory, state)

    def _load_state(self, directory: str, state: dict) -> None:
        with np.load(os.path.join(directory, "dense.npz")) as arrays:
            variables = self.network.variables
            if len(variables) != len(state["variables"]):
                raise ValueError(f"{directory}: the checkpoint has {len(state['variables'])} "
                                 f"dense variables, this model {len(variables)}")
            for i, v in enumerate(variables):
                v.assign(arrays[f"model/{i:04d}"])
            for i, v in enumerate(self.network.optimizer.variables):
                v.assign(arrays[f"optimizer/{i:04d}"])
        for table in self.tables:
            self.stores[table] = native.EmbeddingStore.load(
                os.path.join(directory, "stores", table), self.config.table(table).store_config(0))
        self.step, self.samples = state["step"], state["samples"]
        self.expired = state.get("expired", 0)


def _config_v1(config: dict, schema) -> dict:
    """A version-1 checkpoint's config with that version's defaults written out: ids lists
    pooled by sum, dense values untransformed unless configured and never standardized, row
    gradients of the batch mean."""
    config = dict(config)
    features = {k: dict(v) for k, v in (config.get("features") or {}).items()}
    for f in schema.features:
        if f.kind == "ids":
            features.setdefault(f.name, {}).setdefault("pooling", "sum")
    dense = {f.name: {"transform": "none"} for f in schema.features if f.kind == "dense"}
    for name, raw in (config.get("dense") or {}).items():
        dense[name] = dict(raw)
    for raw in dense.values():
        raw["standardize"] = False
    config.update(features=features, dense=dense, row_gradients="mean")
    return config


_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))


def _scalar(name: str, value) -> None:
    """A TensorBoard scalar through TensorFlow's own summary op: ``tf.summary.scalar`` lives in
    the tensorboard package, which the trainer does not need in order to write event files."""
    tf.summary.write(name, tf.constant(float(value), tf.float32), metadata=_SCALAR_METADATA)


def write_scalars(writer, step: int, scalars: dict) -> None:
    """TensorBoard scalars ``{name: value}`` at ``step`` through ``writer``."""
    with writer.as_default(step=step):
        for name, value in scalars.items():
            _scalar(name, value)


def _table_seed(seed: int, table: str) -> int:
    """Per-table store seeds, so two tables do not start an id at the same vector."""
    return (seed * 0x9E3779B97F4A7C15 ^ (schemas.stable_hash(table) & (2**63 - 1))) % (2**63)


def _dense_optimizer(config: TrainConfig):
    opt = config.dense_optimizer
    if opt.name == "adam":
        return keras.optimizers.Adam(learning_rate=opt.lr)
    if opt.name == "adagrad":
        return keras.optimizers.Adagrad(learning_rate=opt.lr)
    return keras.optimizers.SGD(learning_rate=opt.lr)


_threads_set = []


def _configure_threads(threads: int):
    """Size TensorFlow's pools once per process (it refuses after its first op)."""
    if threads <= 0 or _threads_set:
        return
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
        _threads_set.append(threads)
    except RuntimeError:
        pass  # TensorFlow already started: its pools keep their size


class _NoBar:
    def update(self, n):
        pass

    def set_postfix(self, **kwargs):
        pass

    def close(self):
        pass


def _close_bar(bar, completed: bool) -> None:
    """Close a progress bar; after a pass that completed, first make its total what it counted
    (training that stopped early, before ``samples x epochs``, ends the bar at 100%)."""
    if completed and getattr(bar, "total", None) is not None and bar.n != bar.total:
        bar.total = bar.n
        bar.refresh()
    bar.close()


def _progress_bar(enabled: bool, total, desc: str):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="samples", unit_scale=True, dynamic_ncols=True,
                mininterval=0.5)
