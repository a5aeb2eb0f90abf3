"""The JSON sample codec (``compression.decode_json_samples``, the native decoder) and the
dead-letter record.

The decoder is checked against a reference: pyarrow's JSON reader with the schema + the row
checks of ``compression.split_bad_rows`` (what the file readers do; the project's decoder
until the native one replaced it). It must give exactly the reference's good rows (values and
Arrow types) and reject exactly the messages it rejects, with the same reason texts for row
problems, unknown fields, empty messages and non-objects. The deliberate differences (invalid
UTF-8, raw CR/LF inside strings, the message ``null``) are checked on their own.
"""
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compression
import schemas
from compression.messages import MESSAGE_INDEX, DeadLetter, dead_letter_topic
from compression.validate import split_bad_rows
from pipelines.generate import generate_tables
from pipelines.replay import json_lines
from mutations import mutate

decode_json_samples = compression.decode_json_samples


# -- the reference: pyarrow's JSON reader + split_bad_rows (never given b"null": it crashes) ---

_ROW = re.compile(r" row \d+:")
_NEXT_PROBLEM = re.compile(r"; (?:also )?(?=(?:key column|column|label) ')")


def reference_decode(values, schema, with_index=False):
    """The former pyarrow decoder: bulk ``pyarrow.json`` over the values joined by newlines,
    bisected on a parse error so that every message gets its own verdict."""
    raw_schema = schema.raw_arrow_schema()
    dead, lines, line_message = [], [], []
    for index, value in enumerate(values):
        if value is None or not value.strip():
            dead.append((index, "empty message; expected one JSON object"))
            continue
        if b"\n" in value or b"\r" in value:
            value = value.replace(b"\r", b" ").replace(b"\n", b" ")
        lines.append(value)
        line_message.append(index)
    tables, parsed = [], []
    if lines:
        _reference_parse(lines, np.arange(len(lines)), raw_schema, tables, parsed, dead,
                         line_message)
    if tables:
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        message = np.asarray(line_message, np.int64)[np.concatenate(parsed)]
        good, rejected = split_bad_rows(table, schema, first_row=0)  # rows numbered from 0
        keep = np.ones(table.num_rows, bool)
        rows = rejected.column("row").to_numpy()
        keep[rows] = False
        good = good.append_column(MESSAGE_INDEX, pa.array(message[keep]))
        for row, reason in zip(rows.tolist(), rejected.column("reason").to_pylist()):
            # the decoder names a row's first problem (split_bad_rows may list them all)
            first = _NEXT_PROBLEM.split(reason, maxsplit=1)[0]
            dead.append((int(message[row]), _ROW.sub(":", first, count=1)))
    else:
        good = raw_schema.empty_table().append_column(MESSAGE_INDEX, pa.array([], pa.int64()))
    dead.sort()
    if with_index:
        return good, dead
    return good.drop_columns([MESSAGE_INDEX]), [(values[i], reason) for i, reason in dead]


def _reference_parse(lines, numbers, schema, tables, parsed, dead, line_message):
    try:
        chosen = [lines[i] for i in numbers]
        table = pajson.read_json(
            pa.BufferReader(b"\n".join(chosen)),
            read_options=pajson.ReadOptions(block_size=max(1 << 19,
                                                           max(map(len, chosen)) + 1)),
            parse_options=pajson.ParseOptions(explicit_schema=schema,
                                              unexpected_field_behavior="error"))
        if table.num_rows != len(chosen):
            raise pa.ArrowInvalid("expected one JSON object per message")
        tables.append(table)
        parsed.append(numbers)
        return
    except pa.ArrowInvalid as e:
        if len(numbers) == 1:
            dead.append((line_message[numbers[0]], _reference_reason(lines[numbers[0]],
                                                                     schema, e)))
            return
    middle = len(numbers) // 2
    _reference_parse(lines, numbers[:middle], schema, tables, parsed, dead, line_message)
    _reference_parse(lines, numbers[middle:], schema, tables, parsed, dead, line_message)


def _reference_reason(line, schema, error):
    try:
        value = json.loads(line)
    except ValueError as e:
        return f"not a valid sample: not JSON ({e})"
    if not isinstance(value, dict):
        return f"not a valid sample: expected a JSON object, got {type(value).__name__}"
    unknown = [k for k in value if k not in schema.names]
    if unknown:
        return (f"not a valid sample: unexpected field(s) {', '.join(map(repr, unknown))}; "
                "the schema has no such column")
    return f"not a valid sample: {error}"


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


