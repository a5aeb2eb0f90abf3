"""Checkpoints of a long-running job: directories written atomically, never overwritten.

    run_dir/checkpoints/
        ckpt-0000000120/      <- everything one restore needs (dense weights, store, state.json)
        ckpt-0000000240/
        ckpt-0000000240-1/    <- step 240 saved again (e.g. new offsets, no step trained)
        LATEST                <- "ckpt-0000000240-1"

A checkpoint is written into a temporary directory, every file fsynced, and renamed to a name
no other checkpoint has had in this directory (the step, plus a revision when the step was
saved before); only then does LATEST name it (itself replaced atomically), and only after that
are older checkpoints removed (each renamed to a temporary name first, so a half-removed one
never looks like a checkpoint). A crash at any moment therefore leaves every checkpoint LATEST
ever named until then complete, or removed by name. The checkpoint to restore is the newest
complete one, ordered by (step, revision): normally the one LATEST names; after a crash between
the rename and the LATEST update, the new one, which is complete too. Leftover temporary
directories are removed on the next start.

Damage is refused, never restored from: ``state.json`` carries the sha256 of its own contents
(``checksum``), and what ``write`` puts in a checkpoint checks itself (``Trainer.save``'s
``trainer.json`` carries the sha256 of itself and of ``dense.npz``; store snapshots have their
own checksum). A damaged file raises :class:`CheckpointDamagedError` naming it; the operator
removes that checkpoint to resume from the previous one. Files written before checksums
existed (no ``checksum``) are read as they are.

On an object store (``trainer.online --run-dir s3://...``) the run directory is a local working
copy (downloaded from the store at start) that the manager publishes after every save: its files
under a hidden generation, ``_MANIFEST.json`` written last, older generations removed after
(:func:`compression.fs.publish_directory`). Readers and a restart see the run of the last
complete publish, never a mix; a crash before it leaves the previous one.

Each step of :meth:`CheckpointManager.save` is a crash point (``checkpoint.written``,
``checkpoint.renamed``, ``checkpoint.latest``, ``checkpoint.removing``, each also with
``.same-step`` in a save of a step saved before): see :mod:`native.crash_points`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from typing import Callable

import schemas
from compression import fs
from native.crash_points import crash_point
from trainer.config import ConfigError, TrainConfig

STATE_FILE = "state.json"
LATEST_FILE = "LATEST"
CHECKSUM_KEY = "checksum"
_NAME = re.compile(r"^ckpt-(\d{10,})(?:-(\d+))?$")


@dataclass(frozen=True)
class Checkpoint:
    path: str
    state: dict

    @property
    def step(self) -> int:
        return int(self.state["step"])


def _order(name: str) -> tuple[int, int] | None:
    """``(step, revision)`` of a checkpoint directory name; None for any other name."""
    match = _NAME.match(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


def _crash_point(point: str, again: bool) -> None:
    crash_point(f"checkpoint.{point}")
    if again:
        crash_point(f"checkpoint.{point}.same-step")


class CheckpointDamagedError(ValueError):
    """A checkpoint file is damaged: cut short, unparsable, or not what its checksum says.
    The message names the file."""


def file_sha256(path: str) -> str:
    """The sha256 of the file ``path``, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _json_sha256(value: dict) -> str:
    """The sha256 of ``value``'s canonical JSON: the same for every way of writing it."""
    value = json.loads(json.dumps(value))  # as read back: int keys become strings, tuples lists
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def sealed(value: dict) -> dict:
    """``value`` plus ``checksum``, the sha256 of its canonical JSON (see :func:`unsealed`)."""
    return {**value, CHECKSUM_KEY: _json_sha256(value)}


