"""Crash points of the disk tier's writes: a store with a memory budget killed while it moves
rows to disk, or while it compacts its tier file, restores from its last snapshot into the same
tier directory to the rows of that snapshot, and goes on training to the rows of a run that
was never killed (nothing a killed writer left in the tier is read)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import native
from native import crash_points
from store_reference import rows_by_id

_BUILD = """
import numpy as np
import native

def config(tiers):
    kw = {} if tiers is None else dict(memory_budget_bytes=2 * 100 * 64, disk_dir=tiers)
    return native.StoreConfig(dim=3, optimizer=native.Adagrad(0.1), seed=4, num_shards=2, **kw)

def step(store, step, ids):
    unique, _, _ = store.lookup_unique(np.concatenate([ids, ids[:50]]), now=1000.0 + step)
    store.apply_gradients(unique, np.full((len(unique), 3), 0.01 * step, np.float32), step,
                          now=1000.0 + step)

def train(store, first, last):
    for k in range(first, last + 1):
        if k <= 6:  # within the budget: nothing on disk yet
            step(store, k, np.arange(k, k + 40))
        elif k == 7:  # 12,000 rows: most go to disk
            step(store, k, np.arange(0, 12000))
        elif k <= 10:  # a hot set comes back up and goes down again, through the same slots
            step(store, k, np.arange(0, 12000, 4) + (k % 4))
        else:  # the idle rows expire, on disk: the tier's file is compacted
            step(store, k, np.arange(k, k + 40))
            store.expire(max_idle_steps=2)
"""
_CHILD = _BUILD + """
import sys
tiers, snapshot = sys.argv[1], sys.argv[2]
store = native.EmbeddingStore(config(tiers))
train(store, 1, 6)
store.save(snapshot)
print("saved", flush=True)
train(store, 7, 12)
print("done")
"""
_namespace: dict = {}
exec(_BUILD, _namespace)


def rows(store):
    return {k: v.tobytes() for k, v in rows_by_id(store).items()}


def reference(last):
    store = native.EmbeddingStore(_namespace["config"](None))
    _namespace["train"](store, 1, last)
    return store


@pytest.mark.parametrize("point", ["tier.put.written:2", "tier.reclaim.moved"])
def test_a_store_killed_in_a_tier_write_restores_from_its_snapshot(tmp_path, point):
    tiers, snapshot = str(tmp_path / "tiers"), str(tmp_path / "snapshot")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(native.__file__)))
    env = {k: v for k, v in os.environ.items() if k != crash_points.ENV}
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")])
    env[crash_points.ENV] = point
    child = subprocess.run([sys.executable, "-c", _CHILD, tiers, snapshot], env=env,
                           capture_output=True, text=True, timeout=120)
    # Killed in the tier write after the snapshot (the save itself writes no tier).
    assert child.returncode == crash_points.EXIT_CODE, (child.returncode, child.stderr)
    assert child.stdout.split() == ["saved"]
    assert any(os.scandir(tiers))  # the killed writer's tier files are still there

    restored = native.EmbeddingStore.load(snapshot, _namespace["config"](tiers))
    assert rows(restored) == rows(reference(6))
    _namespace["train"](restored, 7, 12)
    stats = restored._native.tier_stats()
    assert stats["evicted_to_disk"] > 10000 and stats["faults"] > 0
    assert rows(restored) == rows(reference(12))
