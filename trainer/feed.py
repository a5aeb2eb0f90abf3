"""The feed of one training step: a TreeBatch's ids looked up in the stores, as numpy arrays.

A step's graph is kept small by fusing per layer: the rows of every table of one dimension go
into one ``rows[dim]`` matrix (tables one after another), each layer's ``id`` features become
one index matrix into it, and all ``ids`` lists of the layer one run of values pooled with a
single segment sum. For the taobao_like schema (dim 18) structured compute feeds::

    rows["18"]            float32[U, 18]    distinct ids of all tables, table after table
    ids["0/18"]           int32[users, 9]   per user node, per id feature: its row
    values["0/18"]        int32[m]          rows of the 3 behaviour lists, list after list
    segments["0/18"]      int32[m]          k * users + node for a value of list k (sorted)
    scale["0/18"]         float32[3 * users] 1, or 1 / max(length, 1) for mean pooling
    splits["clicked_cats"] int32[users + 1]  one list's offsets (for attention models)
    dense["1"]            float32[ads, 1]   the layer's dense features side by side
    sizes                 int32[3]          nodes per layer
    ancestors["0"]        int32[leaves]     each leaf's user node (tree order: sorted)
    parents["1"]          int32[ads]        each ad node's user node
    labels["click"]       float32[leaves]

Flat compute feeds the same keys with every layer's nodes being the leaves (no ancestors or
parents). ``prepare`` is pure numpy and can run ahead of training; ``lookup`` is the only stage
that touches the stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compression import TreeBatch
from schemas import Schema
from trainer import compact as compact_ids
from trainer.config import DenseConfig, transform_values

_COMBINES = compact_ids.COMBINES


@dataclass(frozen=True)
class Block:
    """The features of one layer that share an embedding dimension, in canonical order."""

    level: int
    dim: int
    ids: tuple[str, ...]      # id features, schema order
    lists: tuple[str, ...]    # ids features, schema order
    # multi-hash features (trainer/compact.py): every id reads two rows combined this way
    # ("product" or "sum"); their positions in the feed have a last axis of 2
    combine: str | None = None

    @property
    def key(self) -> str:
        return (f"{self.level}/{self.dim}" if self.combine is None
                else f"{self.level}/{self.dim}/{self.combine}")


class Layout:
    """Where every feature lives in the fused feed, and the canonical input order of a layer:
    per dimension (ascending) its id features then its pooled ids features, then the layer's
    dense features, each group in schema order."""

    def __init__(self, schema: Schema, tables: dict[str, list[str]], dims: dict[str, int],
                 poolings: dict[str, str], dense: dict[str, DenseConfig] | None = None,
                 compact: dict | None = None):
        self.schema = schema
        # dense feature -> its DenseConfig; the trainer resolves them before the first batch
        self.dense_configs = {f.name: (dense or {}).get(f.name, DenseConfig())
                              for f in schema.features if f.kind == "dense"}
        self.tables = tables
        self.table_of = {n: t for t, names in tables.items() for n in names}
        # table -> its TableConfig, for the tables with a compact option (cold_buckets,
        # multi_hash; trainer/compact.py); empty: the feed is what it always was
        self.compact = dict(compact or {})
        self.cold = {t: c.cold_buckets for t, c in self.compact.items()
                     if c.cold_buckets is not None}
        self.multi_hash = {t: c.multi_hash for t, c in self.compact.items()
                           if c.multi_hash is not None}
        self.cold_tables = {compact_ids.cold_table_name(t) for t in self.cold}
        self.dims = dims
        self.poolings = poolings
        self.levels = len(schema.layers)
        self.blocks: list[Block] = []
        self.dense: dict[int, tuple[str, ...]] = {}
        combines = {None: 0, **{c: i + 1 for i, c in enumerate(_COMBINES)}}
        for level, layer in enumerate(schema.layers):
            by_dim: dict[tuple, tuple[list, list]] = {}
            for f in layer.features:
                if f.kind == "dense" or f.name in schema.time_columns:
                    continue
                table = self.table_of[f.name]
                mh = self.multi_hash.get(table)
                group = (dims[table], None if mh is None else mh.combine)
                ids, lists = by_dim.setdefault(group, ([], []))
                (ids if f.kind == "id" else lists).append(f.name)
            for dim, combine in sorted(by_dim, key=lambda g: (g[0], combines[g[1]])):
                ids, lists = by_dim[(dim, combine)]
                self.blocks.append(Block(level, dim, tuple(ids), tuple(lists), combine))
            dense = tuple(f.name for f in layer.features if f.kind == "dense")
            if dense:
                self.dense[level] = dense
        self.row_dims = sorted({b.dim for b in self.blocks})
        # tables in the order their rows are stacked into rows[dim] (a cold table right after
        # its table)
        self.tables_by_dim = {d: [t for t in tables if dims[t] == d] for d in self.row_dims}

    def layer_blocks(self, level: int) -> list[Block]:
        return [b for b in self.blocks if b.level == level]

    def dense_width(self, level: int) -> int:
        return sum(self.schema.feature(n).dim for n in self.dense.get(level, ()))


def _leaf_id_count(batch: TreeBatch, schema: Schema, ancestors: dict) -> int:
    """How many ids the batch's features hold once expanded to the leaves."""
    total = 0
    last = len(batch.layers) - 1
    for level, layer in enumerate(batch.layers):
        for f in schema.layers[level].features:
            if f.name in schema.time_columns:
                continue
            array = layer.features[f.name]
            if f.kind == "id":
                total += batch.num_leaves
            elif f.kind == "ids":
                lengths = np.diff(array[1])
                total += int(lengths.sum() if level == last
                             else lengths[ancestors[str(level)]].sum())
    return total


