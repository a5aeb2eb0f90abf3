"""Ordered behaviour sequences in the schema: declaration, validation, round trips."""
import copy

import pytest

import schemas
from schemas import SchemaError, Sequence

BASE = {"name": "t", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [
        {"name": "uid", "kind": "id"},
        {"name": "hist", "kind": "ids", "sequence": {"max_length": 5, "time": "hist_t"}},
        {"name": "hist_t", "kind": "ids"},
        {"name": "bag", "kind": "ids"}]},
    {"name": "ad", "key": ["aid"], "features": [{"name": "aid", "kind": "id"},
                                                 {"name": "price", "kind": "dense", "dim": 1}]}]}


def _with(change):
    data = copy.deepcopy(BASE)
    change(data)
    return data


def _hist(data):
    return data["layers"][0]["features"][1]


def test_a_sequence_declares_its_order_length_and_time_column():
    schema = schemas.from_dict(BASE)
    assert schema.feature("hist").sequence == Sequence(max_length=5, time="hist_t")
    assert schema.feature("bag").sequence is None
    assert [f.name for f in schema.sequences] == ["hist"]
    assert schema.time_columns == {"hist_t"}
    # the time column orders the sequence; it is not embedded
    assert [f.name for f in schema.embedded_features] == ["uid", "hist", "bag", "aid"]
    # the raw and tree columns are unchanged: the time column is a list of int64
    assert schema.raw_arrow_schema().names == ["uid", "hist", "hist_t", "bag", "aid", "price",
                                               "click"]


@pytest.mark.parametrize("sequence, expected", [
    (True, Sequence()), ({}, Sequence()), ({"max_length": 3}, Sequence(max_length=3)),
    (False, None)])
def test_short_forms(sequence, expected):
    schema = schemas.from_dict(_with(lambda d: _hist(d).update(sequence=sequence)))
    assert schema.feature("hist").sequence == expected
    assert schema.time_columns == frozenset()


def test_sequences_round_trip_through_yaml_and_tree_metadata(tmp_path):
    for change in (lambda d: None, lambda d: _hist(d).update(sequence=True)):
        schema = schemas.from_dict(_with(change))
        path = tmp_path / "s.yaml"
        path.write_text(schema.to_yaml())
        assert schemas.load(path) == schema
        assert schemas.from_arrow_metadata(schema.tree_arrow_schema()) == schema


def test_schemas_without_sequences_write_what_they_wrote_before():
    schema = schemas.load("schemas/examples/taobao_like.yaml")
    assert "sequence" not in schema.to_yaml()
    assert schema.sequences == () and schema.time_columns == frozenset()


W = "layers[0] (user).features"


@pytest.mark.parametrize("change, message", [
    (lambda d: d["layers"][0]["features"][0].update(sequence=True),
     f"{W}[0] (uid).sequence: only ids features can be sequences (a list of behaviours, oldest "
     "first); this feature has kind 'id'"),
    (lambda d: _hist(d).update(sequence="yes"),
     f"{W}[1] (hist).sequence: expected true or a mapping like `sequence: {{max_length: 50, "
     "time: clicked_times}`, got 'yes'"),
    (lambda d: _hist(d).update(sequence={"max_len": 5}),
     f"{W}[1] (hist).sequence: unknown field 'max_len'; expected max_length, time"),
    (lambda d: _hist(d).update(sequence={"max_length": 0}),
     f"{W}[1] (hist).sequence.max_length: 0 is not a positive integer (the number of most "
     "recent behaviours kept)"),
    (lambda d: _hist(d).update(sequence={"max_length": True}),
     f"{W}[1] (hist).sequence.max_length: True is not a positive integer"),
    (lambda d: _hist(d).update(sequence={"time": 3}),
     f"{W}[1] (hist).sequence.time: 3 is not a column name"),
    (lambda d: _hist(d).update(sequence={"time": "when"}),
     f"{W}[1] (hist).sequence.time: 'when' is not a feature of this layer; the time column is "
     "an ids feature beside 'hist' with one int64 time per item, e.g. `{name: when, kind: "
     "ids}`"),
    (lambda d: _hist(d).update(sequence={"time": "aid"}),
     f"{W}[1] (hist).sequence.time: 'aid' is not a feature of this layer"),
    (lambda d: _hist(d).update(sequence={"time": "hist"}),
     f"{W}[1] (hist).sequence.time: a sequence cannot be its own time column"),
    (lambda d: _hist(d).update(sequence={"time": "uid"}),
     f"{W}[1] (hist).sequence.time: the time column 'uid' has kind 'id', dtype int64; it must "
     "be an ids feature of dtype int64 (one time per item)"),
    (lambda d: (d["layers"][0]["features"][2].update(dtype="string")),
     f"{W}[1] (hist).sequence.time: the time column 'hist_t' has kind 'ids', dtype string"),
    (lambda d: (d["layers"][0]["features"][2].update(sequence=True)),
     f"{W}[1] (hist).sequence.time: the time column 'hist_t' is itself declared a sequence"),
])
def test_invalid_sequences_name_the_field(change, message):
    with pytest.raises(SchemaError) as err:
        schemas.from_dict(_with(change))
    assert str(err.value).startswith(message)
