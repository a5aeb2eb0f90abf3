"""Reading and writing samples: raw files (Parquet, CSV, JSON lines) and tree tables (nested
Parquet files, Arrow IPC messages).

Raw CSV has one column per feature, label and carried column; an ``ids`` or ``dense`` cell
holds its values separated by ``|`` (``3|17|42``; an empty cell is an empty list); a carried
timestamp cell holds ISO-8601 text. JSON lines hold one object per sample, lists as JSON arrays.
"""

from __future__ import annotations

import glob as globlib
import os
import uuid
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from compression.validate import RawDataError, validate_raw
from schemas import Schema

RAW_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "json",
               ".json": "json", ".ndjson": "json"}
LIST_SEPARATOR = "|"
DEFAULT_CHUNK_ROWS = 1 << 17


def expand_paths(path_or_glob: str | list[str]) -> list[str]:
    """Files named by a path, a directory (its ``*.parquet`` files), a glob, or a list of these."""
    if isinstance(path_or_glob, (list, tuple)):
        return [p for item in path_or_glob for p in expand_paths(item)]
    path = os.fspath(path_or_glob)
    if os.path.isdir(path):
        files = sorted(p for p in globlib.glob(os.path.join(path, "*"))
                       if os.path.splitext(p)[1] in RAW_FORMATS and
                       not os.path.basename(p).startswith(("_", ".")))
    elif any(ch in path for ch in "*?["):
        files = sorted(globlib.glob(path))
    else:
        files = [path] if os.path.exists(path) else []
    if not files:
        raise FileNotFoundError(f"no input files match {path!r}")
    return files


def raw_format(path: str, format: str | None = None) -> str:
    """``parquet``, ``csv`` or ``json``: from ``format`` if given, else the file extension."""
    if format:
        if format not in ("parquet", "csv", "json"):
            raise ValueError(f"unknown format {format!r}; expected parquet, csv or json")
        return format
    name = path[:-3] if path.endswith(".gz") else path
    ext = os.path.splitext(name)[1].lower()
    if ext not in RAW_FORMATS:
        raise ValueError(f"{path}: cannot tell the format from the extension {ext!r}; "
                         "name files .parquet, .csv or .jsonl, or pass the format explicitly")
    return RAW_FORMATS[ext]


def iter_raw_chunks(path: str, schema: Schema, format: str | None = None,
                    chunk_rows: int = DEFAULT_CHUNK_ROWS) -> Iterator[tuple[pa.Table, int]]:
    """(table, number of its first row) chunks of one raw file, not yet validated. Rows are
    numbered from 1 as editors show them: a CSV file's line number (the header is line 1), a
    JSON lines file's line number, a Parquet file's row number (see :func:`validate_raw`)."""
    fmt = raw_format(path, format)
    first = 1
    if fmt == "parquet":
        try:
            file = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:  # e.g. "Parquet file size is 0 bytes"
            raise RawDataError(f"{path}: cannot read the file as parquet: {e}") from None
        for batch in file.iter_batches(batch_size=chunk_rows):
            yield pa.Table.from_batches([batch]), first
            first += batch.num_rows
        return
    table = _read_csv(path, schema) if fmt == "csv" else _read_json(path, schema)
    first = 2 if fmt == "csv" else 1  # below the header line
    for start in range(0, max(table.num_rows, 1), chunk_rows):
        chunk = table.slice(start, chunk_rows)
        if chunk.num_rows or start == 0:
            yield chunk, first + start


def read_raw(path_or_glob: str | list[str], schema: Schema, format: str | None = None) -> pa.Table:
    """All rows of the raw files, validated and in the schema's canonical types."""
    tables = []
    for path in expand_paths(path_or_glob):
        for chunk, first in iter_raw_chunks(path, schema, format):
            tables.append(validate_raw(chunk, schema, source=path, first_row=first))
    return pa.concat_tables(tables) if tables else schema.raw_arrow_schema().empty_table()


def _read_csv(path: str, schema: Schema) -> pa.Table:
    types = {}
    for f in schema.features:
        if f.kind == "id":
            types[f.name] = pa.int64() if f.dtype == "int64" else pa.string()
        else:
            types[f.name] = pa.string()
    types.update({label: pa.float32() for label in schema.labels})
    for c in schema.carried:  # an empty string cell stays ""; timestamps are parsed below
        types[c.name] = pa.string() if c.dtype == "timestamp" else c.raw_arrow_type()
    timestamps = {c.name for c in schema.carried if c.dtype == "timestamp"}
    try:
        table = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(
            column_types=types, strings_can_be_null=False, quoted_strings_can_be_null=False))
    except pa.ArrowInvalid as e:
        raise RawDataError(f"{path}: {_csv_conversion_error(path, e, types)}") from None
    list_features = {f.name: f for f in schema.features if f.kind != "id"}
    columns = []
    for name in table.column_names:
        column = table.column(name)
        if name in list_features:
            feature = list_features[name]
            column = _split_list_cells(column, name, path)
            item = pa.float32() if feature.kind == "dense" else (
                pa.int64() if feature.dtype == "int64" else pa.string())
            try:
                column = column.cast(pa.list_(item))
            except pa.ArrowInvalid as e:
                raise RawDataError(f"{path}: {_list_cell_error(table.column(name), name, item, e)}"
                                   ) from None
        elif name in timestamps:
            column = _parse_timestamps(column, name, path)
        columns.append(column)
    return pa.Table.from_arrays(columns, names=table.column_names)


