"""native.json_samples: the C++ JSON sample decoder on its own (numpy only, also run under ASan).

Values are checked against json.loads and an exact float32 rounding of the decimal text;
hypothesis feeds it random and mutated bytes, which must never crash it and must either be
rejected with a reason or decode to what json.loads reads. The comparison with the pyarrow
path (compression.decode_json_samples) is in tests/compression/test_messages.py.
"""
import datetime as dt
import json
import math
import struct
import sys
import threading
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from native import _store
from native.errors import InvalidInputError
from native.json_samples import JsonColumn, JsonSampleDecoder
from mutations import mutate

COLUMNS = [
    JsonColumn("uid", "id", key=True),
    JsonColumn("hist", "ids"),
    JsonColumn("tags", "ids", dtype="string"),
    JsonColumn("pid", "id", dtype="string"),
    JsonColumn("vec", "dense", dim=3),
    JsonColumn("click", "label"),
]
DECODER = JsonSampleDecoder(COLUMNS, max_message_bytes=1 << 16)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))

INT64 = st.integers(-(2**63), 2**63 - 1)
DECIMAL = st.builds(
    lambda sign, digits, frac, exp: f"{sign}{digits}{'.' + frac if frac else ''}"
                                    f"{'e' + str(exp) if exp is not None else ''}",
    st.sampled_from(["", "-"]), st.from_regex(r"\A(0|[1-9][0-9]{0,20})\Z"),
    st.from_regex(r"\A[0-9]{0,25}\Z"), st.none() | st.integers(-60, 45))


def sample(uid=1, hist=(1, 2), tags=("a",), pid="p", vec=(0.5, 1, 2), click=0, **extra):
    def listed(v):
        return None if v is None else list(v)

    value = {"uid": uid, "hist": listed(hist), "tags": listed(tags), "pid": pid,
             "vec": listed(vec), "click": click, **extra}
    return json.dumps(value).encode()


def rows(out, columns=COLUMNS):
    """The decoded rows as dicts of Python values, in order, plus their message indices."""
    result, messages = [], []
    for chunk in out.chunks:
        n = chunk.num_rows
        messages += chunk.message.tolist()
        cols = []
        for spec, buffers in zip(columns, chunk.columns):
            cols.append(_column_values(spec, buffers, n))
        result += [dict(zip([c.name for c in columns], vals)) for vals in zip(*cols)]
    return result, messages


def _strings(offsets, data):
    raw = data.tobytes()
    return [raw[offsets[i]:offsets[i + 1]].decode("utf-8") for i in range(len(offsets) - 1)]


def _column_values(spec, buffers, n):
    if spec.kind == "carried":
        return _carried_values(spec, buffers, n)
    for b in buffers:
        assert b.flags.c_contiguous
    if spec.kind == "label":
        (values,) = buffers
        assert values.dtype == np.float32 and len(values) == n
        return values.tolist()
    if spec.kind == "id":
        if spec.dtype == "int64":
            (values,) = buffers
            assert values.dtype == np.int64 and len(values) == n
            return values.tolist()
        offsets, data = buffers
        assert offsets.dtype == np.int32 and data.dtype == np.uint8 and len(offsets) == n + 1
        return _strings(offsets, data)
    offsets = buffers[0]
    assert offsets.dtype == np.int32 and len(offsets) == n + 1 and offsets[0] == 0
    assert (np.diff(offsets) >= 0).all()
    if spec.kind == "dense":
        values = buffers[1]
        assert values.dtype == np.float32 and len(values) == offsets[-1]
        items = values.tolist()
    elif spec.dtype == "int64":
        values = buffers[1]
        assert values.dtype == np.int64 and len(values) == offsets[-1]
        items = values.tolist()
    else:
        str_offsets, data = buffers[1], buffers[2]
        assert len(str_offsets) == offsets[-1] + 1
        items = _strings(str_offsets, data)
    return [items[offsets[i]:offsets[i + 1]] for i in range(n)]


