"""pipelines.generate --out s3://: the same files and truth as on local disk, published by a
manifest (nothing visible before it, nothing left of a failed run)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import compression
import schemas
from compression import cli, fs
from pipelines import generate as gen

ROOT = Path(__file__).resolve().parents[2]
TAOBAO_PATH = str(ROOT / "schemas" / "examples" / "taobao_like.yaml")


def _run(out, *extra):
    return gen.run(["--schema", TAOBAO_PATH, "--samples", "3000", "--shards", "3",
                    "--seed", "5", "--out", str(out), *extra])


def test_generate_to_s3_writes_the_local_files_under_a_manifest(s3_bucket, tmp_path):
    local = _run(tmp_path / "raw")
    out = f"{s3_bucket}/raw"
    remote = _run(out)
    assert remote == local  # the truth, file sizes included
    files = fs.expand(out)
    assert [fs.basename(f) for f in files] == local["files"]
    for name, path in zip(local["files"], files):
        with fs.source(path) as src:
            assert pq.read_table(src).equals(pq.read_table(tmp_path / "raw" / name))
    truth = json.loads(fs.read_text(fs.resolve_published(f"{out}/{gen.TRUTH_FILE}")))
    assert truth == remote
    manifest = fs.published_manifest(out)
    assert sorted(manifest["files"]) == [gen.TRUTH_FILE, *local["files"]]
    assert {f[len(out) + 1:].split("/")[0] for f in fs.list_files(out)} == {
        fs.MANIFEST, manifest["generation"]}
    # the compression job's readers take the published directory as input
    assert compression.read_raw(f"{out}/part-*.parquet", schemas.load(TAOBAO_PATH)).equals(
        compression.read_raw(str(tmp_path / "raw"), schemas.load(TAOBAO_PATH)))
    with pytest.raises(cli.OutputExistsError, match="pass --overwrite"):
        _run(out)


def test_a_failed_generate_on_s3_publishes_nothing(s3_bucket):
    out = f"{s3_bucket}/raw"
    with pytest.raises(ValueError, match="shards: 5000 shards for 3000 samples"):
        _run(out, "--shards", "5000")
    assert fs.list_files(out) == []
