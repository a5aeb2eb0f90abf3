"""TreeBatch: a mini-batch of whole (or split) trees as numpy arrays, with parent indicators.

A batch of 5 leaves from two users (u0 with ads a0, a1; u1 with ad a2)::

    layers[0] user      size 2  parent None         features user_id [u0 u1]
    layers[1] ad        size 3  parent [0 0 1]      features ad_id   [a0 a1 a2]
    layers[2] creative  size 5  parent [0 0 1 2 2]  features ...     labels click [0 1 0 0 1]

``parent`` is XDL's indicator tensor: node ``i`` of layer ``l`` hangs under node ``parent[i]`` of
layer ``l - 1``. Feature arrays by kind: ``id`` -> int64[size]; ``ids`` -> (values int64[m],
offsets int32[size + 1]); ``dense`` -> float32[size, dim]. String ids are hashed to int64 with
:func:`schemas.stable_hash` here, when batches are built.

The schema's carried columns (row ids, timestamps: never trained) come per leaf in
``batch.carried[name]`` as Arrow arrays in their schema type (nulls kept), so predictions can be
joined back to the rows; the trainer's feed never reads them.

Batches hold exactly ``batch_size`` leaves (the last one of a stream may hold fewer). Trees are
packed whole in stream order; a tree that does not fit is split at a leaf boundary and its rest
opens the next batch with its ancestors repeated (XDL's ``split_group``, the default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Union

import numpy as np
import pyarrow as pa

from compression.trees import flat_layers
from schemas import Schema, stable_hash_strings

Ragged = tuple  # (values, offsets)
FeatureArray = Union[np.ndarray, Ragged]


@dataclass
class LayerBatch:
    """The nodes of one layer in a batch."""

    name: str
    size: int
    parent: np.ndarray | None  # int32[size], index into the previous layer; None for roots
    features: dict[str, FeatureArray]


@dataclass
class TreeBatch:
    """A mini-batch of trees: ``layers`` root first, float32 ``labels`` per leaf, and the
    schema's carried columns per leaf (``carried[name]``: a ``pa.Array`` of num_leaves values,
    never fed to the model)."""

    layers: list[LayerBatch]
    labels: dict[str, np.ndarray]
    carried: dict[str, pa.Array] = field(default_factory=dict)

    @property
    def num_leaves(self) -> int:
        return self.layers[-1].size

    def __len__(self) -> int:
        return self.num_leaves

    def leaf_ancestors(self, level: int) -> np.ndarray:
        """Index of every leaf's ancestor at ``level`` (the composed indicators)."""
        index = np.arange(self.num_leaves)
        for below in range(len(self.layers) - 1, level, -1):
            index = self.layers[below].parent[index]
        return index

    def layer_ancestors(self, level: int, of_level: int) -> np.ndarray:
        """Index at ``level`` of the ancestor of every node of layer ``of_level``."""
        index = np.arange(self.layers[of_level].size)
        for below in range(of_level, level, -1):
            index = self.layers[below].parent[index]
        return index

    def leaf_features(self) -> dict[str, FeatureArray]:
        """Every feature expanded to one value per leaf (what flat training consumes)."""
        out = {}
        for level, layer in enumerate(self.layers):
            index = None if level == len(self.layers) - 1 else self.leaf_ancestors(level)
            for name, array in layer.features.items():
                out[name] = array if index is None else take(array, index)
        return out

    def check(self) -> None:
        """Raise ValueError if an invariant does not hold (sizes, parents, offsets)."""
        for level, layer in enumerate(self.layers):
            for name, array in layer.features.items():
                length = len(array[1]) - 1 if isinstance(array, tuple) else len(array)
                if length != layer.size:
                    raise ValueError(f"layer {layer.name!r} feature {name!r} has {length} rows "
                                     f"but the layer has {layer.size} nodes")
            if level == 0:
                if layer.parent is not None:
                    raise ValueError("the root layer cannot have parents")
                continue
            parent = layer.parent
            if parent is None or len(parent) != layer.size:
                raise ValueError(f"layer {layer.name!r} needs one parent per node")
            above = self.layers[level - 1].size
            if layer.size and (parent.min() < 0 or parent.max() >= above):
                raise ValueError(f"layer {layer.name!r} parent out of range [0, {above})")
            if layer.size and np.any(np.diff(parent) < 0):
                raise ValueError(f"layer {layer.name!r} parents are not in tree order")
            if len(np.unique(parent)) != above:
                raise ValueError(f"layer {self.layers[level - 1].name!r} has nodes without "
                                 "children in this batch")
        for name, values in self.labels.items():
            if len(values) != self.num_leaves:
                raise ValueError(f"label {name!r} has {len(values)} values but the batch has "
                                 f"{self.num_leaves} leaves")
        for name, values in self.carried.items():
            if len(values) != self.num_leaves:
                raise ValueError(f"carried column {name!r} has {len(values)} values but the "
                                 f"batch has {self.num_leaves} leaves")

    # -- building and slicing -------------------------------------------------------------

    @classmethod
    def from_trees(cls, trees: pa.Table, schema: Schema) -> "TreeBatch":
        """All trees of a tree table as one (large) batch."""
        nodes = flat_layers(trees, schema)
        layers = []
        for layer, layer_nodes in zip(schema.layers, nodes):
            features = {f.name: feature_array(layer_nodes.columns[f.name], f)
                        for f in layer.features}
            parent = None if layer_nodes.parent is None else layer_nodes.parent
            size = len(layer_nodes) if trees.num_rows else 0
            layers.append(LayerBatch(layer.name, size, parent, features))
        labels = {label: _plain(nodes[-1].columns[label]).to_numpy(zero_copy_only=False)
                  .astype(np.float32, copy=False) for label in schema.labels}
        carried = {name: _plain(nodes[-1].columns[name]) for name in schema.carried_names}
        return cls(layers, labels, carried)

    def slice_leaves(self, start: int, stop: int) -> "TreeBatch":
        """The sub-batch of leaves [start, stop) with all their ancestors, re-indexed."""
        last = len(self.layers) - 1
        ranges = []
        for level in range(last + 1):
            if level == last:
                ranges.append((start, stop))
            else:
                lo = int(self.leaf_ancestor_at(level, start))
                hi = int(self.leaf_ancestor_at(level, stop - 1)) + 1
                ranges.append((lo, hi))
        layers = []
        for level, layer in enumerate(self.layers):
            lo, hi = ranges[level]
            parent = None
            if layer.parent is not None:
                parent = (layer.parent[lo:hi] - ranges[level - 1][0]).astype(np.int32)
            features = {name: _slice(array, lo, hi) for name, array in layer.features.items()}
            layers.append(LayerBatch(layer.name, hi - lo, parent, features))
        labels = {name: values[start:stop] for name, values in self.labels.items()}
        carried = {name: values.slice(start, stop - start)
                   for name, values in self.carried.items()}
        return TreeBatch(layers, labels, carried)

    def leaf_ancestor_at(self, level: int, leaf: int) -> int:
        index = leaf
        for below in range(len(self.layers) - 1, level, -1):
            index = self.layers[below].parent[index]
        return index

    @staticmethod
    def concat(batches: list["TreeBatch"]) -> "TreeBatch":
        """Batches side by side (their trees stay separate)."""
        if len(batches) == 1:
            return batches[0]
        layers = []
        for level, first in enumerate(batches[0].layers):
            parts = [b.layers[level] for b in batches]
            parent = None
            if first.parent is not None:
                shift = np.cumsum([0] + [b.layers[level - 1].size for b in batches[:-1]])
                parent = np.concatenate([p.parent.astype(np.int32, copy=False) + np.int32(s)
                                         for p, s in zip(parts, shift)])
            features = {name: _concat([p.features[name] for p in parts])
                        for name in first.features}
            layers.append(LayerBatch(first.name, sum(p.size for p in parts), parent, features))
        labels = {name: np.concatenate([b.labels[name] for b in batches])
                  for name in batches[0].labels}
        carried = {name: pa.concat_arrays([b.carried[name] for b in batches])
                   for name in batches[0].carried}
        return TreeBatch(layers, labels, carried)


