"""Where things live in distributed training: an id's store shard and a tree's worker.

numpy, pyarrow and ``schemas`` only (no TensorFlow, no Ray): the shard processes, serving and
the driver all place ids the same way, by the functions of :mod:`schemas.hashing` that the
Beam job shards its output by: an id lives on store shard :func:`id_shards` ``(ids, S)``, and
a tree is trained by worker :func:`tree_shards` ``(table, schema, W)``.
"""

from __future__ import annotations

import pyarrow as pa

from schemas import Schema
from schemas.hashing import id_shards, tree_shards


def own_trees(table: pa.Table, schema: Schema, worker: int, workers: int) -> pa.Table:
    """The trees of ``table`` that ``worker`` of ``workers`` trains."""
    if workers == 1:
        return table
    return table.filter(pa.array(tree_shards(table, schema, workers) == worker))
