"""Checkpoints of a long-running job: numbered directories written atomically, with a LATEST pointer.

    run_dir/checkpoints/
        ckpt-0000000120/      <- everything one restore needs (dense weights, store, state.json)
        ckpt-0000000240/
        LATEST                <- "ckpt-0000000240"

A checkpoint is written into a temporary directory, every file fsynced, renamed into place,
and only then named by LATEST (itself replaced atomically). A crash at any moment leaves either
the previous checkpoint or the new one as LATEST, never a partial one; leftover temporary
directories are removed on the next start.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Callable

STATE_FILE = "state.json"
LATEST_FILE = "LATEST"


@dataclass(frozen=True)
class Checkpoint:
    path: str
    state: dict

    @property
    def step(self) -> int:
        return int(self.state["step"])


class CheckpointManager:
    """Writes and finds the checkpoints under ``run_dir/checkpoints``; keeps the newest ``keep``."""

    def __init__(self, run_dir: str, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = os.path.join(run_dir, "checkpoints")
        self.keep = keep
        os.makedirs(self.directory, exist_ok=True)
        for name in os.listdir(self.directory):
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def latest(self) -> Checkpoint | None:
        """The checkpoint LATEST names, or None before the first one."""
        try:
            with open(os.path.join(self.directory, LATEST_FILE)) as f:
                name = f.read().strip()
        except FileNotFoundError:
            return None
        path = os.path.join(self.directory, name)
        try:
            with open(os.path.join(path, STATE_FILE)) as f:
                state = json.load(f)
        except (OSError, ValueError) as e:
            raise RuntimeError(f"{path}: LATEST names a checkpoint that cannot be read ({e}); "
                               "the run directory was changed by hand?") from None
        return Checkpoint(path, state)

    def all(self) -> list[Checkpoint]:
        """Every complete checkpoint still on disk, oldest first."""
        out = []
        for name in sorted(os.listdir(self.directory)):
            state_path = os.path.join(self.directory, name, STATE_FILE)
            if name.startswith("ckpt-") and os.path.exists(state_path):
                with open(state_path) as f:
                    out.append(Checkpoint(os.path.join(self.directory, name), json.load(f)))
        return out

    def save(self, write: Callable[[str], None], state: dict) -> Checkpoint:
        """Call ``write(tmp_dir)`` to fill a new checkpoint, add ``state`` (must hold ``step``),
        make it durable and point LATEST at it."""
        step = int(state["step"])
        name = f"ckpt-{step:010d}"
        final = os.path.join(self.directory, name)
        tmp = os.path.join(self.directory, f".tmp-{uuid.uuid4().hex}")
        os.makedirs(tmp)
        try:
            write(tmp)
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump(state, f, indent=2, sort_keys=True)
            _fsync_tree(tmp)
            if os.path.exists(final):  # same step again (nothing trained since): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        pointer = os.path.join(self.directory, f".tmp-{uuid.uuid4().hex}")
        with open(pointer, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, os.path.join(self.directory, LATEST_FILE))
        _fsync_dir(self.directory)
        self._prune(keep_name=name)
        return Checkpoint(final, state)

    def _prune(self, keep_name: str):
        names = sorted(n for n in os.listdir(self.directory) if n.startswith("ckpt-"))
        for name in names[:-self.keep]:
            if name != keep_name:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)


def _fsync_tree(root: str):
    for directory, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(directory, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(directory)


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
