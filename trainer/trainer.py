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
import shutil
import threading
import time
from collections import defaultdict
from itertools import islice

import numpy as np
import tensorflow as tf

import native
import schemas
from compression import TreeBatch
from compression.outputs import replace_directory
from schemas import Schema
from trainer import models as models_lib
from trainer import fitting, tiers
from trainer.checkpoints import (CHECKPOINT_VERSION, CheckpointDamagedError, checkpoint_config,
                                 checkpoint_state, config_before_l2, file_sha256,
                                 read_trainer_state, sealed)
from trainer.config import TrainConfig, resolve_function, resolve_tier_dir, row_l2
from trainer.data import batch_source, count_samples
from trainer.feed import Feed, Prepared
from trainer.fitting import FitState
from trainer.metrics import evaluation
from trainer.model_core import ModelCore
from trainer.network import sum_row_slices

_END = object()


class Trainer(ModelCore):
    """Trains ``model`` on data of ``schema`` as ``config`` says (see :class:`TrainConfig`): a
    :class:`~trainer.model_core.ModelCore` plus one native embedding store per table, the
    three-stage input pipeline and checkpoints; ``fit`` is :func:`trainer.fitting.fit` over it.

    Tables with a memory budget (``TableConfig.memory_budget_bytes``,
    ``TrainConfig.memory_budget_bytes``) keep the rows beyond it on local disk under
    ``tier_dir/<table>``: ``tier_dir`` given here, else the config's, else a temporary
    directory removed at exit."""

    def __init__(self, schema: Schema, model: models_lib.DenseNet | None = None,
                 config: TrainConfig | None = None, *, tier_dir: str | None = None):
        super().__init__(schema, model, config)
        config = self.config
        self.tier_dir = resolve_tier_dir(config, tier_dir)
        self.stores = {t: tiers.new_store(c) for t, c in self._store_configs(config).items()}
        self.step = 0          # training steps so far (the step apply_gradients receives)
        self.samples = 0       # training samples so far
        self.expired = 0       # rows removed by the configured expiry
        self.ids_fed = 0       # ids looked up in training (per node in structured compute)
        self.leaf_ids = 0      # ids the same samples hold expanded to the leaves
        self.timings = defaultdict(float)  # seconds per stage: read, lookup, step, update
        self.fit_state: FitState | None = None  # where the latest fit is (see fit)
        # the rows' L2 per sample trained, as a share of the pass: 1 / samples of a pass while
        # a fit knows that number, else 0 (see TableConfig.l2)
        self.row_l2_scale = 0.0

    # -- training ---------------------------------------------------------------------------

    def fit(self, data, epochs: int = 1, *, progress: bool = False, log_dir: str | None = None,
            callback=None, eval_data=None, eval_every: int | None = None,
            patience: int | None = None, best_dir: str | None = None,
            shuffle: bool = True, resume: FitState | None = None,
            checkpoint_dir: str | None = None, checkpoint_every: int | None = None,
            should_stop=None) -> dict:
        """Train up to ``epochs`` passes over ``data`` (tree/raw file paths or glob, a pyarrow
        Table, or TreeBatches). ``log_dir`` gets TensorBoard scalars; ``progress`` shows a bar on
        stderr; ``callback(trainer, loss, probabilities, labels)`` runs after every step.

        ``shuffle`` deals the trees of each pass in a new order (seeded by the config's seed and
        the pass). With ``eval_data`` the model is evaluated after every pass, and every
        ``eval_every`` steps if given; ``best_dir`` then always holds the checkpoint of the
        best evaluation AUC so far, and with ``patience`` training stops after that many
        evaluations without a better AUC and the trainer goes back to the best checkpoint
        (CTR models tend to overfit after one epoch, so a run need not guess ``epochs``).
        ``checkpoint_dir``: a checkpoint before the first step, after every pass and every
        ``checkpoint_every`` steps.

        ``self.fit_state`` (a :class:`FitState`) says after every step where the fit is; an
        interrupted fit (``callback`` raised, or ``should_stop()`` returned True: then fit
        returns with ``interrupted`` True, the pending evaluation not run) continues exactly
        with the same arguments and ``resume=`` that state, on this trainer restored from a
        checkpoint of that step (``best_dir`` as it was then).

        Returns samples, steps, samples_per_sec, loss (last step), a streaming train AUC,
        interrupted and, with ``eval_data``, ``evaluations`` (one dict per evaluation),
        ``best`` and ``stopped_early``."""
        return fitting.fit(self, data, epochs, progress=progress, log_dir=log_dir,
                           callback=callback, eval_data=eval_data, eval_every=eval_every,
                           patience=patience, best_dir=best_dir, shuffle=shuffle,
                           checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                           should_stop=should_stop, resume=resume)

    def fit_passes(self, data, shuffle: bool, carried: dict) -> "InProcessPasses":
        """The passes of one fit over ``data`` (the engine side of :class:`fitting.FitLoop`)."""
        return InProcessPasses(self, data, shuffle)

    def train_feeds(self, source, dense: bool = True):
        """A training step on every batch of ``source()`` (a batch source, read, prepared and
        looked up ahead by the input pipeline): yields ``(feed, loss, probabilities)`` after
        each. ``dense`` False trains the rows only."""
        step = self.network.train_step if dense else self.network.train_rows_step
        # the step is traced (~2 s for the paper's MLP, more for DIN and DIEN) while the input
        # threads read and build the first batch, not after it
        for feed in self._pipeline(source, train=True, meanwhile=step.trace):
            loss, probabilities = self._train_on(feed, dense=dense)
            yield feed, loss, probabilities

    def _train_on(self, feed: Feed, dense: bool = True):
        """One step on ``feed``: the dense network (unless ``dense`` is False) and the rows."""
        t0 = time.perf_counter()
        step = self.network.train_step if dense else self.network.train_rows_step
        loss, row_slices, probabilities = step(feed.feed)
        row_grads = sum_row_slices(row_slices, feed.feed["rows"])
        if self.config.row_gradients == "sum":  # per-sample sums, not the batch mean's share
            for grads in row_grads.values():
                grads *= feed.num_leaves
        probabilities = {k: v.numpy() for k, v in probabilities.items()}
        t1 = time.perf_counter()
        self.step += 1
        for table, (dim, start, stop) in feed.row_ranges.items():
            self.stores[table].apply_gradients(
                feed.unique_ids[table], row_grads[str(dim)][start:stop], self.step,
                l2=row_l2(self.config.table(table).l2, feed.num_leaves, self.row_l2_scale))
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
        loss, dense, row_slices, _ = self.network.gradients(feed.feed)
        rows = sum_row_slices(row_slices, feed.feed["rows"])
        return {"loss": float(loss), "dense": [g.numpy() for g in dense],
                "embeddings": {t: (feed.unique_ids[t], rows[str(d)][a:b])
                               for t, (d, a, b) in feed.row_ranges.items()}}

    def calibrate_output(self, batch: TreeBatch | Prepared) -> dict:
        """Shift each head's output bias so that the model's mean probability on ``batch``
        equals the rate of that head's label there (a fresh model starts near 0.5 and scores
        worse than the constant rate until it has learned the bias; online learning calls this
        on a new run's first batch). Rows are looked up without admitting anything. Returns
        ``{label: (rate, shift)}``; a model without ``output_biases`` is left as it is."""
        prepared = batch if isinstance(batch, Prepared) else self.prepare_numpy(batch)
        feed = self.builder.lookup(prepared, self.stores, train=False)
        outputs = {k: v.numpy() for k, v in self.network.outputs(feed.feed).items()}
        return self.shift_output_biases(outputs, feed.labels)

    # -- evaluation -------------------------------------------------------------------------

    def evaluate(self, data, *, progress: bool = False, log_dir: str | None = None) -> dict:
        """Exact AUC and log loss of every predicted label over ``data`` (no update, no
        admission): ``{"samples", "loss", "auc", "logloss", "auc/<label>", ...}``; ``auc`` and
        ``logloss`` are of the model's first head."""
        started = time.perf_counter()
        probabilities, labels, loss_sum, n = self._predict_all(data, progress)
        out = evaluation(probabilities, labels, loss_sum, n, time.perf_counter() - started)
        fitting.write_eval_scalars(log_dir, self.step, out)
        return out

    def predict(self, data, *, progress: bool = False) -> np.ndarray:
        """Probabilities per sample, in the leaf order of the batches (tree order): float32[n]
        for a one-head model, float32[n, heads] otherwise."""
        probabilities = self._predict_all(data, progress)[0]
        columns = list(probabilities.values())
        return columns[0] if len(columns) == 1 else np.stack(columns, axis=1)

    def _predict_all(self, data, progress):
        source = batch_source(data, self.schema, self.config.batch_size, self.config.split_trees)
        bar = fitting.progress_bar(progress, count_samples(data, self.schema), "eval")
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
        return join(probabilities), join(labels), loss_sum, n

    # -- the three-stage input pipeline -----------------------------------------------------

    def _pipeline(self, source, train: bool, meanwhile=None):
        """Feeds in order; stage 1 (thread) reads, batches and prepares, stage 2 (thread) looks
        up, the caller trains. In exact mode stage 2 looks batch k+1 up only after the caller
        asks for it, i.e. after batch k's update. ``meanwhile()`` runs on the caller's thread
        once the stages have started, before the first feed is taken."""
        depth = self.config.pipeline_depth
        exact = train and not self.config.stale_lookups
        stop = threading.Event()
        prepared_q: queue.Queue = queue.Queue(depth)
        feed_q: queue.Queue = queue.Queue(1 if exact else depth)
        updated = threading.Semaphore(1) if exact else None
        errors: list[BaseException] = []
        timings = self.timings
        # Two tiers: batch k + 1's rows on disk are read back while batch k trains.
        tiered = any(s.config.memory_budget_bytes is not None for s in self.stores.values())

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
                    if tiered:
                        t0 = time.perf_counter()
                        self.builder.prefetch(prepared, self.stores)
                        timings["prefetch"] += time.perf_counter() - t0
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
            if meanwhile is not None:
                t0 = time.perf_counter()
                meanwhile()
                timings["trace"] += time.perf_counter() - t0
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

    def _store_configs(self, config: TrainConfig) -> dict:
        return config.store_configs(self.tables, self.tier_dir)

    def store_stats(self) -> dict:
        """Summed counters of all tables: rows, admitted, rejected, expired, evicted, bytes;
        with a memory budget also ``tiers``: per table, where its rows are
        (:func:`trainer.tiers.tier_stats`)."""
        out = defaultdict(int)
        for store in self.stores.values():
            for k, v in store.stats().as_dict().items():
                if k in ("rows", "bytes", "admitted", "rejected", "expired", "evicted"):
                    out[k] += v
        out = dict(out)
        if self.tier_dir is not None:
            out["tiers"] = self.tier_stats()
        return out

    def tier_stats(self) -> dict:
        """Per table: rows and bytes in memory and on disk, faults, hit rate...
        (:func:`trainer.tiers.tier_stats`)."""
        return {t: tiers.tier_stats(s) for t, s in self.stores.items()}

    def save(self, directory: str | os.PathLike) -> str:
        """Write a checkpoint (dense weights, dense optimizer state, every store's snapshot, the
        step, config, schema and model spec) to ``directory``, replacing it atomically."""
        directory = os.path.abspath(os.fspath(directory))
        tmp = f"{directory}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        np.savez(os.path.join(tmp, "dense.npz"), **self.dense_arrays())
        for table, store in self.stores.items():
            os.makedirs(os.path.join(tmp, "stores", table))
            store.save(os.path.join(tmp, "stores", table))
        state = {"version": CHECKPOINT_VERSION, "step": self.step, "samples": self.samples,
                 "expired": self.expired, "model": self.spec(),
                 "config": self.config.to_dict(),
                 "schema": self.schema.to_dict(), "tables": list(self.tables),
                 "variables": self.variable_paths(),
                 # the store snapshots check themselves
                 "checksums": {"dense.npz": file_sha256(os.path.join(tmp, "dense.npz"))}}
        with open(os.path.join(tmp, "trainer.json"), "w") as f:
            json.dump(sealed(state), f, indent=1)
        return replace_directory(tmp, directory)

    def export(self, directory: str | os.PathLike) -> str:
        """Write a SavedModel of the dense network plus every store's snapshot for
        :class:`trainer.serving.Predictor`."""
        from trainer import serving

        return serving.export(self, directory, step=self.step, stores=self.stores)

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
                model: models_lib.DenseNet | None = None, *,
                memory_budget: int | None = None,
                tier_dir: str | None = None) -> "Trainer":
        """The trainer saved in ``directory``; training continues exactly where it stopped.
        Built-in models are rebuilt from the checkpoint; pass ``model`` for your own.
        ``memory_budget``: the whole model's, instead of the checkpoint config's budgets
        (:meth:`TrainConfig.with_memory_budget`); ``tier_dir``: where the rows beyond go."""
        directory = os.fspath(directory)
        state = checkpoint_state(directory)
        if model is None:
            if state["model"] is None:
                raise ValueError(f"{directory}: the checkpoint's model is not built in; pass "
                                 "model= (a fresh instance of the same DenseNet)")
            model = models_lib.from_spec(state["model"])
        schema = schemas.from_dict(state["schema"])
        config = checkpoint_config(directory, state).with_memory_budget(memory_budget)
        trainer = cls(schema, model, config, tier_dir=tier_dir)
        trainer._load_state(directory, state)
        return trainer

    @classmethod
    def restore_run(cls, run_dir: str | os.PathLike,
                    model: models_lib.DenseNet | None = None, *,
                    memory_budget: int | None = None,
                    tier_dir: str | None = None) -> "Trainer":
        """The model a ``trainer.train`` run kept (``RUN_DIR/checkpoint``), in process or on
        Ray, as one in-process Trainer: a Ray run's store shards are merged into one store
        per table (every row with its optimizer state, update count and last step, and the
        entry filters' state, as resharding moves them), its dense weights and optimizer
        state, step and counters taken as they are. What ``trainer.online --init-from``
        starts from. ``memory_budget`` and ``tier_dir`` as :meth:`restore` takes them."""
        run_dir = os.fspath(run_dir)
        checkpoint = os.path.join(run_dir, "checkpoint")
        if os.path.isfile(os.path.join(checkpoint, "trainer.json")):
            return cls.restore(checkpoint, model, memory_budget=memory_budget,
                               tier_dir=tier_dir)
        if not os.path.isfile(os.path.join(checkpoint, "manifest.json")):
            raise FileNotFoundError(
                f"{run_dir}: not a trainer.train run directory (no checkpoint/trainer.json or "
                "checkpoint/manifest.json); an interrupted run keeps its model there too")
        from trainer.distributed.manifest import read_manifest, shard_snapshot_spec
        from trainer.distributed.shard import Shard, table_specs

        manifest = read_manifest(checkpoint)
        if model is None:
            if manifest["model"] is None:
                raise ValueError(f"{checkpoint}: the run's model is not built in; pass model= "
                                 "(a fresh instance of the same DenseNet)")
            model = models_lib.from_spec(manifest["model"])
        schema = schemas.from_dict(manifest["schema"])
        config = TrainConfig.from_dict(config_before_l2(manifest["config"]))
        trainer = cls(schema, model, config.with_memory_budget(memory_budget),
                      tier_dir=tier_dir)
        arrays = _read_dense(checkpoint)
        trainer.check_dense_arrays(arrays, os.path.join(checkpoint, "dense.npz"),
                                   CheckpointDamagedError)
        merged = Shard(0, 1, table_specs(trainer.config, trainer.tables, 1, trainer.tier_dir),
                       restore=shard_snapshot_spec(checkpoint, manifest, 0, 1))
        trainer.set_dense_arrays(arrays)
        trainer.stores.update(merged.stores)
        trainer.step, trainer.samples = manifest["step"], manifest["samples"]
        trainer.expired = manifest["expired"]
        return trainer

    def load(self, directory: str | os.PathLike) -> None:
        """Load the dense weights, stores and counters of a checkpoint of this same trainer
        (e.g. the best one ``fit`` kept) in place."""
        directory = os.fspath(directory)
        state = read_trainer_state(directory)
        config = checkpoint_config(directory, state)
        self._load_state(directory, state, config)

    def _load_state(self, directory: str, state: dict, config: TrainConfig | None = None) -> None:
        """Everything is read and checked before anything changes: a damaged checkpoint
        leaves this trainer as it was."""
        config = config or self.config
        stores = {}
        if self.tier_dir is None:  # a checkpoint of a budgeted config into a trainer without
            self.tier_dir = resolve_tier_dir(config, None)
        configs = self._store_configs(config)
        for table in self.tables:
            path = os.path.join(directory, "stores", table)
            try:
                stores[table] = tiers.load_store(path, configs[table])
            except native.CorruptFileError as e:
                raise CheckpointDamagedError(f"{e}; the checkpoint {directory} is damaged") from None
        arrays = _read_dense(directory)
        if len(self.network.variables) != len(state["variables"]):
            raise ValueError(f"{directory}: the checkpoint has {len(state['variables'])} "
                             f"dense variables, this model {len(self.network.variables)}")
        self.check_dense_arrays(arrays, os.path.join(directory, "dense.npz"),
                                CheckpointDamagedError)
        if config is not self.config:
            self.set_config(config)
        self.set_dense_arrays(arrays)
        self.stores.update(stores)
        self.step, self.samples = state["step"], state["samples"]
        self.expired = state.get("expired", 0)