def _carried_values(spec, buffers, n):
    """A carried column's values, None for null rows (whose placeholder must be 0 or "")."""
    validity, *values = buffers
    if validity is None:
        valid = [True] * n
    else:
        assert validity.dtype == np.uint8 and len(validity) == (n + 7) // 8
        valid = [bool(validity[i // 8] >> (i % 8) & 1) for i in range(n)]
        assert not all(valid)  # a bitmap only when the chunk has a null
        assert n % 8 == 0 or validity[-1] >> (n % 8) == 0  # bits past the last row stay 0
    if spec.dtype == "string":
        offsets, data = values
        assert offsets.dtype == np.int32 and data.dtype == np.uint8 and len(offsets) == n + 1
        items = _strings(offsets, data)
        placeholder = ""
    else:
        (items,) = values
        assert items.dtype == (np.float64 if spec.dtype == "float64" else np.int64)
        assert len(items) == n
        items = items.tolist()
        placeholder = 0
    for item, ok in zip(items, valid):
        assert ok or (item == placeholder and not (isinstance(item, float)
                                                   and math.copysign(1, item) < 0))
    return [item if ok else None for item, ok in zip(items, valid)]


def float32_of(text: str) -> float:
    """The float32 nearest to the decimal ``text`` (ties to even), computed exactly."""
    negative = text.startswith("-")
    x = abs(Fraction(text))
    if x >= Fraction(2**128 - 2**103):  # half way between FLT_MAX and 2**128 rounds up
        value = math.inf
    elif x == 0:
        value = 0.0
    else:
        with np.errstate(over="ignore"):
            guess = np.float32(float(x))
        candidates = {guess, np.nextafter(guess, np.float32(np.inf)),
                      np.nextafter(guess, np.float32(0))}
        candidates = [c for c in candidates if np.isfinite(c)]
        value = float(min(candidates, key=lambda c: (abs(Fraction(float(c)) - x),
                                                     int(np.array(c).view(np.uint32)) & 1)))
    return -value if negative else value


def same_float(a: float, b: float) -> bool:
    return np.array(a, np.float32).view(np.uint32) == np.array(b, np.float32).view(np.uint32)


# -- values ----------------------------------------------------------------------------------

def test_buffers_hold_the_accepted_rows_in_arrow_layout():
    values = [sample(uid=5, hist=[], tags=["x", "", "é"], pid="430548_1007", vec=[1, -2.5, 3e3],
                     click=1),
              sample(uid=-(2**63), hist=[2**63 - 1, 0, -0], tags=[], pid="", click=0.25)]
    out = DECODER.decode(values)
    got, messages = rows(out)
    assert messages == [0, 1] and len(out.rejected_index) == 0
    assert got == [
        {"uid": 5, "hist": [], "tags": ["x", "", "é"], "pid": "430548_1007",
         "vec": [1.0, -2.5, 3000.0], "click": 1.0},
        {"uid": -(2**63), "hist": [2**63 - 1, 0, 0], "tags": [], "pid": "", "vec": [0.5, 1.0, 2.0],
         "click": 0.25},
    ]


def test_field_order_whitespace_escapes_and_bom_do_not_matter():
    text = ('\ufeff \r\n{ "click" :1 ,\t"vec":[ 1 , 2 ,3 ], "pid":"a\\"b\\\\c\\/\\b\\f\\n\\r\\t'
            '\\u00e9\\ud83d\\ude00\\u0000", "tags":[ ], "u\\u0069d":7,"hist":[ 3 ] }  ')
    out = DECODER.decode([text.encode()])
    (row,), _ = rows(out)
    assert row == {"uid": 7, "hist": [3], "tags": [], "pid": 'a"b\\c/\b\f\n\r\té😀\x00',
                   "vec": [1.0, 2.0, 3.0], "click": 1.0}


@pytest.mark.parametrize("text", [
    "0.1", "1.00000005960464477539062", "1.000000059604644775390625",
    "1.0000000596046447753906251", "3.4028235677973366e38", "1e-46", "-1e-46", "1.4e-45",
    "7.006492321624085e-46", "7.006492321624086e-46", "123456789012345678901234567890e-10",
    "9999999999999999999999", "-0", "-0.0e+00", "1E5", "16777217", "0.3333333333333333333333333",
    "340282356779733661637539395458142568447", "1e-400"])
def test_floats_are_rounded_once_to_float32(text):
    out = DECODER.decode([sample(vec=[0, 0, 0]).replace(b"[0, 0, 0]", f"[{text}, 0, 0]".encode())])
    (row,), _ = rows(out)
    assert same_float(row["vec"][0], float32_of(text)), (row["vec"][0], float32_of(text))


@given(st.lists(DECIMAL, min_size=3, max_size=3))
@FUZZ
def test_random_decimals_round_like_the_exact_reference(texts):
    message = sample().replace(b"[0.5, 1, 2]", ("[" + ",".join(texts) + "]").encode())
    out = DECODER.decode([message])
    expected = [float32_of(t) for t in texts]
    if all(math.isfinite(v) for v in expected):
        (row,), _ = rows(out)
        assert all(same_float(a, b) for a, b in zip(row["vec"], expected)), (texts, row["vec"])
    else:
        assert out.rejected_reason == ["column 'vec': NaN or infinite value in a dense feature"]


# -- verdicts --------------------------------------------------------------------------------

REJECTED = [
    (None, "empty message; expected one JSON object"),
    (b"", "empty message; expected one JSON object"),
    (b" \t\r\n\x0b\x0c", "empty message; expected one JSON object"),
    (b"{not json", "not a valid sample: not JSON ("),
    (b"[1, 2]", "not a valid sample: expected a JSON object, got list"),
    (b"12", "not a valid sample: expected a JSON object, got int"),
    (b"-1.5e3", "not a valid sample: expected a JSON object, got float"),
    (b'"x"', "not a valid sample: expected a JSON object, got str"),
    (b"true", "not a valid sample: expected a JSON object, got bool"),
    (b"null", "not a valid sample: expected a JSON object, got null"),
    (sample() + b" x", "not a valid sample: not JSON (unexpected data after the JSON object"),
    (sample() + sample(), "not a valid sample: not JSON (unexpected data after the JSON object"),
    (sample(extra=1, other={"a": [1]}),
     "not a valid sample: unexpected field(s) 'extra', 'other'; the schema has no such column"),
    (sample(uid="1"), "not a valid sample: field 'uid': expected an integer (kind id, dtype "
                      "int64), got a string"),
    (sample(uid=1.0), "not a valid sample: field 'uid': expected an integer (kind id, dtype "
                      "int64), got 1.0, not an integer"),
    (sample(uid=2**63), "not a valid sample: field 'uid': expected an integer (kind id, dtype "
                        "int64), got 9223372036854775808, out of the int64 range"),
    (sample(hist=[1, "2"]), "not a valid sample: field 'hist': expected a list of integers (kind "
                            "ids, dtype int64), got a list holding a string"),
    (sample(tags=[1]), "not a valid sample: field 'tags': expected a list of strings"),
    (sample(pid=None), "column 'pid': null value; fill missing values"),
    (sample(click=True), "not a valid sample: field 'click': expected a number in [0, 1] "
                         "(label), got a boolean"),
    (sample()[:-1] + b', "uid": 2}', "not a valid sample: field 'uid' is given twice"),
    (b'{"hist": [], "tags": [], "pid": "", "vec": [1, 2, 3], "click": 0}',
     "key column 'uid': null value; every row needs a key"),
    (sample(uid=None), "key column 'uid': null value; every row needs a key"),
    (sample(hist=None), "column 'hist': null value; fill missing values (e.g. id 0, an empty "
                        "list) before compressing"),
    (sample(hist=[1, None]), "column 'hist': null inside the list; lists may be empty but "
                             "cannot hold nulls"),
    (sample(vec=[1, 2]), "column 'vec': dense value has the wrong number of floats, expected "
                         "dim 3"),
    (sample(vec=[1, 2, 3, 4]), "column 'vec': dense value has the wrong number of floats"),
    (sample(vec=[1, None, 3]), "column 'vec': null inside the list"),
    (sample().replace(b"0.5", b"NaN"), "column 'vec': NaN or infinite value in a dense feature"),
    (sample().replace(b"0.5", b"-Infinity"), "column 'vec': NaN or infinite value"),
    (sample().replace(b"0.5", b"1e39"), "column 'vec': NaN or infinite value"),
    (sample().replace(b"0.5", b"1e400"), "not a valid sample: not JSON (number too big"),
    (sample(click=None), "label 'click': null label; every sample needs its labels"),
    (sample(click=1.5), "label 'click': value out of range, labels must be in [0, 1]"),
    (sample(click=-0.01), "label 'click': value out of range"),
    (sample().replace(b'"click": 0', b'"click": NaN'), "label 'click': value out of range"),
    (sample(pid="x").replace(b'"x"', b'"\xff"'), "not a valid sample: not JSON (invalid UTF-8"),
    (sample(pid="x").replace(b'"x"', b'"\xed\xa0\x80"'), "not a valid sample: not JSON (invalid "
                                                          "UTF-8"),
    (sample(pid="x").replace(b'"x"', b'"a\nb"'), "not a valid sample: not JSON (control "
                                                  "character in a string"),
    (sample(pid="x").replace(b'"x"', b'"\\ud800"'), "not a valid sample: not JSON (invalid "
                                                     "surrogate pair"),
    (sample(pid="x").replace(b'"x"', b'"\\u12"'), "not a valid sample: not JSON (invalid \\u "
                                                   "escape"),
    (sample(pid="x").replace(b'"x"', b'"\\q"'), "not a valid sample: not JSON (invalid escape"),
    (sample().replace(b"[1, 2]", b"[1, 2,]"), "not a valid sample: not JSON (expected a value"),
    (sample().replace(b"[1, 2]", b"[01]"), "not a valid sample: not JSON ("),
    (sample()[:-5], "not a valid sample: not JSON (the message ends too early)"),
    (sample() + b"\x00", "not a valid sample: not JSON (unexpected data after the JSON object"),
    (b" \xef\xbb\xbf" + sample(), "not a valid sample: not JSON (expected a value at byte 1)"),
    (b"x" * 70000, "oversized: 70000 bytes, the limit is 65536 (max_message_bytes)"),
]


@pytest.mark.parametrize("value,reason", REJECTED, ids=range(len(REJECTED)))
def test_each_malformed_message_gets_a_reason_and_its_neighbours_are_kept(value, reason):
    values = [sample(uid=1), value, sample(uid=2), value, sample(uid=3)]
    out = DECODER.decode(values)
    got, messages = rows(out)
    assert [r["uid"] for r in got] == [1, 2, 3] and messages == [0, 2, 4]
    assert out.rejected_index.tolist() == [1, 3]
    assert out.rejected_reason[0] == out.rejected_reason[1]
    assert out.rejected_reason[0].startswith(reason), out.rejected_reason[0]


def test_a_bad_string_names_its_field():
    """A lone surrogate escape or invalid UTF-8 is a syntax error; inside a field's value (a
    column's or an unknown field's) the reason names the field, as the prediction service's
    scanner names it for the same bytes."""
    for raw in (b'"\\ud800"', b'"a\\udfff"', b'"\xff"', b'"\xed\xa0\x80"'):
        for field, value in (("pid", sample(pid="x").replace(b'"x"', raw)),
                             ("tags", sample(tags=["x"]).replace(b'["x"]', b"[" + raw + b"]")),
                             ("other", sample()[:-1] + b', "other": ' + raw + b"}")):
            (reason,) = DECODER.decode([value]).rejected_reason
            assert reason.startswith("not a valid sample: not JSON (invalid "), reason
            assert reason.endswith(f", in field {field!r})"), reason


def test_unknown_field_names_are_quoted_as_python_does():
    out = DECODER.decode([sample(**{"it's": 1, 'say "hi"': 2, "a\nb": 3, "é\u00a0": 4})])
    assert out.rejected_reason == [
        "not a valid sample: unexpected field(s) \"it's\", 'say \"hi\"', 'a\\nb', 'é\\xa0'; "
        "the schema has no such column"]


def test_threads_split_the_batch_and_give_the_same_rows():
    values = [sample(uid=i, hist=range(i % 7), tags=["t"] * (i % 3), pid=str(i), click=i % 2)
              if i % 10 else b"{bad" for i in range(3000)]
    one = DECODER.decode(values, threads=1)
    two = DECODER.decode(values, threads=2)
    assert len(two.chunks) == 2
    assert rows(one) == rows(two)
    assert one.rejected_index.tolist() == two.rejected_index.tolist() == list(range(0, 3000, 10))
    assert one.rejected_reason == two.rejected_reason


def test_empty_batch_and_all_rejected():
    out = DECODER.decode([])
    assert out.num_rows == 0 and len(out.rejected_index) == 0
    out = DECODER.decode([b"[]", None])
    assert out.num_rows == 0 and out.rejected_index.tolist() == [0, 1]


def test_bad_arguments_raise():
    with pytest.raises(InvalidInputError, match=r"values\[1\] must be bytes or None"):
        DECODER.decode([sample(), "text"])
    with pytest.raises(InvalidInputError):
        JsonColumn("x", "dense")
    with pytest.raises(InvalidInputError):
        JsonSampleDecoder([JsonColumn("x", "id"), JsonColumn("x", "ids")])
    with pytest.raises(InvalidInputError):
        JsonSampleDecoder([JsonColumn('a"b', "id")])
    with pytest.raises(InvalidInputError):
        JsonSampleDecoder(COLUMNS, max_message_bytes=0)


# -- bounds ----------------------------------------------------------------------------------

def test_deep_nesting_and_long_values_stay_bounded():
    decoder = JsonSampleDecoder(COLUMNS, max_message_bytes=1 << 22)
    deep = sample()[:-1] + b', "x": ' + b"[" * 1_000_000 + b"]" * 1_000_000 + b"}"
    unclosed = sample()[:-1] + b', "x": ' + b"[{\"a\":" * 300_000
    long_list = sample(hist=range(200_000))
    out = decoder.decode([deep, unclosed, long_list, deep[:-1]])
    got, messages = rows(out)
    assert messages == [2] and got[0]["hist"] == list(range(200_000))
    assert out.rejected_reason[0] == ("not a valid sample: unexpected field(s) 'x'; the schema "
                                      "has no such column")
    assert out.rejected_reason[1] == out.rejected_reason[2] == (
        "not a valid sample: not JSON (the message ends too early)")


# -- never crash -----------------------------------------------------------------------------

def _check_invariants(values, out):
    got, messages = rows(out)
    rejected = out.rejected_index.tolist()
    assert sorted(messages + rejected) == list(range(len(values)))
    assert rejected == sorted(rejected) and len(out.rejected_reason) == len(rejected)
    assert all(isinstance(r, str) and r for r in out.rejected_reason)
    for row, index in zip(got, messages):
        # An accepted message is JSON (RFC 8259, the BOM aside) and decodes to what json.loads
        # reads (floats: the float32 nearest to the same text, so within one float32 step).
        parsed = json.loads(values[index].decode("utf-8-sig"))
        assert set(parsed) == set(row)
        for name in ("uid", "hist", "tags", "pid"):
            assert row[name] == parsed[name]
        for a, b in zip(row["vec"] + [row["click"]], parsed["vec"] + [parsed["click"]]):
            assert a == pytest.approx(b, rel=1.2e-7, abs=1.5e-45)


@given(st.lists(st.binary(max_size=300) | st.none(), max_size=8), st.booleans())
@FUZZ
def test_random_bytes_never_crash(values, copy):
    _check_invariants(values, DECODER.decode(values, _copy_messages=copy))


SPECIAL_BYTES = st.sampled_from(b'{}[],:"\\ -+.eE0129nulltrfaseNIu\x00\n\x7f\x80\xc3\xa9\xed\xf0\xff')
EDITS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10**6),
                           st.integers(0, 255) | SPECIAL_BYTES), min_size=1, max_size=4)


