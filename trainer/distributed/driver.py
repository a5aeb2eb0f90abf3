"""The driver of distributed training: :class:`DistributedTrainer`, over the modules of its
roles: the actors (:mod:`~trainer.distributed.actors`), the step and its scheduler
(:mod:`~trainer.distributed.steps`), recovery from a dead actor
(:mod:`~trainer.distributed.recovery`), the checkpoint format
(:mod:`~trainer.distributed.manifest`) and serving exports
(:mod:`~trainer.distributed.exports`). ``trainer.train --workers/--shards`` runs it through
:mod:`~trainer.distributed.train_run`."""

from __future__ import annotations

import os
import shutil
import sys
import time
import warnings
from collections import defaultdict

import numpy as np
import pyarrow as pa
import ray

import compression
import schemas
from compression.outputs import replace_directory
from schemas import Schema
from trainer import models as models_lib
from trainer import fitting
from trainer.checkpoints import config_before_l2, dense_name
from trainer import tiers
from trainer.config import TrainConfig, resolve_function, resolve_tier_dir
from trainer.data import count_samples
from trainer.distributed import exports, steps
from trainer.distributed.actors import Actors, check_count, join_ray
from trainer.distributed.manifest import (config_difference, dense_difference,
                                          distributed_manifest, expired_per_shard,
                                          read_manifest,
                                          schema_difference, shard_dir, shard_snapshot_spec,
                                          write_manifest)
from trainer.distributed.placement import id_shards
from trainer.distributed.recovery import (RollbackPoint, await_actors, failure_summary,
                                          retrying)
from trainer.distributed.worker import (Worker, per_worker_lists, resolve_dense,
                                        unresolved_dense)
from trainer.fitting import FitState
from trainer.metrics import evaluation

# Shards are processes; past a few thousand the per-step calls (one per shard and worker)
# cost more than the rows they hold, whatever the number of distinct ids.
MAX_SHARDS = 4096


