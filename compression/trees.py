"""Multi-prefix trees: flat samples grouped into nested root -> ... -> leaf Arrow tables, and back.

A node of an upper layer is identified by its parent node plus the values of all its layer's
features, so nodes whose features change between samples stay distinct and nothing is lost.
Leaves are the samples themselves, in input order within their parent.

How it works, without per-row Python: each upper layer's node identity becomes a dense integer
code per row (hash dictionary-encoding of each column, then of the combined codes); codes are
renumbered so that nodes are ordered by parent and then by first appearance; one stable argsort
of the deepest upper layer's codes puts the leaves in tree order, and per-layer ``bincount``s of
the parent codes give the Arrow list offsets. Roots come out in order of first appearance.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from compression.validate import validate_raw
from schemas import Feature, Layer, Schema

_INT32_MAX = np.iinfo(np.int32).max


def build_trees(table: pa.Table, schema: Schema, validate: bool = True) -> pa.Table:
    """Group flat samples (any row order) into the tree table of ``schema.tree_arrow_schema()``.

    ``validate=False`` skips :func:`validate_raw` for tables already in canonical form.
    """
    if validate:
        table = validate_raw(table, schema)
    n = table.num_rows
    if n > _INT32_MAX:
        raise ValueError(f"{n} rows is more than one tree table can hold (2**31 - 1); "
                         "compress in shards (by root key hash)")
    levels = len(schema.layers)
    if n == 0:
        return schema.tree_arrow_schema().empty_table()
    if levels == 1:
        return pa.Table.from_arrays([table.column(f.name) for f in schema.leaf.features]
                                    + [table.column(lb) for lb in schema.labels],
                                    schema=schema.tree_arrow_schema())

    # codes[l][row]: the row's node at layer l, numbered in tree order (by parent, then first
    # appearance); reps[l][node]: one input row of that node.
    codes: list[np.ndarray] = []
    reps: list[np.ndarray] = []
    parent = None
    for layer in schema.layers[:-1]:
        first_seen = _node_codes(table, layer, parent)
        code, rep = _order_by_parent(first_seen, parent)
        codes.append(code)
        reps.append(rep)
        parent = code

    leaf_order = np.argsort(codes[-1], kind="stable")
    leaf_columns = [f.name for f in schema.leaf.features] + list(schema.labels)
    nodes = _struct(table.select(leaf_columns).take(leaf_order), schema.layer_fields(levels - 1))
    child_parent = codes[-1][leaf_order]
    for level in range(levels - 2, -1, -1):
        count = len(reps[level])
        offsets = np.zeros(count + 1, np.int32)
        np.cumsum(np.bincount(child_parent, minlength=count), out=offsets[1:])
        fields = schema.layer_fields(level)
        children = pa.ListArray.from_arrays(pa.array(offsets), nodes, type=fields[-1].type)
        own = table.select([f.name for f in schema.layers[level].features]).take(reps[level])
        arrays = [col.combine_chunks() for col in own.columns] + [children]
        if level == 0:
            return pa.Table.from_arrays(arrays, schema=schema.tree_arrow_schema())
        nodes = pa.StructArray.from_arrays(arrays, fields=fields)
        child_parent = codes[level - 1][reps[level]]
    raise AssertionError("unreachable")


def flatten(trees: pa.Table, schema: Schema) -> pa.Table:
    """The flat samples of a tree table, in tree order, typed as ``schema.raw_arrow_schema()``."""
    levels = len(schema.layers)
    raw = schema.raw_arrow_schema()
    if trees.num_rows == 0:
        return raw.empty_table()
    root = trees.combine_chunks()
    if levels == 1:
        return pa.Table.from_arrays([root.column(n).combine_chunks() for n in raw.names],
                                    schema=raw)
    layer_nodes = flat_layers(trees, schema)
    # ancestor[l][leaf]: index of the leaf's node at layer l
    leaves = layer_nodes[-1]
    ancestor = [None] * levels
    ancestor[-1] = None
    up = layer_nodes[-1].parent
    for level in range(levels - 2, -1, -1):
        ancestor[level] = up
        if level:
            up = layer_nodes[level].parent[up]
    arrays = {}
    for level, layer in enumerate(schema.layers):
        for f in layer.features:
            column = layer_nodes[level].columns[f.name]
            arrays[f.name] = column if level == levels - 1 else column.take(ancestor[level])
    for label in schema.labels:
        arrays[label] = leaves.columns[label]
    return pa.Table.from_arrays([_cast(arrays[n], raw.field(n).type) for n in raw.names],
                                schema=raw)


class LayerNodes:
    """All nodes of one layer of a tree table: their columns and each node's parent index."""

    __slots__ = ("columns", "parent")

    def __init__(self, columns: dict[str, pa.Array], parent: np.ndarray | None):
        self.columns = columns
        self.parent = parent  # int64 index into the previous layer's nodes; None for roots

    def __len__(self):
        return len(next(iter(self.columns.values())))