def _equal_tables(a: pa.Table, b: pa.Table) -> bool:
    """Table.equals, except that float64 columns (carried) compare bit for bit, so that NaN
    equals NaN (of the same sign) and -0.0 differs from 0.0."""
    if not a.schema.equals(b.schema):
        return False
    for x, y in zip(a.columns, b.columns):
        x, y = x.combine_chunks(), y.combine_chunks()
        if pa.types.is_float64(x.type):
            x, y = x.view(pa.int64()), y.view(pa.int64())
        if not x.equals(y):
            return False
    return True


def _same(values, schema, threads=1):
    """Both decoders on ``values``: tables equal (types and schema included), same dead."""
    expected = reference_decode(values, schema, with_index=True)
    got = decode_json_samples(values, schema, with_index=True, threads=threads)
    got[0].validate(full=True)
    assert got[0].schema.equals(expected[0].schema)
    assert _equal_tables(got[0], expected[0])
    assert [i for i, _ in got[1]] == [i for i, _ in expected[1]]
    return expected, got


@pytest.mark.parametrize("threads", [1, 2])
def test_generated_taobao_messages_decode_to_the_same_table(taobao_messages, threads):
    (_, dead), _ = _same(taobao_messages, TAOBAO, threads)
    assert dead == []
    good, dead = decode_json_samples(taobao_messages, TAOBAO, threads=threads)
    expected = reference_decode(taobao_messages, TAOBAO)
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
    expected = reference_decode(values, MIXED)
    assert good.equals(expected[0]) and dead == expected[1]
    assert good.column_names == list(MIXED.raw_arrow_schema().names)


def test_all_rejected_and_empty_batches_give_empty_tables_of_the_schema():
    for values in ([], [b"[]", None]):
        good, dead = decode_json_samples(values, MIXED, with_index=True)
        expected, expected_dead = reference_decode(values, MIXED, with_index=True)
        assert good.num_rows == 0 and good.schema.equals(expected.schema)
        assert dead == expected_dead


def test_deliberate_differences_from_the_reference():
    invalid_utf8 = GOOD.replace(b'"ann"', b'"\xff"')
    raw_newline = GOOD.replace(b'"ann"', b'"a\nb"')
    too_big = b" " * 1000
    good, dead = decode_json_samples([invalid_utf8, raw_newline, b"null", too_big], MIXED,
                                     with_index=True, max_message_bytes=999)
    assert good.num_rows == 0
    assert [r for _, r in dead] == [
        "not a valid sample: not JSON (invalid UTF-8 in a string at byte 29, in field "
        "'user_name')",
        "not a valid sample: not JSON (control character in a string at byte 30, in field "
        "'user_name')",
        "not a valid sample: expected a JSON object, got null",
        "oversized: 1000 bytes, the limit is 999 (max_message_bytes)"]
    # pyarrow accepts the first two (the first as an invalid string array, the second with the
    # newline turned into a space); it is not called with b"null", which crashes it.
    expected, expected_dead = reference_decode([invalid_utf8, raw_newline], MIXED)
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


# -- carried columns ---------------------------------------------------------------------------

WITH_ROW_IDS = schemas.load("schemas/examples/with_row_ids.yaml")
_CARRIED_DICT = MIXED.to_dict()
_CARRIED_DICT["name"] = "mixed_carried"
_CARRIED_DICT["layers"][-1]["carried"] = [
    {"name": "row_id", "dtype": "int64"}, {"name": "score", "dtype": "float64"},
    {"name": "request_id", "dtype": "string"}, {"name": "event_time", "dtype": "timestamp"}]
CARRIED = schemas.from_dict(_CARRIED_DICT)


def _carried_sample(**changes):
    value = {**json.loads(GOOD), "row_id": 7, "score": 0.5, "request_id": "r-7",
             "event_time": "2024-05-01T12:00:00.25Z"}
    for k, v in changes.items():
        if v is ...:
            del value[k]
        else:
            value[k] = v
    return json.dumps(value).encode()


