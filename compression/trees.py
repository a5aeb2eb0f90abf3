"""Multi-prefix trees: flat samples grouped into nested root -> ... -> leaf Arrow tables, and back.

A node of an upper layer is identified by its parent node plus the values of all its layer's
features, so nodes whose features change between samples stay distinct and nothing is lost.
Leaves are the samples themselves, in input order within their parent; they hold the labels and
the schema's carried columns (row ids, timestamps), which never take part in a node's identity.

How it works, without per-row Python: each upper layer's node identity becomes a dense integer
code per row (each key column and then the combined codes numbered by first appearance: through
a table indexed by value when values are in a small range, one sort of (value, row) pairs packed
in int64, or Arrow's hash encoding); a non-key feature joins the identity only where it really
varies within a key (checked by one memcmp per row against the group's first row); codes are
renumbered so that nodes are ordered by parent and then by first appearance; one sort of packed
(code, row) pairs of the deepest upper layer puts the leaves in tree order, and per-layer
``bincount``s of the parent codes give the Arrow list offsets. Roots come out in order of first
appearance.

``split_roots`` gives the root layer's features once per root node (the shuffled form of the
Beam job); ``build_trees(rows, schema, roots=...)`` builds the same trees from it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from compression.validate import validate_raw
from schemas import Feature, Layer, Schema

_INT32_MAX = np.iinfo(np.int32).max
ROOT_NODE = "__root_node"


def build_trees(table: pa.Table, schema: Schema, validate: bool = True,
                roots: pa.Table | None = None) -> pa.Table:
    """Group flat samples (any row order) into the tree table of ``schema.tree_arrow_schema()``.

    ``validate=False`` skips :func:`validate_raw` for tables already in canonical form.
    With ``roots`` (the root nodes of :func:`split_roots` or :func:`concat_roots`), ``table`` is
    the matching rows table: the root layer's features come once per node from ``roots``
    (already validated) and each row names its node in ``ROOT_NODE``. The trees are the same
    as those of the expanded rows.
    """
    if roots is None and validate:
        table = validate_raw(table, schema)
    n = table.num_rows
    if n > _INT32_MAX:
        raise ValueError(f"{n} rows is more than one tree table can hold (2**31 - 1); "
                         "compress in shards (by root key hash)")
    levels = len(schema.layers)
    if n == 0:
        return schema.tree_arrow_schema().empty_table()
    if levels == 1:
        return pa.Table.from_arrays([table.column(name) for name in schema.leaf_columns],
                                    schema=schema.tree_arrow_schema())

    # codes[l][row]: the row's node at layer l, numbered in tree order (by parent, then first
    # appearance); reps[l][node]: one input row of that node (for the root layer with
    # ``roots``: one row of ``roots``).
    codes: list[np.ndarray] = []
    reps: list[np.ndarray] = []
    parent = None
    for level, layer in enumerate(schema.layers[:-1]):
        if level == 0 and roots is not None:
            code, rep = _root_codes_from_nodes(roots, table, layer)
        else:
            first_seen = _node_codes(table, layer, parent)
            code, rep = _order_by_parent(first_seen, parent)
        codes.append(code)
        reps.append(rep)
        parent = code

    leaf_order = _stable_order(codes[-1], len(reps[-1]))
    # Carried columns (request ids...) are mostly distinct: no dictionary detour for them.
    carried = set(schema.carried_names)
    nodes = pa.StructArray.from_arrays([_take(table.column(name), leaf_order,
                                              dictionary=name not in carried)
                                        for name in schema.leaf_columns],
                                       fields=schema.layer_fields(levels - 1))
    child_parent = codes[-1][leaf_order]
    for level in range(levels - 2, -1, -1):
        count = len(reps[level])
        offsets = np.zeros(count + 1, np.int32)
        np.cumsum(np.bincount(child_parent, minlength=count), out=offsets[1:])
        fields = schema.layer_fields(level)
        children = pa.ListArray.from_arrays(pa.array(offsets), nodes, type=fields[-1].type)
        source = roots if (level == 0 and roots is not None) else table
        arrays = [_take(source.column(f.name), reps[level])
                  for f in schema.layers[level].features] + [children]
        if level == 0:
            return pa.Table.from_arrays(arrays, schema=schema.tree_arrow_schema())
        nodes = pa.StructArray.from_arrays(arrays, fields=fields)
        child_parent = codes[level - 1][reps[level]]
    raise AssertionError("unreachable")


def split_roots(table: pa.Table, schema: Schema) -> tuple[pa.Table, pa.Table]:
    """Flat samples in canonical form -> (root nodes, rows), for ``build_trees(rows, schema,
    roots=root_nodes)``.

    ``root nodes`` holds the root layer's features once per distinct root node of ``table`` (in
    order of first appearance); ``rows`` holds every other column of every row plus
    ``ROOT_NODE`` (int32), the row's index into the root nodes. Pairs from several tables merge
    with :func:`concat_roots`. The root layer's features (a user's behaviour lists) are most of
    a sample's bytes and repeat in every sample of the user: a shuffle of the split form moves
    them once per user and chunk.
    """
    code, rep = root_node_codes(table, schema)
    return split_roots_from_codes(table, schema, code, rep)


def root_node_codes(table: pa.Table, schema: Schema) -> tuple[np.ndarray, np.ndarray]:
    """(root node of every row, numbered by first appearance; first row of every root node)."""
    if len(schema.layers) < 2:
        raise ValueError("split_roots needs a schema of at least two layers")
    if not table.num_rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    code = _node_codes(table, schema.root, None)
    return code, _first_rows(code)


def split_roots_from_codes(table: pa.Table, schema: Schema, code: np.ndarray,
                           rep: np.ndarray, row_order: np.ndarray | None = None
                           ) -> tuple[pa.Table, pa.Table]:
    """:func:`split_roots` from :func:`root_node_codes`, nodes in the order of ``rep``
    (``code`` numbers them in that order) and rows in ``row_order`` (default: as they are)."""
    names = [f.name for f in schema.root.features]
    roots = pa.Table.from_arrays([_take(table.column(name), rep) for name in names],
                                 schema=pa.schema([table.schema.field(name) for name in names]))
    rows = table.select([name for name in table.column_names if name not in names])
    if row_order is not None:
        rows, code = take_rows(rows, row_order), code[row_order]
    return roots, rows.append_column(ROOT_NODE, pa.array(code.astype(np.int32)))


def concat_roots(parts: list[tuple[pa.Table, pa.Table]]) -> tuple[pa.Table, pa.Table]:
    """One (root nodes, rows) pair from several :func:`split_roots` pairs, rows in order."""
    if not parts:
        raise ValueError("concat_roots needs at least one (root nodes, rows) pair")
    index, base = [], 0
    for roots, rows in parts:
        index.append(rows.column(ROOT_NODE).to_numpy().astype(np.int64) + base)
        base += roots.num_rows
    if base > _INT32_MAX:
        raise ValueError(f"{base} root nodes is more than one tree table can hold")
    rows = pa.concat_tables([rows.drop_columns([ROOT_NODE]) for _, rows in parts])
    return (pa.concat_tables([roots for roots, _ in parts]),
            rows.append_column(ROOT_NODE, pa.array(np.concatenate(index).astype(np.int32))))


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
    for name in schema.labels + schema.carried_names:
        arrays[name] = leaves.columns[name]
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
    check_tree_values(trees, schema)
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
            own.update({name: columns[name] for name in schema.labels + schema.carried_names})
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


def check_tree_schema(arrow_schema: pa.Schema, schema: Schema, source: str | None = None
                      ) -> None:
    """Raise ValueError unless ``arrow_schema`` is a tree table of ``schema``: every column of
    ``schema.tree_arrow_schema()`` with its type, nested lists and structs included (list
    element names, nullability and metadata may differ: other writers spell them otherwise).
    ``source`` (a file name) starts the message."""
    where = f"{source}: " if source else ""
    for expected in schema.tree_arrow_schema():
        index = arrow_schema.get_field_index(expected.name)
        if index < 0:
            hint = ("; it looks like raw samples: compress them first (python -m "
                    "compression.compress)") if len(schema.layers) > 1 and all(
                name in arrow_schema.names for name in schema.raw_arrow_schema().names) else ""
            raise ValueError(f"{where}not a tree table of schema {schema.name!r}: no column "
                             f"{expected.name!r}{hint}")
        problem = _type_problem(arrow_schema.field(index).type, expected.type, expected.name)
        if problem:
            raise ValueError(f"{where}not a tree table of schema {schema.name!r}: {problem}")


def check_tree_values(trees: pa.Table, schema: Schema, source: str | None = None) -> None:
    """Raise ValueError unless ``trees`` is a tree table of ``schema`` (its types, see
    :func:`check_tree_schema`) whose values batches can hold: no null node, children list,
    feature value or label (carried columns may be null) and dense vectors of exactly ``dim``
    values. ``source`` (a file name) starts the message."""
    check_tree_schema(trees.schema, schema, source)
    where = f"{source}: " if source else ""
    root = trees.combine_chunks()
    columns = {name: root.column(name).combine_chunks() for name in root.column_names}
    for level, layer in enumerate(schema.layers):
        values = [(f.name, f) for f in layer.features]
        if level == len(schema.layers) - 1:
            values += [(label, None) for label in schema.labels]
        for name, feature in values:
            column = columns[name]
            nulls = column.null_count
            if feature is not None and feature.kind != "id" and not nulls:
                items = column.flatten()
                nulls = items.null_count
                if feature.kind == "dense":
                    lengths = pc.list_value_length(column)
                    if len(column) and (pc.min(lengths).as_py() != feature.dim or
                                        pc.max(lengths).as_py() != feature.dim):
                        raise ValueError(
                            f"{where}tree table: dense feature {name!r} (layer {layer.name!r}) "
                            f"holds vectors of {pc.min(lengths).as_py()} to "
                            f"{pc.max(lengths).as_py()} values; the schema says dim "
                            f"{feature.dim}")
            if nulls:
                what = "label" if feature is None else f"feature {name!r} of layer"
                what = f"label {name!r}" if feature is None else f"{what} {layer.name!r}"
                raise ValueError(f"{where}tree table: {nulls} null values in {what}; only "
                                 "carried columns may hold nulls")
        if level == len(schema.layers) - 1:
            return
        child = schema.layers[level + 1].name
        children = columns[child]
        if children.null_count:
            raise ValueError(f"{where}tree table: {children.null_count} null {child!r} lists "
                             f"under layer {layer.name!r}; a node's children list cannot be null")
        if len(children) and pc.min(pc.list_value_length(children)).as_py() == 0:
            empty = pc.sum(pc.equal(pc.list_value_length(children), 0)).as_py()
            raise ValueError(f"{where}tree table: {empty} {layer.name!r} nodes with an empty "
                             f"{child!r} list; every node of a tree has at least one child")
        struct = children.flatten()
        if struct.null_count:
            raise ValueError(f"{where}tree table: null {child!r} nodes; nodes cannot be null")
        columns = dict(zip([field.name for field in struct.type], struct.flatten()))


def _type_problem(found: pa.DataType, expected: pa.DataType, name: str) -> str | None:
    """Where ``found`` differs from ``expected`` (a dotted column path and both types), or
    None."""
    if pa.types.is_list(expected):
        if not pa.types.is_list(found):
            return f"column {name!r} is {found}, expected {expected}"
        return _type_problem(found.value_type, expected.value_type, name)
    if pa.types.is_struct(expected):
        if not pa.types.is_struct(found):
            return f"column {name!r} is {found}, expected {expected}"
        names = [found.field(i).name for i in range(found.num_fields)]
        for i in range(expected.num_fields):
            child = expected.field(i)
            if child.name not in names:
                return f"column {name!r} has no field {child.name!r}"
            problem = _type_problem(found.field(names.index(child.name)).type, child.type,
                                    f"{name}.{child.name}")
            if problem:
                return problem
        return None
    if found != expected:
        return f"column {name!r} is {found}, expected {expected}"
    return None


def _cast(array, target: pa.DataType):
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    return array if array.type == target else array.cast(target)


def _stable_order(codes: np.ndarray, count: int) -> np.ndarray:
    """``np.argsort(codes, kind="stable")`` for codes in [0, count): one plain sort of
    (code, row) pairs packed in int64, several times faster than a stable argsort."""
    n = len(codes)
    if n >= 1 << 32 or count >= 1 << 31:
        return np.argsort(codes, kind="stable")
    key = codes.astype(np.int64) << np.int64(32)
    key |= np.arange(n, dtype=np.int64)
    key.sort()
    return key & np.int64(0xFFFFFFFF)


def take_rows(table: pa.Table, indices: np.ndarray) -> pa.Table:
    """``table.take(indices)`` (numpy indices), each column one array, faster for primitive
    and low-cardinality string columns."""
    return pa.Table.from_arrays([_take(column, indices) for column in table.columns],
                                schema=table.schema)


def _take(column, indices: np.ndarray, dictionary: bool = True) -> pa.Array:
    """``column.take(indices)`` as one array, with faster paths for primitive and string data
    (``dictionary=False``: no try through a dictionary, for strings known to be mostly
    distinct)."""
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks == 1:
            column = column.chunk(0)
        elif len(indices) * 4 < len(column) and not _is_primitive(column.type):
            # few rows of a big column: no copy of the whole column
            return column.take(pa.array(indices)).combine_chunks()
        else:
            column = column.combine_chunks()
    kind = column.type
    if _is_primitive(kind) and not column.null_count:
        return pa.array(column.to_numpy(zero_copy_only=False)[indices], type=kind)
    if (dictionary and len(indices) >= 1 << 16 and not column.null_count
            and (pa.types.is_string(kind) or pa.types.is_binary(kind))):
        # Random gathers from a big string buffer miss the cache on every row; through a
        # small dictionary they don't.
        encoded = pc.dictionary_encode(column)
        if len(encoded.dictionary) * 8 <= len(column):
            codes = encoded.indices.to_numpy(zero_copy_only=False)[indices]
            return encoded.dictionary.take(pa.array(codes))
    return column.take(pa.array(indices))


def _is_primitive(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


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
        column = _one_array(table.column(feature.name))
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
    # Each row's list as one binary value (its items' bytes, zero-copy; bitwise, so -0.0 and
    # 0.0 differ and lengths are compared too): one memcmp per row, no per-item index arrays.
    as_binary = _list_as_binary(column, feature)
    return pc.all(pc.equal(as_binary, as_binary.take(pa.array(rep_row)))).as_py()


def _one_array(column) -> pa.Array:
    """A column as one array (without a copy when it has a single chunk)."""
    if isinstance(column, pa.ChunkedArray):
        return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    return column


def _column_codes(column: pa.ChunkedArray, feature: Feature) -> tuple[np.ndarray, int]:
    """Dense int codes of a column's values (equal values, equal codes) and how many there are."""
    column = _one_array(column)
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
    if data is None or len(items) == 0:
        # Arrow refuses a null data pointer, which an empty buffer that crossed a process
        # boundary (Beam) may have: every list empty, e.g. a CSV column of empty cells.
        data = pa.py_buffer(b"")
    else:
        data = data.slice(items.offset * width, len(items) * width)
    offsets = column.offsets.to_numpy()
    if len(items) * width <= _INT32_MAX:
        offsets = (offsets - offsets[0]) * np.int32(width)
        kind = pa.binary()
    else:
        offsets = (offsets.astype(np.int64) - offsets[0]) * width
        kind = pa.large_binary()
    return pa.Array.from_buffers(kind, len(column), [None, pa.py_buffer(offsets), data])