@given(st.lists(st.tuples(st.integers(-(2**63), 2**63 - 1), st.lists(INT64, max_size=4),
                          st.lists(st.text(max_size=5), max_size=3), st.text(max_size=8),
                          EDITS), min_size=1, max_size=6),
       st.sampled_from([1, 2]), st.booleans())
@FUZZ
def test_mutated_samples_never_crash_and_decode_exactly_when_accepted(specs, threads, copy):
    values = [mutate(sample(uid=u, hist=h, tags=t, pid=p), edits) for u, h, t, p, edits in specs]
    values += [sample(uid=u, hist=h, tags=t, pid=p) for u, h, t, p, _ in specs]
    out = DECODER.decode(values, threads=threads, _copy_messages=copy)
    _check_invariants(values, out)
    if not copy:  # the in-place and the copying paths agree
        again = DECODER.decode(values, threads=threads, _copy_messages=True)
        assert rows(again) == rows(out) and again.rejected_reason == out.rejected_reason
    # The unmutated copies are all accepted.
    _, messages = rows(out)
    assert set(range(len(specs), len(values))) <= set(messages)


@given(st.lists(st.fixed_dictionaries({
    "uid": INT64, "hist": st.lists(INT64, max_size=5),
    "tags": st.lists(st.text(), max_size=4), "pid": st.text(),
    "vec": st.lists(DECIMAL, min_size=3, max_size=3),
    "click": st.sampled_from(["0", "1", "0.5", "-0", "1e-3", "0.999999999", "1.00000001"])}),
    min_size=1, max_size=5), st.booleans(), st.randoms(use_true_random=False))