@pytest.mark.parametrize("threads", [1, 2])
def test_generated_messages_with_carried_columns_decode_to_the_same_table(threads):
    messages = _messages(WITH_ROW_IDS, 2000, seed=6)
    assert b'"event_time":"2024-01-01 00:00:00.000000Z"' in messages[0]
    # some nulls and missing fields, as real logs have them
    for i in range(0, len(messages), 7):
        sample = json.loads(messages[i])
        sample["row_id"] = None
        del sample["request_id"]
        messages[i] = json.dumps(sample).encode()
    (expected, dead), (good, _) = _same(messages, WITH_ROW_IDS, threads)
    assert dead == [] and good.num_rows == len(messages)
    assert good.schema.field("event_time").type == pa.timestamp("us", tz="UTC")
    assert good.column("row_id").null_count == good.column("request_id").null_count == 286


def test_carried_values_nulls_and_missing_fields_are_those_of_the_pyarrow_path():
    values = [_carried_sample(), _carried_sample(row_id=..., score=..., request_id=...,
                                                 event_time=...),
              _carried_sample(row_id=None, score=None, request_id=None, event_time=None),
              _carried_sample(row_id=-(2**63), request_id="", event_time="2024-05-01"),
              _carried_sample(row_id=2**63 - 1, request_id="é\u0000\"", event_time="0000-02-29"),
              _carried_sample(score=2**64), _carried_sample(score=1e-320),
              _carried_sample(score=float("nan")), _carried_sample(score=float("-inf")),
              _carried_sample().replace(b'"score": 0.5', b'"score": -NaN'),
              _carried_sample().replace(b'"score": 0.5', b'"score": -0'),
              _carried_sample().replace(b'"score": 0.5', b'"score": 2e308'),
              _carried_sample().replace(b'"score": 0.5', b'"score": 1' + b"0" * 400),
              _carried_sample().replace(b'"score": 0.5', b'"score": 1e-400')]
    values += [_carried_sample(event_time=t) for t in (
        "2024-05-01T12", "2024-05-01 12:34", "2024-05-01T12:34:56", "2024-05-01T12:34:56.123456",
        "2024-05-01T12-05", "2024-05-01T12:00:00+0530", "2024-05-01T12:00:00.5-00:30",
        "9999-12-31T23:59:59.999999", "0001-01-01T00:00Z")]
    (_, dead), (good, _) = _same(values, CARRIED)
    assert dead == [] and good.num_rows == len(values)
    assert good.column("row_id").to_pylist()[:5] == [7, None, None, -(2**63), 2**63 - 1]
    assert good.column("request_id").to_pylist()[:5] == ["r-7", None, None, "", "é\u0000\""]
    assert good.column("event_time")[3].as_py().isoformat() == "2024-05-01T00:00:00+00:00"


CARRIED_WRONG = [
    ("row_id", '"1"'), ("row_id", "1.0"), ("row_id", "1e3"), ("row_id", "9223372036854775808"),
    ("row_id", "true"), ("row_id", "[1]"), ("row_id", "{}"), ("row_id", "NaN"),
    ("score", '"1.5"'), ("score", "true"), ("score", "[]"), ("request_id", "5"),
    ("request_id", "false"), ("request_id", '["a"]'), ("event_time", "1714564800"),
    ("event_time", '"2024-13-01"'), ("event_time", '"2024-05-01T12:00:00.1234567"'),
    ("event_time", '"2024-05-01Z"'), ("event_time", '""'), ("event_time", '"1900-02-29"'),
    ("event_time", '"2024-05-01T12:00:00+24:00"'), ("event_time", "[]"),
]


@pytest.mark.parametrize("field,text", CARRIED_WRONG, ids=range(len(CARRIED_WRONG)))
def test_a_carried_value_of_the_wrong_type_is_a_dead_letter_naming_the_column(field, text):
    bad = _carried_sample(**{field: "@@"}).replace(b'"@@"', text.encode())
    values = [_carried_sample(user_id=1), bad, _carried_sample(user_id=2, row_id=None)]
    (_, expected_dead), (good, dead) = _same(values, CARRIED)
    assert good.column("user_id").to_pylist() == [1, 2]
    assert [i for i, _ in dead] == [i for i, _ in expected_dead] == [1]
    reason = dead[0][1]
    assert reason.startswith(f"not a valid sample: field '{field}': expected "), reason


