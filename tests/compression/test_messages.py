"""Bulk JSON decoding of sample messages: good rows in order, one reason per bad message."""

import json

import schemas
import compression

SCHEMA = schemas.from_dict({"name": "t", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"},
                                                   {"name": "hist", "kind": "ids"}]},
    {"name": "ad", "key": ["aid"], "features": [{"name": "aid", "kind": "id"}]}]})


def _sample(uid, click=0.0, **extra):
    return json.dumps({"uid": uid, "hist": [1, 2], "aid": 7, "click": click, **extra}).encode()


def test_good_and_bad_messages_are_told_apart_with_reasons():
    values = [_sample(1), b"{not json", _sample(2, click=3.0), b"", _sample(3),
              json.dumps({"uid": "x", "hist": [], "aid": 1, "click": 0}).encode(),
              _sample(4, extra_field=1), json.dumps({"hist": [], "aid": 1, "click": 0}).encode(),
              _sample(5)]
    good, dead = compression.decode_json_samples(values, SCHEMA, with_index=True)
    assert good.column("uid").to_pylist() == [1, 3, 5]
    assert good.column("__message").to_pylist() == [0, 4, 8]
    reasons = dict(dead)
    assert sorted(reasons) == [1, 2, 3, 5, 6, 7]
    assert reasons[1].startswith("not a valid sample: not JSON (")
    assert reasons[2] == "label 'click': value out of range, labels must be in [0, 1]"
    assert reasons[3] == "empty message; expected one JSON object"
    assert reasons[5].startswith("not a valid sample:") and "uid" in reasons[5]
    assert reasons[6] == ("not a valid sample: unexpected field(s) 'extra_field'; the schema "
                          "has no such column")
    assert reasons[7] == "key column 'uid': null value; every row needs a key"


def test_without_index_dead_letters_carry_the_message_bytes():
    good, dead = compression.decode_json_samples([_sample(1), b"[]"], SCHEMA)
    assert good.column_names == list(SCHEMA.raw_arrow_schema().names)
    assert [value for value, _ in dead] == [b"[]"]


def test_messages_with_newlines_still_decode():
    value = b'{"uid": 9,\n "hist": [],\r\n "aid": 1, "click": 1}'
    good, dead = compression.decode_json_samples([value], SCHEMA)
    assert dead == [] and good.column("uid").to_pylist() == [9]