@FUZZ
def test_valid_samples_decode_to_their_values(samples, ensure_ascii, rnd):
    values = []
    for s in samples:
        fields = [f'"{k}": ' + (json.dumps(v, ensure_ascii=ensure_ascii) if k not in ("vec", "click")
                                else ("[" + ", ".join(v) + "]" if k == "vec" else v))
                  for k, v in s.items()]
        rnd.shuffle(fields)
        values.append(("{" + ",\n ".join(fields) + "}").encode())
    out = DECODER.decode(values)
    got, messages = rows(out)
    expected_ok = [i for i, s in enumerate(samples)
                   if all(math.isfinite(float32_of(t)) for t in s["vec"])]
    assert messages == expected_ok
    for row, i in zip(got, messages):
        s = samples[i]
        assert {k: row[k] for k in ("uid", "hist", "tags", "pid")} == {
            k: s[k] for k in ("uid", "hist", "tags", "pid")}
        assert all(same_float(a, float32_of(t)) for a, t in zip(row["vec"], s["vec"]))
        assert same_float(row["click"], float32_of(s["click"]))


# -- the GIL ---------------------------------------------------------------------------------

@pytest.mark.parametrize("carried", [False, True])
def test_the_gil_is_released_while_decoding(carried):
    # With a 100 s switch interval no thread is ever forced to give up the GIL: the main thread,
    # woken when the worker is about to call decode, can only run before decode returns if
    # decode releases the GIL.
    if carried:
        decoder = CARRIED_DECODER
        values = [carried_sample(uid=i, rid=i, score=i / 7, req=f"r{i}",
                                 ts="2024-05-01T12:00:00.25Z") if i % 3 else carried_sample(uid=i)
                  for i in range(100_000)]
    else:
        decoder = DECODER
        values = [sample(uid=i, hist=range(30)) for i in range(100_000)]
    started, state = threading.Event(), {}

    def work():
        started.set()
        state["out"] = decoder.decode(values, threads=1)
        state["done"] = True

    interval = sys.getswitchinterval()
    sys.setswitchinterval(100)
    try:
        worker = threading.Thread(target=work)
        worker.start()
        started.wait()
        ran_during_decode = "done" not in state
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert ran_during_decode
    assert state["out"].num_rows == len(values)


