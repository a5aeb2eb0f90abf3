"""Raw readers (Parquet, CSV, JSON lines), nested Parquet tree files, IPC messages, and the
inspect and compress commands."""

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
from compression import RawDataError
from sample_data import row_multiset, taobao_table

SCHEMA = schemas.from_dict({"name": "t", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"},
                                                   {"name": "hist", "kind": "ids",
                                                    "dtype": "string"}]},
    {"name": "ad", "key": ["aid"], "features": [{"name": "aid", "kind": "id"},
                                                 {"name": "price", "kind": "dense", "dim": 2}]}]})
ROWS = [
    {"uid": 1, "hist": ["x", "y"], "aid": 10, "price": [1.5, 2.0], "click": 1.0},
    {"uid": 1, "hist": ["x", "y"], "aid": 11, "price": [0.5, 0.0], "click": 0.0},
    {"uid": 2, "hist": [], "aid": 10, "price": [1.5, 2.0], "click": 0.0},
]


def test_csv_lists_are_pipe_separated_and_empty_cells_are_empty_lists(tmp_path):
    path = tmp_path / "raw.csv"
    path.write_text("uid,hist,aid,price,click\n1,x|y,10,1.5|2,1\n1,x|y,11,0.5|0,0\n2,,10,1.5|2,0\n")
    table = compression.read_raw(str(path), SCHEMA)
    assert table.to_pylist() == ROWS


def test_json_lines_and_parquet_read_the_same_rows(tmp_path):
    jsonl = tmp_path / "raw.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    parquet = tmp_path / "raw.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS, schema=SCHEMA.raw_arrow_schema()), parquet)
    assert compression.read_raw(str(jsonl), SCHEMA).to_pylist() == ROWS
    assert compression.read_raw(str(tmp_path / "raw.*"), SCHEMA).num_rows == 6


def test_raw_errors_name_the_file_and_row(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("uid,hist,aid,price,click\n1,x,10,1.5|2,1\n2,y,11,0.5,0\n")
    with pytest.raises(RawDataError, match=r"bad.csv: column 'price' line 3: dense value has the "
                                           r"wrong number of floats, expected dim 2"):
        compression.read_raw(str(path), SCHEMA)
    path.write_text("uid,hist,aid,price,click\n1,x,10,1.5|2,1\n2,y,11,0.5|1,0\n3,z,12,1|two,0\n")
    with pytest.raises(RawDataError) as err:
        compression.read_raw(str(path), SCHEMA)
    assert str(err.value) == (f"{path}: column 'price' line 4: invalid value 'two' in the list "
                              "'1|two', expected '|'-separated numbers")
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text("\n".join(json.dumps({**r, "click": 2.0 if i == 1 else r["click"]})
                               for i, r in enumerate(ROWS)) + "\n")
    with pytest.raises(RawDataError, match=r"bad.jsonl: label 'click' line 2: value out of "):
        compression.read_raw(str(jsonl), SCHEMA)
    # a value of the wrong JSON type: the reason a Kafka message gets, with the file's line
    jsonl.write_text("\n".join(json.dumps({**r, "aid": "ten" if i == 2 else r["aid"]})
                               for i, r in enumerate(ROWS)) + "\n")
    with pytest.raises(RawDataError) as err:
        compression.read_raw(str(jsonl), SCHEMA)
    assert str(err.value) == (f"{jsonl}: line 3: not a valid sample: field 'aid': expected an "
                              "integer (kind id, dtype int64), got a string")
    parquet = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "uid": None if i == 2 else r["uid"]}
                                         for i, r in enumerate(ROWS)],
                                        schema=SCHEMA.raw_arrow_schema()), parquet)
    with pytest.raises(RawDataError, match=r"bad.parquet: key column 'uid' row 3: null value"):
        compression.read_raw(str(parquet), SCHEMA)
    with pytest.raises(ValueError, match="cannot tell the format from the extension '.txt'"):
        compression.raw_format("x.txt")
    with pytest.raises(FileNotFoundError, match="no input files match"):
        compression.read_raw(str(tmp_path / "none*.csv"), SCHEMA)


