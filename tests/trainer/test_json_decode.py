"""trainer.json_decode against compression.decode_json_samples: same tables, same verdicts.

The native decoder must give exactly the pyarrow path's good rows (values and Arrow types) and
reject exactly the messages it rejects, with the same reason texts for row problems, unknown
fields, empty messages and non-objects. The deliberate differences (invalid UTF-8, raw CR/LF
inside strings, the message ``null``) are checked on their own.
"""
import json

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compression
import schemas
from pipelines.generate import generate_tables
from pipelines.replay import json_lines
from trainer.json_decode import decode_json_samples
from mutations import mutate

TAOBAO = schemas.load("schemas/examples/taobao_like.yaml")
MIXED = schemas.from_dict({"name": "mixed", "labels": ["click", "conversion"], "layers": [
    {"name": "user", "key": ["user_id"], "features": [
        {"name": "user_id", "kind": "id"},
        {"name": "user_name", "kind": "id", "dtype": "string"},
        {"name": "clicked_items", "kind": "ids"},
        {"name": "clicked_tags", "kind": "ids", "dtype": "string"}]},
    {"name": "ad", "key": ["ad_id"], "features": [
        {"name": "ad_id", "kind": "id", "dtype": "string"},
        {"name": "embedding", "kind": "dense", "dim": 4},
        {"name": "price", "kind": "dense", "dim": 1}]}]})


def _messages(schema, samples, seed):
    out = []
    for table in generate_tables(schema, samples, seed=seed):
        out += [v.as_py().encode() for v in json_lines(table, schema)]
    return out


@pytest.fixture(scope="module")
def taobao_messages():
    return _messages(TAOBAO, 3000, seed=3)


@pytest.fixture(scope="module")
def mixed_messages():
    return _messages(MIXED, 1500, seed=4)


def _same(values, schema, threads=1):
    """Both decoders on ``values``: tables equal (types and schema included), same dead."""
    expected = compression.decode_json_samples(values, schema, with_index=True)
    got = decode_json_samples(values, schema, with_index=True, threads=threads)
    got[0].validate(full=True)
    assert got[0].schema.equals(expected[0].schema)
    assert got[0].equals(expected[0])
    assert [i for i, _ in got[1]] == [i for i, _ in expected[1]]
    return expected, got


@pytest.mark.parametrize("threads", [1, 2])
def test_generated_taobao_messages_decode_to_the_same_table(taobao_messages, threads):
    (_, dead), _ = _same(taobao_messages, TAOBAO, threads)
    assert dead == []
    good, dead = decode_json_samples(taobao_messages, TAOBAO, threads=threads)
    expected = compression.decode_json_samples(taobao_messages, TAOBAO)
    assert good.equals(expected[0]) and good.schema.equals(TAOBAO.raw_arrow_schema())
    assert good.num_rows == len(taobao_messages) and dead == []


def test_string_ids_string_lists_and_dense_vectors(mixed_messages):
    _same(mixed_messages, MIXED, threads=2)
    good, _ = decode_json_samples(mixed_messages[:3], MIXED)
    assert good.schema.field("clicked_tags").type == pa.list_(pa.string())
    assert good.schema.field("embedding").type == pa.list_(pa.float32())
    assert all(len(v) == 4 for v in good.column("embedding").to_pylist())


def _sample(**changes):
    value = {"user_id": 1, "user_name": "ann", "clicked_items": [1, 2], "clicked_tags": ["a"],
             "ad_id": "x1", "embedding": [0.1, 0.2, 0.3, 0.4], "price": [9.99], "click": 0,
             "conversion": 0}
    for k, v in changes.items():
        if v is ...:
            del value[k]
        else:
            value[k] = v
    return json.dumps(value).encode()


