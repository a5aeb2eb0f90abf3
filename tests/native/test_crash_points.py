"""Crash points of the store's durable writes: a child process killed at every named step of a
snapshot save or a delta export leaves the old complete file or the new complete one, never a
half file that loads; restarted without the crash point it writes the new one."""
import glob
import os
import subprocess
import sys

import pytest

import native
from native import crash_points
from store_reference import rows_by_id

# What the child and this test both run: a deterministic store after `version` rounds of work.
_BUILD = """
import numpy as np
import native

def build(version, write=None):
    store = native.EmbeddingStore(native.StoreConfig(
        dim=3, optimizer=native.Adagrad(0.1), entry_filter=native.CounterFilter(2), seed=4,
        num_shards=2))
    for step in range(1, version + 1):
        ids = np.arange(step * 7, step * 7 + 40) % 53
        unique, _, _ = store.lookup_unique(np.concatenate([ids, ids]), now=1000.0 + step)
        store.apply_gradients(unique, np.full((len(unique), 3), 0.01 * step, np.float32), step,
                              now=1000.0 + step)
        store.expire(max_idle_steps=1)
        if write is not None:
            write(store)
    return store
"""
# Snapshot: saves after rounds 1 and 2. Delta: exports after rounds 1 and 2.
_CHILD = _BUILD + """
import sys
kind, directory = sys.argv[1], sys.argv[2]
build(2, (lambda s: s.save(directory)) if kind == "snapshot" else
      (lambda s: s.export_delta(directory)))
print("done")
"""
_namespace: dict = {}
exec(_BUILD, _namespace)
build = _namespace["build"]


def run_child(kind, directory, point=None):
    """Run the child; with ``point`` set, it must die there with the crash exit code."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(native.__file__)))
    env = {k: v for k, v in os.environ.items() if k != crash_points.ENV}
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")])
    if point is not None:
        env[crash_points.ENV] = point
    child = subprocess.run([sys.executable, "-c", _CHILD, kind, str(directory)], env=env,
                           capture_output=True, text=True, timeout=120)
    if point is None:
        assert child.returncode == 0 and child.stdout.strip() == "done", child.stderr
    else:
        assert child.returncode == crash_points.EXIT_CODE, (child.returncode, child.stderr)
        assert "done" not in child.stdout
    return child


def rows(store):
    return {k: v.tobytes() for k, v in rows_by_id(store).items()}


# (point, version whose file is in place after the crash: 0 none, 1 the old one, 2 the new one)
SNAPSHOT_CASES = [
    ("store.snapshot.written", 0), ("store.snapshot.written:2", 1),
    ("store.snapshot.synced:2", 1), ("store.snapshot.renamed:2", 2),
    ("store.snapshot.renamed", 1),
]


@pytest.mark.parametrize("point, survivor", SNAPSHOT_CASES)
def test_a_snapshot_killed_at_any_point_is_the_old_or_the_new_one(tmp_path, point, survivor):
    directory = tmp_path / "snapshot"
    run_child("snapshot", directory, point)
    if survivor == 0:
        with pytest.raises(native.StoreIOError, match="cannot open"):
            native.EmbeddingStore.load(directory)
    else:
        assert rows(native.EmbeddingStore.load(directory)) == rows(build(survivor))
    leftovers = glob.glob(str(directory / "store.snapshot.tmp.*"))
    assert len(leftovers) == (0 if point.startswith("store.snapshot.renamed") else 1)
    run_child("snapshot", directory)  # the restart, without the crash point
    assert rows(native.EmbeddingStore.load(directory)) == rows(build(2))
    assert os.listdir(directory) == ["store.snapshot"]  # the crashed writer's temporary is gone


DELTA_CASES = [
    ("store.delta.written", 0), ("store.delta.written:2", 1), ("store.delta.synced:2", 1),
    ("store.delta.renamed:2", 2), ("store.delta.renamed", 1),
]


def follow(directory):
    """A serving copy that applies every delta in the directory, in order."""
    follower = build(0)
    for path in sorted(glob.glob(os.path.join(directory, "delta-*.bin"))):
        follower.apply_delta(path)
    return follower


@pytest.mark.parametrize("point, survivor", DELTA_CASES)
def test_a_delta_killed_at_any_point_is_the_old_or_the_new_one(tmp_path, point, survivor):
    directory = tmp_path / "deltas"
    run_child("delta", directory, point)
    names = sorted(os.listdir(directory)) if directory.exists() else []
    assert [n for n in names if n.endswith(".bin")] == [
        f"delta-{i:06d}.bin" for i in range(1, survivor + 1)]
    assert rows(follow(directory)) == rows(build(survivor))
    run_child("delta", directory)  # restarted from scratch: the same deltas, written whole
    assert sorted(os.listdir(directory)) == ["delta-000001.bin", "delta-000002.bin"]
    assert rows(follow(directory)) == rows(build(2))


def test_crash_points_count_hits_and_refuse_unknown_names():
    script = ("from native.crash_points import crash_point\n"
              "for _ in range(3): crash_point('offsets.commit')\n"
              "crash_point('offsets.committed')\nprint('survived')")
    env = {**os.environ}
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(native.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")])
    for value, code in (("offsets.commit:3", 86), ("offsets.commit:4", 0),
                        ("offsets.committed", 86), ("store.delta.written", 0)):
        child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                               timeout=60, env={**env, crash_points.ENV: value})
        assert child.returncode == code, (value, child.stderr)
        assert ("survived" in child.stdout) == (code == 0)
    assert crash_points.parse("checkpoint.latest") == ("checkpoint.latest", 1)
    assert crash_points.parse("checkpoint.latest:12") == ("checkpoint.latest", 12)
    with pytest.raises(ValueError, match="unknown crash point 'checkpoint.lastest'"):
        crash_points.parse("checkpoint.lastest")
    with pytest.raises(ValueError, match="n >= 1"):
        crash_points.parse("offsets.commit:0")
