"""Validation of raw (flat) samples against a schema, with errors that name the column and row.

``validate_raw`` returns the table in canonical types (the schema's ``raw_arrow_schema()``) or
raises :class:`RawDataError`. ``split_bad_rows`` is the forgiving variant the Beam job uses:
whole-column problems still raise, row problems come back as a table of rejected rows with
their reasons, so nothing is silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas import Carried, Feature, Schema


class RawDataError(ValueError):
    """Raw samples that do not match the schema; the message names the column, row and fix."""


@dataclass(frozen=True)
class _RowProblem:
    mask: np.ndarray  # True where the row has the problem
    reason: str       # formatted with row="row 8" (or "line 8")


def validate_raw(table: pa.Table, schema: Schema, source: str | None = None,
                 first_row: int = 1) -> pa.Table:
    """Check ``table`` against ``schema`` and return it with the schema's column order and types.

    ``source`` (a file name) and ``first_row`` only make error messages point at the right
    place: ``first_row`` is the number of the table's first row as its file counts rows,
    1-based, the way editors show them: a CSV file's line number (its header is line 1), a
    JSON lines file's line number, a Parquet file's row number. Rows of a CSV or JSON lines
    ``source`` are called lines. Every kind of problem is reported, key columns first, each
    with its first row and how many more rows have it.
    """
    table = conform_columns(table, schema, source)
    found = []
    for problem in _row_problems(table, schema):
        bad = np.flatnonzero(problem.mask)
        if len(bad):
            more = f" ({len(bad) - 1} more rows like it)" if len(bad) > 1 else ""
            found.append(problem.reason.format(row=_row(source, int(bad[0]) + first_row))
                         + more)
    if found:
        raise RawDataError(_where(source) + "; also ".join(found))
    return table


def validate_features(table: pa.Table, schema: Schema, names, what: str = "sample") -> pa.Table:
    """Check the feature columns ``names`` of ``table`` (no others: a ranking request's
    candidates, whose root features come once) as :func:`validate_raw` checks them, naming a
    bad row as ``{what} {i}`` (0-based); returns those columns in canonical types."""
    expected = schema.raw_arrow_schema()
    missing = [n for n in names if n not in table.column_names]
    if missing:
        raise RawDataError(f"column {missing[0]!r} missing: the schema {schema.name!r} needs it")
    fields = [expected.field(n) for n in names]
    table = pa.Table.from_arrays(
        [_cast_feature(table.column(n), schema.feature(n), what) for n in names],
        schema=pa.schema(fields))
    found = []
    for problem in _row_problems(table, schema, names):
        bad = np.flatnonzero(problem.mask)
        if len(bad):
            more = f" ({len(bad) - 1} more like it)" if len(bad) > 1 else ""
            found.append(problem.reason.format(row=f"{what} {int(bad[0])}") + more)
    if found:
        raise RawDataError("; also ".join(found))
    return table


def split_bad_rows(table: pa.Table, schema: Schema, source: str | None = None,
                   first_row: int = 1) -> tuple[pa.Table, pa.Table]:
    """Split rows into (good rows in canonical types, rejected rows).

    The rejected table has columns ``source`` (string), ``row`` (int64, the row's 1-based
    number in the source, counted as :func:`validate_raw` counts them from ``first_row``) and
    ``reason`` (string: every problem of the row, key columns first, joined by "; ").
    Problems with whole columns (missing, extra, wrong type) still raise :class:`RawDataError`.
    """
    table = conform_columns(table, schema, source)
    bad = np.zeros(table.num_rows, bool)
    reasons = {}  # row -> its problems
    for problem in _row_problems(table, schema):
        for i in np.flatnonzero(problem.mask):
            reasons.setdefault(int(i), []).append(
                problem.reason.format(row=_row(source, int(i) + first_row)))
        bad |= problem.mask
    bad_rows = np.flatnonzero(bad)
    rejected = pa.table({
        "source": pa.array([source or ""] * len(bad_rows), pa.string()),
        "row": pa.array(bad_rows + first_row, pa.int64()),
        "reason": pa.array(["; ".join(reasons[int(i)]) for i in bad_rows], pa.string()),
    })
    good = table.filter(pa.array(~bad)) if len(bad_rows) else table
    return good, rejected


_TEXT_SUFFIXES = (".csv", ".jsonl", ".json", ".ndjson")


def _row(source: str | None, number: int) -> str:
    """``row 8``, or ``line 8`` in a CSV or JSON lines file (where a row is a line)."""
    name = source[:-3] if source and source.endswith(".gz") else source
    word = "line" if name and name.lower().endswith(_TEXT_SUFFIXES) else "row"
    return f"{word} {number}"


def conform_columns(table: pa.Table, schema: Schema, source: str | None = None) -> pa.Table:
    """Check the column set and types, and cast to the schema's canonical types (no row checks)."""
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    expected = schema.raw_arrow_schema()
    names = table.column_names
    missing = [n for n in expected.names if n not in names]
    extra = [n for n in names if n not in expected.names]
    if missing:
        raise RawDataError(
            f"{_where(source)}missing column(s) {', '.join(map(repr, missing))}: the schema "
            f"{schema.name!r} needs every feature of every layer plus the labels"
            f"{' and carried columns' if schema.carried else ''} in each row")
    if extra:
        raise RawDataError(
            f"{_where(source)}unexpected column(s) {', '.join(map(repr, extra))}: not in schema "
            f"{schema.name!r}; drop them or declare them as features (or, to keep them with "
            "the samples without training on them, under the leaf layer's `carried:`)")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise RawDataError(f"{_where(source)}column(s) {', '.join(map(repr, dupes))} appear twice")
    columns = []
    carried = {c.name: c for c in schema.carried}
    for field in expected:
        column = table.column(field.name)
        if schema.labels and field.name in schema.labels:
            columns.append(_cast_label(column, field.name, source))
        elif field.name in carried:
            columns.append(_cast_carried(column, carried[field.name], source))
        else:
            columns.append(_cast_feature(column, schema.feature(field.name), source))
    return pa.Table.from_arrays(columns, schema=expected)


