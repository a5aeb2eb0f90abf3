"""Carried columns (row ids, request ids, timestamps): kept losslessly with every sample
through trees, files, messages and batches, never part of a node's identity."""

import datetime as dt
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compression
import schemas
from compression import RawDataError
from sample_data import carried_samples, random_schemas, raw_tables, row_multiset

PROPERTY = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
UTC = dt.timezone.utc
# Small pools with duplicates and nulls: the same row id twice must still give two leaves.
_VALUES = {"int64": [0, 7, -(1 << 62), None],
           "float64": [0.0, -0.0, 1.5, float("inf"), None],
           "string": ["", "req-1", "réq-2", None],
           "timestamp": [dt.datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC),
                         dt.datetime(1970, 1, 1, tzinfo=UTC), None]}

SCHEMA = schemas.load("schemas/examples/with_row_ids.yaml")


def _with_carried(schema: schemas.Schema, dtypes) -> schemas.Schema:
    data = schema.to_dict()
    data["layers"][-1]["carried"] = [{"name": f"c{i}", "dtype": d} for i, d in enumerate(dtypes)]
    return schemas.from_dict(data)


def _append_carried(draw, table: pa.Table, schema: schemas.Schema) -> pa.Table:
    for c in schema.carried:
        values = [draw(st.sampled_from(_VALUES[c.dtype])) for _ in range(table.num_rows)]
        table = table.append_column(c.name, pa.array(values, c.raw_arrow_type()))
    return table


@PROPERTY
@given(st.data())
def test_flatten_of_build_trees_keeps_every_carried_value(data):
    base = data.draw(random_schemas())
    dtypes = data.draw(st.lists(st.sampled_from(list(_VALUES)), min_size=1, max_size=4))
    schema = _with_carried(base, dtypes)
    table = _append_carried(data.draw, data.draw(raw_tables(base)), schema)
    trees = compression.build_trees(table, schema)
    assert trees.schema.equals(schema.tree_arrow_schema())
    back = compression.flatten(trees, schema)
    assert back.schema.equals(schema.raw_arrow_schema())
    assert row_multiset(back) == row_multiset(table)
    # carried columns never split a node: the upper layers are those of the schema without them
    without = compression.build_trees(table.drop_columns(list(schema.carried_names)), base)
    for ours, theirs in zip(compression.flat_layers(trees, schema)[:-1],
                            compression.flat_layers(without, base)[:-1]):
        assert len(ours) == len(theirs)
    if len(schema.layers) > 1 and table.num_rows:  # the Beam job's split form: same trees
        roots, rows = compression.split_roots(table, schema)
        assert compression.build_trees(rows, schema, validate=False, roots=roots).equals(trees)


def test_batches_carry_the_leaves_values_in_leaf_order():
    raw = carried_samples(700)
    trees = compression.build_trees(raw, SCHEMA)
    flat = compression.flatten(trees, SCHEMA)
    for split in (True, False):
        batches = list(compression.iter_batches([trees.slice(0, 30), trees.slice(30)], SCHEMA,
                                                64, split_trees=split))
        for batch in batches:
            batch.check()
            assert set(batch.carried) == {"request_id", "row_id", "event_time"}
            assert batch.carried["row_id"].type == pa.int64()
            assert all(name not in layer.features for layer in batch.layers
                       for name in batch.carried)
        for name in SCHEMA.carried_names:
            joined = pa.concat_arrays([b.carried[name] for b in batches])
            assert joined.equals(flat.column(name).combine_chunks())
    whole = compression.TreeBatch.from_trees(trees, SCHEMA)
    assert whole.carried["row_id"].equals(flat.column("row_id").combine_chunks())
    part = whole.slice_leaves(10, 20)
    assert part.carried["row_id"].to_pylist() == flat.column("row_id")[10:20].to_pylist()
    both = compression.TreeBatch.concat([whole.slice_leaves(0, 5), part])
    both.check()
    assert len(both.carried["request_id"]) == both.num_leaves == 15
    broken = compression.TreeBatch(both.layers, both.labels,
                                   {"row_id": both.carried["row_id"].slice(1)})
    with pytest.raises(ValueError, match="carried column 'row_id' has 14 values but the batch "
                                         "has 15 leaves"):
        broken.check()


