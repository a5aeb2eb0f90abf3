"""Raw and tree files on a real S3 server (moto): the readers, writers and commands of
compression/ give on ``s3://`` what they give on local files."""

import gzip
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import compression
import schemas
from compression import RawDataError, fs
from sample_data import row_multiset, taobao_table

TAOBAO = "schemas/examples/taobao_like.yaml"


def _upload(local_path, uri):
    with open(local_path, "rb") as f:
        fs.write_bytes(uri, f.read())


def test_raw_parquet_csv_and_json_lines_read_the_same_rows_from_s3(s3_bucket, tmp_path):
    schema = schemas.load(TAOBAO)
    table = taobao_table(300)
    pq.write_table(table.slice(0, 100), tmp_path / "a.parquet")
    rows = table.slice(100, 100).to_pylist()
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    pq.write_table(table.slice(200), tmp_path / "c.parquet")
    for name in ["a.parquet", "b.jsonl.gz", "c.parquet"]:
        _upload(tmp_path / name, f"{s3_bucket}/raw/{name}")
    local = compression.read_raw(str(tmp_path / "*.*"), schema)
    remote = compression.read_raw(f"{s3_bucket}/raw/*.*", schema)
    assert remote.equals(local)
    assert row_multiset(remote) == row_multiset(table)
    assert compression.expand_paths(f"{s3_bucket}/raw") == [
        f"{s3_bucket}/raw/a.parquet", f"{s3_bucket}/raw/c.parquet"]  # .gz: by glob only


def test_csv_on_s3_and_its_errors_name_the_uri(s3_bucket):
    schema = schemas.from_dict({"name": "t", "labels": ["click"], "layers": [
        {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"}]},
        {"name": "ad", "key": ["aid"], "features": [{"name": "aid", "kind": "id"},
                                                     {"name": "price", "kind": "dense",
                                                      "dim": 2}]}]})
    good = f"{s3_bucket}/raw.csv"
    fs.write_text(good, "uid,aid,price,click\n1,10,1.5|2,1\n2,11,0.5|0,0\n")
    assert compression.read_raw(good, schema).to_pylist() == [
        {"uid": 1, "aid": 10, "price": [1.5, 2.0], "click": 1.0},
        {"uid": 2, "aid": 11, "price": [0.5, 0.0], "click": 0.0}]
    bad = f"{s3_bucket}/bad.csv"
    fs.write_text(bad, "uid,aid,price,click\n1,10,1.5|2,1\n2,ten,0.5|0,0\n")
    with pytest.raises(RawDataError) as err:
        compression.read_raw(bad, schema)
    assert str(err.value) == (f"{bad}: column 'aid' line 3: invalid value 'ten', expected an "
                              "integer (CSV conversion error to int64: invalid value 'ten')")


def test_tree_files_on_s3_round_trip(s3_bucket):
    schema = schemas.load(TAOBAO)
    table = taobao_table(400)
    trees = compression.build_trees(table, schema)
    path = compression.write_trees(trees, f"{s3_bucket}/trees/part-0.parquet")
    assert fs.list_files(f"{s3_bucket}/trees") == [path]  # no temporary object left
    read = compression.read_trees(f"{s3_bucket}/trees")
    assert read.equals(trees) and schemas.from_arrow_metadata(read.schema) == schema
    streamed = list(compression.iter_trees(f"{s3_bucket}/trees/*.parquet", rows=50,
                                           schema=schema))
    assert pa.concat_tables(streamed).equals(trees)


def _run(*args, env):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          env=env)


def test_compress_and_inspect_commands_on_s3_equal_local(s3_bucket, s3_server, tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
           **s3_server.env()}
    table = taobao_table(600)
    for i, part in enumerate([table.slice(0, 350), table.slice(350)]):
        pq.write_table(part, tmp_path / f"p{i}.parquet")
        _upload(tmp_path / f"p{i}.parquet", f"{s3_bucket}/raw/p{i}.parquet")
    local = _run("compression.compress", "--schema", TAOBAO, "--input",
                 str(tmp_path / "*.parquet"), "--output", str(tmp_path / "trees"), env=env)
    assert local.returncode == 0, local.stderr
    out = f"{s3_bucket}/trees"
    remote = _run("compression.compress", "--schema", TAOBAO, "--input",
                  f"{s3_bucket}/raw/*.parquet", "--output", out, env=env)
    assert remote.returncode == 0, remote.stderr
    assert "compressed 600 samples" in remote.stdout
    assert compression.read_trees(out).equals(compression.read_trees(str(tmp_path / "trees")))
    stats = json.loads(fs.read_text(fs.resolve_published(f"{out}/_stats.json")))
    assert stats == json.loads((tmp_path / "trees" / "_stats.json").read_text())
    inspected = _run("compression.inspect", f"{out}/*.parquet", "--json", env=env)
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout) == json.loads(
        _run("compression.inspect", str(tmp_path / "trees"), "--json", env=env).stdout)
    # the output policy holds on the store: a second run needs --overwrite
    again = _run("compression.compress", "--schema", TAOBAO, "--input",
                 f"{s3_bucket}/raw/p0.parquet", "--output", out, env=env)
    assert again.returncode == 2
    assert again.stderr.startswith(f"python -m compression.compress: error: --output {out}: "
                                   "the directory is not empty")
    missing = _run("compression.compress", "--schema", TAOBAO, "--input",
                   f"{s3_bucket}/raw/none-*.parquet", "--output", f"{s3_bucket}/t2", env=env)
    assert missing.returncode == 2
    assert missing.stderr == ("python -m compression.compress: error: --input: no input files "
                              f"match '{s3_bucket}/raw/none-*.parquet'\n")
