"""Bad raw input: errors that name the column and the row, and nothing silently dropped."""

import pyarrow as pa
import pytest

import compression
import schemas
from compression import RawDataError

SCHEMA = schemas.from_dict({"name": "t", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"},
                                                   {"name": "hist", "kind": "ids"}]},
    {"name": "ad", "key": ["aid"], "features": [{"name": "aid", "kind": "id", "dtype": "string"},
                                                 {"name": "price", "kind": "dense", "dim": 2}]}]})


def _table(**overrides):
    columns = {"uid": pa.array([1, 2, 3], pa.int64()),
               "hist": pa.array([[1], [], [2, 3]], pa.list_(pa.int64())),
               "aid": pa.array(["a", "b", "c"]),
               "price": pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], pa.list_(pa.float32())),
               "click": pa.array([0.0, 1.0, 0.0], pa.float32())}
    columns.update(overrides)
    return pa.table({k: v for k, v in columns.items() if v is not None})


def test_a_good_table_passes_and_is_cast_to_canonical_types():
    table = _table(uid=pa.array([1, 2, 3], pa.int32()), click=pa.array([0, 1, 0], pa.int8()),
                   price=pa.array([[1, 2], [3, 4], [5, 6]], pa.list_(pa.float64())))
    out = compression.validate_raw(table, SCHEMA)
    assert out.schema.equals(SCHEMA.raw_arrow_schema())
    assert out.column("price").to_pylist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]


@pytest.mark.parametrize("overrides, message", [
    ({"hist": None}, "missing column(s) 'hist': the schema 't' needs every feature of every "
                     "layer plus the labels in each row"),
    ({"extra": pa.array([1, 2, 3])}, "unexpected column(s) 'extra': not in schema 't'; drop them "
                                     "or declare them as features"),
    ({"uid": pa.array(["1", "2", "3"])}, "column 'uid' has type string, expected an integer "
                                         "(kind id, dtype int64); convert the column or fix the "
                                         "schema"),
    ({"aid": pa.array([1, 2, 3])}, "column 'aid' has type int64, expected a string (kind id, "
                                   "dtype string)"),
    ({"uid": pa.array([1, None, 3], pa.int64())},
     "key column 'uid' row 2: null value; every row needs a key"),
    ({"click": pa.array([0.0, 1.0, 2.0], pa.float32())},
     "label 'click' row 3: value out of range, labels must be in [0, 1]"),
    ({"click": pa.array(["0", "1", "0"])}, "label column 'click' has type string, expected "
                                           "numbers in [0, 1]"),
    ({"price": pa.array([[1.0, 2.0], [3.0], [5.0, 6.0]], pa.list_(pa.float32()))},
     "column 'price' row 2: dense value has the wrong number of floats, expected dim 2"),
    ({"price": pa.array([[1.0, 2.0], [3.0, 4.0], [float("nan"), 6.0]], pa.list_(pa.float32()))},
     "column 'price' row 3: NaN or infinite value in a dense feature"),
    ({"hist": pa.array([[1], [None], [2]], pa.list_(pa.int64()))},
     "column 'hist' row 2: null inside the list; lists may be empty but cannot hold nulls"),
    ({"uid": pa.array([1, 2, 2**63], pa.uint64())},
     "column 'uid': cannot convert uint64 to int64 without loss"),
])
def test_bad_tables_raise_naming_column_and_row(overrides, message):
    with pytest.raises(RawDataError) as err:
        compression.validate_raw(_table(**overrides), SCHEMA, source="day1.parquet")
    assert str(err.value).startswith("day1.parquet: ")
    assert message in str(err.value)


def test_row_numbers_count_from_the_chunk_offset_and_say_how_many_more():
    table = _table(click=pa.array([3.0, 1.0, -1.0], pa.float32()))
    with pytest.raises(RawDataError, match=r"label 'click' row 1000: value out of range, labels "
                                           r"must be in \[0, 1\] \(1 more rows like it\)"):
        compression.validate_raw(table, SCHEMA, first_row=1000)


def test_split_bad_rows_keeps_good_rows_and_reports_each_bad_one():
    table = _table(uid=pa.array([1, None, 3], pa.int64()),
                   click=pa.array([0.0, 1.0, 7.0], pa.float32()))
    good, bad = compression.split_bad_rows(table, SCHEMA, source="f.parquet", first_row=10)
    assert good.column("uid").to_pylist() == [1]
    assert bad.to_pylist() == [
        {"source": "f.parquet", "row": 11, "reason": "key column 'uid' row 11: null value; "
                                                     "every row needs a key"},
        {"source": "f.parquet", "row": 12, "reason": "label 'click' row 12: value out of range, "
                                                     "labels must be in [0, 1]"},
    ]
    assert good.num_rows + bad.num_rows == table.num_rows


def test_build_trees_validates_its_input():
    with pytest.raises(RawDataError, match="key column 'uid' row 1: null value"):
        compression.build_trees(_table(uid=pa.array([None, 2, 3], pa.int64())), SCHEMA)


def test_every_kind_of_problem_is_reported_key_columns_first():
    """A null key and a null in another column (here before the key in schema order): both."""
    schema = schemas.from_dict({"name": "k", "labels": ["click"], "layers": [
        {"name": "user", "key": ["uid"], "features": [{"name": "age", "kind": "id"},
                                                       {"name": "uid", "kind": "id"}]}]})
    table = pa.table({"age": pa.array([None, 3, 4], pa.int64()),
                      "uid": pa.array([1, 2, None], pa.int64()),
                      "click": pa.array([0.0, 1.0, 0.0], pa.float32())})
    with pytest.raises(RawDataError) as err:
        compression.validate_raw(table, schema, source="day1.parquet")
    assert str(err.value) == (
        "day1.parquet: key column 'uid' row 3: null value; every row needs a key; also column "
        "'age' row 1: null value; fill missing values (e.g. id 0, an empty list) before "
        "compressing")
    good, bad = compression.split_bad_rows(table.set_column(0, "age", pa.array(
        [None, 3, None], pa.int64())), schema, source="day1.csv", first_row=2)
    assert good.num_rows == 1
    assert bad.to_pylist() == [
        {"source": "day1.csv", "row": 2, "reason": "column 'age' line 2: null value; fill "
                                                   "missing values (e.g. id 0, an empty list) "
                                                   "before compressing"},
        {"source": "day1.csv", "row": 4, "reason": "key column 'uid' line 4: null value; every "
                                                   "row needs a key; column 'age' line 4: null "
                                                   "value; fill missing values (e.g. id 0, an "
                                                   "empty list) before compressing"}]