def flat_layers(trees: pa.Table, schema: Schema) -> list[LayerNodes]:
    """The nodes of every layer of a tree table, root layer first, with parent indices.

    Reads Arrow list offsets only (no search): node ``i`` of layer ``l`` is the child of node
    ``parent[i]`` of layer ``l - 1``.
    """
    root = trees.combine_chunks()
    levels = len(schema.layers)
    columns = {name: root.column(name).chunk(0) if root.column(name).num_chunks == 1
               else root.column(name).combine_chunks() for name in root.column_names}
    out = []
    parent = None
    for level in range(levels):
        layer = schema.layers[level]
        own = {f.name: columns[f.name] for f in layer.features}
        if level == levels - 1:
            own.update({label: columns[label] for label in schema.labels})
        out.append(LayerNodes(own, parent))
        if level == levels - 1:
            break
        child_name = schema.layers[level + 1].name
        children = columns.get(child_name)
        if children is None:
            raise ValueError(f"tree table has no {child_name!r} column under layer "
                             f"{layer.name!r}; is it a tree table of schema {schema.name!r}?")
        if children.null_count:
            raise ValueError(f"tree table: {children.null_count} null {child_name!r} lists "
                             f"under layer {layer.name!r}; a node's children list cannot be null")
        offsets = children.offsets.to_numpy()
        parent = np.repeat(np.arange(len(children), dtype=np.int64), np.diff(offsets))
        struct = children.flatten()
        if struct.null_count:
            raise ValueError(f"tree table: null {child_name!r} nodes; nodes cannot be null")
        # StructArray.flatten() (unlike .field()) honours the array's own offset.
        columns = dict(zip([field.name for field in struct.type], struct.flatten()))
    return out


def _cast(array, target: pa.DataType):
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    return array if array.type == target else array.cast(target)


def _struct(table: pa.Table, fields: list[pa.Field]) -> pa.StructArray:
    arrays = [col.combine_chunks() for col in table.columns]
    return pa.StructArray.from_arrays(arrays, fields=fields)


def _node_codes(table: pa.Table, layer: Layer, parent: np.ndarray | None) -> np.ndarray:
    """First-appearance codes of the rows' nodes of ``layer``: (parent, all feature values).

    Grouping by the key columns is cheap; the other features are then checked against each
    group's first row, vectorised, and only a feature that really varies within a group (a
    user whose age changes) is added to the grouping with its exact codes. Same result as
    grouping by every feature, at a fraction of the cost of hashing every behaviour list.
    """
    by_name = {f.name: f for f in layer.features}
    grouped = list(layer.key)
    first_seen = _dense_codes(parent, [_column_codes(table.column(k), by_name[k])
                                       for k in grouped])
    rep_row = _first_rows(first_seen)[first_seen]
    for feature in layer.features:
        if feature.name in grouped:
            continue
        column = table.column(feature.name)
        column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        if _constant_within(column, feature, rep_row):
            continue
        grouped.append(feature.name)
        first_seen = _dense_codes(first_seen, [_column_codes(column, feature)])
        rep_row = _first_rows(first_seen)[first_seen]
    return first_seen


