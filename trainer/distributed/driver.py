"""The driver of distributed training: creates the shard and worker actors, schedules the
synchronous steps, checkpoints, recovers from a dead actor, and runs ``trainer.train
--workers/--shards``."""

from __future__ import annotations

import json
import math
import os
import re
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
from compression.signal_points import signal_point
from schemas import Schema
from trainer import models as models_lib
from trainer import fitting, runs
from trainer.checkpoints import checkpoint_state, config_before_l2, dense_name
from trainer.config import ConfigError, TrainConfig, resolve_function
from trainer.data import count_samples
from trainer.distributed.manifest import (MANIFEST_VERSION, schema_difference,
                                          shard_snapshot_spec, single_process_manifest,
                                          read_manifest)
from trainer.distributed.placement import shard_of
from trainer.distributed.shard import RESTARTED, Shard, table_specs
from trainer.distributed.worker import (Worker, per_worker_lists, resolve_dense,
                                        unresolved_dense, worker_batch_size)
from trainer.fitting import FitState
from trainer.metrics import evaluation
from trainer.ray_address import check_ray_address

# Shards are processes; past a few thousand the per-step calls (one per shard and worker)
# cost more than the rows they hold, whatever the number of distinct ids.
MAX_SHARDS = 4096


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a whole number >= 1, got {value!r}")
    return value


def is_actor_failure(error: BaseException) -> bool:
    """An actor's process died (or Ray restarted it and it refused to go on without a
    checkpoint), as opposed to an error in the step itself."""
    return isinstance(error, ray.exceptions.RayActorError) or RESTARTED in str(error)


def failure_summary(error: BaseException) -> str:
    """One line naming an actor's death: the error's type and the first line of its text."""
    cause = getattr(error, "cause", None) or error  # a RayTaskError wraps the death
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(cause)).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _refs(value, n: int) -> list:
    """``num_returns=n`` gives a single ref for n == 1, a list otherwise."""
    return [value] if n == 1 else list(value)


def run_checkpoint(run_dir) -> tuple[str, dict]:
    """The checkpoint a ``trainer.train`` run kept (``RUN_DIR/checkpoint``) and its manifest:
    a Ray run's own, or a single-process run's state read as a one-shard distributed
    checkpoint (:func:`~trainer.distributed.manifest.single_process_manifest`), so that
    :meth:`DistributedTrainer.restore` takes either into any number of shards. What
    ``trainer.online --init-from RUN_DIR --workers W --shards S`` starts from."""
    checkpoint = os.path.join(os.fspath(run_dir), "checkpoint")
    if os.path.isfile(os.path.join(checkpoint, "trainer.json")):
        return checkpoint, single_process_manifest(checkpoint_state(checkpoint))
    if not os.path.isfile(os.path.join(checkpoint, "manifest.json")):
        raise FileNotFoundError(
            f"{run_dir}: not a trainer.train run directory (no checkpoint/trainer.json or "
            "checkpoint/manifest.json); an interrupted run keeps its model there too")
    return checkpoint, read_manifest(checkpoint)