def _encode(array: pa.Array) -> tuple[np.ndarray, int]:
    """Codes 0..k-1 of the values, in order of first appearance, and k."""
    if pa.types.is_integer(array.type) and not array.null_count:
        return _encode_ints(array.to_numpy(zero_copy_only=False))
    encoded = pc.dictionary_encode(array)
    return encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64), len(encoded.dictionary)


def _encode_ints(values: np.ndarray) -> tuple[np.ndarray, int]:
    """:func:`_encode` of integers. Values in a small range (codes, small ids) go through a
    table indexed by value, ~10x faster than hashing; others through Arrow's hash encoding."""
    n = len(values)
    if n == 0:
        return np.zeros(0, np.int64), 0
    low, high = int(values.min()), int(values.max())
    span = high - low + 1
    slot = values - low if low else values
    if span > max(4 * n, 1 << 16):
        row_bits = max(1, (n - 1).bit_length())
        if (span - 1).bit_length() + row_bits <= 63:
            return _encode_by_sort(slot.astype(np.int64, copy=False), row_bits)
        encoded = pc.dictionary_encode(pa.array(values))
        return (encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64),
                len(encoded.dictionary))
    first = np.full(span, n, np.int64)
    np.minimum.at(first, slot, np.arange(n, dtype=np.int64))
    present = np.flatnonzero(first < n)
    by_appearance = present[np.argsort(first[present])]  # first rows are distinct
    rank = np.empty(span, np.int64)
    rank[by_appearance] = np.arange(len(by_appearance), dtype=np.int64)
    return rank[slot], len(by_appearance)