def _csv_conversion_error(path: str, error: pa.ArrowInvalid, types: dict) -> str:
    """Arrow's "In CSV column #20: CSV conversion error to int64: invalid value 'ten'" with the
    column's name and the 1-based line of the first bad cell (as editors count, header = 1)."""
    import csv
    import re

    text = str(error)
    match = re.match(r"In CSV column #(\d+): (.*)", text, re.S)
    if not match:
        return text
    try:
        with pa.input_stream(path, compression="detect") as f:  # .csv.gz too
            first = f.read(1 << 20).decode("utf-8", "replace").splitlines()[0]
        header = next(csv.reader([first]))
        name = header[int(match.group(1))]
        cells = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(
            include_columns=[name], column_types={name: pa.string()})).column(name)
    except (pa.ArrowException, IndexError, OSError, StopIteration, ValueError):
        return text
    kind = types.get(name)
    parse = float if kind is not None and pa.types.is_floating(kind) else int
    for i, cell in enumerate(cells.to_pylist()):
        try:
            parse(cell)
        except (TypeError, ValueError):
            return (f"column {name!r} line {i + 2}: invalid value {cell!r}, expected "
                    f"{'a number' if parse is float else 'an integer'} ({match.group(2)})")
    return f"column {name!r}: {match.group(2)}"


def _list_cell_error(cells: pa.ChunkedArray, name: str, item: pa.DataType,
                     error: pa.ArrowInvalid) -> str:
    """The first list cell whose values do not parse as ``item``, with its 1-based line (the
    header is line 1); Arrow's own message when no cell can be blamed."""
    what = "integers" if pa.types.is_integer(item) else "numbers"
    for i, cell in enumerate(cells.to_pylist()):
        for value in (cell or "").split(LIST_SEPARATOR):
            if not value:
                continue
            try:
                pa.array([value]).cast(item)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                return (f"column {name!r} line {i + 2}: invalid value {value!r} in the list "
                        f"{cell!r}, expected {LIST_SEPARATOR!r}-separated {what}")
    return f"column {name!r}: cells must hold {LIST_SEPARATOR!r}-separated {what} ({error})"


def _parse_timestamps(column: pa.ChunkedArray, name: str, path: str) -> pa.ChunkedArray:
    """ISO-8601 cells (an empty cell is null) as timestamps: all with a zone offset, or all
    without (then read as UTC)."""
    column = pc.if_else(pc.equal(column, ""), pa.scalar(None, pa.string()), column)
    for kind in (pa.timestamp("us", tz="UTC"), pa.timestamp("us")):
        try:
            return column.cast(kind)
        except pa.ArrowInvalid:
            continue
    raise RawDataError(f"{path}: carried column {name!r}: cells must hold ISO-8601 timestamps "
                       "(2024-05-01 12:00:00.123456), all with a zone offset or all without "
                       "(read as UTC), with at most microsecond precision")


def _split_list_cells(column: pa.ChunkedArray, name: str, path: str) -> pa.Array:
    column = column.combine_chunks()
    split = pc.split_pattern(column, LIST_SEPARATOR)
    items = split.flatten()
    keep = pc.not_equal(items, "").to_numpy(zero_copy_only=False)
    parents = pc.list_parent_indices(split).to_numpy(zero_copy_only=False)
    counts = np.bincount(parents[keep], minlength=len(split))
    offsets = np.zeros(len(split) + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), items.filter(pa.array(keep)),
                                    mask=split.is_null())


def _read_json(path: str, schema: Schema) -> pa.Table:
    raw = schema.raw_arrow_schema()
    try:
        return pajson.read_json(path, parse_options=pajson.ParseOptions(
            explicit_schema=raw, unexpected_field_behavior="infer"))
    except pa.ArrowInvalid as e:
        raise RawDataError(f"{path}: {_json_error(path, raw, e)}") from None


def _json_error(path: str, raw: pa.Schema, error: pa.ArrowInvalid) -> str:
    """Arrow's JSON error ("Column(/uid) changed from number to string in row 0", its row
    counted within a block) as the first bad line of the file, 1-based, and its column; Arrow's
    own message when no line can be blamed. Reads the file again, line by line: errors only."""
    import json

    text = str(error)
    try:
        with pa.input_stream(path, compression="detect") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
    except (pa.ArrowException, OSError):
        return text
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            sample = json.loads(line)
        except ValueError as e:
            return f"line {number}: not valid JSON ({e})"
        if not isinstance(sample, dict):
            return f"line {number}: expected a JSON object, got {type(sample).__name__}"
        for field in raw:
            value = sample.get(field.name)
            if not _json_value_fits(value, field.type):
                return (f"column {field.name!r} line {number}: invalid value "
                        f"{json.dumps(value)}, expected {_json_kind(field.type)}")
    return text