def test_carried_columns_do_not_change_the_trees_or_their_statistics():
    raw = carried_samples(600, seed=3)
    data = SCHEMA.to_dict()
    data["layers"][-1].pop("carried")
    plain = schemas.from_dict(data)
    trees = compression.build_trees(raw, SCHEMA)
    without = compression.build_trees(raw.drop_columns(list(SCHEMA.carried_names)), plain)
    assert trees.num_rows == without.num_rows
    assert compression.flatten(trees, SCHEMA).drop_columns(list(SCHEMA.carried_names)).equals(
        compression.flatten(without, plain))
    ours = compression.TreeStats(SCHEMA).add(trees).summary()
    theirs = compression.TreeStats(plain).add(without).summary()
    for key in ("samples", "trees", "nodes", "ids_in_trees", "ids_flat"):
        assert ours[key] == theirs[key]


def test_validation_casts_carried_columns_without_loss_and_keeps_nulls():
    raw = carried_samples(4)
    table = raw.set_column(raw.schema.get_field_index("row_id"), "row_id",
                           pa.array([1, 2, None, 4], pa.int32()))
    table = table.set_column(table.schema.get_field_index("request_id"), "request_id",
                             pa.array(["a", None, "c", "d"], pa.large_string()))
    table = table.set_column(table.schema.get_field_index("event_time"), "event_time",
                             pa.array([1_000, 2_000, 3_000, None], pa.timestamp("ns")))
    out = compression.validate_raw(table, SCHEMA)
    assert out.schema.equals(SCHEMA.raw_arrow_schema())
    assert out.column("row_id").to_pylist() == [1, 2, None, 4]
    assert out.column("request_id").to_pylist() == ["a", None, "c", "d"]
    assert out.column("event_time").cast(pa.int64()).to_pylist() == [1, 2, 3, None]
    good, rejected = compression.split_bad_rows(table, SCHEMA)
    assert good.num_rows == 4 and rejected.num_rows == 0  # a null carried value is no problem
    all_null = raw.set_column(raw.schema.get_field_index("row_id"), "row_id",
                              pa.nulls(4))
    assert compression.validate_raw(all_null, SCHEMA).column("row_id").null_count == 4


@pytest.mark.parametrize("name, column, message", [
    ("row_id", pa.array(["1", "2", "3", "4"]),
     "carried column 'row_id' has type string, expected int64; convert the column or change "
     "its dtype in the schema's `carried:` list"),
    ("request_id", pa.array([1, 2, 3, 4]),
     "carried column 'request_id' has type int64, expected string"),
    ("event_time", pa.array([1, 2, 3, 4]),
     "carried column 'event_time' has type int64, expected timestamp"),
    ("event_time", pa.array([1, 2, 3, 1001], pa.timestamp("ns")),
     "carried column 'event_time': cannot convert timestamp[ns] to timestamp[us, tz=UTC] "
     "without loss"),
    ("row_id", pa.array([1, 2, 3, 2**63], pa.uint64()),
     "carried column 'row_id': cannot convert uint64 to int64 without loss"),
])
def test_a_carried_column_of_the_wrong_type_is_refused_naming_it(name, column, message):
    raw = carried_samples(4)
    table = raw.set_column(raw.schema.get_field_index(name), name, column)
    with pytest.raises(RawDataError) as err:
        compression.validate_raw(table, SCHEMA)
    assert message in str(err.value)


def test_missing_and_undeclared_columns_point_at_carried():
    raw = carried_samples(4)
    with pytest.raises(RawDataError, match="missing column.*'row_id'.*and carried columns"):
        compression.validate_raw(raw.drop_columns(["row_id"]), SCHEMA)
    with pytest.raises(RawDataError, match="under the leaf layer's `carried:`"):
        compression.validate_raw(raw.append_column("session", pa.array([1, 2, 3, 4])), SCHEMA)


def test_float64_carried_values_stay_bit_exact():
    data = SCHEMA.to_dict()
    data["layers"][-1]["carried"].append({"name": "c0", "dtype": "float64"})
    schema = schemas.from_dict(data)
    raw = carried_samples(5).append_column("c0", pa.array([0.1, -0.0, 1e300, float("nan"), None]))
    back = compression.flatten(compression.build_trees(raw, schema), schema)
    got = back.sort_by("row_id").column("c0").to_pylist()
    assert got[:3] == [0.1, -0.0, 1e300] and np.signbit(got[1]) and np.isnan(got[3])
    assert got[4] is None


