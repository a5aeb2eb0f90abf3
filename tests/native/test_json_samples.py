"""native.json_samples: the C++ JSON sample decoder on its own (numpy only, also run under ASan).

Values are checked against json.loads and an exact float32 rounding of the decimal text;
hypothesis feeds it random and mutated bytes, which must never crash it and must either be
rejected with a reason or decode to what json.loads reads. The comparison with the pyarrow
path (compression.decode_json_samples) is in tests/trainer/test_json_decode.py.
"""
import json
import math
import sys
import threading
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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

def test_the_gil_is_released_while_decoding():
    # With a 100 s switch interval no thread is ever forced to give up the GIL: the main thread,
    # woken when the worker is about to call decode, can only run before decode returns if
    # decode releases the GIL.
    values = [sample(uid=i, hist=range(30)) for i in range(100_000)]
    started, state = threading.Event(), {}

    def work():
        started.set()
        state["out"] = DECODER.decode(values, threads=1)
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
