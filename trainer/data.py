"""Training input: TreeBatches from tree Parquet, raw sample files or in-memory tables.

``batch_source(data, schema, batch_size)`` accepts tree Parquet files (what the pipelines
write), raw files (Parquet, CSV, JSON lines; compressed into trees on the fly, one chunk of
rows at a time), a ``pyarrow.Table`` of either kind, or TreeBatches. It returns a function that
starts a fresh pass over the data, so ``fit(data, epochs=3)`` reads it three times (the trees
built from raw files in the first pass are kept for the later ones, up to ``TREE_CACHE_BYTES``).
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import compression
from compression import TreeBatch, fs
from schemas import Schema
from schemas.schema import SCHEMA_YAML_KEY

# Raw rows compressed together: one user's rows in a chunk share a tree. Logs are in time
# order, so a user's samples spread over the whole file: in chunks of 2^18 rows a user of a 1M-
# sample file (57 samples per user) has ~15 per chunk and a 5000-sample batch ~180 user nodes
# instead of ~90. 2^20 rows keep files up to 1M samples whole, at ~0.5 GB more peak memory
# (taobao_like); larger data is best compressed once by pipelines.compress.
RAW_CHUNK_ROWS = 1 << 20
# The trees built from a raw file in a fit's first pass are kept for its later passes while
# all kept trees take at most this many bytes: building them again each pass costs the read
# stage as much CPU as the first time (~1 s per million taobao_like samples on a quiet core,
# several seconds on a loaded one), taken from the training step on a 2-core machine.
TREE_CACHE_BYTES = 1 << 30


def is_tree_table(arrow_schema: pa.Schema, schema: Schema) -> bool:
    """Whether a table/file holds trees (nested child lists) rather than flat samples."""
    if arrow_schema.metadata and SCHEMA_YAML_KEY in arrow_schema.metadata:
        return True
    if len(schema.layers) == 1:
        return False  # one layer: the tree table is the flat table
    return schema.layers[1].name in arrow_schema.names


def batch_source(data, schema: Schema, batch_size: int, split_trees: bool = True,
                 shuffle_seed: int | None = None) -> Callable[[], Iterator[TreeBatch]]:
    """A function that starts a fresh pass over ``data``. With ``shuffle_seed`` every pass deals
    the trees in a new order (pass k uses the seed ``(shuffle_seed, k)``): a table's trees all
    together, files in a new order and the trees of each chunk read from them. TreeBatches and
    one-shot iterators are read as they come."""
    passes = [0]

    def rng():
        passes[0] += 1
        return None if shuffle_seed is None else np.random.default_rng(
            [shuffle_seed, passes[0], 0x5F])

    def shuffled(table: pa.Table, r) -> pa.Table:
        return table if r is None or table.num_rows < 2 else table.take(
            r.permutation(table.num_rows))

    if isinstance(data, TreeBatch):
        return lambda: iter([data])
    if isinstance(data, pa.Table):
        if not is_tree_table(data.schema, schema):
            data = compression.build_trees(data, schema)
        table = data
        return lambda: compression.iter_batches(shuffled(table, rng()), schema, batch_size,
                                                split_trees)
    if isinstance(data, (str, os.PathLike)) or (
            isinstance(data, (list, tuple)) and data and isinstance(data[0], (str, os.PathLike))):
        files = compression.expand_paths(data if isinstance(data, (list, tuple))
                                         else os.fspath(data))

        kept: dict = {}    # raw file -> its tree tables, as file_tables builds them

        def file_pass():
            r = rng()
            order = files if r is None else [files[i] for i in r.permutation(len(files))]
            tables = (shuffled(t, r) for t in _kept_file_tables(order, schema, kept))
            return compression.iter_batches(tables, schema, batch_size, split_trees)
        return file_pass
    if isinstance(data, (list, tuple)):
        for i, item in enumerate(data):
            if not isinstance(item, TreeBatch):
                raise TypeError(f"data[{i}] is a {type(item).__name__}; a list of data must hold "
                                "TreeBatches (or be a list of file paths)")
        return lambda: iter(data)
    if isinstance(data, Iterable):
        used = []

        def once():
            if used:
                raise ValueError("this data is a one-shot iterator and was read already; pass "
                                 "a list, a table or file paths to train several epochs")
            used.append(True)
            return iter(data)
        return once
    raise TypeError(f"cannot train on a {type(data).__name__}; pass tree or raw file paths, a "
                    "pyarrow.Table, or TreeBatches")


def count_samples(data, schema: Schema) -> int | None:
    """Samples in the data if cheap to know, else None: the row count of raw Parquet files and
    raw tables, the leaves of tree tables, and the leaves of tree Parquet files from their
    footers (:func:`tree_file_samples`); None for CSV and JSON lines."""
    if isinstance(data, pa.Table):
        if not is_tree_table(data.schema, schema):
            return data.num_rows
        return _tree_table_samples(data, schema)
    if isinstance(data, (list, tuple)) and data and isinstance(data[0], TreeBatch):
        return sum(b.num_leaves for b in data)
    if isinstance(data, (str, os.PathLike, list, tuple)):
        try:
            files = compression.expand_paths(data if isinstance(data, (list, tuple))
                                             else os.fspath(data))
        except FileNotFoundError:
            return None
        total = 0
        for path in files:
            if not path.endswith((".parquet", ".pq")):
                return None
            with fs.source(path) as source:
                meta = pq.ParquetFile(source).metadata
            if is_tree_table(meta.schema.to_arrow_schema(), schema):
                samples = tree_file_samples(meta, schema)
                if samples is None:
                    return None
                total += samples
            else:
                total += meta.num_rows
        return total
    return None


# how writers spell a list's repeated group and its element in Parquet column paths
_LIST_SPELLINGS = (("list", "element"), ("list", "item"))


def tree_file_samples(metadata: pq.FileMetaData, schema: Schema) -> int | None:
    """The samples (leaves) of a tree Parquet file from its footer alone, or None if the file
    does not have the expected leaf column.

    The first label lives once per leaf, in the leaf layer's list nested in every upper
    layer's list (``ad.list.element.creative.list.element.click``). A column chunk's
    ``num_values`` counts its value slots, nulls and empty lists included; in a tree no node's
    child list is empty or null and labels are never null, so the slots of the label column
    are exactly the leaves."""
    if len(schema.layers) == 1:
        return metadata.num_rows
    names = [layer.name for layer in schema.layers[1:]]
    label = schema.labels[0]
    wanted = {".".join([part for name in names for part in (name, *spelling)] + [label])
              for spelling in _LIST_SPELLINGS}
    for i in range(metadata.num_columns):
        column = metadata.schema.column(i)
        if column.path in wanted and column.max_repetition_level == len(names):
            return sum(metadata.row_group(g).column(i).num_values
                       for g in range(metadata.num_row_groups))
    return None


def _tree_table_samples(table: pa.Table, schema: Schema) -> int | None:
    """The leaves of an in-memory tree table: the length of its leaf lists, flattened."""
    if len(schema.layers) == 1:
        return table.num_rows
    names = [layer.name for layer in schema.layers[1:]]
    if names[0] not in table.column_names:
        return None
    lists = table.column(names[0])
    for name in names[1:]:
        lists = pc.struct_field(pc.list_flatten(lists), name)
    return len(pc.list_flatten(lists))


def _arrow_schema(path: str) -> pa.Schema:
    with fs.source(path) as source:
        return pq.ParquetFile(source).schema_arrow


def _kept_file_tables(files: list[str], schema: Schema, kept: dict) -> Iterator[pa.Table]:
    """:func:`file_tables`, with the trees of each raw file read to its end kept in ``kept``
    (up to ``TREE_CACHE_BYTES`` in all) and given again instead of rebuilt: the same tables."""
    for path in files:
        if path in kept:
            yield from kept[path]
            continue
        raw = not (path.endswith((".parquet", ".pq"))
                   and is_tree_table(_arrow_schema(path), schema))
        room = TREE_CACHE_BYTES - sum(t.nbytes for ts in kept.values() for t in ts)
        tables: list | None = [] if raw else None
        for table in file_tables([path], schema):
            if tables is not None:
                tables.append(table)
                room -= table.nbytes
                if room < 0:
                    tables = None
            yield table
        if tables is not None:
            kept[path] = tables


def file_tables(files: list[str], schema: Schema) -> Iterator[pa.Table]:
    for path in files:
        if path.endswith((".parquet", ".pq")) and is_tree_table(_arrow_schema(path), schema):
            yield from compression.iter_trees(path, schema=schema)
            continue
        for chunk in compression.iter_raw_chunks(path, schema, chunk_rows=RAW_CHUNK_ROWS):
            flat = chunk.validate(schema, path)
            yield compression.build_trees(flat, schema, validate=False)
