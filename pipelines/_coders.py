"""The Beam coder of Arrow tables: an LZ4-compressed Arrow IPC stream.

Without it Beam pickles a ``pa.Table`` (protocol 4): dumps + loads of the benchmark's 2M raw
samples took 14.5 s, this coder ~2.4 s. LZ4 buffer compression shrinks those samples ~4.4x
(224 MB -> 50 MB per 500k taobao_like rows) and still encodes faster than the uncompressed
stream, because the runner's data plane then copies a quarter of the bytes. Sliced tables are
written with only their own rows.

The batch job shuffles :class:`ShardPart` objects (root nodes + rows of one chunk and shard)
with their own coder, whose encoding the job computes ahead of time on its worker threads.
"""

from __future__ import annotations

import struct

import apache_beam as beam
import pyarrow as pa


_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")


def encode_table(table: pa.Table) -> bytes:
    """One table (schema and metadata included) as an LZ4-compressed Arrow IPC stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=_OPTIONS) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def decode_table(data) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


class ArrowTableCoder(beam.coders.Coder):
    """Encodes one ``pa.Table`` (schema and metadata included) as an Arrow IPC stream."""

    def encode(self, table: pa.Table) -> bytes:
        return encode_table(table)

    def decode(self, data: bytes) -> pa.Table:
        return decode_table(data)

    def estimate_size(self, table: pa.Table) -> int:
        # Beam samples element sizes for its metrics; the default would encode the table.
        return table.get_total_buffer_size()

    def is_deterministic(self) -> bool:
        # Tables are values, never keys; equal tables may encode differently (chunking).
        return False

    def to_type_hint(self):
        return pa.Table

    def __eq__(self, other):
        return type(self) is type(other)

    def __hash__(self):
        return hash(type(self))


beam.coders.registry.register_coder(pa.Table, ArrowTableCoder)


class ShardPart:
    """What the batch job shuffles: one chunk's rows of one shard, as (root nodes or None,
    rows) tables (``compression.split_roots``; None for single-layer schemas).

    Encoding and decoding are explicit (:meth:`encoded`, :attr:`tables`) and cached, so the
    job does them on its worker threads: the runner's own coder call on the bundle's
    thread then only hands over bytes. A decoded part keeps its bytes until
    :attr:`tables` is first read.
    """

    __slots__ = ("_tables", "_data")

    def __init__(self, roots: pa.Table | None = None, rows: pa.Table | None = None,
                 data: bytes | None = None):
        self._tables = None if data is not None else (roots, rows)
        self._data = data

    @property
    def tables(self) -> tuple[pa.Table | None, pa.Table]:
        if self._tables is None:
            data = memoryview(self._data)
            (size,) = struct.unpack_from("<Q", data)
            roots = decode_table(data[8:8 + size]) if size else None
            self._tables = (roots, decode_table(data[8 + size:]))
            self._data = None
        return self._tables

    def encoded(self) -> bytes:
        if self._data is None:
            roots, rows = self._tables
            head = encode_table(roots) if roots is not None else b""
            self._data = b"".join([struct.pack("<Q", len(head)), head, encode_table(rows)])
        return self._data

    def nbytes(self) -> int:
        if self._data is not None:
            return len(self._data)
        return sum(t.get_total_buffer_size() for t in self._tables if t is not None)


class ShardPartCoder(beam.coders.Coder):
    """The coder of :class:`ShardPart`: two LZ4 Arrow IPC streams, the first length-prefixed
    (empty for no root nodes)."""

    def encode(self, part: ShardPart) -> bytes:
        return part.encoded()

    def decode(self, data: bytes) -> ShardPart:
        return ShardPart(data=data)

    def estimate_size(self, part: ShardPart) -> int:
        return part.nbytes()

    def is_deterministic(self) -> bool:
        return False

    def to_type_hint(self):
        return ShardPart

    def __eq__(self, other):
        return type(self) is type(other)

    def __hash__(self):
        return hash(type(self))


beam.coders.registry.register_coder(ShardPart, ShardPartCoder)