def start_ray(**kwargs) -> None:
    """``ray.init(**kwargs)``, leaving SIGINT and SIGTERM to the command that runs it.

    ray.init takes SIGTERM over twice in the process that calls it: in Python, a handler that
    exits with status 15 at once (set through ``ray._private.utils.set_sigterm_handler``), and
    in C++, the core worker it starts installs Abseil's failure-signal handler, which prints a
    stack dump (``*** SIGTERM received at time=... PC: @ ...``) and arms an alarm that aborts
    the process (SIGABRT) seconds later, whatever the Python handler does. Here the core
    worker of this process installs none (Ray's ``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``
    setting, read when it starts; the actors' processes keep theirs, and a native crash of
    this process loses its C++ stack dump), ray.init sets no SIGTERM handler, and a signal
    that comes meanwhile is held until ray.init has returned
    (:func:`trainer.runs.signals_held`), then handled by the command. Ray's cleanup of the
    processes it started stays: ``ray.shutdown`` (what :meth:`DistributedTrainer.close`
    calls) and its exit hook stop them, and on Linux they end with this process anyway (Ray
    starts them to die with their parent)."""
    from ray._private import ray_constants, utils

    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    set_sigterm_handler = utils.set_sigterm_handler
    with runs.signals_held():
        signal_point("ray.init.entered")
        utils.set_sigterm_handler = lambda handler: None
        try:
            ray.init(**kwargs)
        finally:
            utils.set_sigterm_handler = set_sigterm_handler
        signal_point("ray.init.returned")


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
                 max_restarts: int = 3):
        if not isinstance(schema, Schema):
            raise TypeError(f"schema: expected a schemas.Schema, got {type(schema).__name__}")
        self.workers = _check_count("workers", workers)
        self.shards = _check_count("shards", shards)
        self.schema = schema
        self.config = config = config or TrainConfig()
        self.tables = config.check(schema)
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
        self._rollback = None  # the last checkpoint fit wrote, to roll back to
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
            start_ray(**kwargs)
        try:
            cpus = ray.cluster_resources().get("CPU", 0)
            needed = (self.workers + self.shards) * actor_cpus
            if needed > cpus:
                raise ValueError(
                    f"the Ray cluster{'' if ray_address is None else ' at ' + ray_address} "
                    f"has {cpus:g} CPUs; {self.workers} workers + {self.shards} shards at "
                    f"{actor_cpus:g} CPU each need {needed:g} (lower actor_cpus or add nodes)")
            specs = table_specs(config, self.tables, self.shards)
            # Ray restarts a dead actor by running its constructor again (max_restarts); a
            # task is never retried (max_task_retries=0): a step is not idempotent, the
            # driver rolls everything back to a checkpoint instead.
            options = dict(num_cpus=actor_cpus, max_restarts=max_restarts, max_task_retries=0)
            shard_cls = ray.remote(Shard)
            self._shards = [shard_cls.options(**options).remote(s, self.shards, specs)
                            for s in range(self.shards)]
            worker_cls = ray.remote(self.worker_class)
            self._workers = [worker_cls.options(**options).remote(
                w, self.workers, self.shards, schema.to_dict(), self._model, config.to_dict())
                for w in range(self.workers)]
            signal_point("actors.created")
            # fail here, not in the first step, when an actor cannot start
            ray.get([s.ping.remote() for s in self._shards])
            self._variable_shapes = ray.get(self._workers[0].variable_shapes.remote())
            ray.get([w.ping.remote() for w in self._workers[1:]])
            signal_point("actors.started")
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

    def actor_pids(self) -> dict:
        """The process id of every actor: ``{"shards": [...], "workers": [...]}``."""
        return {"shards": ray.get([s.pid.remote() for s in self._shards]),
                "workers": ray.get([w.pid.remote() for w in self._workers])}

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
        """Every shard's rows for every worker: ``[shard][worker]`` refs. ``request_refs``:
        ``[worker][shard]`` refs of the workers' requests."""
        W = self.workers
        return [_refs(shard.lookup.options(num_returns=W).remote(
            train, *[request_refs[w][s] for w in range(W)]), W)
            for s, shard in enumerate(self._shards)]

    def _submit_step(self, step: int, mean: bool, rows, lookup_next: bool,
                     dense_before=None, apply_dense: bool = True) -> dict:
        """Submit training step ``step``: every worker's ``train_step`` on ``rows``
        (``[shard][worker]`` refs), a dense update of every worker right after it (it runs
        while the shards work), and every shard's ``step``: apply this step's row gradients
        and, with ``lookup_next``, look the workers' next batches up. Returns the refs:
        ``results`` (per worker), ``applied`` (rows expired, per shard), ``dense_applied``,
        ``messages`` (``[worker][shard]``: gradients and next requests), ``next_rows``
        (``[shard][worker]``; None without ``lookup_next``) and ``dense`` (per worker, its
        dense message).

        Without ``apply_dense`` the dense update is left to the caller (``dense_applied`` is
        empty): it passes ``dense`` as the next step's ``dense_before``, and each worker
        applies it at the start of that step's ``train_step``, which saves an actor call per
        worker and step."""
        W, S = self.workers, self.shards
        dense_args = [] if dense_before is None else list(dense_before)
        outs = [_refs(worker.train_step.options(num_returns=S + 2).remote(
            *[None if v == w else dense_args[v] for v in range(len(dense_args))],
            *[rows[s][w] for s in range(S)], dense_messages=len(dense_args),
            dense=self._dense_trains), S + 2)
            for w, worker in enumerate(self._workers)]
        dense_applied = ([worker.apply_dense.remote(
            *[None if v == w else outs[v][1] for v in range(W)])
            for w, worker in enumerate(self._workers)]
            if self.dense_messages and apply_dense else [])
        messages = [o[2:] for o in outs]
        applied, next_rows = [], [] if lookup_next else None
        for s, shard in enumerate(self._shards):
            to_shard = [messages[w][s] for w in range(W)]
            if lookup_next:
                refs = _refs(shard.step.options(num_returns=W + 1).remote(
                    step, mean, self.row_l2_scale, W, True, *to_shard), W + 1)
                applied.append(refs[0])
                next_rows.append(refs[1:])
            else:
                applied.append(shard.step.remote(step, mean, self.row_l2_scale, W, False,
                                                 *to_shard))
        return {"results": [o[0] for o in outs], "applied": applied,
                "dense_applied": dense_applied, "messages": messages, "next_rows": next_rows,
                "dense": [o[1] for o in outs]}

    def _next(self, stream: str, dense_refs=None):
        dense_refs = list(dense_refs or [])
        return [_refs(w.next_step.options(num_returns=self.shards + 1).remote(
            stream, len(dense_refs), *dense_refs), self.shards + 1) for w in self._workers]

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

    def fit_passes(self, data, shuffle: bool, carried: dict) -> "_Passes":
        """The passes of one fit over ``data`` (the engine side of :func:`fitting.fit`)."""
        return _Passes(self, data, shuffle, carried)

    def _train_steps(self, mean: bool, pause):
        """The steps of the pass the workers are reading, to its end, one
        :class:`fitting.Step` each; ``pause(step)``: whether the fit will evaluate,
        checkpoint or stop after step ``step`` (then the pipeline is drained: that step is
        submitted without looking the next one up, and the Step is ``pausable``).

        Each step's calls are submitted before the previous step's results are read (Ray
        runs an actor's calls in the order one caller submitted them, so a shard applies
        step k before it looks up step k+1, in the same call). A step past the end of the
        data changes nothing. Before a pause the pipeline drains instead: the shards apply
        the step without looking the next one up, and nothing of the next step has run (its
        batches are taken but not looked up or trained)."""
        nxt = self._next("train")
        current = self._submit_step(self.step + 1, mean,
                                    self._lookup([refs[1:] for refs in nxt], True),
                                    not pause(self.step + 1))
        while True:
            following = None if current["next_rows"] is None else self._submit_step(
                self.step + 2, mean, current["next_rows"], not pause(self.step + 2))
            results = ray.get(current["results"])
            if not any(r["n"] for r in results):
                outstanding = [current] + ([following] if following else [])
                ray.get([ref for c in outstanding for ref in c["results"] + c["applied"]
                         + c["dense_applied"]])
                return
            self.expired += sum(ray.get(current["applied"]))
            self.step += 1
            for w, r in enumerate(results):
                if r["n"]:
                    self._positions[w] += 1
            step = self._stepped(results)
            if following is not None:
                yield step
                current = following
                continue
            ray.get(current["dense_applied"])
            step.pausable = True
            yield step
            current = self._submit_step(self.step + 1, mean,
                                        self._lookup(current["messages"], True),
                                        not pause(self.step + 1))

    def _stepped(self, results) -> fitting.Step:
        """The driver's counters after a step with the workers' ``results``."""
        trained = [r for r in results if r["n"]]
        n = sum(r["n"] for r in trained)
        loss = sum(r["loss"] * r["n"] for r in trained) / n
        self.losses.append(loss)
        self.samples += n
        self.ids_fed += sum(r.get("ids_fed", 0) for r in results)
        self.leaf_ids += sum(r.get("leaf_ids", 0) for r in results)
        self._count_bytes([r.get("meta", {}) for r in results], results)
        return fitting.Step(loss, n, len(trained),
                            [(r["probabilities"], r["labels"]) for r in trained], (loss,),
                            pausable=False)

    def _attempt(self, body, progress=None, pass_index: int | None = None):
        """``body()``; when an actor dies in it, roll back to the last checkpoint fit wrote
        and call ``body`` again (the pass it trains resumes at the checkpoint's input
        positions)."""
        while True:
            try:
                return body()
            except ray.exceptions.RayError as error:
                if not is_actor_failure(error):
                    raise
                self._recover(error, progress, pass_index)

    def _recover(self, error, progress, pass_index: int | None) -> None:
        summary = failure_summary(error)
        if self._rollback is None:
            raise RuntimeError(
                f"an actor of the distributed run died ({summary}) and there is no checkpoint "
                "of this fit to roll back to; pass checkpoint_dir= (and checkpoint_every=) to "
                "fit") from error
        failed_step = self.step
        rollback = self._rollback
        self.roll_back(rollback["directory"], error)
        del self.losses[rollback["losses"]:]
        self.ids_fed, self.leaf_ids = rollback["ids_fed"], rollback["leaf_ids"]
        self.bytes = defaultdict(int, rollback["bytes"])
        if progress is not None:
            progress.restore(rollback["progress"])
        if pass_index is not None and self.passes != pass_index:
            if self._positions is None and self.passes == pass_index - 1:
                self.passes, self._positions = pass_index, [0] * self.workers
            else:
                raise RuntimeError(f"the last checkpoint ({rollback['directory']}) is of pass "
                                   f"{self.passes}, not of pass {pass_index} or the one "
                                   "before") from error
        self.recoveries.append({"error": summary, "failed_at_step": failed_step,
                                "rolled_back_to_step": self.step})
        print(f"warning: an actor died at step {failed_step} ({summary}); Ray restarted it and "
              f"the run rolled back to the checkpoint of step {self.step} "
              f"({rollback['directory']})", file=sys.stderr, flush=True)

    def roll_back(self, directory, error: BaseException) -> None:
        """After an actor's death (``error``): wait until Ray restarted it and every actor
        answers, then load the checkpoint ``directory`` into all of them, so every shard and
        worker is back at its step. Raises ``RuntimeError`` when an actor does not come back
        (Ray restarted it ``max_restarts`` times already, or it did not start in time)."""
        self._await_actors(error, os.fspath(directory))
        self.load(directory)

    def _await_actors(self, error, checkpoint: str, timeout: float = 120.0) -> None:
        """Wait until every actor answers again (Ray restarts a dead one); raise when one
        is gone for good (restarted ``max_restarts`` times already) or does not come back."""
        deadline = time.monotonic() + timeout
        named = ([(f"store shard {i}", s) for i, s in enumerate(self._shards)]
                 + [(f"worker {i}", w) for i, w in enumerate(self._workers)])
        for name, actor in named:
            while True:
                try:
                    ray.get(actor.ping.remote(), timeout=max(deadline - time.monotonic(), 0.1))
                    break
                except ray.exceptions.ActorUnavailableError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{name} did not come back within {timeout:g} s "
                                           "after an actor died") from error
                    time.sleep(0.1)  # restarting: ask again
                except ray.exceptions.RayActorError as e:
                    raise RuntimeError(f"{name} died and Ray restarts it no more (max_restarts="
                                       f"{self.max_restarts}); the last checkpoint is "
                                       f"{checkpoint}") from e
                except ray.exceptions.GetTimeoutError:
                    raise RuntimeError(f"{name} did not come back within {timeout:g} s after "
                                       "an actor died") from error

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
        return dict(out)

    def store_rows(self) -> int:
        return self.store_stats().get("rows", 0)

    @property
    def dense_messages(self) -> bool:
        """Whether a step's dense update travels between workers and needs its
        ``apply_dense`` call: with several workers in a pass that trains the dense weights
        (a lone worker applies its update in its ``train_step``)."""
        return self._dense_trains and self.workers > 1

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
            saved = ray.get([s.save.remote(os.path.join(tmp, f"shard-{i:04d}"))
                             for i, s in enumerate(self._shards)])
            state = ray.get(self._workers[0].dense_state.remote())
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        np.savez(os.path.join(tmp, "dense.npz"), **state["arrays"])
        manifest = {
            "version": MANIFEST_VERSION, "kind": "prefixrec-distributed", "step": self.step,
            "samples": self.samples, "expired": self.expired, "shards": self.shards,
            # every worker's input position: pass `passes` (pass k deals worker w's trees in
            # the order of seed (config.seed, k, w)) and the batches each worker took from it,
            # null once that pass is finished
            "passes": self.passes, "positions": self._positions,
            "workers": self.workers, "placement": "mix64(id) % shards",
            "shard_dirs": [f"shard-{i:04d}" for i in range(self.shards)],
            "shard_rows": [s["rows"] for s in saved],
            "shard_expired": [s["expired"] for s in saved],
            "tables": list(self.tables), "variables": state["variables"],
            "model": self.model_spec, "config": self.config.to_dict(),
            "schema": self.schema.to_dict(), **(extra or {})}
        with open(os.path.join(tmp, "manifest.json.tmp"), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(tmp, "manifest.json.tmp"), os.path.join(tmp, "manifest.json"))
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
        by worker). ``manifest``: the checkpoint's, already read (:func:`run_checkpoint`)."""
        manifest = read_manifest(directory) if manifest is None else manifest
        shards = manifest["shards"] if shards is None else _check_count("shards", shards)
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
        saved_config, config = run_config.to_dict(), self.config.to_dict()
        saved_config.pop("dense", None)  # resolved statistics: the checkpoint's are taken
        differs = sorted(k for k in set(saved_config) | set(config)
                         if k != "dense" and saved_config.get(k) != config.get(k))
        if differs:
            raise ValueError(f"{path}: the checkpoint was trained with another config "
                             f"(differs in: {', '.join(differs)}); restore it with "
                             "DistributedTrainer.restore to take its config")
        with np.load(os.path.join(directory, "dense.npz")) as npz:
            arrays = {k: npz[k] for k in npz.files}
        wanted = {k: tuple(v) for k, v in self._variable_shapes.items()
                  if k.startswith("model/")}
        found = {k: tuple(v.shape) for k, v in arrays.items() if k.startswith("model/")}
        if wanted != found:
            bad = next((k for k in sorted(wanted) if found.get(k, wanted[k]) != wanted[k]), None)
            detail = (f"{len(found)} dense variables in the checkpoint, {len(wanted)} in this "
                      "model" if len(found) != len(wanted) or bad is None else
                      f"variable {manifest['variables'][int(bad[6:])]} has shape "
                      f"{found[bad]} in the checkpoint, {wanted[bad]} in this model")
            raise ValueError(f"{directory}: the checkpoint's dense network does not fit this "
                             f"model ({detail}); pass the model it was trained with")
        positions = manifest.get("positions")
        if positions is not None and len(positions) != self.workers:
            # the pass dealt its trees to another number of workers: its rest cannot be told
            warnings.warn(f"{directory}: taken in the middle of pass {manifest['passes']} with "
                          f"{len(positions)} workers; with {self.workers} the next fit starts "
                          "a new pass (the rest of that pass is not trained)", stacklevel=2)
            positions = None
        expired = manifest["shard_expired"]
        if self.shards != manifest["shards"]:  # resharded: the total on shard 0
            expired = [sum(expired)] + [0] * (self.shards - 1)
        self.config = run_config
        ray.get([s.load.remote(shard_snapshot_spec(directory, manifest, i, self.shards), e)
                 for i, (s, e) in enumerate(zip(self._shards, expired))]
                + [w.reset.remote(self.config.to_dict(), arrays) for w in self._workers])
        self.step, self.samples = manifest["step"], manifest["samples"]
        self.expired, self.passes = manifest["expired"], manifest["passes"]
        self._positions = None if positions is None else list(positions)

    # -- serving --------------------------------------------------------------------------

    def _serving_core(self):
        """A :class:`~trainer.model.ModelCore` holding worker 0's dense weights: what
        :mod:`trainer.serving` builds the SavedModel from."""
        from trainer.model import ModelCore

        model = (models_lib.from_spec(self._model) if isinstance(self._model, dict)
                 else self._model())
        core = ModelCore(self.schema, model, self.config)
        core.set_dense_arrays(ray.get(self._workers[0].dense_state.remote())["arrays"],
                              optimizer=False)
        return core

    def export(self, directory) -> str:
        """A serving export (:class:`trainer.serving.Predictor` reads it) of the sharded run:
        the dense SavedModel and every shard's snapshot of every table, kept per shard
        (``stores/<table>/shard-NNNN``; the Predictor looks each id up on its shard), so that
        :meth:`export_increment` can add per-shard deltas. Written from the shard actors'
        processes: on a cluster, ``directory`` must be storage every node sees."""
        from trainer import serving

        def write_stores(tmp):
            ray.get([s.snapshot.remote(os.path.join(tmp, "stores"))
                     for s in self._shards])
            return {"shards": self.shards, "placement": "mix64(id) % shards"}

        return serving.export(self._serving_core(), directory, step=self.step,
                              write_stores=write_stores)

    def export_delta(self, directory) -> dict:
        """Every shard's delta of every table
        (``directory/<table>/shard-NNNN/delta-MMMMMM.bin``): ``{table: [path per shard]}``."""
        directory = os.path.abspath(os.fspath(directory))
        per_shard = ray.get([s.export_delta.remote(directory) for s in self._shards])
        return {table: [paths[table] for paths in per_shard] for table in per_shard[0]}

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


