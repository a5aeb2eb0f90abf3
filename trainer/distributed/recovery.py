"""Recovery from a dead actor: telling an actor's death from an error of the step, the
checkpoint a fit rolls back to with the driver's counters at that point, and waiting until
Ray restarted every actor."""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass

import ray

from trainer.distributed.shard import RESTARTED


def is_actor_failure(error: BaseException) -> bool:
    """An actor's process died (or Ray restarted it and it refused to go on without a
    checkpoint), as opposed to an error in the step itself."""
    return isinstance(error, ray.exceptions.RayActorError) or RESTARTED in str(error)


def failure_summary(error: BaseException) -> str:
    """One line naming an actor's death: the error's type and the first line of its text."""
    cause = getattr(error, "cause", None) or error  # a RayTaskError wraps the death
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(cause)).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0][:200] if text else ''}"


def retrying(body, recover):
    """``body()``; when an actor dies in it, ``recover(error)`` (which rolls every actor back
    to a checkpoint or raises) and ``body()`` again."""
    while True:
        try:
            return body()
        except ray.exceptions.RayError as error:
            if not is_actor_failure(error):
                raise
            recover(error)


@dataclass
class RollbackPoint:
    """The last checkpoint a fit wrote, with the driver's counters and the fit loop's progress
    at that point: what a rollback goes back to."""

    directory: str
    losses: int                 # len(trainer.losses)
    ids_fed: int
    leaf_ids: int
    bytes: dict
    progress: dict              # the fit loop's snapshot

    @classmethod
    def of(cls, trainer, directory: str, progress: dict) -> "RollbackPoint":
        return cls(directory, len(trainer.losses), trainer.ids_fed, trainer.leaf_ids,
                   dict(trainer.bytes), progress)

    def rewind(self, trainer) -> None:
        """The trainer's counters as they were at this point (its step and model come from
        the checkpoint)."""
        del trainer.losses[self.losses:]
        trainer.ids_fed, trainer.leaf_ids = self.ids_fed, self.leaf_ids
        trainer.bytes = defaultdict(int, self.bytes)


def await_actors(named: list, error, checkpoint: str, max_restarts: int,
                 timeout: float = 120.0) -> None:
    """Wait until every actor of ``named`` (``(name, actor)`` pairs) answers again (Ray
    restarts a dead one); raise ``RuntimeError`` when one is gone for good (restarted
    ``max_restarts`` times already) or does not come back within ``timeout`` s."""
    deadline = time.monotonic() + timeout
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
                                   f"{max_restarts}); the last checkpoint is "
                                   f"{checkpoint}") from e
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(f"{name} did not come back within {timeout:g} s after "
                                   "an actor died") from error