def test_one_decoder_serves_several_python_threads_at_once():
    values = [sample(uid=i, hist=range(i % 50), pid=f"p{i}") if i % 7 else b"[]"
              for i in range(20_000)]
    expected = DECODER.decode(values, threads=1)
    results, errors = [None] * 4, []

    def work(k):
        try:
            results[k] = DECODER.decode(values, threads=1 + k % 2)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for out in results:
        assert rows(out) == rows(expected)
        assert out.rejected_index.tolist() == expected.rejected_index.tolist()


# -- carried columns (kept with the sample, never trained; nulls allowed) ---------------------

CARRIED = [
    JsonColumn("uid", "id", key=True),
    JsonColumn("click", "label"),
    JsonColumn("rid", "carried"),  # int64
    JsonColumn("score", "carried", dtype="float64"),
    JsonColumn("req", "carried", dtype="string"),
    JsonColumn("ts", "carried", dtype="timestamp"),
]
CARRIED_DECODER = JsonSampleDecoder(CARRIED, max_message_bytes=1 << 16)
NO_CARRIED = {"rid": None, "score": None, "req": None, "ts": None}
UTC = dt.timezone.utc
EPOCH = dt.datetime(1970, 1, 1, tzinfo=UTC)


def carried_sample(uid=1, click=0, **fields):
    return json.dumps({"uid": uid, "click": click, **fields}).encode()


def micros(*args, tz=UTC) -> int:
    return (dt.datetime(*args, tzinfo=tz) - EPOCH) // dt.timedelta(microseconds=1)


def bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def arrow_iso_micros(text: str):
    """Arrow's ParseTimestampISO8601 (unit us), written again in Python: the reference for the
    fuzz test (tests/compression/test_messages.py compares the decoder with pyarrow itself)."""
    s = text.encode("utf-8")
    n = len(s)

    def num(a, b):
        part = s[a:b]
        return int(part) if len(part) == b - a and part.isdigit() else None

    def hh(a):
        h = num(a, a + 2)
        return None if h is None or h >= 24 else 3600 * h

    def hhmm(a, colon):
        if colon and s[a + 2:a + 3] != b":":
            return None
        h, m = num(a, a + 2), num(a + 3 if colon else a + 2, a + 5 if colon else a + 4)
        return None if h is None or m is None or h >= 24 or m >= 60 else 3600 * h + 60 * m

    if n < 10 or s[4:5] != b"-" or s[7:8] != b"-":
        return None
    y, mo, d = num(0, 4), num(5, 7), num(8, 10)
    if y is None or mo is None or d is None or not 1 <= mo <= 12:
        return None
    leap = y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)
    if not 1 <= d <= [31, 29 if leap else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31][mo - 1]:
        return None
    # year 0 is fine too: the Gregorian calendar repeats every 400 years (146097 days)
    days = (dt.date(y, mo, d).toordinal() if y else dt.date(400, mo, d).toordinal() - 146097)
    days -= dt.date(1970, 1, 1).toordinal()
    seconds = days * 86400
    if n == 10:
        return seconds * 10**6
    if s[10:11] not in (b" ", b"T"):
        return None
    zone = 0
    if s[n - 1:n] == b"Z":
        n -= 1
    else:
        for width, parse in ((3, hh), (5, lambda a: hhmm(a, False)), (6, lambda a: hhmm(a, True))):
            if s[n - width:n - width + 1] in (b"+", b"-") and (width < 6 or s[n - 3:n - 2] == b":"):
                n -= width
                zone = parse(n + 1)
                if zone is None:
                    return None
                if s[n:n + 1] == b"+":
                    zone = -zone
                break
    if n == 13:
        tod = hh(11)
    elif n == 16:
        tod = hhmm(11, True)
    elif n == 19 or 21 <= n <= 29:
        sec = num(17, 19)
        tod = hhmm(11, True) if s[16:17] == b":" else None
        tod = None if tod is None or sec is None or sec >= 60 else tod + sec
    else:
        return None
    if tod is None:
        return None
    seconds += tod + zone
    if n <= 19:
        return seconds * 10**6
    if s[19:20] != b"." or n - 20 > 6:
        return None
    frac = num(20, n)
    return None if frac is None else seconds * 10**6 + frac * 10 ** (6 - (n - 20))