# -- the command line (trainer/train.py dispatches here) ----------------------------------

def run_cli(args, parser, schema: Schema, config: TrainConfig, model, staged,
            settings: dict, resume: dict | None = None, go_on: str = "") -> dict:
    """``python -m trainer.train ... --workers W --shards S [--ray-address ADDR]``: train on
    Ray, evaluate, checkpoint to ``OUT/checkpoint``; returns the result dict train.py prints
    and writes. ``staged``: the run directory (a :class:`compression.cli.StagedOutput`; this
    writes into ``staged.tmp``, train.py commits it).
    As in process: with ``--eval-data`` the model is evaluated after every pass (and every
    ``--eval-every`` steps), training stops after ``--patience`` evaluations without a better
    AUC and ``OUT/checkpoint`` holds the best model. A shard or worker whose process dies is
    restarted by Ray and the run rolls back to its last checkpoint (``OUT/checkpoint`` or,
    while the best one is kept there, ``OUT/rollback``: written before the first step and
    after every pass).

    SIGINT or SIGTERM (``settings``: train.py's, for ``interrupted.json``) stops as in
    process: the pipeline drains, ``OUT/checkpoint`` (and with early stopping ``OUT/latest``)
    and ``OUT/interrupted.json`` (with the fit's state) are written, the run directory is put
    in place and ``trainer.runs.Interrupted`` is raised (exit 130/143; its message ends with
    ``go_on``); a second signal stops at once. ``resume``: that ``interrupted.json`` (checked
    by train.py against this command): the trainer is restored from the interrupted run's
    checkpoint and its fit goes on to the result of an uninterrupted run (the run directory
    ``staged.tmp`` then starts as a copy of the interrupted one)."""
    for name in ("workers", "shards"):
        value = getattr(args, name)
        if value < 1:
            parser.error(f"--{name}: expected a number >= 1, got {value}")
    if args.shards > MAX_SHARDS:
        parser.error(f"--shards {args.shards}: more than {MAX_SHARDS} shards is not sensible "
                     "(each shard is a process holding a part of every table)")
    try:
        if resume is None:
            trainer = DistributedTrainer(schema, model, config, workers=args.workers,
                                         shards=args.shards, ray_address=args.ray_address)
        else:  # the interrupted run's checkpoint: its step, stores, input positions
            trainer = DistributedTrainer.restore(
                os.path.join(staged.path, resume["checkpoint"]), model, workers=args.workers,
                shards=args.shards, ray_address=args.ray_address)
    except (ConnectionError, ValueError, ConfigError) as e:
        parser.error(str(e))
    try:
        epochs = args.epochs or (runs.DEFAULT_EPOCHS_WITH_EVAL if args.eval_data else 1)
        keep_best = bool(args.eval_data) and args.patience > 0
        checkpoint = os.path.join(staged.tmp, "checkpoint")
        rollback = os.path.join(staged.tmp, "rollback") if keep_best else checkpoint
        # a signal from here on finishes the step and writes the checkpoint; before, it ends
        # the command with nothing written (start_ray holds one that comes during ray.init)
        with runs.StopOnSignal() as stop:
            signal_point("run.started")
            history = trainer.fit(args.train_data, epochs=epochs,
                                  progress=not args.no_progress, log_dir=staged.tmp,
                                  eval_data=args.eval_data, eval_every=args.eval_every,
                                  patience=args.patience if keep_best else None,
                                  best_dir=checkpoint if keep_best else None,
                                  checkpoint_dir=rollback,
                                  should_stop=lambda: stop.signum is not None,
                                  resume=None if resume is None else resume["fit"])
            if keep_best:
                shutil.rmtree(rollback, ignore_errors=True)
            if history["interrupted"]:
                raise runs.write_interrupted(
                    trainer, staged, stop.signum,
                    {"settings": settings, "fit": history["fit_state"],
                     "distributed": {"workers": args.workers, "shards": args.shards}},
                    keep_best, history.get("best"), go_on)
            if not keep_best:
                trainer.save(checkpoint)
        if args.export_dir:
            trainer.export(args.export_dir)  # the kept model: fit went back to the best
        stats = trainer.store_stats()
        rows = stats.get("rows", 0)
        if history["samples"] and rows and args.shards > rows:
            print(f"warning: {args.shards} shards for {rows} rows: most shards hold nothing; "
                  "use fewer shards", file=sys.stderr)
        return runs.fit_result(args, config, history, stats, keep_best, epochs, extra={
            "workers": args.workers, "shards": args.shards,
            "worker_batch_size": worker_batch_size(config.batch_size, 0, args.workers),
            "bytes_per_step": history["bytes_per_step"],
            "recoveries": len(history["recoveries"])})
    finally:
        trainer.close()


