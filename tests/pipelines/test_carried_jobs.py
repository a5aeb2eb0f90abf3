"""Carried columns (row ids, request ids, timestamps) through the Beam jobs: the batch job's
Parquet shards, the streaming job's tree messages, replayed JSON and generated data."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.test_stream import TestStream as EventStream
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.transforms.window import TimestampedValue

import compression
import schemas
from pipelines import compress as job
from pipelines import stream_compress
from pipelines.generate import generate_tables
from pipelines.replay import json_lines
from sample_data import carried_samples, row_multiset

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = str(ROOT / "schemas" / "examples" / "with_row_ids.yaml")
SCHEMA = schemas.load(SCHEMA_PATH)
UTC = dt.timezone.utc


def test_the_batch_job_keeps_carried_columns(tmp_path):
    tables = [carried_samples(600, seed=s) for s in range(2)]
    (tmp_path / "raw").mkdir()
    for i, t in enumerate(tables):
        pq.write_table(t, tmp_path / "raw" / f"part-{i}.parquet")
    summary = job.run(["--schema", SCHEMA_PATH, "--input", str(tmp_path / "raw"),
                       "--output", str(tmp_path / "out"), "--runner=FnApiRunner",
                       "--shards", "3", "--chunk-rows", "250"])
    assert summary["samples"] == 1200
    parts = sorted((tmp_path / "out").glob("part-*.parquet"))
    assert len(parts) == 3
    for part in parts:
        assert schemas.from_arrow_metadata(pq.ParquetFile(part).schema_arrow) == SCHEMA
    trees = compression.read_trees(str(tmp_path / "out" / "part-*.parquet"))
    flat = compression.flatten(trees, SCHEMA)
    assert row_multiset(flat) == row_multiset(pa.concat_tables(tables))
    assert sorted(flat.column("row_id").to_pylist()) == sorted(
        pa.concat_tables(tables).column("row_id").to_pylist())  # every row id, once
    # and the trees are those of the schema without the carried columns
    data = SCHEMA.to_dict()
    data["layers"][-1].pop("carried")
    plain = schemas.from_dict(data)
    without = compression.build_trees(
        pa.concat_tables(tables).drop_columns(list(SCHEMA.carried_names)), plain)
    assert summary["trees"] == without.num_rows


def _tree_messages(record) -> tuple:
    key, value, _ = record
    trees = compression.decode_trees(value)
    assert trees.schema.equals(SCHEMA.tree_arrow_schema())
    return key, tuple(row_multiset(compression.flatten(trees, SCHEMA)))


def test_the_streaming_job_tree_messages_keep_carried_columns():
    table = carried_samples(300, seed=4)
    lines = json_lines(table, SCHEMA).to_pylist()
    assert json.loads(lines[0])["event_time"] == "2024-05-01 12:00:00.000000Z"
    stream = (EventStream()
              .add_elements([TimestampedValue(line.encode(), 1.0 + i * 0.01)
                             for i, line in enumerate(lines)])
              .advance_watermark_to_infinity())
    expected = [(str(user).encode(), tuple(row_multiset(
        table.filter(pc.equal(table.column("user_id"), user)))))
        for user in sorted(set(table.column("user_id").to_pylist()))]
    options = PipelineOptions()
    options.view_as(StandardOptions).streaming = True
    with BeamTestPipeline(options=options) as p:
        out = p | stream | stream_compress.CompressWindows(SCHEMA.to_yaml(), 60, shards=2,
                                                           decode_batch=50)
        assert_that(out["trees"] | beam.Map(_tree_messages), equal_to(expected), label="trees")
        assert_that(out["dead_letter"], equal_to([]), label="no dead letters")


def test_replayed_json_decodes_back_to_the_same_carried_values():
    data = SCHEMA.to_dict()
    data["layers"][-1]["carried"].append({"name": "weight", "dtype": "float64"})
    schema = schemas.from_dict(data)
    table = carried_samples(6).append_column("weight", pa.array(
        [0.1, -0.0, float("nan"), float("inf"), float("-inf"), None], pa.float64()))
    table = table.set_column(table.schema.get_field_index("request_id"), "request_id",
                             pa.array(['quo"te', None, "tab\there", "", "é", "x"]))
    lines = [line.encode() for line in json_lines(table, schema).to_pylist()]
    decoded, dead = compression.decode_json_samples(lines, schema)
    assert dead == []
    assert row_multiset(decoded) == row_multiset(table)


def test_generated_data_fills_carried_columns_with_row_ids():
    table = pa.concat_tables(list(generate_tables(SCHEMA, 500, seed=3, chunk_rows=200)))
    assert table.schema.equals(SCHEMA.raw_arrow_schema())
    row_ids = table.column("row_id").to_numpy()
    assert len(np.unique(row_ids)) == 500
    assert table.column("request_id").to_pylist() == [str(i) for i in row_ids]
    assert table.column("event_time")[0].as_py() == dt.datetime(2024, 1, 1, tzinfo=UTC) + \
        dt.timedelta(seconds=int(row_ids[0]))
    data = SCHEMA.to_dict()
    data["layers"][-1].pop("carried")
    plain = pa.concat_tables(list(generate_tables(schemas.from_dict(data), 500, seed=3,
                                                  chunk_rows=200)))
    assert table.drop_columns(list(SCHEMA.carried_names)).equals(plain)  # same samples