def _json_value_fits(value, kind: pa.DataType) -> bool:
    if value is None:
        return True
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or \
            pa.types.is_fixed_size_list(kind):
        return isinstance(value, list) and all(_json_value_fits(v, kind.value_type)
                                               for v in value)
    if isinstance(value, bool):
        return pa.types.is_boolean(kind)
    if pa.types.is_integer(kind):
        return isinstance(value, int)
    if pa.types.is_floating(kind):
        return isinstance(value, (int, float))
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return isinstance(value, str)
    return True  # timestamps and the rest: Arrow's own message


def _json_kind(kind: pa.DataType) -> str:
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or \
            pa.types.is_fixed_size_list(kind):
        return f"a JSON array of {_json_kind(kind.value_type).split(' ', 1)[1]}s"
    if pa.types.is_integer(kind):
        return "an integer"
    if pa.types.is_floating(kind):
        return "a number"
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "a string"
    return f"a {kind} value"


# -- tree tables --------------------------------------------------------------------------

def write_trees(trees: pa.Table, path: str, row_group_rows: int = 1 << 14,
                compression: str = "zstd") -> str:
    """Write a tree table as one nested Parquet file, atomically (temp file + rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        pq.write_table(trees, tmp, row_group_size=row_group_rows, compression=compression)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def read_trees(path_or_glob: str | list[str]) -> pa.Table:
    """All tree tables of the files named by a path, directory or glob, as one table."""
    return pa.concat_tables([pq.read_table(p) for p in expand_paths(path_or_glob)])


def iter_trees(path_or_glob: str | list[str], rows: int = 4096) -> Iterator[pa.Table]:
    """Tree tables of about ``rows`` roots from the files, one file after another (bounded
    memory, for streaming into :func:`compression.iter_batches`)."""
    for path in expand_paths(path_or_glob):
        file = pq.ParquetFile(path)
        for batch in file.iter_batches(batch_size=rows):
            yield pa.Table.from_batches([batch])


def encode_trees(trees: pa.Table) -> bytes:
    """A tree table as one Arrow IPC stream message (for Kafka)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, trees.schema) as writer:
        writer.write_table(trees)
    return sink.getvalue().to_pybytes()


def decode_trees(message: bytes) -> pa.Table:
    """The tree table of one :func:`encode_trees` message."""
    try:
        return pa.ipc.open_stream(pa.py_buffer(message)).read_all()
    except (pa.ArrowInvalid, OSError) as e:  # a truncated body is an OSError
        raise ValueError(f"not an Arrow IPC tree message ({len(message)} bytes): {e}") from None


class TreeMessageDecoder:
    """Decodes :func:`encode_trees` messages of one known tree schema.

    Every message repeats its schema; parsing it and comparing it with ``Schema.equals`` cost
    three times the rest of the decoding (measured on taobao_like messages of ~57 samples).
    This decoder compares the schema message's bytes with those of the expected schema and
    reads the record batches against the expected schema directly; a message whose schema
    bytes differ (another writer, other field metadata) takes the full path. Malformed
    messages raise ``ValueError``; the batches are fully validated (offsets within bounds), so
    nothing downstream reads out of bounds.
    """

    def __init__(self, schema: pa.Schema, name: str | None = None):
        self.schema = schema
        self.name = name  # the sample schema's name, for errors
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema):
            pass
        first = next(iter(pa.ipc.MessageReader.open_stream(sink.getvalue())))
        self._schema_metadata = first.metadata

    def __call__(self, message: bytes) -> pa.Table:
        try:
            table = self._read_known_schema(pa.py_buffer(message))
            if table is None:
                table = decode_trees(message)
                if not table.schema.equals(self.schema):
                    what = f" {self.name!r}" if self.name else " expected"
                    raise ValueError(f"tree schema does not match schema{what}: {table.schema}")
            table.validate(full=True)
            return table
        except (pa.ArrowException, OSError, EOFError) as e:  # truncated: OSError
            raise ValueError(f"not an Arrow IPC tree message ({len(message)} bytes): "
                             f"{e}") from None

    def _read_known_schema(self, buffer: pa.Buffer) -> pa.Table | None:
        """The table if the message starts with the expected schema's bytes and holds only
        record batches; None for the full path."""
        reader = pa.BufferReader(buffer)
        first = pa.ipc.read_message(reader)
        if first.type != "schema" or not first.metadata.equals(self._schema_metadata):
            return None
        batches = []
        while reader.tell() < buffer.size - 8:  # up to the 8-byte end-of-stream marker
            msg = pa.ipc.read_message(reader)
            if msg.type != "record batch":
                return None
            batches.append(pa.ipc.read_record_batch(msg, self.schema))
        return pa.Table.from_batches(batches, self.schema)