def _first_rows(first_seen: np.ndarray) -> np.ndarray:
    """first_rows[c]: the first row with code c (codes numbered by first appearance)."""
    running_max = np.maximum.accumulate(first_seen)
    is_first = np.empty(len(first_seen), bool)
    is_first[0] = True
    is_first[1:] = first_seen[1:] > running_max[:-1]
    return np.flatnonzero(is_first)


def _constant_within(column: pa.Array, feature: Feature, rep_row: np.ndarray) -> bool:
    """Whether every row's value equals the value of row ``rep_row[row]`` (its group's first)."""
    if feature.kind == "id":
        if feature.dtype == "string":
            return pc.all(pc.equal(column, column.take(pa.array(rep_row)))).as_py()
        values = column.to_numpy(zero_copy_only=False)
        return bool(np.array_equal(values, values[rep_row]))
    offsets = column.offsets.to_numpy().astype(np.int64)
    lengths = np.diff(offsets)
    if not np.array_equal(lengths, lengths[rep_row]):
        return False
    items = column.flatten()
    if feature.kind == "ids" and feature.dtype == "string":
        values = _encode(items)[0]
    else:
        values = items.to_numpy(zero_copy_only=False)
        if feature.kind == "dense":
            values = values.view(np.int32)  # bitwise: -0.0 and 0.0 are different values
    # Lengths match, so row i's items sit at [offsets[i], offsets[i+1]) and its group's first
    # row's items at the same positions shifted by (offsets[rep] - offsets[i]).
    shift = np.repeat(offsets[rep_row] - offsets[:-1], lengths)
    shift += np.arange(len(values))
    return bool(np.array_equal(values, values[shift]))


def _column_codes(column: pa.ChunkedArray, feature: Feature) -> tuple[np.ndarray, int]:
    """Dense int codes of a column's values (equal values, equal codes) and how many there are."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if feature.kind == "id":
        return _encode(column)
    return _encode(_list_as_binary(column, feature))


def _list_as_binary(column: pa.Array, feature: Feature) -> pa.Array:
    """A list column as one binary value per row (the bytes of its items), for exact grouping."""
    items = column.flatten()
    if feature.kind == "ids" and feature.dtype == "string":
        items = pa.array(_encode(items)[0].astype(np.int32))
    width = items.type.bit_width // 8
    data = items.buffers()[1]
    if data is None:
        data = pa.py_buffer(b"")
    data = data.slice(items.offset * width, len(items) * width)
    offsets = column.offsets.to_numpy().astype(np.int64)
    offsets = (offsets - offsets[0]) * width
    return pa.Array.from_buffers(pa.large_binary(), len(column),
                                 [None, pa.py_buffer(offsets), data])


def _encode(array: pa.Array) -> tuple[np.ndarray, int]:
    encoded = pc.dictionary_encode(array)
    return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64), len(encoded.dictionary)


def _dense_codes(parent: np.ndarray | None, columns: list[tuple[np.ndarray, int]]) -> np.ndarray:
    """Codes 0..k-1, in order of first appearance, of the rows' (parent, column values) tuples."""
    if parent is None:
        key, span = columns[0]
        columns = columns[1:]
    else:
        key, span = parent, int(parent.max()) + 1
    for codes, count in columns:
        if span * count >= 1 << 62:  # would overflow int64: renumber the prefix first
            key, span = _encode(pa.array(key))
        key = key * count + codes
        span *= count
    return _encode(pa.array(key))[0]


def _order_by_parent(first_seen: np.ndarray, parent: np.ndarray | None):
    """Renumber first-appearance node codes so nodes are ordered by parent, then appearance.

    Returns (code per row, one representative row per node in the new order).
    """
    first_row = _first_rows(first_seen)
    if parent is None:
        return first_seen, first_row
    order = np.argsort(parent[first_row], kind="stable")
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    return rank[first_seen], first_row[order]