def iter_batches(trees: pa.Table | Iterable[pa.Table], schema: Schema, batch_size: int,
                 split_trees: bool = True) -> Iterator[TreeBatch]:
    """Batches of exactly ``batch_size`` leaves over a tree table or a stream of tree tables.

    With ``split_trees=False`` a batch ends before a tree that does not fit (so batches may be
    smaller); a single tree larger than ``batch_size`` is still split.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    tables = [trees] if isinstance(trees, pa.Table) else trees
    pending = None
    for table in tables:
        if table.num_rows == 0:
            continue
        forest = TreeBatch.from_trees(table, schema)
        if pending is not None:
            forest = TreeBatch.concat([pending, forest])
        start, total = 0, forest.num_leaves
        root_starts = None
        if not split_trees:
            roots = forest.leaf_ancestors(0)
            # where trees start, and the table's end (tables hold whole trees)
            root_starts = np.append(np.flatnonzero(np.diff(roots)) + 1, total)
        while total - start >= batch_size:
            stop = start + batch_size
            if root_starts is not None:
                i = np.searchsorted(root_starts, stop, side="right") - 1
                if i >= 0 and root_starts[i] > start:
                    stop = int(root_starts[i])
            yield forest.slice_leaves(start, stop)
            start = stop
        pending = forest.slice_leaves(start, total) if start < total else None
    if pending is not None:
        yield pending


def take(array: FeatureArray, index: np.ndarray) -> FeatureArray:
    """Rows ``index`` of a feature array (ragged ``(values, offsets)`` included)."""
    if not isinstance(array, tuple):
        return array[index]
    values, offsets = array
    starts = offsets[:-1][index].astype(np.int64)
    lengths = (offsets[1:] - offsets[:-1])[index].astype(np.int64)
    new_offsets = np.zeros(len(index) + 1, np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    # position of each output value in the input: its row start + its rank within the row
    within = np.arange(new_offsets[-1]) - np.repeat(new_offsets[:-1], lengths)
    gathered = values[np.repeat(starts, lengths) + within]
    return gathered, new_offsets.astype(np.int32)


def _slice(array: FeatureArray, lo: int, hi: int) -> FeatureArray:
    if not isinstance(array, tuple):
        return array[lo:hi]
    values, offsets = array
    window = offsets[lo:hi + 1]
    return values[window[0]:window[-1]], (window - window[0]).astype(np.int32)


def _concat(arrays: list[FeatureArray]) -> FeatureArray:
    """A feature's arrays end to end: ids and dense rows as they are; a list feature's values
    (those its offsets cover) end to end, its offsets shifted by the values before them."""
    if not isinstance(arrays[0], tuple):
        return np.concatenate(arrays)
    values, offsets, shift = [], [np.zeros(1, np.int64)], 0
    for v, o in arrays:
        first, last = int(o[0]), int(o[-1])
        values.append(v[first:last])
        offsets.append(o[1:].astype(np.int64) - first + shift)
        shift += last - first
    return np.concatenate(values), np.concatenate(offsets).astype(np.int32)


def _plain(array) -> pa.Array:
    return array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array


def _ids_to_int64(array: pa.Array, dtype: str) -> np.ndarray:
    if dtype == "string":
        return stable_hash_strings(array)
    return array.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def feature_array(column, feature) -> FeatureArray:
    """A validated raw or tree column of ``feature`` (pyarrow) as a LayerBatch holds it."""
    column = _plain(column)
    if feature.kind == "id":
        return _ids_to_int64(column, feature.dtype)
    offsets = column.offsets.to_numpy()
    offsets = (offsets - offsets[0]).astype(np.int32)
    items = column.flatten()
    if feature.kind == "ids":
        return _ids_to_int64(items, feature.dtype), offsets
    values = items.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return values.reshape(len(column), feature.dim)