def test_carried_columns_keep_their_values_and_read_null_or_missing_as_null():
    values = [carried_sample(uid=1, rid=-(2**63), score=0.1, req="é\x00x", ts="2024-05-01 12:00"),
              carried_sample(uid=2),  # all missing
              carried_sample(uid=3, rid=None, score=None, req=None, ts=None),
              carried_sample(uid=4, rid=2**63 - 1, req="", ts="2024-05-01T12:00:00.5+02:00"),
              carried_sample(uid=5, score=-2.5e-300)]
    out = CARRIED_DECODER.decode(values)
    got, messages = rows(out, CARRIED)
    assert messages == [0, 1, 2, 3, 4] and len(out.rejected_index) == 0
    assert got == [
        {"uid": 1, "click": 0.0, "rid": -(2**63), "score": 0.1, "req": "é\x00x",
         "ts": micros(2024, 5, 1, 12, 0)},
        {"uid": 2, "click": 0.0, **NO_CARRIED},
        {"uid": 3, "click": 0.0, **NO_CARRIED},
        {"uid": 4, "click": 0.0, "rid": 2**63 - 1, "score": None, "req": "",
         "ts": micros(2024, 5, 1, 10, 0, 0, 500000)},
        {"uid": 5, "click": 0.0, **NO_CARRIED, "score": -2.5e-300}]
    # No null in a chunk: no bitmap at all.
    (chunk,) = CARRIED_DECODER.decode(values[:1]).chunks
    assert all(buffers[0] is None for buffers in chunk.columns[2:])


@pytest.mark.parametrize("text", [
    "0.1", "-0", "-0.0", "1E5", "0.30000000000000004", "9007199254740993", "1e308",
    "1.7976931348623157e308", "1.7976931348623159e308", "2e308", "10e308", "1" + "0" * 400,
    "-1" + "0" * 400, "1e-400", "-1e-400", "4.9e-324", "2.4703282292062328e-324",
    "2.4703282292062327e-324", "2.2250738585072011e-308", "123456789012345678901234567890e-10",
    "1" + "0" * 400 + "e-400", "0." + "0" * 400 + "1e400", "NaN", "-NaN", "Infinity",
    "-Infinity", "Inf", "-Inf", "18446744073709551616", "999999999999999", "9999999999999999"])
def test_carried_float64_is_rounded_once_from_the_text(text):
    message = carried_sample(score=0).replace(b'"score": 0', f'"score": {text}'.encode())
    (row,), _ = rows(CARRIED_DECODER.decode([message]), CARRIED)
    assert bits(row["score"]) == bits(float(text)), (row["score"], float(text))


@given(st.lists(DECIMAL, min_size=1, max_size=4))
@FUZZ
def test_random_decimals_as_float64_match_pythons_correct_rounding(texts):
    values = [carried_sample(score=0).replace(b'"score": 0', f'"score": {t}'.encode())
              for t in texts]
    got, _ = rows(CARRIED_DECODER.decode(values), CARRIED)
    assert [bits(r["score"]) for r in got] == [bits(float(t)) for t in texts]


TIMESTAMPS = [
    ("2024-05-01", micros(2024, 5, 1)),
    ("2024-05-01T12", micros(2024, 5, 1, 12)),
    ("2024-05-01 12:34", micros(2024, 5, 1, 12, 34)),
    ("2024-05-01T12:34:56", micros(2024, 5, 1, 12, 34, 56)),
    ("2024-05-01T12:34:56.1", micros(2024, 5, 1, 12, 34, 56, 100000)),
    ("2024-05-01T12:34:56.000001", micros(2024, 5, 1, 12, 34, 56, 1)),
    ("2024-05-01T12:34:56.123456Z", micros(2024, 5, 1, 12, 34, 56, 123456)),
    ("2024-05-01T12Z", micros(2024, 5, 1, 12)),
    ("2024-05-01T12:00-05", micros(2024, 5, 1, 17)),
    ("2024-05-01T12-05", micros(2024, 5, 1, 17)),
    ("2024-05-01T12:00:00+0530", micros(2024, 5, 1, 6, 30)),
    ("2024-05-01T12:00:00.5-00:30", micros(2024, 5, 1, 12, 30, 0, 500000)),
    ("2024-05-01T00:00+23:59", micros(2024, 4, 30, 0, 1)),
    ("2000-02-29", micros(2000, 2, 29)),
    ("1969-12-31T23:59:59.999999", -1),
    ("0001-01-01", micros(1, 1, 1)),
    ("0000-01-01", micros(1, 1, 1) - 366 * 86400 * 10**6),
    ("9999-12-31T23:59:59.999999", micros(9999, 12, 31, 23, 59, 59, 999999)),
    ("\u0032024-05-01", micros(2024, 5, 1)),  # escapes are decoded first
    # rejected, as pyarrow rejects them
    ("", None), ("2024-5-1", None), ("20240501", None), ("2024-05-01Z", None),
    ("2024-05-01T", None), ("2024-05-01t12", None), ("2024-05-01T12:00:00z", None),
    ("2024-13-01", None), ("2024-00-01", None), ("2023-02-29", None), ("1900-02-29", None),
    ("2024-04-31", None), ("2024-05-01T24:00", None), ("2024-05-01T12:60", None),
    ("2024-05-01T23:59:60", None), ("2024-05-01T12:00:00.", None),
    ("2024-05-01T12:00:00.1234567", None), ("2024-05-01T12:00:00,5", None),
    ("2024-05-01T12:00:00+24:00", None), ("2024-05-01T12:00:00+02:60", None),
    ("2024-05-01T12:00:00+2", None), ("2024-05-01T12:00:00.123-45", None),
    (" 2024-05-01", None), ("2024-05-01 ", None), ("10000-01-01", None), ("-001-01-01", None),
    ("2024-05-01T12:00:00\u0000", None), ("２０２４-05-01", None), ("2024-05-01T12:0000", None),
]


