"""The Beam batch compression job on Beam's DaskRunner, against a local Dask cluster of two
worker processes, reading from and writing to s3:// on a real S3 server (moto): the same
trees, statistics and dead letters as the FnApiRunner gives."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client, get_task_stream

import compression
from compression import fs
from dask_cluster import local_dask_cluster
from pipelines import compress as job
from sample_data import taobao_table

ROOT = Path(__file__).resolve().parents[2]
TAOBAO_PATH = str(ROOT / "schemas" / "examples" / "taobao_like.yaml")
DASK_RUNNER = "--runner=apache_beam.runners.dask.dask_runner.DaskRunner"


@pytest.fixture(scope="module")
def dask_cluster(s3_server):
    """Two Dask worker processes whose environment names the S3 server (as a cluster's
    workers would have their store's credentials)."""
    with s3_server.environment(), local_dask_cluster(workers=2) as cluster:
        yield cluster


def _run(inputs: str, output: str, *extra) -> dict:
    return job.run(["--schema", TAOBAO_PATH, "--input", inputs, "--output", output,
                    "--shards", "4", "--chunk-rows", "400", "--max-bad-rows", "1",
                    *map(str, extra)])


def test_the_job_on_a_dask_cluster_writes_the_trees_of_the_fnapi_runner(
        dask_cluster, s3_bucket, tmp_path):
    tables = [taobao_table(700, seed=20 + s) for s in range(3)]
    click = tables[2].column("click").to_pylist()
    click[5] = 4.0  # one bad row: its dead letter is written by a worker
    tables[2] = tables[2].set_column(tables[2].schema.get_field_index("click"), "click",
                                     pa.array(click, pa.float32()))
    for i, table in enumerate(tables):
        pq.write_table(table, tmp_path / f"{i}.parquet")
        fs.write_bytes(f"{s3_bucket}/raw/part-{i}.parquet",
                       (tmp_path / f"{i}.parquet").read_bytes())
    raw = f"{s3_bucket}/raw/part-*.parquet"
    local = _run(raw, f"{s3_bucket}/fnapi", "--runner=FnApiRunner")
    with Client(dask_cluster) as client, get_task_stream(client=client) as tasks:
        remote = _run(raw, f"{s3_bucket}/dask", DASK_RUNNER,
                      f"--dask_client_address={dask_cluster.scheduler_address}")
    # the work ran in both worker processes
    assert len({t["worker"] for t in tasks.data if "apply_dofn" in str(t["key"])}) == 2
    assert remote == local and remote["samples"] == 2099 and remote["bad_rows"] == 1
    names = [job.part_name(s, 4) for s in range(4)]
    for out in ("fnapi", "dask"):
        assert [fs.basename(f) for f in compression.expand_paths(f"{s3_bucket}/{out}")] == names
    for name in names:
        assert compression.read_trees(f"{s3_bucket}/dask/{name}").equals(
            compression.read_trees(f"{s3_bucket}/fnapi/{name}"))
    stats = [json.loads(fs.read_text(fs.resolve_published(f"{s3_bucket}/{out}/_stats.json")))
             for out in ("fnapi", "dask")]
    assert stats[0] == stats[1] == remote
    dead = [[fs.read_text(f) for f in fs.expand(f"{s3_bucket}/{out}/_dead_letter/*.jsonl")]
            for out in ("fnapi", "dask")]
    assert dead[0] == dead[1] and json.loads(dead[1][0])["row"] == 6


def test_too_many_bad_rows_on_dask_fail_the_job_and_publish_nothing(dask_cluster, s3_bucket,
                                                                    tmp_path):
    table = taobao_table(200, seed=4)
    click = table.column("click").to_pylist()
    click[3], click[9] = 2.0, -1.0
    table = table.set_column(table.schema.get_field_index("click"), "click",
                             pa.array(click, pa.float32()))
    pq.write_table(table, tmp_path / "bad.parquet")
    fs.write_bytes(f"{s3_bucket}/raw/bad.parquet", (tmp_path / "bad.parquet").read_bytes())
    out = f"{s3_bucket}/trees"
    with pytest.raises(job.TooManyBadRows, match=rf"^2 rows failed validation.*"
                                                 rf"their reasons are in {out}\.dead_letter/"):
        _run(f"{s3_bucket}/raw/bad.parquet", out, DASK_RUNNER,
             f"--dask_client_address={dask_cluster.scheduler_address}")
    assert fs.list_files(out) == []
    rejected = [json.loads(line) for f in fs.list_files(f"{out}.dead_letter")
                for line in fs.read_text(f).splitlines()]
    assert sorted(r["row"] for r in rejected) == [4, 10]
