"""Quantized exports: an embedding table written as float16, int8 or int4 and served as stored.

Training keeps float32 rows (:class:`native.EmbeddingStore`); an export of a table in another
format is made from the store's own files, :func:`quantize_snapshot` (``store.snapshot`` ->
``store.quantized``) and :func:`quantize_delta` (``delta-NNNNNN.bin``, same name). A serving
process loads it into a :class:`QuantizedStore`, which keeps the rows quantized in memory and
dequantizes only the rows a lookup reads.

Row formats and their error bounds (every element ``x`` of a row, ``x'`` as served):

========  ===========================  =================================================
format    bytes a row (dim d)          bound
========  ===========================  =================================================
float32   4 d (+ 20 header, optimizer  exact (the store's own files, unchanged)
          state: the training files)
float16   2 d                          ``|x - x'| <= 2**-11 |x| + 2**-25``; ``|x| > 65504``
                                       refused
int8      8 + d (float32 scale, bias)  ``|x - x'| <= scale / 2 + 2**-20 max|row|``,
                                       ``scale = (max - min) / 255``
int4      8 + ceil(d / 2)              the same with ``scale = (max - min) / 15``
========  ===========================  =================================================

A row of equal values (zeros included) is exact in int8 and int4. NaN and infinities are
refused when a file is written (:class:`InvalidInputError` naming the id and column). Ids are
stored sorted, as varint differences (about 1-3 bytes an id instead of 8). The file layouts are
described in ``native/include/prefixrec/quantized.h``; a damaged or cut-short file is a
:class:`CorruptFileError` naming the file and the byte offset.
"""
from __future__ import annotations

import os

import numpy as np

from native import _store
from native.errors import InvalidDtypeError, InvalidInputError
from native.store import StoreStats

FORMATS = ("float32", "float16", "int8", "int4")
"""Every export format; float32 is the store's own files."""
_CODES = {"float16": 1, "int8": 2, "int4": 3}
SNAPSHOT_FILE = "store.quantized"


def _as_ids(ids) -> np.ndarray:
    """``ids`` as a 1-D C-contiguous int64 array (integers of another width converted)."""
    array = np.asarray(ids)
    if array.size == 0:
        return np.zeros(0, np.int64)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise InvalidDtypeError(f"ids must be integers (e.g. an int64 numpy array), got dtype "
                                f"{array.dtype}")
    if array.ndim != 1:
        raise InvalidInputError(f"ids must be 1-D, got shape {array.shape}")
    if array.dtype == np.uint64 and int(array.max()) > np.iinfo(np.int64).max:
        raise InvalidInputError(f"ids must fit in int64, got {int(array.max())}")
    return np.ascontiguousarray(array, dtype=np.int64)


def _code(format: str) -> int:
    if format not in _CODES:
        raise InvalidInputError(f"format must be one of {', '.join(_CODES)} (a quantized format), "
                                f"got {format!r}")
    return _CODES[format]


def row_bytes(format: str, dim: int) -> int:
    """Bytes of one row of ``dim`` values in ``format`` (float32: ``4 * dim``, values only)."""
    if format == "float32":
        return 4 * int(dim)
    return int(_store.quantized_row_bytes(_code(format), int(dim)))


def error_bound(format: str, rows) -> np.ndarray:
    """The largest ``|x - x'|`` the format allows for each element of ``rows`` (float[n, d])."""
    x = np.asarray(rows, np.float64)
    if format == "float32":
        return np.zeros_like(x)
    if format == "float16":
        return np.abs(x) * 2.0 ** -11 + 2.0 ** -25
    levels = 255 if format == "int8" else 15
    if format not in ("int8", "int4"):
        _code(format)
    if x.size == 0:
        return np.zeros_like(x)
    span = (x.max(axis=1) - x.min(axis=1)) / levels
    # the stored scale may be one float32 step above span (it must cover the range)
    scale = span * (1 + 2.0 ** -22)
    top = np.abs(x).max(axis=1)
    return np.broadcast_to((scale / 2 + 2.0 ** -20 * top)[:, None], x.shape)


def quantize_rows(rows, format: str) -> np.ndarray:
    """``rows`` (float32[n, d]) as stored: uint8[n, row_bytes(format, d)]."""
    rows = np.asarray(rows)
    if rows.ndim != 2:
        raise InvalidInputError(f"rows must be 2-D [n, dim], got shape {rows.shape}")
    return _store.quantize_rows(np.ascontiguousarray(rows, np.float32), _code(format))


def dequantize_rows(data, format: str, dim: int) -> np.ndarray:
    """Stored rows (uint8[n, row_bytes]) back as float32[n, dim]."""
    return _store.dequantize_rows(np.ascontiguousarray(data, np.uint8), _code(format), int(dim))


def quantize_snapshot(snapshot_dir: str | os.PathLike, path: str | os.PathLike,
                      format: str) -> int:
    """Writes the store snapshot in ``snapshot_dir`` as a quantized snapshot at ``path``
    (atomically, crash points ``quantized.snapshot.*``); returns its bytes. Rows only: no
    optimizer state, filter or counters (a serving copy has no use for them)."""
    os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
    return _store.quantize_snapshot(os.fspath(snapshot_dir), os.fspath(path), _code(format))