@pytest.mark.parametrize("text,expected", TIMESTAMPS, ids=range(len(TIMESTAMPS)))
def test_carried_timestamps_are_read_with_arrows_iso8601_grammar(text, expected):
    assert arrow_iso_micros(text) == expected  # the fuzz test's reference agrees
    out = CARRIED_DECODER.decode([carried_sample(ts=text)])
    got, _ = rows(out, CARRIED)
    if expected is None:
        assert got == []
        assert out.rejected_reason == [
            "not a valid sample: field 'ts': expected an ISO-8601 timestamp string or null "
            f"(carried, dtype timestamp), got {json.dumps(text)[:41]}" +
            ('..."' if len(json.dumps(text)) > 42 else "") + ", not a timestamp"]
    else:
        assert got[0]["ts"] == expected


CARRIED_REJECTED = [
    ('"rid": "1"', "field 'rid': expected an integer or null (carried, dtype int64), got a string"),
    ('"rid": 1.0', "field 'rid': expected an integer or null (carried, dtype int64), got 1.0, "
                   "not an integer"),
    ('"rid": 9223372036854775808', "field 'rid': expected an integer or null (carried, dtype "
                                   "int64), got 9223372036854775808, out of the int64 range"),
    ('"rid": true', "field 'rid': expected an integer or null (carried, dtype int64), got a "
                    "boolean"),
    ('"rid": [1]', "field 'rid': expected an integer or null (carried, dtype int64), got a list"),
    ('"rid": NaN', "field 'rid': expected an integer or null"),
    ('"score": "1.5"', "field 'score': expected a number or null (carried, dtype float64), got a "
                       "string"),
    ('"score": false', "field 'score': expected a number or null (carried, dtype float64), got a "
                       "boolean"),
    ('"score": {"a": 1}', "field 'score': expected a number or null (carried, dtype float64), "
                          "got an object"),
    ('"req": 5', "field 'req': expected a string or null (carried, dtype string), got 5"),
    ('"req": ["a"]', "field 'req': expected a string or null (carried, dtype string), got a list"),
    ('"ts": 1714564800', "field 'ts': expected an ISO-8601 timestamp string or null (carried, "
                         "dtype timestamp), got 1714564800"),
    ('"ts": "2024-05-01T12:00:00.1234567"', "field 'ts': expected an ISO-8601 timestamp string "
                                            "or null (carried, dtype timestamp), got "
                                            '"2024-05-01T12:00:00.1234567", not a timestamp'),
    ('"ts": "' + "é" * 30 + '"', "field 'ts': expected an ISO-8601 timestamp string or null "
                                 '(carried, dtype timestamp), got "' + "é" * 20 + '...", not a '
                                 "timestamp"),
    ('"rid": 1, "rid": 2', "field 'rid' is given twice"),
    ('"ts": "2024-05-01", "other": 1', "unexpected field(s) 'other'; the schema has no such "
                                       "column"),
    ('"score": 1e400', "not JSON (number too big to be stored in a double"),
    ('"req": "a\\qb"', "not JSON (invalid escape in a string"),
    ('"ts": "2024-05-01', "not JSON ("),
]