def _dense_values(values: np.ndarray, config: DenseConfig, name: str) -> np.ndarray:
    """A dense feature's values as the model sees them; per row, so the same per node or per
    leaf."""
    if not config.resolved:
        raise ValueError(f"dense feature {name!r}: its transform/statistics are not resolved "
                         "yet (Trainer resolves them from the first training batch)")
    values = transform_values(values, config.transform)
    if config.standardize:
        values = (values - np.asarray(config.mean, np.float32)) / np.asarray(config.std,
                                                                             np.float32)
    return values.astype(np.float32, copy=False)


def order_sequences(arrays: dict, schema: Schema) -> dict:
    """``arrays`` (feature -> values, or ``(values, offsets)`` for a list) with every sequence
    feature ordered by its time column (stable: equal times keep their list order) and cut to
    its ``max_length`` most recent items. Per row, so the same per node or per leaf."""
    out = None
    for f in schema.sequences:
        seq = f.sequence
        if seq.time is None and seq.max_length is None:
            continue
        values, offsets = arrays[f.name]
        lengths = np.diff(offsets)
        if seq.time is not None:
            times, time_offsets = arrays[seq.time]
            if not np.array_equal(time_offsets, offsets):
                bad = int(np.flatnonzero(np.diff(time_offsets) != lengths)[0])
                raise ValueError(f"sequence {f.name!r}: row {bad} has {int(lengths[bad])} "
                                 f"items but its time column {seq.time!r} has "
                                 f"{int(time_offsets[bad + 1] - time_offsets[bad])} times; "
                                 "give one time per item")
            rows = np.repeat(np.arange(len(lengths)), lengths)
            values = values[np.lexsort((times, rows))]
        if seq.max_length is not None and len(lengths) and lengths.max() > seq.max_length:
            ends = np.repeat(offsets[1:], lengths)
            position_from_end = ends - np.arange(len(values)) - 1
            values = values[position_from_end < seq.max_length]
            kept = np.minimum(lengths, seq.max_length)
            offsets = np.concatenate([[0], np.cumsum(kept)]).astype(offsets.dtype)
        if out is None:
            out = dict(arrays)
        out[f.name] = (values, offsets)
    return arrays if out is None else out