def _encode_by_sort(slot: np.ndarray, row_bits: int) -> tuple[np.ndarray, int]:
    """:func:`_encode_ints` of values 0 <= slot < 2**(63 - row_bits) (e.g. a (parent, child)
    code pair): one sort of (value, row) packed in int64, for values too spread out for a
    table and too many distinct for a fast hash table."""
    n = len(slot)
    packed = slot << np.int64(row_bits)
    packed |= np.arange(n, dtype=np.int64)
    packed.sort()
    rows = packed & np.int64((1 << row_bits) - 1)
    packed >>= np.int64(row_bits)
    starts = np.empty(n, bool)
    starts[0] = True
    np.not_equal(packed[1:], packed[:-1], out=starts[1:])
    group = np.cumsum(starts) - 1  # group of each sorted position, by value
    first_rows = rows[starts]      # rows are sorted within a value: its first appearance
    count = len(first_rows)
    rank = np.empty(count, np.int64)
    rank[_stable_order(first_rows, n)] = np.arange(count, dtype=np.int64)
    codes = np.empty(n, np.int64)
    codes[rows] = rank[group]
    return codes, count


def _dense_codes(parent: np.ndarray | None, columns: list[tuple[np.ndarray, int]]) -> np.ndarray:
    """Codes 0..k-1, in order of first appearance, of the rows' (parent, column values) tuples."""
    if parent is None:
        key, span = columns[0]
        columns = columns[1:]
    else:
        key, span = parent, int(parent.max()) + 1
    if not columns:
        return key  # already codes in order of first appearance
    for codes, count in columns:
        if span * count >= 1 << 62:  # would overflow int64: renumber the prefix first
            key, span = _encode_ints(key)
        key = key * count + codes
        span *= count
    return _encode_ints(key)[0]


def _root_codes_from_nodes(roots: pa.Table, rows: pa.Table, layer: Layer):
    """Root codes per row and one row of ``roots`` per root node, when the root layer's
    features come once per node (``split_roots``) instead of once per row."""
    node_of_row = rows.column(ROOT_NODE).to_numpy()
    node_code = _node_codes(roots, layer, None)  # equal nodes of several parts: one code
    rep_node = _first_rows(node_code)
    # Renumber by first appearance in the rows, as the per-row path numbers them.
    code, count = _encode_ints(node_code[node_of_row])
    first_row = _first_rows(code)
    return code, rep_node[node_code[node_of_row[first_row]]]


def _order_by_parent(first_seen: np.ndarray, parent: np.ndarray | None):
    """Renumber first-appearance node codes so nodes are ordered by parent, then appearance.

    Returns (code per row, one representative row per node in the new order).
    """
    first_row = _first_rows(first_seen)
    if parent is None:
        return first_seen, first_row
    order = _stable_order(parent[first_row], int(parent.max()) + 1)
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    return rank[first_seen], first_row[order]
