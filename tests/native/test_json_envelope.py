"""native.json_envelope: the request envelope scanner on its own (numpy only, also run under ASan).

Accepted bodies give the spans json.loads sees; a syntax error inside a sample gets, word for
word, the reason the JSON sample decoder gives the same sample's bytes (mutated samples, by
hypothesis); the bodies of issue 39 are refused at the nesting limit; spans feed
``JsonSampleDecoder.decode_spans``, which equals decoding the slices."""
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mutations import mutate
from native.errors import InvalidInputError
from native.json_envelope import MalformedJsonError, scan_envelope
from native.json_samples import JsonColumn, JsonSampleDecoder

MEMBERS = ["samples", "root", "candidates"]
COLUMNS = [JsonColumn("uid", "id", key=True), JsonColumn("hist", "ids"),
           JsonColumn("pid", "id", dtype="string"), JsonColumn("vec", "dense", dim=2)]
DECODER = JsonSampleDecoder(COLUMNS)
SAMPLE = b'{"uid": 7, "hist": [1, 2], "pid": "p\\u00e9", "vec": [0.5, -1e3]}'


def refusal(body, **options) -> MalformedJsonError:
    with pytest.raises(MalformedJsonError) as error:
        scan_envelope(body, MEMBERS, **options)
    return error.value


def test_the_bodies_of_issue_39_are_refused_at_the_nesting_limit():
    brackets = refusal(b"[" * 100_000)
    assert brackets.too_deep and brackets.offset == 64 and brackets.member is None
    assert str(brackets) == "arrays and objects nested deeper than 64 levels at byte 64"
    deep = refusal(b'{"samples": [' + b"[" * 50_000 + b"]" * 50_000 + b"]}")
    assert (deep.too_deep, deep.member, deep.element, deep.message) == (True, "samples", 0, 13)
    assert deep.reason is None
    surrogate = refusal(b'{"samples": [' + SAMPLE.replace(b"p\\u00e9", b"\\ud800") + b"]}")
    assert surrogate.reason == ("not a valid sample: not JSON (invalid surrogate pair in a "
                                "string at byte 35, in field 'pid')")
    assert refusal(b'{"samples": [' + b"[" * 62 + b"]" * 62 + b"]}", max_depth=63).too_deep
    scan_envelope(b'{"samples": [' + b"[" * 62 + b"]" * 62 + b"]}", MEMBERS)


def test_spans_are_what_json_loads_reads():
    value = {"trace": {"x": [1, None, {"y": "é"}]}, "root": {"uid": 1, "hist": []},
             "candidates": [{"pid": "a"}, [], "s", -1.5e-3, {"vec": [1, 2]}]}
    for indent in (None, 2):
        body = json.dumps(value, indent=indent, ensure_ascii=indent is None).encode()
        envelope = scan_envelope(b"\xef\xbb\xbf" + body, MEMBERS, max_elements=4)
        assert envelope.is_object and set(envelope.members) == {"root", "candidates"}
        root, candidates = envelope.members["root"], envelope.members["candidates"]
        whole = b"\xef\xbb\xbf" + body
        assert json.loads(whole[root.start:root.end]) == value["root"] and not root.is_array
        assert json.loads(whole[candidates.start:candidates.end]) == value["candidates"]
        assert candidates.count == 5 and len(candidates.starts) == 4
        assert [json.loads(whole[s:e]) for s, e in zip(candidates.starts, candidates.ends)] == \
            value["candidates"][:4]
    assert scan_envelope(b" [1, 2] ", MEMBERS).is_object is False


@pytest.mark.parametrize("body,words", [
    (b"", "the body ends too early"),
    (b'{"samples": [', "the body ends too early"),
    (b'{"samples": [], "samples": []}', "member 'samples' given twice at byte 16"),
    (b'{"samples": [{}, ]}', "expected a value at byte 17"),
    (b'{"note": "\xff"}', "invalid UTF-8 in a string at byte 10"),
    (b'{"note": 1e400}', "number too big to be stored in a double at byte 9"),
    (b"{} []", "unexpected data after the JSON value at byte 3"),
])
def test_envelope_errors_say_what_and_where(body, words):
    error = refusal(body)
    assert str(error) == words and error.reason is None


def _decoder_reason(data: bytes) -> str:
    out = DECODER.decode([data])
    return out.rejected_reason[0] if out.rejected_reason else "accepted"


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10**4),
                          st.integers(0, 255) | st.sampled_from(b'{}[],:"\\ -.eE0nuNI')),
                min_size=1, max_size=3))
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
def test_a_mutated_sample_gets_the_decoders_verdict(edits):
    sample = mutate(SAMPLE, edits)
    before = b'{"samples": [{}, '
    body = before + sample + b", {}]}"
    try:
        envelope = scan_envelope(body, MEMBERS)
    except MalformedJsonError as error:
        if error.message is None or error.too_deep:
            return  # an error of the envelope (the sample cut short, say): no sample to judge
        # the decoder reads the message's bytes from its start on, as far as it gets
        assert error.reason == _decoder_reason(body[error.message:]), sample
        if error.message == len(before) and error.offset < len(before) + len(sample):
            # the error lies inside the sample: the sample alone gets the same reason
            assert error.element == 1
            assert error.reason == _decoder_reason(sample), sample
        return
    samples = envelope.members["samples"]
    spans = [body[s:e] for s, e in zip(samples.starts, samples.ends)]
    # accepted: every span is one whole JSON value the decoder finds no syntax error in
    assert all(not _decoder_reason(span).startswith("not a valid sample: not JSON")
               for span in spans), spans
    if samples.count == 3:
        assert spans[1] == sample.strip(b" \t\r\n")


def test_decode_spans_equals_decoding_the_slices():
    good = SAMPLE
    bad = SAMPLE.replace(b"7", b"99999999999999999999")
    body = b'{"samples": [' + b", ".join([good, bad, b"[]", good]) + b"]}"
    samples = scan_envelope(body, MEMBERS).members["samples"]
    spans = DECODER.decode_spans(body, samples.starts, samples.ends)
    slices = DECODER.decode([body[s:e] for s, e in zip(samples.starts, samples.ends)])
    assert spans.rejected_index.tolist() == slices.rejected_index.tolist() == [1, 2]
    assert spans.rejected_reason == slices.rejected_reason
    assert spans.rejected_reason[0] == ("not a valid sample: field 'uid': expected an integer "
                                        "(kind id, dtype int64), got 99999999999999999999, out "
                                        "of the int64 range")
    for a, b in zip(spans.chunks, slices.chunks):
        assert a.message.tolist() == b.message.tolist() == [0, 3]
        for x, y in zip(a.columns, b.columns):
            assert all(np.array_equal(p, q) for p, q in zip(x, y))
    # a span ending at the last byte is read in place (the NUL after the bytes), others copied
    tail = DECODER.decode_spans(good, np.array([0]), np.array([len(good)]))
    assert tail.num_rows == 1
    with pytest.raises(InvalidInputError, match="not inside"):
        DECODER.decode_spans(body, np.array([5]), np.array([len(body) + 1]))
    with pytest.raises(InvalidInputError, match="not inside"):
        DECODER.decode_spans(body, np.array([5]), np.array([4]))
    with pytest.raises(InvalidInputError, match="starts has 2 entries"):
        DECODER.decode_spans(body, np.array([0, 1]), np.array([1]))
