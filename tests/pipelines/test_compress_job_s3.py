"""The Beam batch compression job on a real S3 server (moto): input glob, trees, dead letters
and _stats.json on s3://, the same trees as on local disk, all-or-nothing publishing."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import compression
import schemas
from compression import cli, fs
from pipelines import compress as job
from sample_data import row_multiset, taobao_table

ROOT = Path(__file__).resolve().parents[2]
TAOBAO_PATH = str(ROOT / "schemas" / "examples" / "taobao_like.yaml")
TAOBAO = schemas.load(TAOBAO_PATH)


def _run(inputs, output, *extra) -> dict:
    argv = ["--schema", TAOBAO_PATH, "--output", str(output), "--runner=FnApiRunner"]
    for path in inputs if isinstance(inputs, list) else [inputs]:
        argv += ["--input", str(path)]
    return job.run(argv + [str(e) for e in extra])


def _upload(directory: Path, prefix: str) -> None:
    for path in sorted(directory.iterdir()):
        fs.write_bytes(fs.join(prefix, path.name), path.read_bytes())


def _with_bad_labels(table: pa.Table, rows: dict) -> pa.Table:
    click = table.column("click").to_pylist()
    for i, value in rows.items():
        click[i] = value
    return table.set_column(table.schema.get_field_index("click"), "click",
                            pa.array(click, pa.float32()))


def test_the_job_on_s3_writes_the_trees_it_writes_on_local_disk(s3_bucket, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    tables = [taobao_table(800, seed=s) for s in range(3)]
    tables[1] = _with_bad_labels(tables[1], {7: 3.0})
    for i, table in enumerate(tables):
        pq.write_table(table, raw / f"part-{i}.parquet")
    _upload(raw, f"{s3_bucket}/raw")
    extra = ("--shards", 3, "--chunk-rows", 500, "--max-bad-rows", 1)
    local = _run(str(raw / "*.parquet"), tmp_path / "trees", *extra)
    out = f"{s3_bucket}/trees"
    remote = _run(f"{s3_bucket}/raw/part-*.parquet", out, *extra)
    assert local["samples"] == remote["samples"] == 2399 and remote["bad_rows"] == 1
    names = [job.part_name(s, 3) for s in range(3)]
    remote_files = compression.expand_paths(out)
    assert [fs.basename(f) for f in remote_files] == names
    for name, path in zip(names, remote_files):  # shard by shard, the same trees
        assert compression.read_trees(path).equals(
            compression.read_trees(str(tmp_path / "trees" / name)))
    assert compression.read_trees(f"{out}/part-*.parquet").num_rows == \
        compression.read_trees(str(tmp_path / "trees")).num_rows
    stats = json.loads(fs.read_text(fs.resolve_published(f"{out}/_stats.json")))
    local_stats = json.loads((tmp_path / "trees" / "_stats.json").read_text())
    assert stats == local_stats == remote
    dead = [json.loads(line) for f in fs.expand(f"{out}/_dead_letter/*.jsonl")
            for line in fs.read_text(f).splitlines()]
    assert dead == [{"source": f"{s3_bucket}/raw/part-1.parquet", "row": 8,
                     "reason": "label 'click' row 8: value out of range, labels must be in "
                               "[0, 1]"}]
    # published, not staged: the manifest and one generation, nothing else
    assert {f[len(out) + 1:].split("/")[0] for f in fs.list_files(out)} == {
        fs.MANIFEST, fs.published_manifest(out)["generation"]}


def test_a_failed_job_on_s3_publishes_nothing_and_keeps_the_old_output(s3_bucket, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    good = taobao_table(300, seed=5)
    pq.write_table(good, raw / "good.parquet")
    _upload(raw, f"{s3_bucket}/raw")
    out = f"{s3_bucket}/trees"
    _run(f"{s3_bucket}/raw/*.parquet", out, "--shards", 2)
    before = compression.read_trees(out)
    pq.write_table(_with_bad_labels(good, {3: 2.0, 9: -1.0}), raw / "bad.parquet")
    fs.write_bytes(f"{s3_bucket}/raw/bad.parquet", (raw / "bad.parquet").read_bytes())
    with pytest.raises(job.TooManyBadRows, match=rf"their reasons are in {out}\.dead_letter/"):
        _run(f"{s3_bucket}/raw/*.parquet", out, "--shards", 2, "--overwrite")
    assert compression.read_trees(out).equals(before)  # the old output, whole
    rejected = [json.loads(line) for f in fs.list_files(f"{out}.dead_letter")
                for line in fs.read_text(f).splitlines()]
    assert sorted(r["row"] for r in rejected) == [4, 10]
    # nothing of the failed run is left in the output directory
    assert {f[len(out) + 1:].split("/")[0] for f in fs.list_files(out)} == {
        fs.MANIFEST, fs.published_manifest(out)["generation"]}
    with pytest.raises(cli.OutputExistsError, match="pass --overwrite"):
        _run(f"{s3_bucket}/raw/good.parquet", out)


def test_store_errors_of_the_job_are_one_line(s3_bucket, tmp_path):
    with pytest.raises(cli.UsageError) as err:
        _run(f"{s3_bucket}/raw/*.parquet", f"{s3_bucket}/trees")
    assert str(err.value) == f"--input: no input files match '{s3_bucket}/raw/*.parquet'"
    pq.write_table(taobao_table(50), tmp_path / "x.parquet")
    with pytest.raises(fs.StorageError) as err:
        _run(str(tmp_path / "x.parquet"), "s3://no-such-bucket-here/trees")
    assert str(err.value) == ("s3://no-such-bucket-here/trees: the bucket 'no-such-bucket-here' "
                              "does not exist; create it or fix the path")
    assert os.listdir(tmp_path) == ["x.parquet"]


def test_csv_and_gzipped_json_lines_on_s3_read_through_beam(s3_bucket, tmp_path):
    """The workers open CSV and JSON-lines files through Beam's FileSystems (a .gz file is
    decompressed by its suffix); a bad CSV cell's error names the URI, column and line."""
    table = taobao_table(300, seed=6)
    rows = table.to_pylist()
    lists = {f.name for f in TAOBAO.features if f.kind != "id"}
    header = table.column_names
    lines = [",".join(header)] + [
        ",".join("|".join(map(str, r[c])) if c in lists else str(r[c]) for c in header)
        for r in rows[:150]]
    fs.write_text(f"{s3_bucket}/raw/a.csv", "\n".join(lines) + "\n")
    fs.write_bytes(f"{s3_bucket}/raw/b.jsonl.gz", gzip.compress(
        "".join(json.dumps(r) + "\n" for r in rows[150:]).encode()))
    summary = _run([f"{s3_bucket}/raw/a.csv", f"{s3_bucket}/raw/b.jsonl.gz"],
                   f"{s3_bucket}/trees", "--shards", 2)
    assert summary["samples"] == 300 and summary["bad_rows"] == 0
    trees = compression.read_trees(f"{s3_bucket}/trees")
    assert row_multiset(compression.flatten(trees, TAOBAO)) == row_multiset(table)
    cells = lines[3].split(",")
    cells[header.index("campaign_id")] = "ten"
    lines[3] = ",".join(cells)
    fs.write_text(f"{s3_bucket}/bad/a.csv", "\n".join(lines) + "\n")
    with pytest.raises(compression.RawDataError) as err:
        _run(f"{s3_bucket}/bad/a.csv", f"{s3_bucket}/trees2")
    assert str(err.value).startswith(f"{s3_bucket}/bad/a.csv: column 'campaign_id' line 4: "
                                     "invalid value 'ten', expected an integer")


def test_beams_s3_endpoint_option_is_enough(s3_bucket, tmp_path):
    """Without AWS_ENDPOINT_URL in the environment, Beam's --s3_endpoint_url and
    --s3_region_name name the server for the workers' Beam S3 client and, while the job runs,
    for the launcher's checks and manifest too."""
    pq.write_table(taobao_table(200, seed=9), tmp_path / "x.parquet")
    fs.write_bytes(f"{s3_bucket}/raw/x.parquet", (tmp_path / "x.parquet").read_bytes())
    endpoint = os.environ.pop("AWS_ENDPOINT_URL")
    region = os.environ.pop("AWS_DEFAULT_REGION")
    try:
        summary = _run(f"{s3_bucket}/raw/*.parquet", f"{s3_bucket}/trees", "--shards", 2,
                       f"--s3_endpoint_url={endpoint}", f"--s3_region_name={region}")
        assert "AWS_ENDPOINT_URL" not in os.environ and "AWS_DEFAULT_REGION" not in os.environ
    finally:
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_DEFAULT_REGION=region)
    assert summary["samples"] == 200
    assert compression.read_trees(f"{s3_bucket}/trees").num_rows == summary["trees"]
