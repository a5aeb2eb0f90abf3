"""A distributed checkpoint's format: ``manifest.json``, written last by the driver, read first
by a restore (which may use another number of shards), beside every shard's snapshot
(``shard-NNNN/<table>``) and worker 0's dense weights and optimizer state (``dense.npz``);
and what a restore checks before it loads one."""

from __future__ import annotations

import json
import os

MANIFEST_VERSION = 1
PLACEMENT = "mix64(id) % shards"


def shard_dir(shard: int) -> str:
    """Shard ``shard``'s directory in a checkpoint."""
    return f"shard-{shard:04d}"


def distributed_manifest(*, step: int, samples: int, expired: int, passes: int,
                         positions: list[int] | None, workers: int, saved: list[dict],
                         tables: list[str], variables: list, model: dict | None,
                         config: dict, schema: dict, extra: dict | None = None) -> dict:
    """The manifest of a checkpoint whose shards wrote ``saved`` (each shard's ``rows`` and
    ``expired``) and whose dense variables are ``variables``. ``extra``: entries of the
    caller's (online learning's Kafka offsets)."""
    shards = len(saved)
    return {
        "version": MANIFEST_VERSION, "kind": "prefixrec-distributed", "step": step,
        "samples": samples, "expired": expired, "shards": shards,
        # every worker's input position: pass `passes` (pass k deals worker w's trees in
        # the order of seed (config.seed, k, w)) and the batches each worker took from it,
        # null once that pass is finished
        "passes": passes, "positions": positions,
        "workers": workers, "placement": PLACEMENT,
        "shard_dirs": [shard_dir(i) for i in range(shards)],
        "shard_rows": [s["rows"] for s in saved],
        "shard_expired": [s["expired"] for s in saved],
        "tables": list(tables), "variables": variables,
        "model": model, "config": config,
        "schema": schema, **(extra or {})}


def write_manifest(directory: str, manifest: dict) -> None:
    """``directory/manifest.json``, fsynced and renamed into place (the checkpoint's last
    file)."""
    with open(os.path.join(directory, "manifest.json.tmp"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(directory, "manifest.json.tmp"),
               os.path.join(directory, "manifest.json"))


def shard_snapshot_spec(directory: str, manifest: dict, shard: int, shards: int):
    """What shard ``shard`` of ``shards`` loads from a checkpoint ``directory``."""
    dirs = [os.path.join(directory, d) for d in manifest["shard_dirs"]]
    return (dirs[shard],) if manifest["shards"] == shards else dirs


def single_process_manifest(state: dict) -> dict:
    """A single-process checkpoint's state (its checked ``trainer.json``) as the manifest of a
    one-shard distributed checkpoint in the same directory: its ``stores/`` holds every
    table's snapshot as a shard's directory does and its ``dense.npz`` the same arrays, so a
    distributed run loads it (resharded into any number of shards) as its own."""
    expired = state.get("expired", 0)
    return {"version": MANIFEST_VERSION, "kind": "prefixrec-distributed",
            "step": state["step"], "samples": state["samples"], "expired": expired,
            "shards": 1, "passes": 0, "positions": None, "workers": 1,
            "placement": PLACEMENT, "shard_dirs": ["stores"],
            "shard_expired": [expired], "tables": state.get("tables"),
            "variables": state["variables"], "model": state["model"],
            "config": state["config"], "schema": state["schema"]}


def read_manifest(directory) -> dict:
    """A distributed checkpoint's ``manifest.json``, with clear errors for what is not one."""
    directory = os.path.abspath(os.fspath(directory))
    path = os.path.join(directory, "manifest.json")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        if os.path.exists(os.path.join(directory, "trainer.json")):
            raise FileNotFoundError(f"{directory}: a single-process checkpoint (trainer.json, no "
                                    "manifest.json); restore it with trainer.Trainer.restore"
                                    ) from None
        raise FileNotFoundError(f"{directory}: no distributed checkpoint (manifest.json "
                                "missing; a checkpoint without one was not finished)") from None
    if manifest.get("kind") != "prefixrec-distributed" or \
            manifest.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{path}: not a version-{MANIFEST_VERSION} distributed checkpoint")
    return manifest


def schema_difference(saved: dict, current: dict) -> str:
    """What differs between two schemas' dicts, in words."""
    def features(d):
        return {(layer["name"], f["name"]): f for layer in d["layers"] for f in layer["features"]}

    a, b = features(saved), features(current)
    parts = []
    if set(a) - set(b):
        parts.append("features only in the checkpoint: "
                     + ", ".join(f"{l}.{n}" for l, n in sorted(set(a) - set(b))))
    if set(b) - set(a):
        parts.append("features only in this trainer: "
                     + ", ".join(f"{l}.{n}" for l, n in sorted(set(b) - set(a))))
    changed = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    if changed:
        parts.append("features changed: " + ", ".join(f"{l}.{n}" for l, n in changed))
    if not parts:
        keys = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
        parts.append("differs in " + (", ".join(keys) or "the layers' keys or order"))
    return "; ".join(parts)


def run_checkpoint(run_dir) -> tuple[str, dict]:
    """The checkpoint a ``trainer.train`` run kept (``RUN_DIR/checkpoint``) and its manifest:
    a Ray run's own, or a single-process run's state read as a one-shard distributed
    checkpoint (:func:`single_process_manifest`), so that :meth:`DistributedTrainer.restore`
    takes either into any number of shards. What ``trainer.online --init-from RUN_DIR
    --workers W --shards S`` starts from."""
    from trainer.checkpoints import checkpoint_state

    checkpoint = os.path.join(os.fspath(run_dir), "checkpoint")
    if os.path.isfile(os.path.join(checkpoint, "trainer.json")):
        return checkpoint, single_process_manifest(checkpoint_state(checkpoint))
    if not os.path.isfile(os.path.join(checkpoint, "manifest.json")):
        raise FileNotFoundError(
            f"{run_dir}: not a trainer.train run directory (no checkpoint/trainer.json or "
            "checkpoint/manifest.json); an interrupted run keeps its model there too")
    return checkpoint, read_manifest(checkpoint)


def config_difference(saved: dict, current: dict) -> list[str]:
    """The config keys in which a checkpoint's config (as saved) and a trainer's differ,
    sorted; the resolved dense statistics do not count (the checkpoint's are taken)."""
    saved = dict(saved)
    saved.pop("dense", None)
    return sorted(k for k in set(saved) | set(current)
                  if k != "dense" and saved.get(k) != current.get(k))


def dense_difference(manifest: dict, found: dict, wanted: dict) -> str | None:
    """Why a checkpoint's dense network (``found``: its ``model/`` variables' shapes by
    ``dense.npz`` name) does not fit a model's (``wanted``), in words; None when it fits."""
    if wanted == found:
        return None
    bad = next((k for k in sorted(wanted) if found.get(k, wanted[k]) != wanted[k]), None)
    return (f"{len(found)} dense variables in the checkpoint, {len(wanted)} in this "
            "model" if len(found) != len(wanted) or bad is None else
            f"variable {manifest['variables'][int(bad[6:])]} has shape "
            f"{found[bad]} in the checkpoint, {wanted[bad]} in this model")


def expired_per_shard(manifest: dict, shards: int) -> list[int]:
    """The rows each of ``shards`` shards counts as expired after loading the checkpoint:
    its own shard's count, or resharded, the total on shard 0."""
    expired = manifest["shard_expired"]
    if shards != manifest["shards"]:
        expired = [sum(expired)] + [0] * (shards - 1)
    return expired
