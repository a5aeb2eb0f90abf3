"""Native decoder of JSON sample messages (one flat JSON object per message) into column buffers.

    decoder = JsonSampleDecoder([JsonColumn("user_id", "id", key=True),
                                 JsonColumn("hist", "ids"),
                                 JsonColumn("price", "dense", dim=1),
                                 JsonColumn("click", "label"),
                                 JsonColumn("request_id", "carried", dtype="string")])
    out = decoder.decode([b'{"user_id": 1, ...}', ...], threads=2)

The whole decode runs in C++ without the GIL (optionally on several threads). The accepted rows
come back as Arrow-layout numpy buffers (:class:`DecodedChunk`, one or more chunks in message
order), every rejected message as its index and a reason. This module depends on numpy only;
``compression.decode_json_samples`` (compression/messages.py) turns the buffers into a pyarrow
Table of a schema (zero copy).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from native import _store
from native.errors import InvalidInputError

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
MAX_MESSAGE_BYTES_LIMIT = 1 << 30

_KINDS = {"id": 0, "ids": 1, "dense": 2, "label": 3, "carried": 4}
_TYPES = {"int64": 0, "string": 1, "float32": 2, "float64": 3, "timestamp": 4}
CARRIED_DTYPES = ("int64", "float64", "string", "timestamp")


@dataclass(frozen=True)
class JsonColumn:
    """One field of the sample objects.

    ``kind``: ``id`` (one int64 or string), ``ids`` (a list of them, possibly empty), ``dense``
    (a list of exactly ``dim`` floats, float32), ``label`` (a float32 number in [0, 1]) or
    ``carried`` (a value kept with the sample but never trained, of ``dtype`` ``int64``,
    ``float64``, ``string`` or ``timestamp``; null or missing gives a null row; a timestamp is
    an ISO-8601 string, as pyarrow's JSON reader parses it for ``timestamp[us, tz=UTC]``).
    ``key`` only changes the reason given for a null value (key columns are named as such).
    """

    name: str
    kind: str
    dtype: str = "int64"  # id/ids: int64 or string; dense/label: always float32
    dim: int = 0
    key: bool = False

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise InvalidInputError(f"column {self.name!r}: unknown kind {self.kind!r}; expected "
                                    f"one of {', '.join(_KINDS)}")
        if self.kind == "carried":
            if self.dtype not in CARRIED_DTYPES:
                raise InvalidInputError(f"column {self.name!r}: carried dtype {self.dtype!r} is "
                                        f"not one of {', '.join(CARRIED_DTYPES)}")
            if self.key:
                raise InvalidInputError(f"column {self.name!r}: a carried column is never a key")
        elif self.kind in ("dense", "label"):
            object.__setattr__(self, "dtype", "float32")
            if self.kind == "dense" and (not isinstance(self.dim, int) or self.dim < 1):
                raise InvalidInputError(f"column {self.name!r}: dense columns need a dim >= 1")
        elif self.dtype not in ("int64", "string"):
            raise InvalidInputError(f"column {self.name!r}: dtype {self.dtype!r} is not int64 "
                                    "or string")
        if self.kind != "dense" and self.dim:
            raise InvalidInputError(f"column {self.name!r}: only dense columns have a dim")


@dataclass
class DecodedChunk:
    """Accepted rows of a range of messages, in message order.

    ``message``: int64 index of each row's message. ``columns[i]`` holds the buffers of column
    ``i`` (offsets are int32 and start at 0):

    - id int64: ``(values int64[rows],)``; id string: ``(offsets[rows+1], data uint8)``
    - ids int64: ``(list_offsets[rows+1], values int64)``
    - ids string: ``(list_offsets[rows+1], str_offsets[items+1], data uint8)``
    - dense: ``(list_offsets[rows+1], values float32[rows*dim])``; label: ``(values float32,)``
    - carried: ``(validity, ...)`` then int64 / timestamp: ``values int64[rows]`` (timestamps in
      microseconds since the epoch, UTC), float64: ``values float64[rows]``, string:
      ``offsets[rows+1], data uint8``. ``validity`` is an Arrow bitmap (uint8, bit ``i % 8`` of
      byte ``i // 8`` set when row ``i`` has a value), or None when no row of the chunk is null;
      a null row holds 0 or an empty string.
    """

    message: np.ndarray
    columns: list[tuple[np.ndarray, ...]]

    @property
    def num_rows(self) -> int:
        return len(self.message)


@dataclass
class DecodedSamples:
    chunks: list[DecodedChunk]
    rejected_index: np.ndarray  # int64, sorted
    rejected_reason: list[str]

    @property
    def num_rows(self) -> int:
        return sum(c.num_rows for c in self.chunks)


class JsonSampleDecoder:
    """Decodes batches of JSON sample messages; thread-safe, reusable."""

    def __init__(self, columns: Sequence[JsonColumn],
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        columns = tuple(columns)
        if not columns:
            raise InvalidInputError("a JSON sample decoder needs at least one column")
        if not 1 <= max_message_bytes <= MAX_MESSAGE_BYTES_LIMIT:
            raise InvalidInputError(f"max_message_bytes must be in [1, 2**30], got "
                                    f"{max_message_bytes}")
        self.columns = columns
        self._decoder = _store.JsonSampleDecoder(
            [(c.name, _KINDS[c.kind], _TYPES[c.dtype], c.dim, bool(c.key)) for c in columns],
            int(max_message_bytes))

    @property
    def max_message_bytes(self) -> int:
        return self._decoder.max_message_bytes

    def decode(self, values: Sequence[bytes | None], threads: int | None = None, *,
               _copy_messages: bool = False) -> DecodedSamples:
        """Decode ``values`` (bytes, or None for a missing value).

        ``threads``: how many threads share the batch (None: 2 when the batch holds at least
        256 KiB and the machine has 2 cores or more, else 1). The rows come in one chunk per
        thread (and a new chunk every 1 GiB of input, so int32 offsets never overflow).
        """
        num_threads = 0 if threads is None else max(1, int(threads))  # 0: the C++ side picks
        # _copy_messages (tests): decode copies instead of the bytes in place (both paths must
        # give the same result; the copy is what non-Python callers of the C++ decoder get).
        chunks, index, reasons = self._decoder.decode(values, num_threads, _copy_messages)
        return DecodedSamples([DecodedChunk(m, list(cols)) for m, cols in chunks], index, reasons)

    def decode_spans(self, data: bytes, starts: np.ndarray, ends: np.ndarray,
                     threads: int | None = 1) -> DecodedSamples:
        """Decode the messages ``data[starts[i]:ends[i]]`` of one bytes object (e.g. the samples
        of a request body, spans from :func:`native.json_envelope.scan_envelope`) without
        slicing it in Python; message ``i`` is span ``i``. ``threads`` as for :meth:`decode`
        (1 by default: a request is small)."""
        if not isinstance(data, bytes):
            data = bytes(data)  # immutable: decoded without the GIL
        starts = np.ascontiguousarray(starts, dtype=np.int64)
        ends = np.ascontiguousarray(ends, dtype=np.int64)
        num_threads = 0 if threads is None else max(1, int(threads))
        chunks, index, reasons = self._decoder.decode_spans(data, starts, ends, num_threads)
        return DecodedSamples([DecodedChunk(m, list(cols)) for m, cols in chunks], index, reasons)
