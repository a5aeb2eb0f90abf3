"""Where things live in distributed training: an id's store shard and a tree's worker.

numpy, pyarrow and ``schemas`` only (no TensorFlow, no Ray): the shard processes, serving and
the driver all place ids the same way, by the functions of :mod:`schemas.hashing` that the
Beam job shards its output by.
"""

from __future__ import annotations

import pyarrow as pa

from schemas import Schema
from schemas.hashing import id_shards as shard_of  # noqa: F401 - the placement of an id
from schemas.hashing import tree_shards as tree_workers  # the worker of every tree


def own_trees(table: pa.Table, schema: Schema, worker: int, workers: int) -> pa.Table:
    """The trees of ``table`` that ``worker`` of ``workers`` trains."""
    if workers == 1:
        return table
    return table.filter(pa.array(tree_workers(table, schema, workers) == worker))