class _Passes:
    """The passes of one fit on Ray (see :mod:`trainer.fitting`): pass numbers run on across
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
        trainer._rollback = None

    def first_epoch(self, state: FitState) -> int | None:
        # the pass the interrupted fit was in is pass `passes` of the restored trainer
        return state.epoch if state.epoch >= 1 and self.trainer.passes >= 1 else None

    def begin(self, epoch: int, continued: bool) -> None:
        t = self.trainer
        if not continued and t._positions is None:
            t.passes += 1
            t._positions = [0] * t.workers
        # else: the pass in progress (a resumed fit's, or that of a checkpoint taken in it)
        self.pass_index = t.passes

    def train(self, epoch: int, skip: int, dense: bool, pause):
        """The rest of the pass (from the workers' positions: ``skip`` is for in process)."""
        t = self.trainer
        # as in process: the dense network trains in this fit's first
        # dense_optimizer.epochs passes, later ones train the rows only
        t._dense_trains = dense
        if t._positions is None:  # trained already (a resumed fit stopped before evaluating)
            return
        t._start_pass(self.data, self.pass_index, self.shuffle, "train", t._positions)
        yield from t._train_steps(t.config.row_gradients == "mean", pause)
        t._positions = None

    def evaluate(self, data, log_dir: str | None) -> dict:
        # no TensorBoard scalars of evaluations: the run directory of a Ray run has "train"
        # only (train.py's layout)
        return self.trainer.evaluate(data)

    def guard(self, body, progress):
        return self.trainer._attempt(body, progress, self.pass_index)

    def checkpoint(self, directory, snapshot: dict) -> None:
        t = self.trainer
        path = t.save(directory)
        t._rollback = {"directory": path, "losses": len(t.losses), "ids_fed": t.ids_fed,
                       "leaf_ids": t.leaf_ids, "bytes": dict(t.bytes), "progress": snapshot}

    def result(self, steps: int, state: FitState) -> dict:
        t = self.trainer
        fit_bytes = {k: t.bytes.get(k, 0) - self.bytes0.get(k, 0)
                     for k in set(t.bytes) | set(self.bytes0)}
        per_step = {k: v / max(steps, 1) for k, v in fit_bytes.items()}
        recoveries = self.carried["recoveries"] + t.recoveries[self.recoveries0:]
        fit_state = state.to_dict()
        fit_state["batches"] = sum(t._positions or [])
        return {"recoveries": recoveries,
                "bytes_per_step": {
                    "per_worker": (per_step.get("worker_sent", 0)
                                   + per_step.get("worker_received", 0)) / t.workers,
                    "per_shard": (per_step.get("shard_sent", 0)
                                  + per_step.get("shard_received", 0)) / t.shards,
                    **per_step},
                # where this fit is, for fit(resume=...) on the checkpoint saved now
                "fit_state": {**fit_state, "bytes": fit_bytes, "recoveries": recoveries}}
