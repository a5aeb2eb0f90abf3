"""The stable 64-bit hash that turns string ids into int64 ids.

The hash is **FNV-1a 64** over the UTF-8 bytes of the string, with the 64-bit result
reinterpreted as a two's-complement int64::

    h = 0xcbf29ce484222325
    for byte in s.encode("utf-8"):
        h = ((h ^ byte) * 0x100000001b3) mod 2**64
    id = h - 2**64 if h >= 2**63 else h

It depends on nothing but the bytes, so it gives the same id on every machine, Python version
and process (unlike ``hash()``), and any language can reproduce it in five lines. Examples:
``stable_hash("") == -3750763034362895579`` and ``stable_hash("a") == -5808556873153909620``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1


def stable_hash(value: str | bytes) -> int:
    """FNV-1a 64 of one string (UTF-8) or bytes value, as a signed int64."""
    data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    h = FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & _MASK
    return h - (1 << 64) if h >= (1 << 63) else h


def stable_hash_strings(values) -> np.ndarray:
    """FNV-1a 64 of every string of an Arrow string/binary array (or chunked array), as int64.

    Vectorised: each distinct string is hashed once, one numpy pass per byte position.
    Nulls are not allowed (validation rejects them before this point).
    """
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if not isinstance(values, pa.Array):
        values = pa.array(values, pa.string())
    if values.null_count:
        raise ValueError(f"cannot hash {values.null_count} null strings")
    if pa.types.is_large_string(values.type) or pa.types.is_large_binary(values.type):
        values = values.cast(pa.binary() if pa.types.is_large_binary(values.type) else pa.string())
    if len(values) == 0:
        return np.zeros(0, np.int64)
    encoded = pc.dictionary_encode(values)
    indices = encoded.indices.to_numpy(zero_copy_only=False)
    return _fnv1a_unique(encoded.dictionary)[indices]


def _fnv1a_unique(strings: pa.Array) -> np.ndarray:
    n = len(strings)
    buffers = strings.buffers()
    offsets = np.frombuffer(buffers[1], np.int32, count=n + 1, offset=strings.offset * 4)
    data = (np.frombuffer(buffers[2], np.uint8) if buffers[2] is not None
            else np.zeros(0, np.uint8))
    starts = offsets[:-1].astype(np.int64)
    lengths = np.diff(offsets)
    # Longest first, so the strings still being hashed at byte j are always a prefix.
    order = np.argsort(-lengths, kind="stable")
    starts, lengths = starts[order], lengths[order]
    h = np.full(n, FNV_OFFSET, np.uint64)
    prime = np.uint64(FNV_PRIME)
    active = n
    for j in range(int(lengths[0]) if n else 0):
        while active and lengths[active - 1] <= j:
            active -= 1
        byte = data[starts[:active] + j].astype(np.uint64)
        h[:active] = (h[:active] ^ byte) * prime
    out = np.empty(n, np.uint64)
    out[order] = h
    return out.view(np.int64)


# -- integer mixing and the root-key hash -----------------------------------------------------

MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / the golden ratio


def mix64(values) -> np.ndarray:
    """SplitMix64's finalizer of 64-bit values (int64 bits read as uint64), as uint64::

        x ^= x >> 30; x *= 0xbf58476d1ce4e5b9; x ^= x >> 27; x *= 0x94d049bb133111eb; x ^= x >> 31

    (arithmetic mod 2**64): a bijection with full avalanche, so consecutive ids (1, 2, 3...)
    spread evenly over shards. It depends on nothing but the value: every process, machine and
    language computes the same number (unlike Python's ``hash``). Where ids live on store
    shards, which worker trains which trees, which Beam shard a sample goes to, and the
    generator's random streams all use this one function."""
    x = np.asarray(values)
    x = x.astype(np.uint64) if x.dtype == np.uint64 else x.astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(MIX1)
        x ^= x >> np.uint64(27)
        x *= np.uint64(MIX2)
        x ^= x >> np.uint64(31)
    return x


def root_key_hash(table, schema) -> np.ndarray:
    """uint64 hash per row of the root layer's key columns, of a raw table (canonical raw
    types) or a tree table (one row per root) alike: string keys through :func:`stable_hash`,
    integer keys as int64, then ``h = mix64((h * GOLDEN) ^ mix64(key))`` column by column from
    ``h = 0`` (keeps (a, b) and (b, a) apart). The Beam job shards samples by it and distributed
    training deals trees to workers by it, so a shard file's trees belong to one worker."""
    h = np.zeros(table.num_rows, np.uint64)
    for name in schema.layers[0].key:
        column = table.column(name)
        if schema.feature(name).dtype == "string":
            values = stable_hash_strings(column)
        else:
            values = pc.cast(column, pa.int64()).to_numpy()
        with np.errstate(over="ignore"):
            h = mix64((h * np.uint64(GOLDEN)) ^ mix64(values))
    return h


def id_shards(ids, shards: int) -> np.ndarray:
    """The shard of every id: ``mix64(id) mod shards`` (int64[n]). Ids are often hashes
    already, but many are small sequential integers; mixing spreads both evenly. Where an id's
    row lives on a store shard, in training and in serving."""
    return (mix64(ids) % np.uint64(shards)).astype(np.int64)


def tree_shards(table, schema, shards: int) -> np.ndarray:
    """The shard (0 .. shards - 1) of every row of a raw or tree table: its root key's
    :func:`root_key_hash` mod ``shards``, so all samples of one root node (one user) land
    together: the Beam job's output shards, and the worker that trains a tree. When the job
    wrote N shards with N a multiple of the workers, every file's trees belong to one worker.
    With one layer every sample is a tree of its own, dealt out in turn (a key-less leaf layer
    would otherwise put everything in one shard)."""
    if len(schema.layers) == 1:
        return np.arange(table.num_rows, dtype=np.int64) % shards
    return (root_key_hash(table, schema) % np.uint64(shards)).astype(np.int64)
