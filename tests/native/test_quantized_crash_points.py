"""Crash points of the quantized export files: a child killed at every named step of writing a
quantized snapshot, or of rewriting a store delta as a quantized one in place, leaves the old
complete file or the new complete one (a quantized file that loads, or the store's delta it
was made from), never a half file; the write run again finishes it."""
import glob
import os
import subprocess
import sys

import numpy as np
import pytest

import native
from native import crash_points
from native import quantized as q

_BUILD = """
import os
import numpy as np
import native
from native import quantized as q

def build(version, out):
    store = native.EmbeddingStore(native.StoreConfig(dim=3, optimizer=native.Adagrad(0.1),
                                                     seed=4, num_shards=2))
    for step in range(1, version + 1):
        ids = np.arange(step * 7, step * 7 + 40) % 53
        unique, _, _ = store.lookup_unique(ids, now=1000.0 + step)
        store.apply_gradients(unique, np.full((len(unique), 3), 0.01 * step, np.float32), step,
                              now=1000.0 + step)
        store.save(os.path.join(out, f"float-{step}"))
        store.export_delta(os.path.join(out, "deltas"))
    return store
"""
_CHILD = _BUILD + """
import sys
kind, out = sys.argv[1], sys.argv[2]
build(2, out)
if kind == "snapshot":
    for step in (1, 2):
        q.quantize_snapshot(os.path.join(out, f"float-{step}"),
                            os.path.join(out, "q", q.SNAPSHOT_FILE), "int8")
else:
    path = os.path.join(out, "deltas", "delta-000001.bin")
    q.quantize_delta(path, path, "int8")
print("done")
"""


def run_child(kind, out, point=None):
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(native.__file__)))
    env = {k: v for k, v in os.environ.items() if k != crash_points.ENV}
    env["PYTHONPATH"] = os.pathsep.join([package_root, env.get("PYTHONPATH", "")])
    if point is not None:
        env[crash_points.ENV] = point
    child = subprocess.run([sys.executable, "-c", _CHILD, kind, str(out)], env=env,
                           capture_output=True, text=True, timeout=120)
    if point is None:
        assert child.returncode == 0 and child.stdout.strip() == "done", child.stderr
    else:
        assert child.returncode == crash_points.EXIT_CODE, (child.returncode, child.stderr)
    return child


def quantized_rows(path):
    contents = q.read_quantized_snapshot(path)
    return contents["ids"].tolist(), contents["rows"].tobytes()


# (point, which quantized snapshot is in place: 0 none, 1 the first, 2 the second)
SNAPSHOT_CASES = [("quantized.snapshot.written", 0), ("quantized.snapshot.synced:2", 1),
                  ("quantized.snapshot.renamed", 1), ("quantized.snapshot.renamed:2", 2)]


@pytest.mark.parametrize("point, survivor", SNAPSHOT_CASES)
def test_a_quantized_snapshot_killed_at_any_point_is_the_old_or_the_new_one(
        tmp_path, point, survivor):
    run_child("snapshot", tmp_path, point)
    path = tmp_path / "q" / q.SNAPSHOT_FILE
    expected = {}
    for step in (1, 2):
        q.quantize_snapshot(tmp_path / f"float-{step}", tmp_path / f"check-{step}" /
                            q.SNAPSHOT_FILE, "int8")
        expected[step] = quantized_rows(tmp_path / f"check-{step}" / q.SNAPSHOT_FILE)
    if survivor == 0:
        with pytest.raises(native.StoreIOError, match="cannot open"):
            native.QuantizedStore.load(tmp_path / "q")
    else:
        assert quantized_rows(path) == expected[survivor]
    run_child("snapshot", tmp_path)
    assert quantized_rows(path) == expected[2]
    assert os.listdir(tmp_path / "q") == [q.SNAPSHOT_FILE]  # the crashed temporary is gone


@pytest.mark.parametrize("point, converted", [("quantized.delta.written", False),
                                              ("quantized.delta.synced", False),
                                              ("quantized.delta.renamed", True)])
def test_a_delta_rewritten_in_place_is_the_store_delta_or_the_quantized_one(
        tmp_path, point, converted):
    run_child("delta", tmp_path, point)
    path = tmp_path / "deltas" / "delta-000001.bin"
    with open(path, "rb") as f:
        magic = f.read(8)
    assert magic == (b"PRXQDLT1" if converted else b"PRXDELT1")
    if not converted:  # the store's delta, whole: a store follows it
        store = native.EmbeddingStore(native.StoreConfig(dim=3, optimizer=native.Adagrad(0.1)))
        assert store.apply_delta(path) == 1
    else:
        assert len(q.read_quantized_delta(path)["ids"]) == 40
    assert len(glob.glob(str(tmp_path / "deltas" / "*.tmp.*"))) == (0 if converted else 1)
    run_child("delta", tmp_path)
    contents = q.read_quantized_delta(path)
    assert contents["sequence"] == 1 and len(contents["ids"]) == 40
    assert np.isfinite(contents["rows"]).all()