GOOD = _sample()
MALFORMED = [
    # (message, True if the reason text is the pyarrow path's exactly)
    (None, True), (b"", True), (b"  \n", True), (b"[1]", True), (b"3", True), (b'"s"', True),
    (b"true", True), (b"{}", True), (_sample(user_id=...), True), (_sample(user_id=None), True),
    (_sample(user_name=None), True), (_sample(clicked_items=None), True),
    (_sample(clicked_items=[1, None]), True), (_sample(clicked_tags=[None]), True),
    (_sample(embedding=[1, 2, 3]), True), (_sample(embedding=[]), True),
    (_sample(embedding=[1, 2, 3, None]), True), (_sample(price=None), True),
    (_sample(click=None), True), (_sample(conversion=...), True), (_sample(click=2), True),
    (_sample(click=-1e-9), True), (_sample(extra=1), True), (_sample(a=1, b={"c": [1]}), True),
    (_sample(user_id=True, zz=1), True),
    (GOOD.replace(b"0.1", b"NaN"), True), (GOOD.replace(b"0.1", b"-Infinity"), True),
    (GOOD.replace(b"0.1", b"Inf"), True), (GOOD.replace(b"0.1", b"1e39"), True),
    (GOOD.replace(b'"click": 0', b'"click": NaN'), True),
    (b"{not json", False), (GOOD + b" x", False), (GOOD + GOOD, False), (GOOD[:-1], False),
    (_sample(user_id="1"), False), (_sample(user_id=1.0), False), (_sample(user_id=2**63), False),
    (_sample(user_id=-(2**63) - 1), False), (_sample(user_name=5), False),
    (_sample(clicked_items=["1"]), False), (_sample(clicked_items=[1.5]), False),
    (_sample(clicked_tags=[1]), False), (_sample(embedding=[1, 2, 3, "4"]), False),
    (_sample(embedding=7), False), (_sample(click=True), False), (_sample(click="0"), False),
    (GOOD[:-1] + b', "user_id": 2}', False), (GOOD.replace(b"0.1", b"1e400"), False),
    (GOOD.replace(b"0.1", b"nan"), False), (GOOD.replace(b"0.1", b".1"), False),
    (GOOD.replace(b"0.1", b"01"), False), (GOOD.replace(b'"ann"', b'"\\ud800"'), False),
    (GOOD.replace(b'"ann"', b'"\\x"'), False), (GOOD.replace(b'"ann"', b'"a\tb"'), False),
    (GOOD.replace(b"[1, 2]", b"[1, 2,]"), False), (GOOD + b"\x00", False),
    (b" \xef\xbb\xbf" + GOOD, False),
]


@pytest.mark.parametrize("value,same_text", MALFORMED, ids=range(len(MALFORMED)))
def test_each_malformed_class_gets_the_same_verdict_and_keeps_its_neighbours(value, same_text):
    values = [_sample(user_id=1), value, _sample(user_id=2)]
    (expected_good, expected_dead), (good, dead) = _same(values, MIXED)
    assert good.column("user_id").to_pylist() == [1, 2]
    assert good.column("__message").to_pylist() == [0, 2]
    assert [i for i, _ in dead] == [1]
    if same_text:
        assert dead == expected_dead
    else:
        assert dead[0][1].startswith("not a valid sample: ")


def test_accepted_oddities_match_pyarrow():
    # Number forms, escapes, whitespace, key order and a leading BOM that both paths accept.
    values = [GOOD.replace(b"0.1", b"1E-1").replace(b"9.99", b"-0.0e+00"),
              GOOD.replace(b"0.1", b"1.0000000596046447753906251"),
              GOOD.replace(b"0.1", b"3.4028235677973366e38"),
              GOOD.replace(b"0.1", b"7.006492321624086e-46"),
              GOOD.replace(b"0.1", b"1" + b"0" * 400 + b"e-400"),
              GOOD.replace(b"0.1", b"0." + b"0" * 400 + b"1e400"),
              GOOD.replace(b'"ann"', b'"\\u00e9\\ud83d\\ude00\\u0000\\/\\"\xc3\xa9"'),
              GOOD.replace(b'"user_id"', b'"user\\u005fid"'),
              b"\xef\xbb\xbf" + GOOD, b"\t " + GOOD.replace(b", ", b" ,\n\t") + b"\r\n ",
              json.dumps(dict(reversed(json.loads(GOOD).items()))).encode(),
              _sample(user_id=-(2**63), clicked_items=[2**63 - 1, -0], click=1, conversion=0.5)]
    (expected, _), (good, dead) = _same(values, MIXED)
    assert dead == [] and good.num_rows == len(values)


