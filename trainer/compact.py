"""Compact embedding tables as id transforms in front of ordinary store tables.

Two options of a table's config (``TableConfig.cold_buckets``, ``TableConfig.multi_hash``)
change which ids the stores see, never the stores themselves, so snapshots, deltas, expiry,
resharding, crash points, Ray shards and serving hold their rows as they hold any table's:

- **Cold table** (``cold_buckets: B``): an id the table's entry filter has not admitted (or
  whose row expired) reads and trains the row of its bucket ``mix64(id ^ salt) mod B`` in a
  second table, ``<table>__cold`` (no entry filter: at most B rows). Admitted ids read and
  train their own rows as before. Every id looked up also looks up its bucket, admitted or
  not, so which bucket rows exist depends on the ids seen only, not on the order of
  admission; a bucket row is trained only by the gradients of the ids that read it.
- **Multi-hash** (``multi_hash: {buckets: [Q, R], combine: product|sum}``): an id becomes
  two component ids of one table, ``q = h // R`` and ``Q + h % R`` with ``h = mix64(id ^
  salt) mod (Q * R)`` (quotient and remainder of one hash: two ids share both rows only when
  their ``h`` are equal), and the network combines the two rows element-wise (the
  quotient-remainder trick, Shi et al., KDD 2020). The table holds at most Q + R rows
  whatever the number of distinct ids.

Both transforms are functions of the id and the table's name alone (per id, deterministic),
so structured and flat compute, one process and Ray shards, training and serving see the
same rows. Pure numpy: the store shards import it without TensorFlow.
"""

from __future__ import annotations

import numpy as np

from schemas import stable_hash
from schemas.hashing import mix64

COLD_SUFFIX = "__cold"
COMBINES = ("product", "sum")


def cold_table_name(table: str) -> str:
    """The name of ``table``'s cold table (its bucket rows)."""
    return table + COLD_SUFFIX


def _salt(table: str, what: str) -> np.uint64:
    return np.uint64(stable_hash(f"{table}/{what}") & 0xFFFFFFFFFFFFFFFF)


def cold_buckets(ids: np.ndarray, table: str, buckets: int) -> np.ndarray:
    """int64 bucket ids in ``[0, buckets)`` of ``ids`` of ``table`` (the rows of its cold
    table they read while not admitted)."""
    ids = np.asarray(ids, np.int64).view(np.uint64)
    return (mix64(ids ^ _salt(table, "cold")) % np.uint64(buckets)).astype(np.int64)


def multi_hash_components(ids: np.ndarray, table: str, buckets: tuple[int, int]
                          ) -> np.ndarray:
    """int64[n, 2]: the two component ids of each of ``ids`` in ``table`` (quotient row in
    ``[0, Q)``, remainder row in ``[Q, Q + R)``)."""
    q, r = (np.uint64(b) for b in buckets)
    ids = np.asarray(ids, np.int64).view(np.uint64)
    h = mix64(ids ^ _salt(table, "multi_hash")) % (q * r)
    out = np.empty((len(ids), 2), np.int64)
    out[:, 0] = (h // r).astype(np.int64)
    out[:, 1] = (q + h % r).astype(np.int64)
    return out