class DistributedTrainer:
    """Synchronous data-parallel training on Ray with the embedding tables sharded over
    ``shards`` store actors and the TensorFlow steps on ``workers`` worker actors; equal to
    :class:`trainer.Trainer` on the union of the workers' batches (see the module docstring).

    ``model``: a built-in DenseNet (rebuilt in each worker from its ``spec()``) or a function
    returning a fresh DenseNet (pickled to the workers). Without ``ray_address`` a local Ray
    cluster is started and stopped by :meth:`close`; with one (``HOST:PORT`` of a running
    cluster's head, or ``auto``) the trainer connects to it, failing within
    ``connect_timeout`` seconds when nothing answers. If Ray is already initialised in this
    process, that cluster is used and left running. ``actor_cpus``: CPUs each actor reserves.
    ``max_restarts``: how many times Ray restarts each actor whose process died; ``fit`` with
    a ``checkpoint_dir`` then rolls every actor back to its last checkpoint and goes on."""

    # the worker actors' class (online learning's reads Kafka; see trainer.distributed.online)
    worker_class = Worker

    def __init__(self, schema: Schema, model=None, config: TrainConfig | None = None, *,
                 workers: int = 2, shards: int = 2, ray_address: str | None = None,
                 num_cpus: int | None = None, actor_cpus: float = 1.0,
                 connect_timeout: float = 10.0, runtime_env: dict | None = None,
                 max_restarts: int = 3, tier_dir: str | None = None):
        if not isinstance(schema, Schema):
            raise TypeError(f"schema: expected a schemas.Schema, got {type(schema).__name__}")
        self.workers = check_count("workers", workers)
        self.shards = check_count("shards", shards)
        self.schema = schema
        self.config = config = config or TrainConfig()
        self.tables = config.check(schema)
        config.table_budgets(self.tables, self.shards)  # each shard's share holds a row
        # budgeted tables: each shard's disk tier in tier_dir/<table>/shard-NNNN (a local
        # directory on every node that runs a shard)
        self.tier_dir = resolve_tier_dir(config, tier_dir)
        for table in self.tables:
            tc = config.table(table)
            if tc.expire is not None and tc.expire.function is not None:
                resolve_function(tc.expire.function, f"tables.{table}.expire.function")
            if tc.max_rows is not None and self.shards > tc.max_rows:
                # ids live on mix64(id) % shards: with more shards than rows allowed, the
                # per-shard cap ceil(max_rows / shards) would let the table grow to `shards`
                raise ValueError(
                    f"shards: {self.shards} shards for table {table!r}, which holds at most "
                    f"{tc.max_rows} rows (max_rows); use at most {tc.max_rows} shards")
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
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or \
                max_restarts < 0:
            raise ValueError(f"max_restarts: expected a whole number >= 0, got {max_restarts!r}")
        self.max_restarts = max_restarts
        self.model_spec = self._model if isinstance(self._model, dict) else None
        self.step = 0
        self.samples = 0
        self.expired = 0
        self.passes = 0        # training passes started
        self._dense_trains = True  # whether this pass's steps update the dense weights
        self.row_l2_scale = 0.0  # as Trainer.row_l2_scale: 1 / samples of a pass, or 0
        # batches each worker took from pass `passes` (the input position a checkpoint
        # records); None once that pass is finished
        self._positions: list[int] | None = None
        self.bytes = defaultdict(int)  # bytes moved, summed over steps
        self.losses: list[float] = []  # the union batch's loss of every step
        self.ids_fed = 0       # ids looked up (per node in structured compute), all workers
        self.leaf_ids = 0      # ids the same samples hold expanded to the leaves
        self.recoveries: list[dict] = []  # one per rollback after an actor died
        self.fit_state: FitState | None = None  # where the latest fit is (fitting.fit)
        self._rollback: RollbackPoint | None = None  # the last checkpoint fit wrote
        self._owns_ray = False
        self._closed = False
        self.actors = Actors()
        self._owns_ray = join_ray(self.workers, self.shards, ray_address, num_cpus=num_cpus,
                                  actor_cpus=actor_cpus, connect_timeout=connect_timeout,
                                  runtime_env=runtime_env)
        try:
            self.actors.start(self.worker_class, schema, self._model, config, self.tables,
                              workers=self.workers, shards=self.shards, actor_cpus=actor_cpus,
                              max_restarts=max_restarts, ray_address=ray_address,
                              tier_dir=self.tier_dir)
        except BaseException:
            self.close()
            raise

    @property
    def _shards(self) -> list:
        return self.actors.shards

    @property
    def _workers(self) -> list:
        return self.actors.workers

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Kill the actors; stop the Ray cluster if this trainer started it."""
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "actors"):
            self.actors.kill()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def actor_pids(self) -> dict:
        """The process id of every actor: ``{"shards": [...], "workers": [...]}``."""
        return self.actors.pids()

    # -- steps ----------------------------------------------------------------------------

    def _start_pass(self, data, pass_index: int, shuffle: bool, stream: str,
                    skip: list[int] | None = None) -> None:
        if per_worker_lists(data, self.workers):
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
        skip = skip or [0] * self.workers
        ray.get([w.start.remote(stream, p, pass_index, shuffle, k)
                 for w, p, k in zip(self._workers, parts, skip)])
        names = unresolved_dense(self.schema, self.config)
        if names:
            samples = ray.get([w.dense_sample.remote(stream, names) for w in self._workers])
            self.config = resolve_dense(self.schema, self.config, samples)
            ray.get([w.set_config.remote(self.config.to_dict()) for w in self._workers])
        ray.get([w.release.remote(stream) for w in self._workers])

    def _lookup(self, request_refs, train: bool) -> list:
        """Every shard's rows for every worker (:func:`steps.lookup`)."""
        return steps.lookup(self._shards, request_refs, train)

    def _next(self, stream: str, dense_refs=None):
        return steps.next_batches(self._workers, self.shards, stream, dense_refs)

    def fit(self, data, epochs: int = 1, *, progress: bool = False,
            log_dir: str | None = None, shuffle: bool = True, callback=None,
            eval_data=None, eval_every: int | None = None, patience: int | None = None,
            best_dir: str | None = None, checkpoint_dir: str | None = None,
            checkpoint_every: int | None = None, should_stop=None,
            resume: dict | None = None) -> dict:
        """Train ``epochs`` synchronous passes over ``data``: tree or raw files (a path, glob
        or list), a pyarrow Table (each worker keeps its own trees, :func:`worker_batches`),
        or one list of TreeBatches per worker. A trainer restored from a checkpoint taken
        in the middle of a pass first finishes that pass (it counts as one of ``epochs``).

        ``eval_data``, ``eval_every``, ``patience`` and ``best_dir`` work as in
        :meth:`trainer.Trainer.fit` (evaluation after every pass and every ``eval_every``
        steps, the best checkpoint kept in ``best_dir``, early stopping, and back to the best
        model at the end).

        ``checkpoint_dir``: fault tolerance. A checkpoint (:meth:`save`) is written there
        before the first step, after every pass and every ``checkpoint_every`` steps; when an
        actor's process dies, Ray restarts it (``max_restarts``), every shard and worker is
        rolled back to the last of these checkpoints and the steps since are replayed from its
        input positions, so the run ends as an uninterrupted one would.

        Returns what ``Trainer.fit`` returns (samples, steps, seconds, samples_per_sec, loss,
        train_auc, store_rows, with ``eval_data`` evaluations, best, stopped_early) plus
        ``bytes_per_step`` (per worker and per shard), ``recoveries``, ``interrupted`` and
        ``fit_state`` (where the fit is, JSON-ready: what ``resume`` takes).
        ``callback(trainer, loss)`` runs after every step with the union batch's loss.

        ``should_stop()``: asked before every step is submitted; once it returns True the
        pipeline drains (as before a checkpoint: every shard and worker at the same step, no
        batch looked up ahead) and fit returns with ``interrupted`` True, at most two steps
        later, without the pending evaluation and with the trainer at the last step (not
        back at the best model): :meth:`save` then writes a consistent checkpoint, and
        :meth:`restore` of it and ``fit`` go on from there (the interrupted pass first).

        ``resume``: the ``fit_state`` an interrupted fit returned (JSON-ready), on this trainer
        restored from the checkpoint :meth:`save` wrote right after that fit returned, with
        the same data and arguments: the fit goes on where the interrupted one stopped (its
        pass, the evaluation it did not wait for, its evaluations and early-stopping state,
        and its counters, so the result is the whole fit's) and ends as the uninterrupted
        fit would (``python -m trainer.train --resume`` of a Ray run). Without it, the
        evaluations and early-stopping state start over."""
        carried = {"bytes": {}, "recoveries": []}
        state = None
        if resume is not None:
            raw = dict(resume)
            carried = {"bytes": dict(raw.pop("bytes", {})),
                       "recoveries": list(raw.pop("recoveries", []))}
            state = FitState.from_dict(raw)
        return fitting.fit(self, data, epochs, progress=progress, log_dir=log_dir,
                           callback=callback, eval_data=eval_data, eval_every=eval_every,
                           patience=patience, best_dir=best_dir, shuffle=shuffle,
                           checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                           should_stop=should_stop, resume=state, carried=carried)

    def fit_passes(self, data, shuffle: bool, carried: dict) -> "RayPasses":
        """The passes of one fit over ``data`` (the engine side of :class:`fitting.FitLoop`)."""
        return RayPasses(self, data, shuffle, carried)

    # -- passes (what RayPasses runs a fit with) ----------------------------------------------

    def begin_pass(self, new: bool) -> int:
        """The pass the workers train next, by number: with ``new``, a new one, unless a pass
        is in progress (a resumed fit's, or that of a checkpoint taken in it)."""
        if new and self._positions is None:
            self.passes += 1
            self._positions = [0] * self.workers
        return self.passes

    def train_pass(self, data, pass_index: int, shuffle: bool, dense: bool, pause):
        """The rest of pass ``pass_index`` over ``data`` from the workers' positions, one
        :class:`fitting.Step` a step (``pause``: as :meth:`_train_steps`); nothing when the
        pass is trained already (a resumed fit stopped before evaluating). ``dense``: whether
        its steps train the dense network (as in process: in a fit's first
        ``dense_optimizer.epochs`` passes; later ones train the rows only)."""
        self._dense_trains = dense
        if self._positions is None:
            return
        self._start_pass(data, pass_index, shuffle, "train", self._positions)
        yield from self._train_steps(self.config.row_gradients == "mean", pause)
        self._positions = None

    @property
    def pass_batches(self) -> int:
        """The batches the workers took from the pass in progress (0 when none is)."""
        return sum(self._positions or [])

    def save_rollback_point(self, directory, progress: dict) -> str:
        """:meth:`save` to ``directory``, the checkpoint an actor's death rolls back to
        (:meth:`attempt`) with the driver's counters and the fit's ``progress`` now."""
        path = self.save(directory)
        self._rollback = RollbackPoint.of(self, path, progress)
        return path

    def clear_rollback_point(self) -> None:
        """A new fit: no checkpoint of it to roll back to yet."""
        self._rollback = None

    def _train_steps(self, mean: bool, pause):
        """The steps of the pass the workers are reading, to its end, one
        :class:`fitting.Step` each (:class:`~trainer.distributed.steps.StepScheduler`);
        ``pause(step)``: whether the fit will evaluate, checkpoint or stop after step
        ``step`` (then the pipeline is drained and the Step is ``pausable``). A step past the
        end of the data changes nothing."""
        scheduler = steps.StepScheduler(self, self._workers, self._shards, mean=mean,
                                        dense=self._dense_trains, pass_end=True)
        nxt = self._next("train")
        for scheduled in scheduler.run(self._lookup([refs[1:] for refs in nxt], True), pause):
            for w, r in enumerate(scheduled.results):
                if r["n"]:
                    self._positions[w] += 1
            yield scheduled.step

    def attempt(self, body, progress=None, pass_index: int | None = None):
        """``body()``; when an actor dies in it, roll back to the last checkpoint fit wrote
        and call ``body`` again (the pass it trains resumes at the checkpoint's input
        positions)."""
        return retrying(body, lambda error: self._recover(error, progress, pass_index))

    def _recover(self, error, progress, pass_index: int | None) -> None:
        summary = failure_summary(error)
        if self._rollback is None:
            raise RuntimeError(
                f"an actor of the distributed run died ({summary}) and there is no checkpoint "
                "of this fit to roll back to; pass checkpoint_dir= (and checkpoint_every=) to "
                "fit") from error
        failed_step = self.step
        rollback = self._rollback
        self.roll_back(rollback.directory, error)
        rollback.rewind(self)
        if progress is not None:
            progress.restore(rollback.progress)
        if pass_index is not None and self.passes != pass_index:
            if self._positions is None and self.passes == pass_index - 1:
                self.passes, self._positions = pass_index, [0] * self.workers
            else:
                raise RuntimeError(f"the last checkpoint ({rollback.directory}) is of pass "
                                   f"{self.passes}, not of pass {pass_index} or the one "
                                   "before") from error
        self.recoveries.append({"error": summary, "failed_at_step": failed_step,
                                "rolled_back_to_step": self.step})
        print(f"warning: an actor died at step {failed_step} ({summary}); Ray restarted it and "
              f"the run rolled back to the checkpoint of step {self.step} "
              f"({rollback.directory})", file=sys.stderr, flush=True)

    def roll_back(self, directory, error: BaseException) -> None:
        """After an actor's death (``error``): wait until Ray restarted it and every actor
        answers, then load the checkpoint ``directory`` into all of them, so every shard and
        worker is back at its step. Raises ``RuntimeError`` when an actor does not come back
        (Ray restarted it ``max_restarts`` times already, or it did not start in time)."""
        await_actors(self.actors.named(), error, os.fspath(directory), self.max_restarts)
        self.load(directory)

    def evaluate(self, data, *, progress: bool = False) -> dict:
        """AUC and log loss over ``data`` (no update, no admission), as ``Trainer.evaluate``:
        each worker scores its own trees, the driver joins the predictions."""
        S = self.shards
        started = time.perf_counter()
        bar = fitting.progress_bar(progress, None, "eval")
        probabilities, labels = defaultdict(list), defaultdict(list)
        loss_sum, n_total = 0.0, 0
        try:
            self._start_pass(data, 0, False, "eval")
            while True:
                nxt = self._next("eval")
                metas = ray.get([refs[0] for refs in nxt])
                if not any(m["n"] for m in metas):
                    break
                rows = self._lookup([refs[1:] for refs in nxt], False)
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
            ray.get([w.close_pass.remote("eval") for w in self._workers])
        join = lambda d: {k: np.concatenate(v) for k, v in d.items()}  # noqa: E731
        out = evaluation(join(probabilities), join(labels), loss_sum, n_total,
                         time.perf_counter() - started)
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
        out = dict(out)
        if self.tier_dir is not None:
            out["tiers"] = self.tier_stats()
        return out

    def tier_stats(self) -> dict:
        """Per table, summed over the shards: where its rows are
        (:func:`trainer.tiers.tier_stats`)."""
        per_shard = ray.get([s.tier_stats.remote() for s in self._shards])
        return {t: tiers.sum_tier_stats([shard[t] for shard in per_shard])
                for t in self.tables}

    def store_rows(self) -> int:
        return self.store_stats().get("rows", 0)

    @property
    def dense_messages(self) -> bool:
        """Whether a step's dense update travels between workers and needs its
        ``apply_dense`` call: with several workers in a pass that trains the dense weights
        (a lone worker applies its update in its ``train_step``)."""
        return steps.dense_messages(self._dense_trains, self.workers)

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
        owner = id_shards(unique, self.shards)
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
        return [state["arrays"][dense_name("model", i)] for i in range(len(state["variables"]))]

    def timings(self) -> dict:
        """Seconds spent so far in each part of the steps, per worker and per shard."""
        return {"workers": ray.get([w.get_timings.remote() for w in self._workers]),
                "shards": ray.get([s.get_timings.remote() for s in self._shards])}

    def save(self, directory, extra: dict | None = None) -> str:
        """A checkpoint across processes, taken between steps (the barrier: fit calls it
        when the pipeline is drained): every shard writes its snapshot to
        ``shard-NNNN/<table>``, worker 0 gives its dense weights and optimizer state
        (``dense.npz``), and the driver writes ``manifest.json`` last (step, shard files,
        every worker's input position, and ``extra``'s entries: online learning's Kafka
        offsets); the directory is replaced atomically."""
        directory = os.path.abspath(os.fspath(directory))
        tmp = f"{directory}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            saved = ray.get([s.save.remote(os.path.join(tmp, shard_dir(i)))
                             for i, s in enumerate(self._shards)])
            state = ray.get(self._workers[0].dense_state.remote())
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        np.savez(os.path.join(tmp, "dense.npz"), **state["arrays"])
        write_manifest(tmp, distributed_manifest(
            step=self.step, samples=self.samples, expired=self.expired, passes=self.passes,
            positions=self._positions, workers=self.workers, saved=saved, tables=self.tables,
            variables=state["variables"], model=self.model_spec, config=self.config.to_dict(),
            schema=self.schema.to_dict(), extra=extra))
        return replace_directory(tmp, directory)

    @classmethod
    def restore(cls, directory, model=None, *, workers: int | None = None,
                shards: int | None = None, manifest: dict | None = None,
                **kwargs) -> "DistributedTrainer":
        """The run saved in ``directory`` (read from its manifest only), continuing where it
        stopped. ``workers`` may differ from the checkpoint's; so may ``shards``
        (resharding: every id then looks up the same row, a counter filter's pending counts
        move with their ids; see ``Shard._reshard`` for the other filters). A checkpoint
        taken in the middle of a pass needs its own number of workers (the pass deals trees
        by worker). ``manifest``: the checkpoint's, already read (:func:`~trainer.distributed.manifest.run_checkpoint`)."""
        manifest = read_manifest(directory) if manifest is None else manifest
        shards = manifest["shards"] if shards is None else check_count("shards", shards)
        if model is None:
            if manifest["model"] is None:
                raise ValueError(f"{directory}: the checkpoint's model is not built in; pass "
                                 "model= (a function returning a fresh DenseNet)")
            model = models_lib.from_spec(manifest["model"])
        schema = schemas.from_dict(manifest["schema"])
        config = TrainConfig.from_dict(config_before_l2(manifest["config"]))
        trainer = cls(schema, model, config, workers=workers or manifest["workers"],
                      shards=shards, **kwargs)
        try:
            trainer.load(directory, manifest)
        except BaseException:
            trainer.close()
            raise
        return trainer

    def run_config(self, saved: TrainConfig) -> TrainConfig:
        """The config a checkpoint saved with ``saved`` goes on with (the same here; online
        learning's ``--expire-every`` reschedules its expiry)."""
        return saved

    def load(self, directory, manifest: dict | None = None) -> None:
        """Load a checkpoint of this trainer's schema, tables and model into the running
        actors (any number of shards: resharded), with its step, counters and input
        position. A checkpoint of another schema, config or model is refused, naming what
        differs. ``manifest``: the checkpoint's, already read."""
        directory = os.path.abspath(os.fspath(directory))
        manifest = read_manifest(directory) if manifest is None else manifest
        path = os.path.join(directory, "manifest.json")
        if manifest["schema"] != self.schema.to_dict():
            raise ValueError(f"{path}: the checkpoint is of another schema than this trainer's "
                             f"({schema_difference(manifest['schema'], self.schema.to_dict())})")
        run_config = self.run_config(TrainConfig.from_dict(config_before_l2(manifest["config"])))
        differs = config_difference(run_config.to_dict(), self.config.to_dict())
        if differs:
            raise ValueError(f"{path}: the checkpoint was trained with another config "
                             f"(differs in: {', '.join(differs)}); restore it with "
                             "DistributedTrainer.restore to take its config")
        with np.load(os.path.join(directory, "dense.npz")) as npz:
            arrays = {k: npz[k] for k in npz.files}
        detail = dense_difference(
            manifest, {k: tuple(v.shape) for k, v in arrays.items() if k.startswith("model/")},
            {k: tuple(v) for k, v in self.actors.variable_shapes.items()
             if k.startswith("model/")})
        if detail is not None:
            raise ValueError(f"{directory}: the checkpoint's dense network does not fit this "
                             f"model ({detail}); pass the model it was trained with")
        positions = manifest.get("positions")
        if positions is not None and len(positions) != self.workers:
            # the pass dealt its trees to another number of workers: its rest cannot be told
            warnings.warn(f"{directory}: taken in the middle of pass {manifest['passes']} with "
                          f"{len(positions)} workers; with {self.workers} the next fit starts "
                          "a new pass (the rest of that pass is not trained)", stacklevel=2)
            positions = None
        expired = expired_per_shard(manifest, self.shards)
        self.config = run_config
        ray.get([s.load.remote(shard_snapshot_spec(directory, manifest, i, self.shards), e)
                 for i, (s, e) in enumerate(zip(self._shards, expired))]
                + [w.reset.remote(self.config.to_dict(), arrays) for w in self._workers])
        self.step, self.samples = manifest["step"], manifest["samples"]
        self.expired, self.passes = manifest["expired"], manifest["passes"]
        self._positions = None if positions is None else list(positions)

    # -- serving --------------------------------------------------------------------------

    def _serving_core(self):
        """A :class:`~trainer.model_core.ModelCore` holding worker 0's dense weights: what
        :mod:`trainer.serving` builds the SavedModel from."""
        return exports.serving_core(self.schema, self._model, self.config,
                                    self.dense_arrays(optimizer=True))

    def export(self, directory) -> str:
        """A serving export (:class:`trainer.serving.Predictor` reads it) of the sharded run:
        the dense SavedModel and every shard's snapshot of every table, kept per shard
        (``stores/<table>/shard-NNNN``; the Predictor looks each id up on its shard), so that
        :meth:`export_increment` can add per-shard deltas. Written from the shard actors'
        processes: on a cluster, ``directory`` must be storage every node sees."""
        return exports.export(self._serving_core(), self._shards, directory, self.step)

    def export_delta(self, directory) -> dict:
        """Every shard's delta of every table
        (``directory/<table>/shard-NNNN/delta-MMMMMM.bin``): ``{table: [path per shard]}``."""
        return exports.export_delta(self._shards, directory)

    def dense_arrays(self, optimizer: bool = True) -> dict:
        """Worker 0's dense arrays under their ``dense.npz`` names (all workers hold the same
        weights)."""
        arrays = ray.get(self._workers[0].dense_state.remote())["arrays"]
        return {k: v for k, v in arrays.items() if optimizer or k.startswith("model/")}

    def export_increment(self, directory, newest_sample_time: float | None = None) -> dict:
        """Keep a serving export up to date (:func:`trainer.serving.export_increment`): the
        first call writes :meth:`export`; later calls publish versions holding every shard's
        delta of every table (``versions/vNNNNNNNN/<table>/shard-NNNN/delta-MMMMMM.bin``) and
        the dense weights; ``Predictor.update`` and ``trainer.serve`` apply them."""
        from trainer import serving

        return serving.export_increment(self, directory, newest_sample_time)


