"""Samples to the batches a step trains: one path for a poll of Kafka and for batch data.

A poll of a :class:`~trainer.kafka_source.KafkaSampleSource` (in process, :mod:`trainer.online`,
and on every online worker on Ray, :mod:`trainer.distributed.online_worker`) and a worker's
share of batch data (:func:`trainer.distributed.worker.worker_batches`) go the same way: raw
samples are compressed into trees (tree tables pass as they are), the trees are cut into
:class:`compression.TreeBatch` es of a number of leaves, and each batch is optionally prepared
(its feed built) by the caller's ``prepare``. TensorFlow-free: it runs on the reader threads
and in the actors.
"""

from __future__ import annotations

from typing import Callable, Iterable

import pyarrow as pa

import compression
from schemas import Schema


def as_trees(table: pa.Table, schema: Schema, *, validate: bool = True) -> pa.Table:
    """``table`` as a tree table: raw samples compressed (``validate``: checked against the
    schema first; decoded Kafka messages are checked already), a tree table as it is."""
    from trainer.data import is_tree_table

    if is_tree_table(table.schema, schema):
        return table
    return compression.build_trees(table, schema, validate=validate)


def cut_batches(trees: Iterable[pa.Table] | pa.Table, schema: Schema, batch_size: int,
                split_trees: bool, prepare: Callable | None = None):
    """The batches of ``batch_size`` leaves cut from ``trees`` (one tree table or several, in
    order), each passed through ``prepare`` when given."""
    batches = compression.iter_batches(trees, schema, batch_size, split_trees)
    return batches if prepare is None else (prepare(b) for b in batches)


def polled_batches(polled, schema: Schema, batch_size: int, split_trees: bool,
                   prepare: Callable | None = None) -> list:
    """The batches of one poll (:class:`~trainer.kafka_source.Polled`): its samples (format
    json) compressed into trees at once (a bigger poll shares more tree prefixes) or its tree
    messages' tables (format trees), cut and prepared as :func:`cut_batches`. Empty when the
    poll holds no sample (only malformed messages)."""
    if not polled.num_samples:
        return []
    trees = (polled.trees if polled.samples is None
             else as_trees(polled.samples, schema, validate=False))
    return list(cut_batches(trees, schema, batch_size, split_trees, prepare))