def quantize_delta(delta_path: str | os.PathLike, path: str | os.PathLike, format: str) -> int:
    """Writes the store delta at ``delta_path`` (its net effect: rows written, ids removed) as
    a quantized delta at ``path`` (may be the same path: replaced atomically); its bytes."""
    os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
    return _store.quantize_delta(os.fspath(delta_path), os.fspath(path), _code(format))


def read_quantized_delta(path: str | os.PathLike) -> dict:
    """A quantized delta's contents, checked: ``format``, ``dim``, ``sequence``,
    ``global_step``, ``rebase`` (the sequence it sets, or None), ``ids`` with their dequantized
    ``rows`` and ``tombstones``."""
    return dict(_store.read_quantized_delta(os.fspath(path)))


def read_quantized_snapshot(path: str | os.PathLike) -> dict:
    """A quantized snapshot's contents, checked (keys as :func:`read_quantized_delta`'s;
    ``sequence`` is the delta sequence its first delta follows)."""
    return dict(_store.read_quantized_snapshot(os.fspath(path)))


class QuantizedStore:
    """A read-only table of quantized rows, what a serving process holds of a table exported
    as float16, int8 or int4: ``lookup`` dequantizes the rows it reads (an id without a row
    reads zeros, as in an :class:`EmbeddingStore`), ``apply_delta``/``read_delta`` follow the
    export's quantized deltas in sequence, and ``write_rebase_delta`` turns it into another
    export's snapshot of the same format, as :class:`EmbeddingStore`'s do for float32 tables.
    Thread-safe; lookups and delta reads release the GIL."""

    def __init__(self, native_table, path: str):
        self._native = native_table
        self.path = path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "QuantizedStore":
        """The table in ``directory/store.quantized``."""
        path = os.path.join(os.fspath(directory), SNAPSHOT_FILE)
        return cls(_store.QuantizedTable.load(path), path)

    @property
    def dim(self) -> int:
        return self._native.dim

    @property
    def format(self) -> str:
        return self._native.format

    def __len__(self) -> int:
        return len(self._native)

    def __repr__(self) -> str:
        return f"QuantizedStore(rows={len(self)}, format={self.format}, dim={self.dim})"

    def lookup(self, ids, train: bool = False, *, now: float | None = None) -> np.ndarray:
        """Rows of ``ids`` as float32[n, dim] (zeros for ids without a row)."""
        if train:
            raise InvalidInputError("a quantized table is read-only: it serves an export and "
                                    "never trains (train=False)")
        return self._native.lookup(_as_ids(ids))

    def contains(self, ids) -> np.ndarray:
        """bool[n]: whether each id has a row (the others read zeros); as
        :meth:`EmbeddingStore.contains`, for a cold table's routing. Runs without the GIL."""
        return self._native.contains(_as_ids(ids))

    def lookup_unique(self, ids, train: bool = False, *, now: float | None = None):
        """``(unique_ids, inverse, rows)`` as :meth:`EmbeddingStore.lookup_unique`: distinct
        ids in order of first appearance, ``ids == unique_ids[inverse]``, their rows."""
        if train:
            raise InvalidInputError("a quantized table is read-only: it serves an export and "
                                    "never trains (train=False)")
        return tuple(self._native.lookup_unique(_as_ids(ids)))

    def stats(self) -> StoreStats:
        """:class:`StoreStats` of a table that never trains: rows, bytes (rows, ids, hash
        slots), lookups, global step and delta sequence; the training counters are 0."""
        s = self._native.stats()
        return StoreStats(rows=s["rows"], bytes=s["bytes"], filter_bytes=0, admitted=0,
                          rejected=0, expired=0, evicted=0, lookups=s["lookups"], updates=0,
                          global_step=s["global_step"], delta_sequence=s["delta_sequence"])

    def apply_delta(self, path: str | os.PathLike) -> int:
        """Applies the quantized delta at ``path`` (sequence ``delta_sequence + 1``, this
        format and dim; otherwise refused, nothing changed); returns the sequence reached."""
        return self._native.apply_delta(os.fspath(path))

    def read_delta(self, path: str | os.PathLike, ahead: int = 0) -> dict:
        """What the delta would change, refused as :meth:`apply_delta` refuses it (with its
        sequence ``delta_sequence + 1 + ahead``); the keys of
        :meth:`EmbeddingStore.read_delta` (rows dequantized)."""
        if ahead < 0:
            raise InvalidInputError(f"read_delta: ahead must be >= 0, got {ahead}")
        return dict(self._native.read_delta(os.fspath(path), int(ahead)))

    def write_rebase_delta(self, snapshot_dir: str | os.PathLike,
                           path: str | os.PathLike) -> dict:
        """A rebase delta at ``path`` that turns this table into the quantized snapshot in
        ``snapshot_dir`` (same format and dim): as :meth:`EmbeddingStore.write_rebase_delta`,
        rows compared byte for byte. Reads that snapshot whole (a quantized table's worth of
        memory). Returns ``rows``, ``tombstones``, ``unchanged`` and ``bytes``."""
        snapshot = os.path.join(os.fspath(snapshot_dir), SNAPSHOT_FILE)
        return dict(self._native.write_rebase_delta(snapshot, os.fspath(path)))
