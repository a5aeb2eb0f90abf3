"""The Beam batch compression job: lossless, equal to the in-process compression, bad rows to a
dead letter, clear failures, on the real Beam SDK (FnApiRunner)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import compression
import schemas
from compression import RawDataError, cli
from compression.compress import compress_files
from pipelines import compress as job
from pipelines._coders import ShardPart, ShardPartCoder
from pipelines._shards import split_by_shard, split_roots_by_shard
from sample_data import random_schemas, raw_tables, row_multiset, taobao_table
from schemas.hashing import tree_shards

ROOT = Path(__file__).resolve().parents[2]
TAOBAO_PATH = str(ROOT / "schemas" / "examples" / "taobao_like.yaml")
TAOBAO = schemas.load(TAOBAO_PATH)
# String root key, two key columns, ids/dense lists: the CSV and JSON paths.
SMALL = schemas.from_dict({"name": "small", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid", "region"], "features": [
        {"name": "uid", "kind": "id", "dtype": "string"},
        {"name": "region", "kind": "id"},
        {"name": "hist", "kind": "ids"}]},
    {"name": "ad", "key": ["aid"], "features": [
        {"name": "aid", "kind": "id"},
        {"name": "price", "kind": "dense", "dim": 2}]}]})


def _small_rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"uid": f"u{int(rng.integers(0, 9))}", "region": int(rng.integers(0, 2)),
             "hist": [int(x) for x in rng.integers(0, 5, int(rng.integers(0, 3)))],
             "aid": int(rng.integers(0, 6)), "price": [float(rng.integers(0, 4)), 0.5],
             "click": float(rng.integers(0, 2))} for _ in range(n)]


def _run(schema_path, inputs, output, *extra) -> dict:
    inputs = inputs if isinstance(inputs, list) else [inputs]
    argv = ["--schema", str(schema_path), "--output", str(output), "--runner=FnApiRunner"]
    for path in inputs:
        argv += ["--input", str(path)]
    return job.run(argv + [str(e) for e in extra])


def _root_nodes(trees: pa.Table, schema) -> list:
    names = list(schema.root.feature_names)
    return sorted(repr(tuple(r[n] for n in names)) for r in trees.select(names).to_pylist())


@pytest.fixture(scope="module")
def taobao_run(tmp_path_factory):
    """Three Parquet files compressed into 5 shards by the job and in process."""
    base = tmp_path_factory.mktemp("taobao")
    tables = [taobao_table(1500, seed=s) for s in range(3)]
    (base / "raw").mkdir()
    for i, t in enumerate(tables):
        pq.write_table(t, base / "raw" / f"part-{i}.parquet")
    summary = _run(TAOBAO_PATH, str(base / "raw" / "*.parquet"), base / "beam", "--shards", 5,
                   "--chunk-rows", 700)
    reference = compress_files(TAOBAO, str(base / "raw" / "*.parquet"), str(base / "inproc"))
    return base, pa.concat_tables(tables), summary, reference


def test_output_flattened_equals_the_input_multiset(taobao_run):
    base, raw, _, _ = taobao_run
    trees = compression.read_trees(str(base / "beam" / "part-*.parquet"))
    assert trees.schema.equals(TAOBAO.tree_arrow_schema())
    assert row_multiset(compression.flatten(trees, TAOBAO)) == row_multiset(raw)


def test_output_equals_the_in_process_compression(taobao_run):
    base, raw, summary, reference = taobao_run
    ours = compression.read_trees(str(base / "beam" / "part-*.parquet"))
    theirs = compression.read_trees(str(base / "inproc"))
    assert _root_nodes(ours, TAOBAO) == _root_nodes(theirs, TAOBAO)
    assert ours.num_rows == theirs.num_rows == reference["trees"]
    assert (row_multiset(compression.flatten(ours, TAOBAO))
            == row_multiset(compression.flatten(theirs, TAOBAO)))
    for key in ("samples", "trees", "nodes", "ids_flat", "ids_in_trees", "id_compression_ratio",
                "values_flat", "values_in_trees", "samples_per_root"):
        assert summary[key] == reference[key], key


def test_shards_are_whole_trees_split_by_root_key(taobao_run):
    base, raw, summary, _ = taobao_run
    names = sorted(os.listdir(base / "beam"))
    assert names == ["_stats.json"] + [f"part-{i:05d}-of-00005.parquet" for i in range(5)]
    seen_roots = set()
    for shard in range(5):
        trees = pq.read_table(base / "beam" / f"part-{shard:05d}-of-00005.parquet")
        flat = compression.flatten(trees, TAOBAO)
        # every sample sits in the shard of its root key, and no root is in two shards
        assert set(tree_shards(flat, TAOBAO, 5).tolist()) <= {shard}
        roots = set(trees.column("user_id").to_pylist())
        assert not roots & seen_roots
        seen_roots |= roots
    assert seen_roots == set(raw.column("user_id").to_pylist())


def test_stats_file_holds_the_summary(taobao_run):
    base, raw, summary, reference = taobao_run
    on_disk = json.loads((base / "beam" / "_stats.json").read_text())
    assert on_disk == summary
    assert summary["samples"] == raw.num_rows == 4500
    assert summary["bad_rows"] == 0
    assert summary["shards"] == 5
    assert summary["input_files"] == 3
    assert summary["nodes"] == {"user": reference["nodes"]["user"],
                                "ad": reference["nodes"]["ad"], "creative": 4500}
    assert summary["bytes_on_disk"] == sum(
        os.path.getsize(base / "beam" / n) for n in os.listdir(base / "beam")
        if n.startswith("part-"))
    assert summary["id_compression_ratio"] > 1.0


def test_csv_and_json_lines_inputs(tmp_path):
    rows = _small_rows(120)
    schema_path = tmp_path / "small.yaml"
    schema_path.write_text(SMALL.to_yaml())
    lines = ["uid,region,hist,aid,price,click"] + [
        f"{r['uid']},{r['region']},{'|'.join(map(str, r['hist']))},{r['aid']},"
        f"{'|'.join(map(str, r['price']))},{r['click']}" for r in rows[:60]]
    (tmp_path / "a.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[60:]))
    summary = _run(schema_path, [tmp_path / "a.csv", tmp_path / "b.jsonl"], tmp_path / "out",
                   "--shards", 3)
    trees = compression.read_trees(str(tmp_path / "out" / "part-*.parquet"))
    expected = pa.Table.from_pylist(rows, schema=SMALL.raw_arrow_schema())
    assert row_multiset(compression.flatten(trees, SMALL)) == row_multiset(expected)
    assert _root_nodes(trees, SMALL) == _root_nodes(compression.build_trees(expected, SMALL),
                                                    SMALL)
    assert summary["samples"] == 120 and summary["input_files"] == 2


def test_a_csv_whose_list_column_holds_only_empty_lists(tmp_path):
    """Every ``hist`` cell empty: the list column reaches the tree build with an empty values
    buffer (once failed the job with Arrow's "Value data buffer is null")."""
    rows = [{**r, "hist": []} for r in _small_rows(40, seed=3)]
    schema_path = tmp_path / "small.yaml"
    schema_path.write_text(SMALL.to_yaml())
    lines = ["uid,region,hist,aid,price,click"] + [
        f"{r['uid']},{r['region']},,{r['aid']},{'|'.join(map(str, r['price']))},{r['click']}"
        for r in rows]
    (tmp_path / "a.csv").write_text("\n".join(lines) + "\n")
    summary = _run(schema_path, tmp_path / "a.csv", tmp_path / "out", "--shards", 2)
    trees = compression.read_trees(str(tmp_path / "out" / "part-*.parquet"))
    expected = pa.Table.from_pylist(rows, schema=SMALL.raw_arrow_schema())
    assert row_multiset(compression.flatten(trees, SMALL)) == row_multiset(expected)
    assert summary["samples"] == 40 and summary["bad_rows"] == 0


def test_format_flag_overrides_the_extension(tmp_path):
    rows = _small_rows(10)
    schema_path = tmp_path / "small.yaml"
    schema_path.write_text(SMALL.to_yaml())
    (tmp_path / "samples.txt").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = _run(schema_path, tmp_path / "samples.txt", tmp_path / "out", "--format", "json",
                   "--shards", 2)
    assert summary["samples"] == 10


def _with_bad_labels(table: pa.Table, rows: dict) -> pa.Table:
    click = table.column("click").to_pylist()
    for row, value in rows.items():
        click[row] = value
    return table.set_column(table.schema.get_field_index("click"), "click",
                            pa.array(click, pa.float32()))


def test_bad_rows_go_to_the_dead_letter_and_fail_the_job_past_the_limit(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    good = taobao_table(300, seed=3)
    bad = _with_bad_labels(good, {5: 2.0, 250: -1.0})
    user_id = bad.column("user_id").to_pylist()
    user_id[17] = None
    bad = bad.set_column(0, "user_id", pa.array(user_id, pa.int64()))
    pq.write_table(bad, raw / "bad.parquet")
    pq.write_table(taobao_table(100, seed=4), raw / "good.parquet")

    with pytest.raises(job.TooManyBadRows,
                       match=r"^3 rows failed validation, more than --max-bad-rows 2 \(the "
                             r"first: .*/raw/bad\.parquet: label 'click' row 6: value out of "
                             r"range, labels must be in \[0, 1\]\); their "
                             r"reasons are in .*/out\.dead_letter/ \(fix the data, or raise "
                             r"--max-bad-rows to drop them\)$"):
        _run(TAOBAO_PATH, str(raw), tmp_path / "out", "--max-bad-rows", 2, "--chunk-rows", 128)
    # a failed job leaves no output, only its rejected rows beside it
    assert sorted(os.listdir(tmp_path)) == ["out.dead_letter", "raw"]
    assert sum(len(f.read_text().splitlines())
               for f in (tmp_path / "out.dead_letter").iterdir()) == 3

    summary = _run(TAOBAO_PATH, str(raw), tmp_path / "out", "--max-bad-rows", 3,
                   "--chunk-rows", 128, "--shards", 2)
    assert summary["bad_rows"] == 3
    assert sorted(os.listdir(tmp_path)) == ["out", "raw"]  # the failed run's rows are gone
    assert summary["samples"] == 397
    dead = list(json.loads(line) for f in sorted((tmp_path / "out" / "_dead_letter").iterdir())
                  for line in f.read_text().splitlines())
    source = str(raw / "bad.parquet")
    assert sorted(dead, key=lambda d: d["row"]) == [
        {"source": source, "row": 6,  # rows counted from 1: the 0-based index 5
         "reason": "label 'click' row 6: value out of range, labels must be in [0, 1]"},
        {"source": source, "row": 18,
         "reason": "key column 'user_id' row 18: null value; every row needs a key"},
        {"source": source, "row": 251,
         "reason": "label 'click' row 251: value out of range, labels must be in [0, 1]"},
    ]
    kept = compression.flatten(compression.read_trees(str(tmp_path / "out" / "part-*.parquet")),
                               TAOBAO)
    expected = pa.concat_tables([bad.take([i for i in range(300) if i not in (5, 17, 250)]),
                                 taobao_table(100, seed=4)])
    assert row_multiset(kept) == row_multiset(expected)


def test_a_file_with_a_wrong_column_fails_the_job_naming_the_file(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    pq.write_table(taobao_table(50), raw / "fine.parquet")
    pq.write_table(taobao_table(50).drop_columns(["gender"]), raw / "broken.parquet")
    with pytest.raises(RawDataError, match=r"^.*broken\.parquet: missing column\(s\) 'gender': "
                                           r"the schema 'taobao_like' needs every feature"):
        _run(TAOBAO_PATH, str(raw), tmp_path / "out", "--max-bad-rows", 1000)

    table = taobao_table(50)
    pq.write_table(table.set_column(0, "user_id", table.column("user_id").cast(pa.string())),
                   raw / "broken.parquet")
    with pytest.raises(RawDataError, match=r"broken\.parquet: column 'user_id' has type string, "
                                           r"expected an integer"):
        _run(TAOBAO_PATH, str(raw), tmp_path / "out")


def test_a_file_that_is_not_parquet_fails_the_job_naming_the_file(tmp_path):
    (tmp_path / "garbage.parquet").write_bytes(b"this is not a parquet file at all")
    with pytest.raises(RawDataError, match=r"garbage\.parquet: cannot read the file as parquet"):
        _run(TAOBAO_PATH, tmp_path / "garbage.parquet", tmp_path / "out")


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_shard_split_keeps_every_row_and_each_root_key_in_one_shard(data):
    schema = data.draw(random_schemas())
    table = data.draw(raw_tables(schema))
    shards = data.draw(st.integers(1, 5))
    parts = split_by_shard(table, schema, shards)
    assert row_multiset(pa.concat_tables([t for _, t in parts] + [table.slice(0, 0)])) == \
        row_multiset(table)
    owner = {}
    for shard, part in parts:
        assert 0 <= shard < shards and part.num_rows > 0
        if len(schema.layers) == 1:
            continue  # every sample is its own tree: rows are dealt out, keys may repeat
        for key in part.select(list(schema.root.key)).to_pylist():
            assert owner.setdefault(repr(key), shard) == shard


def test_a_rerun_replaces_the_previous_shards_only_with_overwrite(tmp_path):
    pq.write_table(taobao_table(200), tmp_path / "raw.parquet")
    _run(TAOBAO_PATH, tmp_path / "raw.parquet", tmp_path / "out", "--shards", 4)
    with pytest.raises(cli.OutputExistsError, match=r"out: the directory is not empty \(5 "
                                                    r"entries\); pass --overwrite"):
        _run(TAOBAO_PATH, tmp_path / "raw.parquet", tmp_path / "out", "--shards", 2)
    assert len(os.listdir(tmp_path / "out")) == 5
    _run(TAOBAO_PATH, tmp_path / "raw.parquet", tmp_path / "out", "--shards", 2, "--overwrite")
    assert sorted(os.listdir(tmp_path / "out")) == [
        "_stats.json", "part-00000-of-00002.parquet", "part-00001-of-00002.parquet"]
    assert compression.read_trees(str(tmp_path / "out")).num_rows == compression.build_trees(
        taobao_table(200), TAOBAO).num_rows


def test_empty_shards_still_get_a_file(tmp_path):
    table = taobao_table(40)
    one_user = table.filter(pa.compute.equal(table.column("user_id"),
                                             table.column("user_id")[0]))
    pq.write_table(one_user, tmp_path / "raw.parquet")
    summary = _run(TAOBAO_PATH, tmp_path / "raw.parquet", tmp_path / "out", "--shards", 3)
    sizes = [pq.read_metadata(tmp_path / "out" / f"part-{i:05d}-of-00003.parquet").num_rows
             for i in range(3)]
    assert sorted(sizes) == [0, 0, 1] and summary["trees"] == 1


def test_command_line_help_and_errors():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "pipelines.compress", "--help"], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0
    for flag in ("--schema", "--input", "--output", "--shards", "--format", "--max-bad-rows",
                 "FnApiRunner"):
        assert flag in out.stdout
    missing = subprocess.run([sys.executable, "-m", "pipelines.compress", "--schema",
                              TAOBAO_PATH, "--input", "/nonexistent/*.parquet", "--output",
                              "/tmp/unused"], cwd=ROOT, capture_output=True, text=True, env=env,
                             timeout=120)
    assert missing.returncode == 2
    assert missing.stderr == ("python -m pipelines.compress: error: --input: no input files "
                              "match '/nonexistent/*.parquet'\n")


def test_command_line_run_prints_progress_and_summary(tmp_path):
    pq.write_table(taobao_table(300), tmp_path / "raw.parquet")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "pipelines.compress", "--schema", TAOBAO_PATH,
                          "--input", str(tmp_path / "raw.parquet"), "--output",
                          str(tmp_path / "out"), "--shards", "2"], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "shard 1/2 written:" in out.stderr and "shard 2/2 written:" in out.stderr
    assert f"read {tmp_path / 'raw.parquet'}: 300 rows, 0 bad" in out.stderr
    assert "samples               300" in out.stdout
    assert "into 2 shards" in out.stdout


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_split_roots_by_shard_keeps_every_row_and_each_root_key_in_one_shard(data):
    schema = data.draw(random_schemas())
    if len(schema.layers) < 2:
        return
    table = compression.validate_raw(data.draw(raw_tables(schema)), schema)
    shards = data.draw(st.integers(1, 5))
    parts = split_roots_by_shard(table, schema, shards)
    assert sum(rows.num_rows for _, (_, rows) in parts) == table.num_rows
    owner = {}
    for shard, (roots, rows) in parts:
        assert 0 <= shard < shards and rows.num_rows > 0
        assert set(rows.column(compression.ROOT_NODE).to_pylist()) == set(range(roots.num_rows))
        for key in roots.select(list(schema.root.key)).to_pylist():
            assert owner.setdefault(repr(key), shard) == shard
    if parts:
        roots, rows = compression.concat_roots([part for _, part in parts])
        trees = compression.build_trees(rows, schema, roots=roots)
        assert row_multiset(compression.flatten(trees, schema)) == row_multiset(table)


def test_shard_parts_round_trip_through_their_coder():
    table = compression.validate_raw(taobao_table(120), TAOBAO)
    coder = beam.coders.registry.get_coder(ShardPart)
    assert isinstance(coder, ShardPartCoder)
    roots, rows = compression.split_roots(table, TAOBAO)
    for part in (ShardPart(roots, rows), ShardPart(None, rows)):
        back = coder.decode(coder.encode(part)).tables
        assert back[1].equals(rows)
        assert (back[0] is None) if part.tables[0] is None else back[0].equals(roots)


@pytest.mark.parametrize("threads", [1, 3])
def test_threads_do_not_change_the_output(tmp_path, threads):
    tables = [taobao_table(500, seed=s) for s in range(2)]
    for i, t in enumerate(tables):
        pq.write_table(t, tmp_path / f"raw-{i}.parquet")
    summary = _run(TAOBAO_PATH, str(tmp_path / "raw-*.parquet"), tmp_path / "out", "--shards", 5,
                   "--chunk-rows", 150, "--threads", threads)
    trees = compression.read_trees(str(tmp_path / "out" / "part-*.parquet"))
    raw = pa.concat_tables(tables)
    assert row_multiset(compression.flatten(trees, TAOBAO)) == row_multiset(raw)
    assert _root_nodes(trees, TAOBAO) == _root_nodes(compression.build_trees(raw, TAOBAO), TAOBAO)
    assert summary["samples"] == 1000 and summary["shards"] == 5