class RayPasses:
    """The passes of one fit on Ray (a :class:`fitting.FitPasses`): pass numbers run on across
    fits (``DistributedTrainer.passes``; pass k deals worker w's trees in the order of seed
    (config.seed, k, w)), a checkpoint records every worker's position in the pass, and an
    actor's death rolls everything back to the last checkpoint of this fit."""

    def __init__(self, trainer: DistributedTrainer, data, shuffle: bool, carried: dict):
        self.trainer, self.data, self.shuffle = trainer, data, shuffle
        W = trainer.workers
        # the rows' L2 unit, as in process: the data's samples where cheap to count, else
        # those of the fit's first pass
        self.samples = (sum(b.num_leaves for part in data for b in part)
                        if per_worker_lists(data, W) else count_samples(data, trainer.schema))
        self.carried = carried
        self.bytes0 = {k: trainer.bytes.get(k, 0) - carried["bytes"].get(k, 0)
                       for k in set(trainer.bytes) | set(carried["bytes"])}
        self.recoveries0 = len(trainer.recoveries)
        self.pass_index = None
        trainer.clear_rollback_point()

    def first_epoch(self, state: FitState) -> int | None:
        # the pass the interrupted fit was in is pass `passes` of the restored trainer
        return state.epoch if state.epoch >= 1 and self.trainer.passes >= 1 else None

    def begin(self, epoch: int, continued: bool) -> None:
        self.pass_index = self.trainer.begin_pass(new=not continued)

    def train(self, epoch: int, skip: int, dense: bool, pause):
        """The rest of the pass (from the workers' positions: ``skip`` is for in process)."""
        return self.trainer.train_pass(self.data, self.pass_index, self.shuffle, dense, pause)

    def evaluate(self, data, log_dir: str | None) -> dict:
        # no TensorBoard scalars of evaluations: the run directory of a Ray run has "train"
        # only (train.py's layout)
        return self.trainer.evaluate(data)

    def guard(self, body, progress):
        return self.trainer.attempt(body, progress, self.pass_index)

    def checkpoint(self, directory, snapshot: dict) -> None:
        self.trainer.save_rollback_point(directory, snapshot)

    def result(self, steps: int, state: FitState) -> dict:
        t = self.trainer
        fit_bytes = {k: t.bytes.get(k, 0) - self.bytes0.get(k, 0)
                     for k in set(t.bytes) | set(self.bytes0)}
        per_step = {k: v / max(steps, 1) for k, v in fit_bytes.items()}
        recoveries = self.carried["recoveries"] + t.recoveries[self.recoveries0:]
        fit_state = state.to_dict()
        fit_state["batches"] = t.pass_batches
        return {"recoveries": recoveries,
                "bytes_per_step": {
                    "per_worker": (per_step.get("worker_sent", 0)
                                   + per_step.get("worker_received", 0)) / t.workers,
                    "per_shard": (per_step.get("shard_sent", 0)
                                  + per_step.get("shard_received", 0)) / t.shards,
                    **per_step},
                # where this fit is, for fit(resume=...) on the checkpoint saved now
                "fit_state": {**fit_state, "bytes": fit_bytes, "recoveries": recoveries}}
