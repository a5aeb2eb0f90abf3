"""The messages prefixrec's Kafka jobs exchange: raw samples as JSON (one sample per message),
decoded in bulk by the native decoder, and the dead-letter record of a rejected message.

:func:`decode_json_samples` parses every message in C++ (``native.json_samples``) without
holding the GIL; the Arrow columns are built on the decoder's buffers without a copy. The one
JSON sample decoder of the project: JSON-lines files (``compression.iter_raw_chunks``, so every
command that reads files), the streaming Beam job and the online trainer all use it.

Verdicts (those pyarrow's JSON reader with the schema + the row checks of
``compression.split_bad_rows`` gave, where that reader is right): integers must be JSON integers in int64 range (``1.0``, ``1e3``
or ``"1"`` are rejected for an int64 id), strings must be strings, dense values and labels are
numbers (``NaN``, ``Inf``, ``Infinity``, optionally negative, are read and then rejected by the
row checks), floats are rounded once from their decimal text to float32, unknown and repeated
fields are rejected (silently dropping them would lose data the schema does not know about;
field names are compared after unescaping, so ``"user\\u005fid"`` is ``user_id``), missing or
null values get split_bad_rows' reasons, in its order; a number too big for a double
(``1e400``) is rejected, one that only overflows float32 (``1e39``) becomes infinity and fails
the row checks; a leading UTF-8 BOM is skipped. Carried columns (``schema.carried``: row ids,
timestamps, never trained) are read as pyarrow reads them for their Arrow type: int64 as ids
are, float64 correctly rounded from the text (NaN and Infinity accepted, overflow to infinity),
strings as strings, timestamps from an ISO-8601 string with pyarrow's exact grammar
(``YYYY-MM-DD``, then ``[ T]hh``, ``hh:mm``, ``hh:mm:ss`` or ``hh:mm:ss.ffffff``, then an
optional ``Z`` or ``+-hh[[:]mm]`` offset; naive ones are UTC); a null or missing carried field
is a null, never a reason to reject. Every rejected message gets a reason: row problems,
unknown fields (quoted as Python's repr), empty messages and non-objects have the file
readers' texts; syntax and type errors start with ``not a valid sample:`` (a syntax error inside
a field's value also names the field: ``not JSON (invalid surrogate pair in a string at byte 9,
in field 'pid')``). The verdict order:
not JSON, then not an object, then unknown fields, then a value of the wrong type, then the
row checks.

Rejected where pyarrow's JSON reader is wrong (and why no command calls it any more): a string with invalid UTF-8 (pyarrow builds an
invalid string array), a raw CR or LF inside a string (JSON forbids it), the message ``null``
(``pyarrow.json.read_json`` crashes the process on it: a segmentation fault), and a message
over ``max_message_bytes``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa

from native.json_samples import (DEFAULT_MAX_MESSAGE_BYTES, DecodedChunk, DecodedSamples,
                                 JsonColumn, JsonSampleDecoder)
from schemas import Schema

MESSAGE_INDEX = "__message"
DEAD_LETTER_SUFFIX = ".dlq"

__all__ = ["DEAD_LETTER_SUFFIX", "DEFAULT_MAX_MESSAGE_BYTES", "DeadLetter", "MESSAGE_INDEX",
           "dead_letter_topic", "decode_json_samples", "decoded_table", "json_columns",
           "oversized_reason"]


# -- the dead-letter record -------------------------------------------------------------------

def dead_letter_topic(topic: str, given: str | None = None) -> str:
    """Where rejected messages of ``topic`` go: ``given``, else ``<topic>.dlq``."""
    return given if given else f"{topic}{DEAD_LETTER_SUFFIX}"


def oversized_reason(size: int, limit: int) -> str:
    return f"oversized: {size} bytes, the limit is {limit} (max_message_bytes)"


@dataclass(frozen=True)
class DeadLetter:
    """A rejected message: its value and key unchanged, why, and where it was read.

    On Kafka it is the original value and key with the headers ``reason``, ``source.topic``,
    ``source.partition`` and ``source.offset`` (text; the last three only when known)::

        value b'{"user_id": 1, "click": 3}'
        headers reason=b"label 'click': value out of range, labels must be in [0, 1]"
                source.topic=b"samples" source.partition=b"0" source.offset=b"1234"

    For a writer without headers (Beam's Java KafkaIO) :meth:`json_value` puts all of it in the
    value instead.
    """

    value: bytes | None
    reason: str
    key: bytes | None = None
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None

    def headers(self) -> tuple[tuple[str, bytes], ...]:
        headers = [("reason", self.reason.encode())]
        for name, field in (("source.topic", self.topic), ("source.partition", self.partition),
                            ("source.offset", self.offset)):
            if field is not None:
                headers.append((name, str(field).encode()))
        return tuple(headers)

    def record(self) -> tuple[bytes | None, bytes | None, tuple]:
        """``(key, value, headers)``, as Kafka writers take it."""
        return self.key, self.value, self.headers()

    def json_value(self) -> bytes:
        """The record as one JSON object (the message as text, invalid UTF-8 replaced)."""
        message = None if self.value is None else self.value.decode("utf-8", "replace")
        return json.dumps({"reason": self.reason, "topic": self.topic,
                           "partition": self.partition, "offset": self.offset,
                           "message": message}).encode()

    @classmethod
    def from_message(cls, value: bytes | None, headers, key: bytes | None = None
                     ) -> "DeadLetter":
        """Read a dead letter back from a consumed message's value, headers and key."""
        h = {name: v.decode() for name, v in headers or ()}
        return cls(value, h.get("reason", ""), key, h.get("source.topic"),
                   int(h["source.partition"]) if "source.partition" in h else None,
                   int(h["source.offset"]) if "source.offset" in h else None)


# -- the JSON sample codec --------------------------------------------------------------------

def json_columns(schema: Schema) -> list[JsonColumn]:
    """The decoder's columns for the raw samples of ``schema`` (raw_arrow_schema() order)."""
    keys = {k for layer in schema.layers for k in layer.key}
    columns = [JsonColumn(f.name, f.kind, dtype=f.dtype if f.kind != "dense" else "float32",
                          dim=f.dim or 0, key=f.name in keys) for f in schema.features]
    columns += [JsonColumn(label, "label") for label in schema.labels]
    return columns + [JsonColumn(c.name, "carried", dtype=c.dtype) for c in schema.carried]


@functools.lru_cache(maxsize=16)
def decoder_for(schema: Schema, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
                ) -> JsonSampleDecoder:
    return JsonSampleDecoder(json_columns(schema), max_message_bytes)


def decode_json_samples(values: list[bytes | None], schema: Schema, with_index: bool = False,
                        *, threads: int | None = 1,
                        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
    """Decode JSON sample messages: ``(good rows, [(message, reason)])``.

    Good rows come in ``schema.raw_arrow_schema()``, in message order. With ``with_index`` the
    table gets an int64 column ``__message`` (the index of each row's message in ``values``) and
    rejected messages are given by index: ``[(index, reason)]``, sorted. A value may be None
    (a Kafka tombstone): it is rejected as empty. Passing anything but bytes or None raises
    ``native.InvalidInputError``. The Table may have several chunks (one per thread).

    ``threads``: decoding threads. 1 by default: in the online trainer the other core runs the
    TensorFlow step, and on a busy machine a second thread gains little (benchmarks/RESULTS.md);
    None lets the decoder pick (2 for batches of 256 KiB or more on a multi-core machine).
    The whole decode runs without the GIL either way.
    """
    decoder = decoder_for(schema, max_message_bytes)
    out = decoder.decode(values, threads=threads)
    table = decoded_table(out, decoder.columns, schema.raw_arrow_schema())
    dead = list(zip(out.rejected_index.tolist(), out.rejected_reason))
    if with_index:
        return table, dead
    return table.drop_columns([MESSAGE_INDEX]), [(values[i], reason) for i, reason in dead]


def decoded_table(out: DecodedSamples, columns: Sequence[JsonColumn],
                  arrow_schema: pa.Schema) -> pa.Table:
    """The accepted rows of a native decode (``JsonSampleDecoder.decode`` or ``decode_spans``
    with ``columns``) as a Table of ``arrow_schema`` (one field per column, in order, of the
    Arrow type the column's buffers hold: the raw schema's for features and labels, float64
    for a carried float64...) plus ``__message`` (int64: each row's message), built on the
    decoder's buffers without a copy."""
    indexed = arrow_schema.append(pa.field(MESSAGE_INDEX, pa.int64()))
    batches = [_record_batch(chunk, tuple(columns), arrow_schema, indexed)
               for chunk in out.chunks if chunk.num_rows]
    return pa.Table.from_batches(batches, schema=indexed)


def _record_batch(chunk: DecodedChunk, columns: tuple[JsonColumn, ...],
                  raw_schema: pa.Schema, indexed: pa.Schema) -> pa.RecordBatch:
    rows = chunk.num_rows
    arrays = [_carried_array(field.type, rows, buffers) if column.kind == "carried"
              else _array(field.type, rows, buffers)
              for column, field, buffers in zip(columns, raw_schema, chunk.columns)]
    arrays.append(pa.Array.from_buffers(pa.int64(), rows, [None, pa.py_buffer(chunk.message)]))
    return pa.RecordBatch.from_arrays(arrays, schema=indexed)


def _array(type_: pa.DataType, rows: int, buffers: tuple[np.ndarray, ...]) -> pa.Array:
    buf = [pa.py_buffer(b) for b in buffers]
    if pa.types.is_list(type_):
        item = type_.value_type
        items = int(buffers[0][-1])
        if pa.types.is_string(item):
            child = pa.Array.from_buffers(item, items, [None, buf[1], buf[2]])
        else:
            child = pa.Array.from_buffers(item, items, [None, buf[1]])
        return pa.Array.from_buffers(type_, rows, [None, buf[0]], children=[child])
    if pa.types.is_string(type_):
        return pa.Array.from_buffers(type_, rows, [None, buf[0], buf[1]])
    return pa.Array.from_buffers(type_, rows, [None, buf[0]])


def _carried_array(type_: pa.DataType, rows: int, buffers: tuple) -> pa.Array:
    """A carried column: (validity bitmap or None, values...) in the schema's Arrow type
    (int64, float64, string, or timestamp[us, tz=UTC] over int64 microseconds)."""
    validity, *values = buffers
    buf = [None if validity is None else pa.py_buffer(validity)]
    buf += [pa.py_buffer(b) for b in values]
    return pa.Array.from_buffers(type_, rows, buf, null_count=0 if validity is None else -1)