def _where(source: str | None) -> str:
    return f"{source}: " if source else ""


def _describe(feature: Feature) -> str:
    if feature.kind == "dense":
        return f"a list of {feature.dim} floats (kind dense, dim {feature.dim})"
    scalar = "integers" if feature.dtype == "int64" else "strings"
    one = "an integer" if feature.dtype == "int64" else "a string"
    return (f"{one} (kind id, dtype {feature.dtype})" if feature.kind == "id"
            else f"a list of {scalar} (kind ids, dtype {feature.dtype})")


def _unwrap_dictionary(column: pa.ChunkedArray) -> pa.ChunkedArray:
    if pa.types.is_dictionary(column.type):
        return column.cast(column.type.value_type)
    return column


def _cast_feature(column: pa.ChunkedArray, feature: Feature, source) -> pa.ChunkedArray:
    column = _unwrap_dictionary(column)
    target = feature.raw_arrow_type()
    found = column.type
    ok = False
    if feature.kind == "id":
        ok = _scalar_ok(found, feature.dtype)
    else:
        is_list = (pa.types.is_list(found) or pa.types.is_large_list(found)
                   or pa.types.is_fixed_size_list(found))
        if is_list:
            item = found.value_type
            if pa.types.is_dictionary(item):
                item = item.value_type
            ok = (_scalar_ok(item, feature.dtype) if feature.kind == "ids"
                  else pa.types.is_floating(item) or pa.types.is_integer(item))
    if not ok:
        raise RawDataError(f"{_where(source)}column {feature.name!r} has type {found}, expected "
                           f"{_describe(feature)}; convert the column or fix the schema")
    if found == target:
        return column
    try:
        return column.cast(target, safe=feature.kind != "dense")
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise RawDataError(f"{_where(source)}column {feature.name!r}: cannot convert {found} to "
                           f"{target} without loss ({e})") from None