def read_json(path: str) -> dict:
    """The JSON object in the file ``path``; CheckpointDamagedError naming it when the bytes
    are not one (cut short, flipped bytes). A missing file raises FileNotFoundError."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointDamagedError(f"{path}: damaged checkpoint file, not valid JSON "
                                     f"({e})") from None
    except RecursionError:  # json.loads of thousands of nested [ or {
        raise CheckpointDamagedError(f"{path}: damaged checkpoint file, JSON nested too "
                                     "deeply") from None
    if not isinstance(value, dict):
        raise CheckpointDamagedError(f"{path}: damaged checkpoint file, expected a JSON "
                                     f"object, found {type(value).__name__}")
    return value


def unsealed(path: str, value: dict, required: bool = True) -> dict:
    """``value`` (read from ``path``) without its ``checksum``, after checking it: a value
    without one is accepted only when not ``required`` (written before checksums existed)."""
    value = dict(value)
    stored = value.pop(CHECKSUM_KEY, None)
    if stored is None:
        if required:
            raise CheckpointDamagedError(f"{path}: damaged checkpoint file, its checksum is "
                                         "missing")
        return value
    if stored != _json_sha256(value):
        raise CheckpointDamagedError(f"{path}: damaged checkpoint file, its contents do not "
                                     "match its checksum")
    return value


class CheckpointManager:
    """Writes and finds the checkpoints under ``run_dir/checkpoints``; keeps the newest ``keep``."""

    def __init__(self, run_dir: str, keep: int = 3, publish_to: str | None = None):
        """``publish_to``: an object-store run directory (``s3://...``), of which ``run_dir``
        is the local working copy: after each save the whole of ``run_dir`` is published there
        all or nothing (:func:`compression.fs.publish_directory`), and :meth:`save` returns
        only then (an object store cannot rename a directory; see the module's docstring)."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.run_dir = run_dir
        self.directory = os.path.join(run_dir, "checkpoints")
        self.keep = keep
        self.publish_to = publish_to
        os.makedirs(self.directory, exist_ok=True)
        # leftovers of a writer that died mid-save; a live writer's (a manager of another
        # process saving right now, or of this one) are its own to finish or remove
        for name in os.listdir(self.directory):
            if name.startswith(".tmp-") and not _writer_alive(name):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def _names(self) -> list[str]:
        """The checkpoint directory names, oldest first by (step, revision)."""
        names = [n for n in os.listdir(self.directory) if _order(n) is not None]
        return sorted(names, key=_order)

    def latest(self) -> Checkpoint | None:
        """The newest complete checkpoint (normally the one LATEST names), or None before the
        first one."""
        complete = self.all()
        if complete:
            return complete[-1]
        try:
            with open(os.path.join(self.directory, LATEST_FILE)) as f:
                name = f.read().strip()
        except FileNotFoundError:
            return None
        raise RuntimeError(f"{os.path.join(self.directory, name)}: LATEST names a checkpoint "
                           "that cannot be read and no other complete checkpoint is left; "
                           "the run directory was changed by hand?")

    def all(self) -> list[Checkpoint]:
        """Every complete checkpoint still on disk, oldest first."""
        out = []
        for name in self._names():
            path = os.path.join(self.directory, name)
            state_path = os.path.join(path, STATE_FILE)
            # Checkpoints are complete when named: one that cannot be read was damaged after.
            try:
                state = unsealed(state_path, read_json(state_path), required=False)
            except FileNotFoundError:
                if not os.path.isdir(path):
                    continue  # pruned by the writer since it was listed
                raise CheckpointDamagedError(
                    f"{state_path}: damaged checkpoint, its state is missing; remove {path} "
                    "to resume from the previous checkpoint") from None
            except OSError as e:
                raise CheckpointDamagedError(
                    f"{state_path}: damaged checkpoint, cannot read its state ({e}); remove "
                    f"{path} to resume from the previous checkpoint") from None
            except CheckpointDamagedError as e:
                raise CheckpointDamagedError(
                    f"{e}; remove {path} to resume from the previous checkpoint") from None
            out.append(Checkpoint(path, state))
        return out

    def save(self, write: Callable[[str], None], state: dict) -> Checkpoint:
        """Call ``write(tmp_dir)`` to fill a new checkpoint, add ``state`` (must hold ``step``),
        make it durable and point LATEST at it. Saving a step that has a checkpoint already
        writes a new revision of it; the older one is removed only after LATEST moved."""
        step = int(state["step"])
        revisions = [r for s, r in map(_order, self._names()) if s == step]
        again = bool(revisions)
        name = f"ckpt-{step:010d}" + (f"-{max(revisions) + 1}" if again else "")
        final = os.path.join(self.directory, name)
        tmp = os.path.join(self.directory, _tmp_name())
        os.makedirs(tmp)
        try:
            write(tmp)
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump(sealed(state), f, indent=2, sort_keys=True)
            _fsync_tree(tmp)
            _crash_point("written", again)
            os.rename(tmp, final)  # a new name: nothing is replaced
            _fsync_dir(self.directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _crash_point("renamed", again)
        pointer = os.path.join(self.directory, _tmp_name())
        with open(pointer, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, os.path.join(self.directory, LATEST_FILE))
        _fsync_dir(self.directory)
        _crash_point("latest", again)
        self._prune(keep_name=name, again=again)
        if self.publish_to is not None:
            self.publish()
        return Checkpoint(final, state)

    def publish(self) -> None:
        """Publish the local run directory to ``publish_to`` (nothing without one)."""
        if self.publish_to is not None:
            fs.publish_directory(self.run_dir, self.publish_to, flag="--run-dir")

    def _prune(self, keep_name: str, again: bool = False):
        """Remove the checkpoints older than the newest ``keep`` and older revisions of
        ``keep_name``'s step (it supersedes them)."""
        step = _order(keep_name)[0]
        names = [n for n in self._names() if n != keep_name]
        superseded = [n for n in names if _order(n)[0] == step]
        others = [n for n in names if _order(n)[0] != step]
        kept = sorted(others + [keep_name], key=_order)[-self.keep:]
        for name in superseded + [n for n in others if n not in kept]:
            # rename first: a crash mid-removal leaves a temporary directory, not a checkpoint
            doomed = os.path.join(self.directory, _tmp_name())
            try:
                os.rename(os.path.join(self.directory, name), doomed)
            except OSError:
                continue
            _crash_point("removing", again)
            shutil.rmtree(doomed, ignore_errors=True)


def _tmp_name() -> str:
    """A temporary name in the checkpoints directory: ``.tmp-PID-RANDOM`` (the writer's pid)."""
    return f".tmp-{os.getpid()}-{uuid.uuid4().hex}"


def _writer_alive(name: str) -> bool:
    """Whether the process that made the temporary ``name`` still runs (names without a pid,
    from older versions, count as a dead writer's)."""
    parts = name.split("-")
    if len(parts) < 3 or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except PermissionError:
        return True  # another user's process
    except (ProcessLookupError, OverflowError):
        return False
    return True


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


def config_before_l2(config: dict) -> dict:
    """A checkpoint's config written before the rows' L2 existed (no ``l2`` in its tables)
    with that version's behaviour written out: no L2."""
    config = dict(config)
    embedding = dict(config.get("embedding") or {})
    if "l2" in embedding:
        return config
    embedding["l2"] = 0.0
    config["embedding"] = embedding
    config["tables"] = {name: {**(raw or {}), "l2": (raw or {}).get("l2", 0.0)}
                        for name, raw in (config.get("tables") or {}).items()}
    return config


def dense_name(kind: str, index: int) -> str:
    """The name of dense array ``index`` in ``dense.npz`` (checkpoints, exports, deltas):
    ``model/NNNN`` (``kind`` "model": the network's variables, in their build order) or
    ``optimizer/NNNN`` (the dense optimizer's)."""
    return f"{kind}/{index:04d}"


# -- trainer.json: the state of a single-process trainer checkpoint (trainer.Trainer.save) --

# 3: trainer.json carries the sha256 of itself and of dense.npz (``checksum``, ``checksums``)
CHECKPOINT_VERSION = 3


def checkpoint_state(directory: str) -> dict:
    """The state (``trainer.json``) of the checkpoint in ``directory``, checked as
    :meth:`Trainer.restore` checks it (CheckpointDamagedError naming what is damaged), its
    config in this version's form: what :meth:`Trainer.restore` and a distributed run
    starting from a single-process one (``trainer.distributed.manifest.run_checkpoint``)
    read."""
    state = read_trainer_state(directory)
    try:
        schema = schemas.from_dict(state["schema"])
    except schemas.SchemaError as e:
        raise CheckpointDamagedError(f"{os.path.join(directory, 'trainer.json')}: the "
                                     f"schema it holds is not valid: {e}") from None
    if state["version"] == 1:
        state["config"] = _config_v1(state["config"], schema)
    checkpoint_config(directory, state)
    return state


def read_trainer_state(directory: str) -> dict:
    """The state (trainer.json) of the checkpoint in ``directory``, checked: a damaged
    trainer.json or dense.npz raises CheckpointDamagedError naming it (version 3 checks both
    against their sha256; older versions only what parsing them finds, when the trainer
    reads dense.npz)."""
    path = os.path.join(directory, "trainer.json")
    try:
        state = read_json(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{directory}: no trainer checkpoint (trainer.json missing); "
                                "write one with Trainer.save") from None
    version = state.get("version")
    if version not in (1, 2, CHECKPOINT_VERSION):
        raise ValueError(f"{path}: checkpoint version {version}, this trainer reads versions "
                         f"1 to {CHECKPOINT_VERSION}")
    dense_path = os.path.join(directory, "dense.npz")
    if version >= 3:
        state = unsealed(path, state)
        checksums = state.get("checksums")
        if not isinstance(checksums, dict) or not isinstance(checksums.get("dense.npz"), str):
            raise CheckpointDamagedError(f"{path}: damaged checkpoint file, no sha256 of "
                                         "dense.npz in its 'checksums'")
        expected = checksums["dense.npz"]
        try:
            found = file_sha256(dense_path)
        except FileNotFoundError:
            raise CheckpointDamagedError(f"{dense_path}: missing from the checkpoint") from None
        if found != expected:
            raise CheckpointDamagedError(f"{dense_path}: damaged checkpoint file, its sha256 is "
                                         f"{found}, {path} says {expected}")
    _check_state(path, state)
    return state


def _check_state(path: str, state: dict) -> None:
    """The fields of a trainer.json that loading reads, with their types: a file with a valid
    checksum can still be one a bug or a hand edit wrote (CheckpointDamagedError naming it)."""
    def bad(what: str):
        raise CheckpointDamagedError(f"{path}: not a valid trainer checkpoint, {what}; restore "
                                     "it from a copy or train again")

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    for key in ("step", "samples"):
        if not count(state.get(key)):
            bad(f"{key!r} must be a count (an integer >= 0), found {state.get(key)!r}")
    if "expired" in state and not count(state["expired"]):
        bad(f"'expired' must be a count (an integer >= 0), found {state['expired']!r}")
    for key in ("config", "schema"):
        if not isinstance(state.get(key), dict):
            bad(f"{key!r} must be a mapping, found {type(state.get(key)).__name__}")
    if "model" not in state or not isinstance(state["model"], (dict, type(None))):
        bad("'model' must be a mapping or null")
    variables = state.get("variables")
    if not isinstance(variables, list) or not all(isinstance(v, str) for v in variables):
        bad(f"'variables' must be a list of names, found {type(variables).__name__}")
    config = state["config"]
    if not isinstance(config.get("embedding") or {}, dict):
        bad("config.embedding must be a mapping")
    tables = config.get("tables") or {}
    if not isinstance(tables, dict) or not all(isinstance(raw or {}, dict)
                                               for raw in tables.values()):
        bad("config.tables must map table names to mappings")


def checkpoint_config(directory: str, state: dict) -> TrainConfig:
    """The checkpoint's training config; CheckpointDamagedError naming its trainer.json when
    the config it holds is not valid."""
    try:
        return TrainConfig.from_dict(config_before_l2(state["config"]))
    except ConfigError as e:
        raise CheckpointDamagedError(f"{os.path.join(directory, 'trainer.json')}: the training "
                                     f"config it holds is not valid: {e}") from None


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
