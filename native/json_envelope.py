"""Native scanner of a JSON request envelope: the body validated whole, the byte spans of its parts.

    body = b'{"root": {"uid": 7}, "candidates": [{"item": 1}, {"item": 2}]}'
    envelope = scan_envelope(body, ["samples", "root", "candidates"])
    envelope.members["root"]                      # MemberSpans(start=9, end=19, ...)
    spans = envelope.members["candidates"]
    spans.starts, spans.ends                      # array([36, 49]), array([47, 60])
    decoder.decode_spans(body, spans.starts, spans.ends)   # a native.JsonSampleDecoder

The body must be JSON as the JSON sample decoder reads it (RFC 8259 plus NaN / Inf / Infinity,
valid UTF-8, no lone surrogate escapes, an optional leading UTF-8 BOM) with at most ``max_depth``
nested arrays and objects; every member is validated, the listed ones may not be given twice.
The scan runs in C++ without the GIL and without recursion (prefixrec/json_envelope.h). A syntax
error inside a *message* (a listed member's object value, or an element of a listed member's
array) comes with the reason the JSON sample decoder gives for that message's bytes
(:attr:`MalformedJsonError.reason`), so a request's sample is refused in the words a file or a
Kafka message holding it would get.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from native import _store
from native.errors import InvalidInputError

DEFAULT_MAX_DEPTH = 64
DEFAULT_MAX_ELEMENTS = 10_000


class MalformedJsonError(InvalidInputError):
    """The body is not JSON the scanner accepts. ``what``: the problem; ``offset``: the byte of
    the body where it was found (``at_end``: the body ended first; ``too_deep``: nesting above
    ``max_depth``); ``member`` (a listed name or None) and ``element`` (-1: not in an element of
    its array) say which part holds it; ``message``: the first byte of the message holding it,
    or None; ``reason``: the JSON sample decoder's reason for that message (None outside a
    message, and for nesting, which the decoder does not limit)."""

    def __init__(self, what: str, offset: int, at_end: bool, too_deep: bool,
                 member: str | None, element: int, message: int | None, reason: str | None):
        where = "the body ends too early" if at_end else f"{what} at byte {offset}"
        super().__init__(where)
        self.what, self.offset, self.at_end, self.too_deep = what, offset, at_end, too_deep
        self.member, self.element, self.message, self.reason = member, element, message, reason


@dataclass(frozen=True)
class MemberSpans:
    """A listed member's value ``body[start:end]``; when it is an array, ``count`` elements, of
    which the first ``max_elements`` are ``body[starts[i]:ends[i]]`` (int64 arrays; None for a
    value that is not an array)."""

    start: int
    end: int
    count: int = 0
    starts: np.ndarray | None = None
    ends: np.ndarray | None = None

    @property
    def is_array(self) -> bool:
        return self.starts is not None


@dataclass(frozen=True)
class Envelope:
    """A scanned body: whether it is an object, and the listed members it holds."""

    is_object: bool
    members: dict[str, MemberSpans]


def scan_envelope(body: bytes, members: Sequence[str], *, max_depth: int = DEFAULT_MAX_DEPTH,
                  max_elements: int = DEFAULT_MAX_ELEMENTS) -> Envelope:
    """Validate ``body`` and find the listed top-level ``members``; raises
    :class:`MalformedJsonError` for a body it refuses. ``max_elements``: element spans kept per
    array member (the count goes on past it, so a caller can refuse too many)."""
    if not isinstance(body, bytes):
        body = bytes(body)  # immutable: the scan reads it without the GIL
    names = list(members)
    if max_depth < 1 or max_elements < 0:
        raise InvalidInputError(f"max_depth must be >= 1 and max_elements >= 0, got "
                                f"{max_depth} and {max_elements}")
    ok, is_object, spans, error = _store.scan_json_envelope(body, names, int(max_depth),
                                                            int(max_elements))
    if not ok:
        what, offset, at_end, too_deep, member, element, in_message, message, reason = error
        raise MalformedJsonError(what, offset, at_end, too_deep,
                                 names[member] if member >= 0 else None, element,
                                 message if in_message else None, reason or None)
    found = {}
    for name, (present, start, end, is_array, count, starts, ends) in zip(names, spans):
        if present:
            found[name] = (MemberSpans(start, end, count, starts, ends) if is_array
                           else MemberSpans(start, end))
    return Envelope(is_object, found)