def test_without_index_dead_letters_carry_the_message_bytes():
    values = [GOOD, b"[]", None, GOOD]
    good, dead = decode_json_samples(values, MIXED)
    expected = compression.decode_json_samples(values, MIXED)
    assert good.equals(expected[0]) and dead == expected[1]
    assert good.column_names == list(MIXED.raw_arrow_schema().names)


def test_all_rejected_and_empty_batches_give_empty_tables_of_the_schema():
    for values in ([], [b"[]", None]):
        good, dead = decode_json_samples(values, MIXED, with_index=True)
        expected, expected_dead = compression.decode_json_samples(values, MIXED, with_index=True)
        assert good.num_rows == 0 and good.schema.equals(expected.schema)
        assert dead == expected_dead


def test_deliberate_differences_from_the_pyarrow_path():
    invalid_utf8 = GOOD.replace(b'"ann"', b'"\xff"')
    raw_newline = GOOD.replace(b'"ann"', b'"a\nb"')
    too_big = b" " * 1000
    good, dead = decode_json_samples([invalid_utf8, raw_newline, b"null", too_big], MIXED,
                                     with_index=True, max_message_bytes=999)
    assert good.num_rows == 0
    assert [r for _, r in dead] == [
        "not a valid sample: not JSON (invalid UTF-8 in a string at byte 29)",
        "not a valid sample: not JSON (control character in a string at byte 30)",
        "not a valid sample: expected a JSON object, got null",
        "oversized: 1000 bytes, the limit is 999 (max_message_bytes)"]
    # pyarrow accepts the first two (the first as an invalid string array, the second with the
    # newline turned into a space); it is not called with b"null", which crashes it.
    expected, expected_dead = compression.decode_json_samples([invalid_utf8, raw_newline], MIXED)
    assert expected.num_rows == 2 and expected_dead == []


def _pyarrow_may_differ(value: bytes) -> bool:
    """The known differences: invalid UTF-8, raw CR/LF (pyarrow path accepts), and a top-level
    null (crashes pyarrow, so it is never given to it)."""
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return b"\n" in value or b"\r" in value


BYTES = st.integers(0, 255) | st.sampled_from(b'{}[],:"\\ -+.eE0129nulltrfaseNIu')


@given(st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10**4), BYTES),
                         min_size=1, max_size=3), min_size=1, max_size=6))
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_mutated_messages_get_the_pyarrow_verdict(edits):
    values = [mutate(_sample(user_id=i), e) for i, e in enumerate(edits)]
    values = [v for v in values
              if v.strip(b" \t\r\n").removeprefix(b"\xef\xbb\xbf").strip(b" \t\r\n") != b"null"
              and not _pyarrow_may_differ(v)]
    values.append(GOOD)
    _same(values, MIXED)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats()
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=8)
FIELDS = st.sampled_from(list(MIXED.raw_arrow_schema().names) + ["other"])


@given(st.lists(st.dictionaries(FIELDS, JSON_VALUES, max_size=4), min_size=1, max_size=6),
       st.booleans())
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
def test_random_field_values_get_the_pyarrow_verdict(changes, ensure_ascii):
    # Any JSON value (NaN and +-Infinity included, as json.dumps writes them) in place of a
    # field's value: the same rows and the same rejected messages as the pyarrow path.
    values = []
    for change in changes:
        sample = json.loads(GOOD)
        sample.update(change)
        values.append(json.dumps(sample, ensure_ascii=ensure_ascii).encode())
    _same(values, MIXED)