@pytest.mark.parametrize("field,reason", CARRIED_REJECTED, ids=range(len(CARRIED_REJECTED)))
def test_a_carried_value_of_the_wrong_type_is_rejected_naming_the_column(field, reason):
    bad = b'{"uid": 9, ' + field.encode() + b', "click": 1}'
    values = [carried_sample(uid=1, rid=1, ts="2024-05-01"), bad,
              carried_sample(uid=2, req="b", score=2.5), bad, carried_sample(uid=3)]
    for copy in (False, True):
        out = CARRIED_DECODER.decode(values, _copy_messages=copy)
        got, messages = rows(out, CARRIED)
        assert messages == [0, 2, 4] and out.rejected_index.tolist() == [1, 3]
        assert got == [{"uid": 1, "click": 0.0, **NO_CARRIED, "rid": 1, "ts": micros(2024, 5, 1)},
                       {"uid": 2, "click": 0.0, **NO_CARRIED, "req": "b", "score": 2.5},
                       {"uid": 3, "click": 0.0, **NO_CARRIED}]
        assert out.rejected_reason[0] == out.rejected_reason[1]
        assert out.rejected_reason[0].startswith("not a valid sample: " + reason), \
            out.rejected_reason[0]


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_rejected_after_their_carried_values_roll_them_back(threads):
    # Carried fields come first in each message, then a row check rejects every 5th one: the
    # values already appended must go, and the validity bits stay aligned with the rows.
    values, expected = [], []
    for i in range(3000):
        fields = {}
        if i % 3:
            fields = {"rid": i, "score": i / 4, "req": "r" * (i % 5),
                      "ts": f"2024-05-01T00:00:{i % 60:02d}"}
        elif i % 2:
            fields = {"rid": None, "req": None}
        click = 2 if i % 5 == 0 else i % 2
        values.append(json.dumps({**fields, "uid": i, "click": click}).encode())
        if i % 5:
            row = {"uid": i, "click": float(i % 2), **NO_CARRIED, **fields}
            if row["ts"] is not None:
                row["ts"] = micros(2024, 5, 1, 0, 0, i % 60)
            expected.append(row)
    out = CARRIED_DECODER.decode(values, threads=threads)
    got, messages = rows(out, CARRIED)
    assert len(out.chunks) == threads
    assert got == expected
    assert out.rejected_index.tolist() == list(range(0, 3000, 5))
    assert set(out.rejected_reason) == {"label 'click': value out of range, labels must be in "
                                        "[0, 1]"}


def test_carried_column_specs_are_checked_at_the_boundary():
    with pytest.raises(InvalidInputError, match="carried dtype"):
        JsonColumn("x", "carried", dtype="float32")
    with pytest.raises(InvalidInputError, match="never a key"):
        JsonColumn("x", "carried", key=True)
    with pytest.raises(InvalidInputError, match="only dense"):
        JsonColumn("x", "carried", dim=2)
    with pytest.raises(InvalidInputError, match="not int64 or string"):
        JsonColumn("x", "id", dtype="timestamp")
    # The C++ side checks on its own whatever it is given.
    for spec in [("x", 4, 2, 0, False), ("x", 4, 0, 1, False), ("x", 0, 3, 0, False),
                 ("x", 1, 4, 0, False), ("x", 3, 3, 0, False), ("x", 5, 0, 0, False),
                 ("x", 4, 5, 0, False), ("x", -1, 0, 0, False)]:
        with pytest.raises(InvalidInputError):
            _store.JsonSampleDecoder([spec], 100)


def _check_carried_invariants(values, out):
    got, messages = rows(out, CARRIED)
    rejected = out.rejected_index.tolist()
    assert sorted(messages + rejected) == list(range(len(values)))
    assert len(out.rejected_reason) == len(rejected) and all(out.rejected_reason)
    for row, index in zip(got, messages):
        try:
            parsed = json.loads(values[index].decode("utf-8-sig"))
        except ValueError:  # RapidJSON's Inf and -NaN, which json.loads does not know
            assert b"Inf" in values[index] or b"NaN" in values[index]
            continue
        assert set(parsed) <= set(row)
        assert row["uid"] == parsed["uid"] and row["req"] == parsed.get("req")
        assert row["rid"] == parsed.get("rid")
        # float64 from the number's own text (-0 is -0.0, not the int 0)
        score = json.loads(values[index].decode("utf-8-sig"), parse_int=float).get("score")
        assert (row["score"] is None) == (score is None)
        if score is not None:
            assert bits(row["score"]) == bits(score) or (
                math.isnan(row["score"]) and math.isnan(score))
        ts = parsed.get("ts")
        assert row["ts"] == (None if ts is None else arrow_iso_micros(ts))


TS_TEXT = st.builds(lambda d, sep, t, z: d + sep + t + z,
                    st.sampled_from(["2024-05-01", "2000-02-29", "2023-02-29", "0000-12-31"]),
                    st.sampled_from(["", "T", " "]),
                    st.sampled_from(["", "12", "12:34", "12:34:56", "12:34:56.5",
                                     "23:59:59.999999"]),
                    st.sampled_from(["", "Z", "+05", "-0530", "+05:30", "-23:59"]))


@given(st.lists(st.tuples(INT64 | st.none(), DECIMAL | st.none(), st.text(max_size=6) | st.none(),
                          TS_TEXT | st.none(), EDITS), min_size=1, max_size=6),
       st.sampled_from([1, 2]), st.booleans())
@FUZZ
def test_mutated_carried_samples_never_crash_and_decode_exactly_when_accepted(specs, threads,
                                                                              copy):
    def make(uid, rid, score, req, ts):
        text = json.dumps({"uid": uid, "rid": rid, "score": 0, "req": req, "ts": ts, "click": 1})
        return text.replace('"score": 0', f'"score": {score or "null"}').encode()

    values = [mutate(make(i, *spec[:4]), spec[4]) for i, spec in enumerate(specs)]
    values += [make(i, *spec[:4]) for i, spec in enumerate(specs)]
    out = CARRIED_DECODER.decode(values, threads=threads, _copy_messages=copy)
    _check_carried_invariants(values, out)
    _, messages = rows(out, CARRIED)
    # The unmutated copies are accepted unless their timestamp is not one.
    for i, spec in enumerate(specs):
        ts = spec[3]
        assert ((len(specs) + i) in messages) == (ts is None or arrow_iso_micros(ts) is not None)
