"""Where things live in distributed training: an id's store shard and a tree's worker.

numpy, pyarrow and ``schemas`` only (no TensorFlow, no Ray): the shard processes, serving and
the driver all place ids the same way.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from schemas import Schema
from schemas.hashing import mix64, root_key_hash


def shard_of(ids, shards: int) -> np.ndarray:
    """The shard of every id: ``mix64(id) mod shards`` (int64[n]). Ids are often hashes
    already, but many are small sequential integers; mixing spreads both evenly."""
    return (mix64(ids) % np.uint64(shards)).astype(np.int64)


def tree_workers(trees: pa.Table, schema: Schema, workers: int) -> np.ndarray:
    """The worker of every tree (row) of a tree table: the hash of the root layer's key
    columns that the Beam job shards by (:func:`schemas.hashing.root_key_hash`), mod
    ``workers``. All trees of one root key go to one worker, and
    when the job wrote N shards with N a multiple of ``workers``, every file's trees belong to
    one worker. A one-layer schema deals its rows (single samples) round robin."""
    if len(schema.layers) == 1:
        return np.arange(trees.num_rows, dtype=np.int64) % workers
    return (root_key_hash(trees, schema) % np.uint64(workers)).astype(np.int64)


def own_trees(table: pa.Table, schema: Schema, worker: int, workers: int) -> pa.Table:
    if workers == 1:
        return table
    return table.filter(pa.array(tree_workers(table, schema, workers) == worker))