def test_parquet_files_and_tree_messages_keep_carried_columns(tmp_path):
    raw = carried_samples(400)
    trees = compression.build_trees(raw, SCHEMA)
    path = compression.write_trees(trees, str(tmp_path / "part-0.parquet"))
    read = compression.read_trees(path)
    assert schemas.from_arrow_metadata(pq.ParquetFile(path).schema_arrow) == SCHEMA
    assert row_multiset(compression.flatten(read, SCHEMA)) == row_multiset(raw)
    decoder = compression.TreeMessageDecoder(SCHEMA.tree_arrow_schema(), SCHEMA.name)
    message = compression.encode_trees(trees.slice(3, 5))
    for decoded in (compression.decode_trees(message), decoder(message)):
        assert decoded.equals(trees.slice(3, 5))
    streamed = list(compression.iter_batches(compression.iter_trees(path, rows=7), SCHEMA, 50))
    assert pa.concat_arrays([b.carried["request_id"] for b in streamed]).equals(
        compression.flatten(trees, SCHEMA).column("request_id").combine_chunks())


def test_csv_and_json_lines_read_carried_columns(tmp_path):
    csv = tmp_path / "raw.csv"
    csv.write_text("user_id,clicked_cats,ad_id,price,click,request_id,row_id,event_time\n"
                   "1,3|4,7,1.5,1,r-1,10,2024-05-01 12:00:00.123456\n"
                   "1,3|4,8,2.5,0,,,2024-05-01T12:00:01\n"
                   "2,,8,2.5,0,r-3,12,\n")
    table = compression.read_raw(str(csv), SCHEMA)
    assert table.column("request_id").to_pylist() == ["r-1", "", "r-3"]
    assert table.column("row_id").to_pylist() == [10, None, 12]
    assert table.column("event_time").to_pylist() == [
        dt.datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC),
        dt.datetime(2024, 5, 1, 12, 0, 1, tzinfo=UTC), None]
    zoned = tmp_path / "zoned.csv"
    zoned.write_text(csv.read_text().replace(".123456", "+02:00").replace(":01\n", ":01Z\n"))
    assert compression.read_raw(str(zoned), SCHEMA).column("event_time").to_pylist()[:2] == [
        dt.datetime(2024, 5, 1, 10, 0, 0, tzinfo=UTC), dt.datetime(2024, 5, 1, 12, 0, 1,
                                                                   tzinfo=UTC)]
    mixed = tmp_path / "mixed.csv"
    mixed.write_text(zoned.read_text().replace("+02:00", ""))
    with pytest.raises(RawDataError, match="mixed.csv: carried column 'event_time': cells must "
                                           "hold ISO-8601 timestamps"):
        compression.read_raw(str(mixed), SCHEMA)
    jsonl = tmp_path / "raw.jsonl"
    jsonl.write_text(
        '{"user_id": 1, "clicked_cats": [3], "ad_id": 7, "price": [1.5], "click": 1, '
        '"request_id": "r-1", "row_id": 10, "event_time": "2024-05-01T12:00:00.5"}\n'
        '{"user_id": 2, "clicked_cats": [], "ad_id": 7, "price": [1.5], "click": 0}\n')
    table = compression.read_raw(str(jsonl), SCHEMA)
    assert table.column("request_id").to_pylist() == ["r-1", None]
    assert table.column("row_id").to_pylist() == [10, None]
    assert table.column("event_time")[0].as_py() == dt.datetime(2024, 5, 1, 12, 0, 0, 500000,
                                                                tzinfo=UTC)


def test_json_messages_keep_carried_columns():
    good, dead = compression.decode_json_samples([
        b'{"user_id": 1, "clicked_cats": [3], "ad_id": 7, "price": [1.5], "click": 1, '
        b'"request_id": "r-1", "row_id": 10, "event_time": "2024-05-01T12:00:00"}',
        b'{"user_id": 1, "clicked_cats": [3], "ad_id": 7, "price": [1.5], "click": 1}',
        b'{"user_id": 1, "clicked_cats": [3], "ad_id": 7, "price": [1.5], "click": 1, '
        b'"row_id": "ten"}'], SCHEMA)
    assert good.schema.equals(SCHEMA.raw_arrow_schema())
    assert good.column("request_id").to_pylist() == ["r-1", None]
    assert good.column("row_id").to_pylist() == [10, None]
    assert len(dead) == 1 and "row_id" in dead[0][1]


def test_a_one_layer_schema_carries_columns_too():
    schema = schemas.from_dict({"name": "flat", "labels": ["click"], "layers": [
        {"name": "sample", "features": [{"name": "item", "kind": "id"}],
         "carried": [{"name": "rid", "dtype": "string"}]}]})
    raw = pa.table({"item": [1, 1, 2], "click": pa.array([0, 1, 0], pa.float32()),
                    "rid": ["a", "a", None]})
    trees = compression.build_trees(raw, schema)
    assert row_multiset(compression.flatten(trees, schema)) == row_multiset(raw)
    (batch,) = compression.iter_batches(trees, schema, 10)
    assert batch.carried["rid"].to_pylist() == ["a", "a", None]