@dataclass
class Prepared:
    """A batch before its store lookup: the ids each table must look up, the rest of the feed."""

    num_leaves: int
    table_ids: dict        # table -> int64[n]: the ids of all its features, concatenated
    table_parts: dict      # table -> [(feature, count)] in the order of table_ids
    feed: dict             # everything of the feed except rows, ids and values
    labels: dict           # label -> float32[num_leaves] (numpy, for metrics)
    ids_fed: int = 0       # ids this feed looks up (before deduplication)
    leaf_ids: int = 0      # ids flat compute would look up for the same samples


@dataclass
class Feed:
    """A looked-up batch: ``feed`` goes to the TensorFlow step; ``unique_ids[table]`` and
    ``row_ranges[table] = (dim, start, stop)`` say which ids the rows of ``feed['rows']`` are,
    for ``apply_gradients``."""

    num_leaves: int
    feed: dict
    unique_ids: dict
    row_ranges: dict
    labels: dict
    ids_fed: int = 0
    leaf_ids: int = 0


class FeedBuilder:
    """Turns TreeBatches into feeds for one layout and compute mode."""

    def __init__(self, layout: Layout, structured: bool):
        self.layout = layout
        self.schema = layout.schema
        self.structured = structured

    def prepare(self, batch: TreeBatch) -> Prepared:
        layout, schema = self.layout, self.schema
        if self.structured:
            arrays = {name: array for layer in batch.layers
                      for name, array in layer.features.items()}
            sizes = [layer.size for layer in batch.layers]
        else:
            arrays = batch.leaf_features()
            sizes = [batch.num_leaves] * layout.levels
        arrays = order_sequences(arrays, schema)
        feed: dict = {"sizes": np.asarray(sizes, np.int32), "splits": {}, "segments": {},
                      "scale": {}, "dense": {}}
        for block in layout.blocks:
            size = sizes[block.level]
            if not block.lists:
                continue
            segments, scale = [], []
            for k, name in enumerate(block.lists):
                offsets = arrays[name][1].astype(np.int32, copy=False)
                feed["splits"][name] = offsets
                lengths = np.diff(offsets)
                segments.append(np.repeat(np.arange(k * size, (k + 1) * size, dtype=np.int32),
                                          lengths))
                if layout.poolings[name] == "mean":
                    scale.append(1.0 / np.maximum(lengths, 1).astype(np.float32))
                else:
                    scale.append(np.ones(size, np.float32))
            feed["segments"][block.key] = np.concatenate(segments)
            feed["scale"][block.key] = np.concatenate(scale)
        for level, names in layout.dense.items():
            parts = [_dense_values(np.asarray(arrays[n], np.float32), layout.dense_configs[n], n)
                     for n in names]
            feed["dense"][str(level)] = np.ascontiguousarray(
                parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1))
        table_ids, table_parts = {}, {}
        for table, names in layout.tables.items():
            if not names:  # a cold table: its buckets come with its table's ids (below)
                continue
            parts = [arrays[n][0] if isinstance(arrays[n], tuple) else arrays[n] for n in names]
            table_ids[table] = parts[0] if len(parts) == 1 else np.concatenate(parts)
            table_parts[table] = [(n, len(p)) for n, p in zip(names, parts)]
        ids_fed = sum(len(ids) for ids in table_ids.values())
        for table, buckets in layout.cold.items():
            # every id's bucket, admitted or not: which bucket rows exist then depends on the
            # ids seen only (one process or shards alike); lookup routes the ids
            table_ids[compact_ids.cold_table_name(table)] = compact_ids.cold_buckets(
                table_ids[table], table, buckets)
        for table, mh in layout.multi_hash.items():
            # each id as its two component ids, side by side: [q0, r0, q1, r1, ...]
            table_ids[table] = compact_ids.multi_hash_components(
                table_ids[table], table, mh.buckets).reshape(-1)
        leaf_ids = ids_fed
        if self.structured:
            feed["ancestors"] = {str(level): batch.leaf_ancestors(level).astype(np.int32)
                                 for level in range(layout.levels - 1)}
            feed["parents"] = {str(level): batch.layers[level].parent.astype(np.int32)
                               for level in range(1, layout.levels)}
            leaf_ids = _leaf_id_count(batch, schema, feed["ancestors"])
        labels = {name: np.asarray(batch.labels[name], np.float32) for name in schema.labels}
        feed["labels"] = labels
        return Prepared(batch.num_leaves, table_ids, table_parts, feed, labels, ids_fed,
                        leaf_ids)

    def prefetch(self, prepared: Prepared, stores: dict) -> int:
        """Two tiers: reads the batch's rows that are on disk back into memory ahead of its
        lookup, one batched read per store shard (rows unchanged: the lookup's result is the
        same with or without it). Returns rows read; 0 for stores without a memory budget."""
        return sum(stores[table].prefetch(ids) for table, ids in prepared.table_ids.items()
                   if stores[table].config.memory_budget_bytes is not None)

    def lookup(self, prepared: Prepared, stores: dict, train: bool) -> Feed:
        """One ``lookup_unique`` per table (the union of its features' ids, as XDL does)."""
        layout = self.layout
        rows, unique_ids, row_ranges, position = {}, {}, {}, {}
        for dim, tables in layout.tables_by_dim.items():
            parts, start = [], 0
            for table in tables:
                if table in layout.cold_tables:  # looked up with its table (below)
                    continue
                unique, inverse, table_rows = stores[table].lookup_unique(
                    prepared.table_ids[table], train)
                parts.append(table_rows)
                unique_ids[table] = unique
                row_ranges[table] = (dim, start, start + len(unique))
                inverse = inverse.astype(np.int32)
                if start:
                    inverse += start
                start += len(unique)
                if table in layout.cold:
                    cold = compact_ids.cold_table_name(table)
                    unique_ids[cold], cold_rows = self._route_cold(
                        prepared, stores, train, table, cold, unique, inverse, start)
                    parts.append(cold_rows)
                    row_ranges[cold] = (dim, start, start + len(cold_rows))
                    start += len(cold_rows)
                pair = 2 if table in layout.multi_hash else 1
                at = 0
                for name, count in prepared.table_parts[table]:
                    position[name] = (inverse[at:at + count] if pair == 1 else
                                      inverse[at:at + 2 * count].reshape(count, 2))
                    at += pair * count
            rows[str(dim)] = (parts[0] if len(parts) == 1 else np.concatenate(parts)) \
                if parts else np.zeros((0, dim), np.float32)
        ids, values = {}, {}
        for block in layout.blocks:
            if block.ids:
                ids[block.key] = np.stack([position[n] for n in block.ids], axis=1)
                # multi-hash: [size, n_ids, 2]; a list block's values: [m, 2]
            if block.lists:
                values[block.key] = np.concatenate([position[n] for n in block.lists])
        feed = dict(prepared.feed)
        feed.update(rows=rows, ids=ids, values=values)
        return Feed(prepared.num_leaves, feed, unique_ids, row_ranges, prepared.labels,
                    prepared.ids_fed, prepared.leaf_ids)

    def _route_cold(self, prepared: Prepared, stores: dict, train: bool, table: str,
                    cold: str, unique: np.ndarray, inverse: np.ndarray, start: int
                    ) -> tuple[np.ndarray, np.ndarray]:
        """A table with a cold table: looks up every id's bucket row, then points the ids
        ``table`` has no row for (not admitted, expired, unseen) at their bucket's row, in
        place in ``inverse`` (the ids' positions in ``rows[dim]``; ``table``'s rows end at
        ``start``). Returns the bucket ids read and their rows (they follow ``table``'s); the
        buckets no id reads are left out, so only the ids that read a bucket row train it."""
        admitted = np.asarray(stores[table].contains(unique), bool)
        bucket_unique, bucket_inverse, bucket_rows = stores[cold].lookup_unique(
            prepared.table_ids[cold], train)
        cold_at = ~admitted[inverse - (start - len(unique))]
        read = np.unique(bucket_inverse[cold_at])
        # each read bucket's position among the rows of the buckets read
        inverse[cold_at] = start + np.searchsorted(read, bucket_inverse[cold_at])
        return bucket_unique[read], bucket_rows[read]
