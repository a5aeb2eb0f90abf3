"""A distributed checkpoint's ``manifest.json``: written last by the driver, read first by a
restore (which may use another number of shards)."""

from __future__ import annotations

import json
import os

MANIFEST_VERSION = 1


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
            "placement": "mix64(id) % shards", "shard_dirs": ["stores"],
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