def _cast_carried(column: pa.ChunkedArray, carried: Carried, source) -> pa.ChunkedArray:
    """A carried column in its canonical type: any integer for int64, any float or integer
    for float64 (integers beyond 2**53 are refused, not rounded), string or large_string for
    string, any timestamp (naive ones are read as UTC) for timestamp; an all-null column
    of any of these. Casts never lose a value."""
    column = _unwrap_dictionary(column)
    target = carried.raw_arrow_type()
    found = column.type
    ok = pa.types.is_null(found) or {
        "int64": pa.types.is_integer,
        "float64": lambda t: pa.types.is_floating(t) or pa.types.is_integer(t),
        "string": lambda t: pa.types.is_string(t) or pa.types.is_large_string(t),
        "timestamp": pa.types.is_timestamp,
    }[carried.dtype](found)
    if not ok:
        raise RawDataError(f"{_where(source)}carried column {carried.name!r} has type {found}, "
                           f"expected {carried.dtype}; convert the column or change its dtype "
                           "in the schema's `carried:` list")
    if found == target:
        return column
    try:
        return column.cast(target, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise RawDataError(f"{_where(source)}carried column {carried.name!r}: cannot convert "
                           f"{found} to {target} without loss ({e})") from None


def _scalar_ok(found: pa.DataType, dtype: str) -> bool:
    if dtype == "int64":
        return pa.types.is_integer(found)
    return pa.types.is_string(found) or pa.types.is_large_string(found)


def _cast_label(column: pa.ChunkedArray, name: str, source) -> pa.ChunkedArray:
    column = _unwrap_dictionary(column)
    found = column.type
    if not (pa.types.is_floating(found) or pa.types.is_integer(found)
            or pa.types.is_boolean(found)):
        raise RawDataError(f"{_where(source)}label column {name!r} has type {found}, expected "
                           "numbers in [0, 1] (float, integer or bool)")
    return column if found == pa.float32() else column.cast(pa.float32(), safe=False)


def _row_problems(table: pa.Table, schema: Schema, names=None):
    """Yield one _RowProblem per check, in the order rows should be reported: missing keys
    first (a row without its keys has no place in a tree), then the other columns in schema
    order. ``names``: check only these columns."""
    key_columns = list(dict.fromkeys(k for layer in schema.layers for k in layer.key))
    wanted = (lambda name: True) if names is None else set(names).__contains__
    for name in filter(wanted, key_columns):
        column = table.column(name)
        if column.null_count:
            yield _RowProblem(_null_mask(column),
                              f"key column {name!r} {{row}}: null value; every row needs a key")
    for feature in schema.features:
        if not wanted(feature.name):
            continue
        column = table.column(feature.name)
        if column.null_count and feature.name not in key_columns:
            yield _RowProblem(_null_mask(column),
                              f"column {feature.name!r} {{row}}: null value; fill missing "
                              "values (e.g. id 0, an empty list) before compressing")
        if feature.kind in ("ids", "dense"):
            values = pc.list_flatten(column)
            if values.null_count:
                yield _RowProblem(
                    _list_rows_with_null_items(column),
                    f"column {feature.name!r} {{row}}: null inside the list; "
                    "lists may be empty but cannot hold nulls")
        if feature.kind == "dense":
            lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
            lengths = np.where(_null_mask(column), feature.dim, lengths)
            yield _RowProblem(
                lengths != feature.dim,
                f"column {feature.name!r} {{row}}: dense value has the wrong number of floats,"
                f" expected dim {feature.dim}")
            floats = pc.list_flatten(column).to_numpy(zero_copy_only=False)
            if floats.size and not np.isfinite(floats).all():
                yield _RowProblem(
                    _list_rows_with(column, ~np.isfinite(floats)),
                    f"column {feature.name!r} {{row}}: NaN or infinite value in a dense "
                    "feature")
    for label in filter(wanted, schema.labels):
        column = table.column(label)
        if column.null_count:
            yield _RowProblem(_null_mask(column),
                              f"label {label!r} {{row}}: null label; every sample needs "
                              "its labels")
        values = column.to_numpy(zero_copy_only=False).astype(np.float64)
        with np.errstate(invalid="ignore"):
            out = ~((values >= 0) & (values <= 1)) & ~_null_mask(column)
        yield _RowProblem(out, f"label {label!r} {{row}}: value out of range, labels must "
                               "be in [0, 1]")


def _null_mask(column: pa.ChunkedArray) -> np.ndarray:
    if not column.null_count:
        return np.zeros(len(column), bool)
    return pc.is_null(column).to_numpy(zero_copy_only=False)


def _list_rows_with(column: pa.ChunkedArray, value_mask: np.ndarray) -> np.ndarray:
    """Rows of a list column that hold at least one flagged value."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
    rows = np.zeros(len(column), bool)
    rows[parents[value_mask]] = True
    return rows


def _list_rows_with_null_items(column: pa.ChunkedArray) -> np.ndarray:
    column = column.combine_chunks()
    values = pc.list_flatten(column)
    return _list_rows_with(column, pc.is_null(values).to_numpy(zero_copy_only=False))