def _read_dense(directory: str) -> dict:
    """Every array of ``directory/dense.npz``, read whole (so a damaged file fails here)."""
    dense_path = os.path.join(directory, "dense.npz")
    try:
        with np.load(dense_path) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except FileNotFoundError:
        raise CheckpointDamagedError(f"{dense_path}: missing from the checkpoint") from None
    except Exception as e:  # zipfile, zlib and numpy's format errors alike
        raise CheckpointDamagedError(f"{dense_path}: damaged checkpoint file "
                                     f"({type(e).__name__}: {e})") from None
    return arrays


def _close(batches) -> None:
    """Close a pass that will not be read (a generator's ``finally`` blocks run now)."""
    close = getattr(batches, "close", None)
    if close is not None:
        close()


class InProcessPasses:
    """The passes of one in-process fit (a :class:`fitting.FitPasses`): pass k's tree order
    comes from (seed, k), so a resumed fit deals the orders of the passes before its own."""

    def __init__(self, trainer: Trainer, data, shuffle: bool):
        self.trainer = trainer
        config = trainer.config
        self.source = batch_source(data, trainer.schema, config.batch_size, config.split_trees,
                                   shuffle_seed=config.seed if shuffle else None)
        self.samples = count_samples(data, trainer.schema)
        self.dealt = 0  # passes whose order was dealt

    def first_epoch(self, state: FitState) -> int:
        return state.epoch

    def begin(self, epoch: int, continued: bool) -> None:
        pass

    def train(self, epoch: int, skip: int, dense: bool, pause):
        """Pass ``epoch`` less its first ``skip`` batches, one :class:`fitting.Step` a batch."""
        while self.dealt < epoch - 1:  # passes a resumed fit did: their orders, not their data
            _close(self.source())
            self.dealt += 1
        self.dealt += 1
        source = self.source
        if skip:
            source = lambda: islice(self.source(), skip, None)  # noqa: E731
        for feed, loss, probabilities in self.trainer.train_feeds(source, dense=dense):
            yield fitting.Step(loss, feed.num_leaves, 1, [(probabilities, feed.labels)],
                               (loss, probabilities, feed.labels))

    def evaluate(self, data, log_dir: str | None) -> dict:
        return self.trainer.evaluate(data, log_dir=log_dir)

    def guard(self, body, progress):
        return body()

    def checkpoint(self, directory, snapshot: dict) -> None:
        self.trainer.save(directory)

    def result(self, steps: int, state: FitState) -> dict:
        return {}
