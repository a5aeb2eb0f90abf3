"""The actors of a distributed run: the Ray cluster joined (or started), the store shard and
worker actors created and checked, their process ids, and their end."""

from __future__ import annotations

import math
import os

import ray

from compression.signal_points import signal_point
from trainer import runs
from trainer.distributed.shard import Shard, table_specs
from trainer.ray_address import check_ray_address


def check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a whole number >= 1, got {value!r}")
    return value


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


def join_ray(workers: int, shards: int, ray_address: str | None, *, num_cpus: int | None,
             actor_cpus: float, connect_timeout: float, runtime_env: dict | None) -> bool:
    """Connect to the cluster at ``ray_address`` (failing within ``connect_timeout`` s when
    nothing answers) or, without one, start a local cluster for ``workers + shards`` actors; a Ray
    already initialised in this process is used as it is. Whether this started the cluster
    (then the caller stops it)."""
    if ray_address is not None:
        check_ray_address(ray_address, connect_timeout)
    if ray_address is None and workers + shards > 8 * (os.cpu_count() or 1):
        raise ValueError(
            f"{workers} workers + {shards} shards on a local Ray cluster of "
            f"{os.cpu_count()} cores: each is a process; use at most "
            f"{8 * (os.cpu_count() or 1)} in all here, or a cluster (ray_address)")
    if ray.is_initialized():
        return False
    kwargs = dict(include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
    owns = False
    if ray_address is None:
        needed = math.ceil((workers + shards) * actor_cpus)
        kwargs["num_cpus"] = num_cpus or max(os.cpu_count() or 1, needed)
        owns = True
    else:
        kwargs["address"] = ray_address
    start_ray(**kwargs)
    return owns


class Actors:
    """The ``shards`` store shard actors and ``workers`` worker actors (of ``worker_class``)
    of one run, each reserving ``actor_cpus`` CPUs. Ray restarts a dead actor by running its
    constructor again, up to ``max_restarts`` times; a task is never retried
    (``max_task_retries=0``): a step is not idempotent, the driver rolls everything back to a
    checkpoint instead."""

    def __init__(self):
        self.shards: list = []
        self.workers: list = []
        self.variable_shapes: dict = {}  # the dense variables' shapes, by dense.npz name

    def start(self, worker_class, schema, model, config, tables, *, workers: int,
              shards: int, actor_cpus: float, max_restarts: int,
              ray_address: str | None, tier_dir: str | None = None) -> None:
        """Create the actors and wait until each answers (failing here, not in the first
        step, when one cannot start)."""
        cpus = ray.cluster_resources().get("CPU", 0)
        needed = (workers + shards) * actor_cpus
        if needed > cpus:
            raise ValueError(
                f"the Ray cluster{'' if ray_address is None else ' at ' + ray_address} "
                f"has {cpus:g} CPUs; {workers} workers + {shards} shards at "
                f"{actor_cpus:g} CPU each need {needed:g} (lower actor_cpus or add nodes)")
        specs = table_specs(config, tables, shards, tier_dir)
        options = dict(num_cpus=actor_cpus, max_restarts=max_restarts, max_task_retries=0)
        shard_cls = ray.remote(Shard)
        self.shards = [shard_cls.options(**options).remote(s, shards, specs)
                       for s in range(shards)]
        worker_cls = ray.remote(worker_class)
        self.workers = [worker_cls.options(**options).remote(
            w, workers, shards, schema.to_dict(), model, config.to_dict())
            for w in range(workers)]
        signal_point("actors.created")
        ray.get([s.ping.remote() for s in self.shards])
        self.variable_shapes = ray.get(self.workers[0].variable_shapes.remote())
        ray.get([w.ping.remote() for w in self.workers[1:]])
        signal_point("actors.started")

    def named(self) -> list:
        """``(name, actor)`` of every actor, shards first, as messages name them."""
        return ([(f"store shard {i}", s) for i, s in enumerate(self.shards)]
                + [(f"worker {i}", w) for i, w in enumerate(self.workers)])

    def pids(self) -> dict:
        """The process id of every actor: ``{"shards": [...], "workers": [...]}``."""
        return {"shards": ray.get([s.pid.remote() for s in self.shards]),
                "workers": ray.get([w.pid.remote() for w in self.workers])}

    def kill(self) -> None:
        for actor in self.workers + self.shards:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