def test_carried_values_come_after_unknown_fields_and_before_row_checks():
    # The verdict order of the pyarrow path: unknown fields, then types, then the row checks.
    both = _carried_sample(row_id="x", extra=1)
    type_and_row = _carried_sample(row_id="x", click=5)
    row_only = _carried_sample(row_id=None, click=5)
    (_, expected), (_, dead) = _same([both, type_and_row, row_only], CARRIED)
    assert dead[0] == expected[0]
    assert dead[0][1].startswith("not a valid sample: unexpected field(s) 'extra'")
    assert dead[1][1].startswith("not a valid sample: field 'row_id'")
    assert dead[2] == expected[2] == (2, "label 'click': value out of range, labels must be in "
                                         "[0, 1]")


TS_PIECES = st.builds(
    lambda date, sep, time, frac, zone: date + sep + time + frac + zone,
    st.from_regex(r"\A[0-9]{4}-[0-9]{2}-[0-9]{2}\Z") | st.sampled_from(
        ["2024-05-01", "2000-02-29", "2023-02-29", "0000-01-01", "2024-5-01"]),
    st.sampled_from(["", "T", " ", "t", "X"]),
    st.sampled_from(["", "12", "23:59", "12:34:56", "24:00", "12:60:00", "1:00", "12:0000"])
    | st.from_regex(r"\A[0-9]{2}(:[0-9]{2}(:[0-9]{2})?)?\Z"),
    st.sampled_from(["", "."]) | st.from_regex(r"\A\.[0-9]{1,8}\Z"),
    st.sampled_from(["", "Z", "z", "+05", "-0530", "+05:30", "-23:59", "+24", "+2", "-05:3",
                     "+0560"]) | st.from_regex(r"\A[+-][0-9]{2}(:?[0-9]{2})?\Z"))
VALID_TS = st.builds(
    lambda date, sep, time, digits, zone: (date.isoformat() + sep + time.isoformat(
        timespec="microseconds")[:{0: 2, 1: 5, 2: 8}.get(digits, 9 + digits - 3)] + zone),
    st.dates(), st.sampled_from(["T", " "]), st.times(), st.integers(0, 9),
    st.sampled_from(["", "Z"]) | st.builds("{}{:02d}{}".format, st.sampled_from("+-"),
                                           st.integers(0, 23),
                                           st.sampled_from(["", "00", ":30", "59", ":59"])))
TS_TEXT = (VALID_TS | TS_PIECES | st.dates().map(str)
           | st.text(st.sampled_from("0123456789-:TZ +."), max_size=30))


@given(st.lists(TS_TEXT, min_size=1, max_size=8))
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
def test_random_timestamp_strings_get_the_pyarrow_value_or_verdict(texts):
    values = [_carried_sample(user_id=i, event_time=t) for i, t in enumerate(texts)]
    _same(values, CARRIED)


CARRIED_FIELDS = st.sampled_from(list(CARRIED.raw_arrow_schema().names) + ["other"])


@given(st.lists(st.dictionaries(CARRIED_FIELDS, JSON_VALUES, max_size=4), min_size=1, max_size=6),
       st.booleans())
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
def test_random_field_values_with_carried_columns_get_the_pyarrow_verdict(changes, ensure_ascii):
    values = []
    for change in changes:
        sample = json.loads(_carried_sample())
        sample.update(change)
        values.append(json.dumps(sample, ensure_ascii=ensure_ascii).encode())
    _same(values, CARRIED)


@given(st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10**4), BYTES),
                         min_size=1, max_size=3), min_size=1, max_size=6))
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_mutated_messages_with_carried_columns_get_the_pyarrow_verdict(edits):
    values = [mutate(_carried_sample(user_id=i, row_id=None if i % 2 else i), e)
              for i, e in enumerate(edits)]
    values = [v for v in values
              if v.strip(b" \t\r\n").removeprefix(b"\xef\xbb\xbf").strip(b" \t\r\n") != b"null"
              and not _pyarrow_may_differ(v)]
    values.append(_carried_sample())
    _same(values, CARRIED)


# -- a small schema: reasons and the message index ------------------------------------------

SMALL = schemas.from_dict({"name": "t", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"},
                                                   {"name": "hist", "kind": "ids"}]},
    {"name": "ad", "key": ["aid"], "features": [{"name": "aid", "kind": "id"}]}]})


