"""trainer.requests: a prediction request's body through the native scanner and sample decoder,
in process and without a model. A sample in a request gets the verdict the same sample gets in a
file or a Kafka message (compression.decode_json_samples), prefixed by its place; valid requests
decode to the tables the file decoder gives; the bodies of issue 39 are 400s."""
import json

import numpy as np
import pyarrow as pa
import pytest

import schemas
from compression import decode_json_samples
from trainer.requests import BadRequest, TreeRequest, decode_request, scan_request

SCHEMA = schemas.from_dict({
    "name": "requests_test", "labels": ["click", "conv"],
    "layers": [
        {"name": "user", "key": ["uid"], "features": [
            {"name": "uid", "kind": "id"}, {"name": "hist", "kind": "ids"},
            {"name": "tags", "kind": "ids", "dtype": "string"}]},
        {"name": "ad", "key": ["aid"], "features": [
            {"name": "aid", "kind": "id", "dtype": "string"},
            {"name": "price", "kind": "dense", "dim": 2}]},
        {"name": "sample", "features": [{"name": "pos", "kind": "id"}],
         "carried": [{"name": "row_id", "dtype": "int64"}, {"name": "note", "dtype": "string"}]},
    ]})
USER = {"uid": 7, "hist": [1, 2, 3], "tags": ["a", "é"]}
FEATURES = [f.name for f in SCHEMA.features]


def _candidate(i):
    return {"aid": f"ad{i}", "price": [0.5 * i, -1.0], "pos": i % 3}


def _sample(i, **extra):
    return {**USER, "uid": 7 + i % 2, **_candidate(i), **extra}


def _decode(body):
    return decode_request(scan_request(body, max_samples=50), SCHEMA)


def _refusal(body, max_samples=50) -> BadRequest:
    with pytest.raises(BadRequest) as error:
        decode_request(scan_request(body, max_samples), SCHEMA)
    return error.value


def test_valid_requests_decode_to_the_files_columns():
    samples = [_sample(i, click=i % 2, conv=None, row_id=i, note="n") for i in range(6)]
    samples[2] = _sample(2)  # labels and carried columns are optional, and ignored
    lines = [json.dumps({**s, "click": 0, "conv": 0}).encode() for s in samples]
    expected, dead = decode_json_samples(lines, SCHEMA)
    assert dead == []
    table = _decode(json.dumps({"samples": samples}).encode())
    assert table.column_names == FEATURES + ["click", "conv"]
    assert table.select(FEATURES).equals(expected.select(FEATURES))
    assert table.column("click").to_pylist() == [0.0] * 6  # serving samples have no labels

    candidates = [{**_candidate(i), "click": 1, "row_id": i} for i in range(5)]
    tree = _decode(json.dumps({"root": USER, "candidates": candidates}).encode())
    assert isinstance(tree, TreeRequest) and len(tree) == 5
    flat, _ = decode_json_samples([json.dumps({**USER, **c, "conv": 0}).encode()
                                   for c in candidates], SCHEMA)
    assert tree.root.equals(flat.select(["uid", "hist", "tags"]).slice(0, 1))
    assert tree.candidates.equals(flat.select(["aid", "price", "pos"]))
    batch = tree.batch(SCHEMA, 1, 4)  # candidates 1-3 under the root, once
    assert [layer.size for layer in batch.layers] == [1, 3, 3]
    assert batch.layers[1].parent.tolist() == [0, 0, 0]
    assert batch.layers[2].parent.tolist() == [0, 1, 2]
    assert batch.layers[2].features["pos"].tolist() == [1, 2, 0]


GOOD = json.dumps(_sample(0, click=1, conv=0)).encode()
# (a training sample's bytes: labels included, so that a file accepts it but for the flaw)
FLAWED = [
    GOOD.replace(b'"uid": 7', b'"uid": "7"'),                       # wrong type
    GOOD.replace(b'"uid": 7', b'"uid": 99999999999999999999'),      # beyond int64
    GOOD.replace(b'"uid": 7', b'"uid": 7.5'),
    GOOD.replace(b'"ad0"', b'"\\ud800"'),                           # a lone surrogate
    GOOD.replace(b'"ad0"', b'"a\\udc00"'),
    GOOD.replace(b'"ad0"', b'"\xed\xa0\x80"'),                      # an encoded surrogate
    GOOD.replace(b'"a"', b'"\xff"'),                                # invalid UTF-8 in a list
    GOOD.replace(b'"ad0"', b'"a\nb"'),                              # a raw newline
    GOOD.replace(b'"pos": 0', b'"pos": 0, "colour": 3'),            # an unknown field
    GOOD.replace(b'"pos": 0', b'"pos": 0, "uid": 8'),               # a repeated field
    GOOD.replace(b'"uid": 7', b'"uid": null'),                      # a null key
    GOOD.replace(b'"tags": ["a", "\\u00e9"]', b'"tags": ["a", null]'),
    GOOD.replace(b"[0.0, -1.0]", b"[0.0]"),                         # dense of the wrong dim
    GOOD.replace(b"[0.0, -1.0]", b"[NaN, 1]"),
    GOOD.replace(b"[0.0, -1.0]", b"[1e400, 1]"),                    # too big for a double
    GOOD.replace(b'"pos": 0', b'"pos": 0 "x": 1'),                  # syntax, between fields
    GOOD.replace(b"[1, 2, 3]", b"[1, 2 3]"),                        # syntax, inside a value
    GOOD.replace(b"[1, 2, 3]", b"[1, {\"a\": tru}]"),
    GOOD.replace(b'"click": 1', b'"click": 1.5'),                   # a label out of range
    GOOD.replace(b'"click": 1', b'"click": 1, "row_id": "r"'),      # a carried value's type
    b"[1, 2]", b'"sample"', b"null",                                # not objects
]