def test_tree_parquet_round_trip_keeps_schema_and_rows(tmp_path):
    schema = schemas.load("schemas/examples/taobao_like.yaml")
    table = taobao_table(500)
    trees = compression.build_trees(table, schema)
    path = compression.write_trees(trees, str(tmp_path / "trees" / "part-0.parquet"))
    assert os.listdir(tmp_path / "trees") == ["part-0.parquet"]  # no temp file left behind
    read = compression.read_trees(str(tmp_path / "trees"))
    assert read.schema.equals(schema.tree_arrow_schema())
    assert schemas.from_arrow_metadata(read.schema) == schema
    assert row_multiset(compression.flatten(read, schema)) == row_multiset(table)
    streamed = list(compression.iter_trees(path, rows=7))
    assert sum(t.num_rows for t in streamed) == trees.num_rows
    batches = list(compression.iter_batches(streamed, schema, batch_size=64))
    assert sum(b.num_leaves for b in batches) == 500


def test_ipc_message_round_trip():
    schema = schemas.load("schemas/examples/taobao_like.yaml")
    trees = compression.build_trees(taobao_table(50), schema)
    message = compression.encode_trees(trees)
    assert isinstance(message, bytes)
    assert compression.decode_trees(message).equals(trees)
    for bad in (b"garbage", message[:len(message) // 2], message[:-9]):  # -9: a cut body
        with pytest.raises(ValueError, match="not an Arrow IPC tree message"):
            compression.decode_trees(bad)


def test_tree_message_decoder_equals_decode_trees_and_refuses_what_it_should():
    schema = schemas.load("schemas/examples/taobao_like.yaml")
    trees = compression.build_trees(taobao_table(300), schema)
    decode = compression.TreeMessageDecoder(schema.tree_arrow_schema(), schema.name)
    one = compression.encode_trees(trees.slice(0, 1))
    assert decode(one).equals(compression.decode_trees(one))
    # several record batches in one message (a chunked table)
    chunked = pa.concat_tables([trees.slice(0, 2), trees.slice(2, 3), trees.slice(5)])
    assert chunked.column(0).num_chunks == 3
    assert decode(compression.encode_trees(chunked)).equals(trees)
    # the same schema written with other metadata: the full path, same table
    plain = trees.replace_schema_metadata(None)
    assert decode(compression.encode_trees(plain)).equals(trees)
    # another schema, garbage, a truncated message
    with pytest.raises(ValueError, match="tree schema does not match schema 'taobao_like'"):
        decode(compression.encode_trees(compression.build_trees(
            pa.Table.from_pylist(ROWS), SCHEMA)))
    for bad in (b"", b"garbage", one[:len(one) // 2], one[:-9]):
        with pytest.raises(ValueError, match="not an Arrow IPC tree message"):
            decode(bad)


def _run(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          check=True)


def test_compress_and_inspect_commands(tmp_path):
    schema_path = "schemas/examples/taobao_like.yaml"
    schema = schemas.load(schema_path)
    table = taobao_table(800)
    pq.write_table(table.slice(0, 500), tmp_path / "a.parquet")
    pq.write_table(table.slice(500), tmp_path / "b.parquet")
    out = _run("compression.compress", "--schema", schema_path, "--input",
               str(tmp_path / "*.parquet"), "--output", str(tmp_path / "trees"))
    assert "compressed 800 samples" in out.stdout
    stats = json.loads((tmp_path / "trees" / "_stats.json").read_text())
    assert stats["samples"] == 800 and stats["input_files"] == 2

    text = _run("compression.inspect", str(tmp_path / "trees")).stdout
    assert "samples               800" in text
    assert "compression ratio" in text
    summary = json.loads(_run("compression.inspect", str(tmp_path / "trees"), "--json").stdout)
    trees = compression.read_trees(str(tmp_path / "trees"))
    assert summary["samples"] == 800
    assert summary["trees"] == trees.num_rows == len(set(table.column("user_id").to_pylist()))
    assert summary["nodes"]["creative"] == 800
    assert summary["nodes"]["ad"] == len(compression.flat_layers(trees, schema)[1])
    assert summary["samples_per_root"]["max"] >= summary["samples_per_root"]["p50"]
    assert summary["bytes_on_disk"] == os.path.getsize(tmp_path / "trees" / "part-00000.parquet")
    assert summary["id_compression_ratio"] == summary["ids_flat"] / summary["ids_in_trees"]


def test_inspect_reports_a_missing_path():
    result = subprocess.run([sys.executable, "-m", "compression.inspect", "/nonexistent/x"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "no input files match '/nonexistent/x'" in result.stderr


def test_json_lines_go_through_the_native_decoder_with_file_line_numbers(tmp_path):
    """JSON-lines files take the decoder of Kafka messages: blank and CRLF lines are skipped,
    every rejected line keeps its 1-based line in the file across chunks, and what killed
    pyarrow's reader (a `null` line: SIGSEGV) or Python's (deep nesting: RecursionError) is
    a rejected line like any other."""
    good = [json.dumps(r).encode() for r in ROWS]
    lines = [good[0] + b"\r", b"", b"  \r", b"null", good[1], b"[" * 100_000, good[2],
             b"{\"uid\": 1, \"extra\": 2}", good[0]]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    chunks = list(compression.iter_raw_chunks(str(path), SCHEMA, chunk_rows=2))
    assert len(chunks) > 1
    table = pa.concat_tables([c.table for c in chunks])
    assert table.to_pylist() == [ROWS[0], ROWS[1], ROWS[2], ROWS[0]]
    rejected = pa.concat_tables([c.rejected for c in chunks]).to_pylist()
    assert [(r["row"], r["reason"]) for r in rejected] == [
        (4, "line 4: not a valid sample: expected a JSON object, got null"),
        (6, "line 6: not a valid sample: not JSON (the message ends too early)"),
        (8, "line 8: not a valid sample: unexpected field(s) 'extra'; the schema has no such "
            "column"),
    ] and {r["source"] for r in rejected} == {str(path)}
    with pytest.raises(RawDataError) as err:  # the strict readers name the first bad line
        compression.read_raw(str(path), SCHEMA)
    assert str(err.value) == f"{path}: line 4: not a valid sample: expected a JSON object, " \
                             "got null (and at least 2 more bad lines)"
    gz = tmp_path / "good.jsonl.gz"
    with gzip.open(gz, "wb") as f:
        f.write(b"\n".join(good))  # no newline at the end
    assert compression.read_raw(str(gz), SCHEMA).to_pylist() == ROWS
    null_only = tmp_path / "null.jsonl"
    null_only.write_bytes(b"null\nnull\n")
    with pytest.raises(RawDataError, match=r"null.jsonl: line 1: not a valid sample: expected a "
                                           r"JSON object, got null \(and at least 1 more bad "
                                           r"line\)$"):
        compression.read_raw(str(null_only), SCHEMA)


def test_a_csv_that_is_not_utf8_is_named_by_column_line_and_byte_offset(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes(b"uid,hist,aid,price,click\n1,x|y,10,1.5|2,1\n2,caf\xe9,11,0.5|0,0\n")
    with pytest.raises(RawDataError) as err:
        compression.read_raw(str(path), SCHEMA)
    assert str(err.value) == (f"{path}: column 'hist' line 3: byte 0xe9 at byte offset 47 is not "
                              "UTF-8; the file must be UTF-8 encoded (convert it, e.g. with iconv"
                              " -f latin1 -t utf-8)")
    path.write_bytes(b"uid,hist,aid,price,click\n1,x|y,99999999999999999999,1.5|2,1\n")
    with pytest.raises(RawDataError, match=r"column 'aid' line 2: invalid value "
                                           r"'99999999999999999999', expected an integer"):
        compression.read_raw(str(path), SCHEMA)