def _small(uid, click=0.0, **extra):
    return json.dumps({"uid": uid, "hist": [1, 2], "aid": 7, "click": click, **extra}).encode()


def test_good_and_bad_messages_are_told_apart_with_reasons():
    values = [_small(1), b"{not json", _small(2, click=3.0), b"", _small(3),
              json.dumps({"uid": "x", "hist": [], "aid": 1, "click": 0}).encode(),
              _small(4, extra_field=1), json.dumps({"hist": [], "aid": 1, "click": 0}).encode(),
              _small(5), None, b"null", b"\xff\xfe\x00garbage", _small(6)[:-3]]
    good, dead = decode_json_samples(values, SMALL, with_index=True)
    assert good.column("uid").to_pylist() == [1, 3, 5]
    assert good.column("__message").to_pylist() == [0, 4, 8]
    reasons = dict(dead)
    assert sorted(reasons) == [1, 2, 3, 5, 6, 7, 9, 10, 11, 12]
    assert reasons[1] == ("not a valid sample: not JSON (expected a field name in double quotes "
                          "at byte 1)")
    assert reasons[2] == "label 'click': value out of range, labels must be in [0, 1]"
    assert reasons[3] == reasons[9] == "empty message; expected one JSON object"
    assert reasons[5] == ("not a valid sample: field 'uid': expected an integer (kind id, dtype "
                          "int64), got a string")
    assert reasons[6] == ("not a valid sample: unexpected field(s) 'extra_field'; the schema "
                          "has no such column")
    assert reasons[7] == "key column 'uid': null value; every row needs a key"
    assert reasons[10] == "not a valid sample: expected a JSON object, got null"
    assert reasons[11] == "not a valid sample: not JSON (expected a value at byte 0)"
    assert reasons[12] == "not a valid sample: not JSON (the message ends too early)"


def test_oversized_messages_are_rejected_with_the_limit():
    big = _small(1, pad="x" * 200)
    good, dead = decode_json_samples([_small(2), big], SMALL, max_message_bytes=100)
    assert good.column("uid").to_pylist() == [2]
    assert dead == [(big, f"oversized: {len(big)} bytes, the limit is 100 (max_message_bytes)")]


def test_without_index_the_dead_letters_are_the_message_bytes():
    good, dead = decode_json_samples([_small(1), b"[]"], SMALL)
    assert good.column_names == list(SMALL.raw_arrow_schema().names)
    assert [value for value, _ in dead] == [b"[]"]


def test_messages_with_newlines_between_tokens_still_decode():
    value = b'{"uid": 9,\n "hist": [],\r\n "aid": 1, "click": 1}'
    good, dead = decode_json_samples([value], SMALL)
    assert dead == [] and good.column("uid").to_pylist() == [9]


# -- the dead-letter record ----------------------------------------------------------------------

def test_a_dead_letter_keeps_the_message_and_says_why_and_where():
    letter = DeadLetter(b"{oops", "not a valid sample: not JSON (x)", b"k", "raw", 3, 1234)
    assert letter.record() == (b"k", b"{oops", (
        ("reason", b"not a valid sample: not JSON (x)"), ("source.topic", b"raw"),
        ("source.partition", b"3"), ("source.offset", b"1234")))
    assert DeadLetter.from_message(b"{oops", letter.headers(), b"k") == letter
    assert json.loads(letter.json_value()) == {
        "reason": "not a valid sample: not JSON (x)", "topic": "raw", "partition": 3,
        "offset": 1234, "message": "{oops"}


def test_a_dead_letter_of_unknown_origin_and_without_a_value():
    letter = DeadLetter(None, "empty message; expected one JSON object")
    assert letter.headers() == (("reason", b"empty message; expected one JSON object"),)
    assert DeadLetter.from_message(None, letter.headers()) == letter
    assert json.loads(DeadLetter(b"\xff", "r").json_value())["message"] == "\ufffd"
    assert json.loads(letter.json_value())["message"] is None


def test_the_dead_letter_topic_is_the_topic_dot_dlq_unless_given():
    assert dead_letter_topic("samples") == "samples.dlq"
    assert dead_letter_topic("samples", "rejected") == "rejected"
    assert compression.dead_letter_topic is dead_letter_topic
