"""Shard assignment: which of N shards a raw sample goes to, from a stable hash of its root key.

Every sample of one root node (one user) lands in the same shard, so a shard's trees are whole
and the shards together give exactly the trees of the whole input. The hash depends only on the
key values (FNV-1a for strings, a splitmix64 mix for integers), never on ``hash()``, so every
worker, process and run agrees.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from compression.trees import root_node_codes, split_roots_from_codes, take_rows
from schemas import Schema
from schemas.hashing import tree_shards


def _by_shard(shard: np.ndarray, shards: int) -> tuple[np.ndarray, np.ndarray]:
    """(stable order of the rows by shard, rows per shard)."""
    small = shard.astype(np.uint16) if shards <= 1 << 16 else shard
    return np.argsort(small, kind="stable"), np.bincount(shard, minlength=shards)


def split_by_shard(table: pa.Table, schema: Schema, shards: int) -> list[tuple[int, pa.Table]]:
    """(shard, rows of that shard) for every shard that has rows; one take, no per-row Python."""
    if table.num_rows == 0:
        return []
    order, counts = _by_shard(tree_shards(table, schema, shards), shards)
    ordered = take_rows(table, order)
    out = []
    start = 0
    for s in np.flatnonzero(counts):
        n = int(counts[s])
        out.append((int(s), ordered.slice(start, n)))
        start += n
    return out


def split_roots_by_shard(table: pa.Table, schema: Schema, shards: int
                         ) -> list[tuple[int, tuple[pa.Table, pa.Table]]]:
    """(shard, (root nodes, rows)) for every shard that has rows, in the form of
    :func:`compression.split_roots` (each shard's rows index its own root nodes).

    The root layer's features go once per distinct root node of ``table`` instead of once per
    row: for the taobao_like data, chunks of 128k samples hold ~10k users, and the users'
    behaviour lists are most of a sample's bytes. Needs a schema of two layers or more.
    """
    if table.num_rows == 0:
        return []
    code, rep = root_node_codes(table, schema)
    key = pa.Table.from_arrays([take_rows(table.select([name]), rep).column(0)
                                for name in schema.root.key], names=list(schema.root.key))
    node_shard = tree_shards(key, schema, shards)
    node_order, node_counts = _by_shard(node_shard, shards)
    # renumber the nodes shard by shard, each shard's from 0
    node_start = np.zeros(shards, np.int64)
    np.cumsum(node_counts[:-1], out=node_start[1:])
    local = np.empty(len(node_shard), np.int64)
    local[node_order] = np.arange(len(node_order)) - node_start[node_shard[node_order]]
    row_order, row_counts = _by_shard(node_shard[code], shards)
    roots, rows = split_roots_from_codes(table, schema, local[code], rep[node_order],
                                         row_order)
    out = []
    row_start = 0
    for s in np.flatnonzero(row_counts):
        part = (roots.slice(int(node_start[s]), int(node_counts[s])),
                rows.slice(row_start, int(row_counts[s])))
        out.append((int(s), part))
        row_start += int(row_counts[s])
    return out