@pytest.mark.parametrize("sample", FLAWED, ids=range(len(FLAWED)))
def test_a_refused_sample_gets_the_verdict_a_file_gives_it(sample):
    _, dead = decode_json_samples([sample], SCHEMA)
    assert len(dead) == 1
    body = b'{"samples": [' + GOOD + b", " + sample + b", " + GOOD + b"]}"
    assert str(_refusal(body)) == f"sample 1: {dead[0][1]}"


def test_a_lone_surrogate_and_an_integer_beyond_int64_name_their_column():
    body = json.dumps({"samples": [_sample(0, aid="\ud800")]}).encode()
    assert str(_refusal(body)).startswith(
        "sample 0: not a valid sample: not JSON (invalid surrogate pair in a string at byte")
    assert str(_refusal(body)).endswith(", in field 'aid')")
    body = json.dumps({"root": USER, "candidates": [_candidate(0), {**_candidate(1),
                                                                    "pos": -2**63 - 1}]})
    assert str(_refusal(body.encode())) == (
        "candidate 1: not a valid sample: field 'pos': expected an integer (kind id, dtype "
        "int64), got -9223372036854775809, out of the int64 range")
    body = json.dumps({"root": {**USER, "tags": ["\udfff"]}, "candidates": [_candidate(0)]})
    assert str(_refusal(body.encode())).startswith("root: not a valid sample: not JSON "
                                                   "(invalid surrogate pair")


@pytest.mark.parametrize("body,status,message", [
    (b"[" * 100_000, 400,
     "malformed JSON: arrays and objects nested deeper than 64 levels at byte 64"),
    (b'{"samples": [' + b"[" * 50_000 + b"]" * 50_000 + b"]}", 400,
     "sample 0: arrays and objects nested deeper than 64 levels at byte 62; the service reads "
     "at most 64 levels"),
    (b'{"samples": [', 400, "malformed JSON: the body ends too early"),
    (b'{"samples": [{"uid": 1}', 400, "malformed JSON: the body ends too early"),
    (b"", 400, "malformed JSON: the body ends too early"),
    (b'{"samples": [], "samples": [1]}', 400,
     "malformed JSON: member 'samples' given twice at byte 16"),
    (b'{"samples": [{}] "x": 1}', 400,
     "malformed JSON: expected ',' or '}' in an object at byte 17"),
    (b"[]", 400, "the body must be a JSON object"),
    (b'{"samples": [], "root": {}}', 400, 'give either "samples" or "root" + "candidates"'),
    (b'{"rows": []}', 400, 'no "samples" (or "root" + "candidates")'),
    (b'{"candidates": [{}]}', 400, '"root" must be an object'),
    (b'{"root": [], "candidates": [{}]}', 400, '"root" must be an object'),
    (b'{"samples": {}}', 400, '"samples" must be a list of objects'),
    (b'{"root": {}, "candidates": []}', 400, '"candidates" is empty'),
    (b'{"samples": [' + b", ".join([b"{}"] * 51) + b"]}", 413,
     "51 samples in one request; the limit is 50 (--max-samples)"),
])
def test_a_body_of_neither_form_is_refused_with_what_to_fix(body, status, message):
    error = _refusal(body)
    assert (error.status, message in str(error)) == (status, True), str(error)


def test_the_tree_form_says_where_each_feature_belongs():
    def tree(root, candidates):
        return json.dumps({"root": root, "candidates": candidates}).encode()

    assert str(_refusal(tree(USER, [_candidate(0), {**_candidate(1), "uid": 3}]))) == (
        "candidate 1: 'uid' is a feature of the root layer 'user'; give it once, in the "
        "request's root")
    assert str(_refusal(tree({**USER, "pos": 1}, [_candidate(0)]))) == (
        "root: 'pos' is not a feature of the root layer 'user' (uid, hist, tags); give the "
        "other layers' features in each candidate")
    assert str(_refusal(tree({**USER, "click": 1}, [_candidate(0)]))).startswith(
        "root: 'click' is not a feature of the root layer 'user'")
    assert str(_refusal(tree(USER, [_candidate(0), {**_candidate(1), "zz": 1}]))) == (
        "candidate 1: not a valid sample: unexpected field(s) 'zz'; the schema has no such "
        "column")
    assert str(_refusal(tree(USER, [{"aid": "x", "price": [1, 2]}] * 3))) == (
        "candidate 0: column 'pos': null value; fill missing values (e.g. id 0, an empty list) "
        "before compressing (2 more candidates refused)")
    assert str(_refusal(tree(USER, [_candidate(0), {**_candidate(1), "click": -1}]))) == (
        "candidate 1: label 'click': value out of range, labels must be in [0, 1]")
    flat = schemas.from_dict({"name": "one_layer", "labels": ["click"], "layers": [
        {"name": "sample", "features": [{"name": "x", "kind": "id"}]}]})
    with pytest.raises(BadRequest, match="has one layer"):
        decode_request(scan_request(tree({"x": 1}, [{}])), flat)
    assert decode_request(scan_request(b'{"samples": [{"x": 1}]}'), flat).num_rows == 1


def test_a_request_at_the_sample_limit_decodes_into_one_chunk_per_column():
    rows = [_sample(i) for i in range(10_000)]
    body = json.dumps({"samples": rows}).encode()
    table = decode_request(scan_request(body, max_samples=10_000), SCHEMA)
    assert table.num_rows == 10_000
    assert all(column.num_chunks == 1 for column in table.columns)
    assert table.schema.field("price").type == pa.list_(pa.float32())
    np.testing.assert_array_equal(table.column("pos").to_numpy(), np.arange(10_000) % 3)
    assert _refusal(body, max_samples=9_999).status == 413
