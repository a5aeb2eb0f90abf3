"""One fuzz target per parser of outside bytes, and the verdict on what an input did.

Every target is a plain function ``target(data: bytes) -> None`` (no atheris needed): it feeds
the bytes to one parser the way a command would (a file with the right name, a Kafka message,
a snapshot directory) and checks what is cheap to check about an accepted input. Then
:func:`run_input` sorts the outcome into

- ``accepted``: the parser gave a result and it is internally consistent;
- ``refused``: the project's clean error, a ``ValueError`` (RawDataError, SchemaError,
  ConfigError, CheckpointDamagedError, native's CorruptFileError ...), which the commands'
  shared error path (``compression.cli.describe_error``) turns into one line and exit 2; for a
  file, the message must name it;
- ``finding``: anything else: another exception (RecursionError, KeyError, TypeError, an
  escaping UnicodeDecodeError, MemoryError, ...), a refusal that does not name the file, or an
  accepted input whose result is inconsistent (:class:`Inconsistent`). Crashes, sanitizer
  reports, hangs and huge memory are findings too; libFuzzer sees those (``-timeout``,
  ``-rss_limit_mb``), and in-process replays fail loudly on them.

Targets import the project lazily, so the atheris worker can import them under
``atheris.instrument_imports()``. Per-process state (the schema, a base store, a trained
trainer) is built once and cached; each execution only writes the input and parses it.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS_DIR = os.path.join(ROOT, "tests", "fuzz_corpus")

# Every input file's path contains this, so a refusal can be checked for naming its file.
INPUT_MARK = "fuzz-input"

# Every column kind the parsers know: int64 and string ids, int64 and string id lists, a dense
# vector, two labels, and carried int64 / float64 / string / timestamp columns; three layers.
SCHEMA = {
    "name": "fuzz",
    "layers": [
        {"name": "user", "key": ["uid"], "features": [
            {"name": "uid", "kind": "id"},
            {"name": "hist", "kind": "ids"},
            {"name": "tags", "kind": "ids", "dtype": "string"}]},
        {"name": "ad", "key": ["aid"], "features": [
            {"name": "aid", "kind": "id", "dtype": "string"},
            {"name": "price", "kind": "dense", "dim": 2}]},
        {"name": "sample", "features": [{"name": "pos", "kind": "id"}],
         "carried": [{"name": "row_id", "dtype": "int64"},
                     {"name": "score", "dtype": "float64"},
                     {"name": "req", "dtype": "string"},
                     {"name": "ts", "dtype": "timestamp"}]}],
    "labels": ["click", "conv"],
}
BATCH_SIZE = 3  # small, so that inputs of a few trees are split across batches


class Inconsistent(AssertionError):
    """An input was accepted but the result contradicts itself (a finding)."""


class Finding(Exception):
    """What the atheris worker raises for a finding, so libFuzzer saves the input."""


@dataclass(frozen=True)
class Target:
    name: str
    fn: Callable[[bytes], None]
    native: bool = False      # runs the C++ extension's parsing code (also fuzzed under ASan)
    names_file: bool = True   # a refusal must name the input file
    max_len: int = 16384      # libFuzzer's -max_len for this target
    doc: str = ""


@dataclass(frozen=True)
class Outcome:
    kind: str                              # "accepted", "refused" or "finding"
    error: BaseException | None = None

    def describe(self) -> str:
        if self.error is None:
            return self.kind
        return f"{self.kind}: {type(self.error).__name__}: {str(self.error)[:300]}"


def signature(error: BaseException) -> str:
    """What tells findings apart: the exception's type and the innermost frame of the
    project's code where it was raised (the cause's, for a refusal without the file name);
    for a finding of the service, what went wrong where (:attr:`ServerError.where`)."""
    import traceback

    if getattr(error, "where", None):
        return f"{type(error).__name__}/{error.where}"
    root = error.__cause__ if isinstance(error, Finding) and error.__cause__ else error
    frames = traceback.extract_tb(root.__traceback__)
    return f"{type(error).__name__}/{type(root).__name__} at {project_place(frames)}"


def project_place(frames) -> str:
    """``path:line`` of the innermost frame in the project's code (not in the installed
    packages, even with the virtualenv inside the repository), else the innermost frame."""
    ours = [f for f in frames if (f.filename.startswith(ROOT) and "site-packages" not in
                                  f.filename) or "/native/" in f.filename]
    where = (ours or frames)[-1] if (ours or frames) else None
    return f"{os.path.relpath(where.filename, ROOT)}:{where.lineno}" if where else "?"


def acceptable_refusal(error: BaseException) -> bool:
    """The project's clean errors: ValueError and its subclasses, except a UnicodeError (an
    escaping decode error names neither the file nor what to do)."""
    return isinstance(error, ValueError) and not isinstance(error, UnicodeError)


def run_input(target: Target, data: bytes) -> Outcome:
    """Run ``data`` through ``target`` and judge the outcome (see the module doc)."""
    try:
        target.fn(data)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - judging every way an input can end
        if isinstance(e, Inconsistent) or not acceptable_refusal(e):
            return Outcome("finding", e)
        if target.names_file and INPUT_MARK not in str(e):
            finding = Finding(f"the refusal does not name the input file: "
                              f"{type(e).__name__}: {e}")
            finding.__cause__ = e
            return Outcome("finding", finding)
        return Outcome("refused", e)
    return Outcome("accepted")


# -- shared per-process state ---------------------------------------------------------------

@functools.cache
def workdir() -> str:
    path = tempfile.mkdtemp(prefix="prefixrec-fuzz-")
    atexit.register(shutil.rmtree, path, True)
    return path


def input_path(name: str) -> str:
    """A fixed path for this process's input file ``fuzz-input<name>``."""
    return os.path.join(workdir(), INPUT_MARK + name)


def write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


@functools.cache
def fuzz_schema():
    import schemas

    return schemas.from_dict(SCHEMA)


# -- JSON sample messages (the native decoder) ------------------------------------------------

def json_decoder(data: bytes) -> None:
    """Kafka JSON sample messages: the input split at ``\\n`` into messages, decoded in bulk by
    ``compression.decode_json_samples`` (native ``JsonSampleDecoder``) on 1 and on 2 threads.
    Checks: every message is either a row or rejected with a reason, exactly once; the table
    is valid Arrow in the raw schema; its rows pass the file readers' row checks
    (``validate_raw``); both thread counts agree."""
    import compression
    from compression.messages import MESSAGE_INDEX

    schema = fuzz_schema()
    values = data.split(b"\n")
    table, dead = compression.decode_json_samples(values, schema, with_index=True)
    try:
        table.validate(full=True)
    except ValueError as e:
        raise Inconsistent(f"the decoder built a table that is not valid Arrow: {e}") from None
    rows = table.column(MESSAGE_INDEX).to_pylist()
    if sorted(rows + [i for i, _ in dead]) != list(range(len(values))):
        raise Inconsistent(f"rows {rows} and rejected {[i for i, _ in dead]} do not cover the "
                           f"{len(values)} messages exactly once")
    if any(not isinstance(reason, str) or not reason for _, reason in dead):
        raise Inconsistent(f"a rejected message without a reason: {dead}")
    good = table.drop_columns([MESSAGE_INDEX])
    if not good.schema.equals(schema.raw_arrow_schema()):
        raise Inconsistent(f"decoded schema {good.schema} is not the raw schema")
    try:
        compression.validate_raw(good, schema)
    except ValueError as e:
        raise Inconsistent(f"accepted rows fail the row checks: {e}") from None
    again, dead2 = compression.decode_json_samples(values, schema, with_index=True, threads=2)
    if dead2 != dead or repr(again.to_pylist()) != repr(table.to_pylist()):
        raise Inconsistent("1 and 2 decoding threads disagree")


# -- the prediction service's request envelope (the native scanner) ----------------------------

ENVELOPE_MEMBERS = ["samples", "root", "candidates"]


def request_envelope(data: bytes) -> None:
    """A prediction request body through ``native.scan_envelope`` (what ``trainer.serve``
    validates every body with, before the JSON sample decoder reads its samples' spans).
    Checks: a refusal inside a sample carries exactly the reason the JSON sample decoder gives
    that sample's bytes (so a request's sample is refused as a file or a Kafka message holding
    it is); an accepted body's spans lie inside it, in order, without overlap, each element a
    whole JSON value in which the decoder finds no syntax error; ``decode_spans`` over the
    spans equals decoding their slices."""
    import native
    from compression.messages import decoder_for

    decoder = decoder_for(fuzz_schema())
    try:
        envelope = native.scan_envelope(data, ENVELOPE_MEMBERS, max_elements=50)
    except native.MalformedJsonError as e:
        if e.reason is not None:
            got = decoder.decode([data[e.message:]]).rejected_reason
            if got != [e.reason]:
                raise Inconsistent(f"the scanner says {e.reason!r} of the message at byte "
                                   f"{e.message}, the sample decoder {got}") from None
        raise
    for name in ENVELOPE_MEMBERS:
        spans = envelope.members.get(name)
        if spans is None:
            continue
        if not envelope.is_object or not 0 < spans.start < spans.end <= len(data):
            raise Inconsistent(f"member {name!r} at [{spans.start}, {spans.end}) of "
                               f"{len(data)} bytes")
        if not spans.is_array:
            continue
        starts, ends = spans.starts.tolist(), spans.ends.tolist()
        if len(starts) != min(spans.count, 50) or data[spans.start:spans.start + 1] != b"[":
            raise Inconsistent(f"member {name!r}: {len(starts)} spans of {spans.count} "
                               "elements")
        edges = [spans.start] + [x for pair in zip(starts, ends) for x in pair] + [spans.end]
        if edges != sorted(edges) or any(a == b for a, b in zip(starts, ends)):
            raise Inconsistent(f"member {name!r}: element spans {list(zip(starts, ends))} "
                               f"out of order in [{spans.start}, {spans.end})")
        out = decoder.decode_spans(data, spans.starts, spans.ends)
        sliced = decoder.decode([data[a:b] for a, b in zip(starts, ends)])
        if out.rejected_reason != sliced.rejected_reason or \
                out.rejected_index.tolist() != sliced.rejected_index.tolist():
            raise Inconsistent("decode_spans and decoding the slices disagree")
        syntax = [r for r in out.rejected_reason if r.startswith("not a valid sample: not JSON")]
        if syntax:
            raise Inconsistent(f"an element the scanner accepted is not JSON: {syntax[0]}")


# -- raw sample files ------------------------------------------------------------------------

def _raw_file(data: bytes, extension: str) -> None:
    import compression

    schema = fuzz_schema()
    path = write(input_path(extension), data)
    table = compression.read_raw(path, schema)
    try:
        table.validate(full=True)
    except ValueError as e:
        raise Inconsistent(f"read_raw accepted a table that is not valid Arrow: {e}") from None
    if [f.type for f in table.schema] != [f.type for f in schema.raw_arrow_schema()] or \
            table.column_names != schema.raw_arrow_schema().names:
        raise Inconsistent(f"read_raw gave {table.schema}, not the raw schema")
    trees = compression.build_trees(table, schema, validate=False)
    if compression.flatten(trees, schema).num_rows != table.num_rows:
        raise Inconsistent("the trees of the accepted rows do not flatten to as many rows")


def csv_file(data: bytes) -> None:
    """A raw CSV file through ``compression.read_raw`` (reader + validate_raw), then trees."""
    _raw_file(data, ".csv")


def parquet_file(data: bytes) -> None:
    """A raw Parquet file through ``compression.read_raw``, then trees."""
    _raw_file(data, ".parquet")


def jsonl_file(data: bytes) -> None:
    """A raw JSON lines file through ``compression.read_raw``, then trees."""
    _raw_file(data, ".jsonl")


# -- tree tables -----------------------------------------------------------------------------

def _leaves(table) -> int:
    import pyarrow.compute as pc

    schema = fuzz_schema()
    lists = table.column(schema.layers[1].name)
    for layer in schema.layers[2:]:
        lists = pc.struct_field(pc.list_flatten(lists), layer.name)
    return len(pc.list_flatten(lists))


def check_batches(tables) -> None:
    """Batch tree tables; every batch must pass ``TreeBatch.check`` (parents in range, one
    value per node) and the leaves must add up to the tables' leaves."""
    import numpy as np

    import compression

    schema = fuzz_schema()
    seen, leaves = [], 0

    def counted():
        for table in tables:
            seen.append(table)
            yield table

    for batch in compression.iter_batches(counted(), schema, BATCH_SIZE):
        try:
            batch.check()
        except ValueError as e:
            raise Inconsistent(f"an accepted tree table gave an inconsistent batch: {e}") \
                from None
        if not 0 < batch.num_leaves <= BATCH_SIZE:
            raise Inconsistent(f"a batch of {batch.num_leaves} leaves (batch size {BATCH_SIZE})")
        for layer in batch.layers:
            for name, array in layer.features.items():
                if isinstance(array, tuple):
                    values, offsets = array
                    if offsets[0] != 0 or offsets[-1] != len(values) or \
                            np.any(np.diff(offsets) < 0):
                        raise Inconsistent(f"feature {name!r}: offsets do not index its values")
                elif array.ndim == 2 and array.shape[1] != schema.feature(name).dim:
                    raise Inconsistent(f"dense feature {name!r} of shape {array.shape}")
        leaves += batch.num_leaves
    expected = sum(_leaves(t) for t in seen)
    if leaves != expected:
        raise Inconsistent(f"the batches hold {leaves} leaves, the tree tables {expected}")


def tree_parquet(data: bytes) -> None:
    """A tree Parquet file (what the compress jobs write) read as the trainer reads it
    (``compression.iter_trees``), then batched."""
    import compression

    path = write(input_path(".parquet"), data)
    check_batches(compression.iter_trees(path, rows=2, schema=fuzz_schema()))


@functools.cache
def _tree_decoder():
    import compression

    schema = fuzz_schema()
    return compression.TreeMessageDecoder(schema.tree_arrow_schema(), schema.name)


def tree_ipc(data: bytes) -> None:
    """An Arrow IPC tree message (the streaming job's Kafka output) through
    ``compression.TreeMessageDecoder``, then batched."""
    check_batches([_tree_decoder()(data)])


# -- the native embedding store --------------------------------------------------------------

_MASK = (1 << 64) - 1
_P1, _P2 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F
END_MAGIC = b"PRXEND01"
TRAILER_BYTES = 16


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _MASK


def _mix64(x: int) -> int:
    import numpy as np

    from schemas.hashing import mix64

    return int(mix64(np.uint64(x & _MASK)))


def store_checksum(body: bytes) -> int:
    """The store files' 64-bit checksum (native/src/internal/hash.h ``Checksum``) of ``body``,
    so a target can seal mutated bytes and reach the checks behind the checksum."""
    lanes = [0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89]
    full = len(body) - len(body) % 32
    for off in range(0, full, 32):
        for lane in range(4):
            word = int.from_bytes(body[off + lane * 8: off + lane * 8 + 8], "little")
            lanes[lane] = (_rotl((lanes[lane] + word * _P2) & _MASK, 31) * _P1) & _MASK
    h = (_rotl(lanes[0], 1) + _rotl(lanes[1], 7) + _rotl(lanes[2], 12) +
         _rotl(lanes[3], 18)) & _MASK
    h ^= (len(body) * _P2) & _MASK
    for i, byte in enumerate(body[full:]):
        h = _mix64(h ^ (byte << ((i % 8) * 8)) ^ i)
    return _mix64(h)


def sealed_store_file(body: bytes) -> bytes:
    return body + store_checksum(body).to_bytes(8, "little") + END_MAGIC


def store_file(data: bytes) -> bytes:
    """The file a store target writes: the first byte chooses the bytes as they are (even) or
    the rest sealed with a valid checksum and end marker (odd)."""
    if data and data[0] & 1:
        return sealed_store_file(data[1:])
    return data[1:]


STORE_DIM = 2


def _store_config(filter_kind: int = 0):
    import native

    filters = [native.CounterFilter(2), native.CountingBloomFilter(1, 16)]
    return native.StoreConfig(dim=STORE_DIM, optimizer=native.Adagrad(0.05),
                              entry_filter=filters[filter_kind % 2], seed=2, num_shards=2)


def train_store(store, steps) -> None:
    """Deterministic rows, optimizer and filter state (ids seen once) and a tombstone."""
    import numpy as np

    for step in steps:
        ids = [1, 2, 3, 4, 5, 6, 3, 4, 5, 100 + step]
        unique, _, _ = store.lookup_unique(ids, now=1000.0 + step)
        grads = np.full((len(unique), store.dim), 0.1 * step, np.float32)
        store.apply_gradients(unique, grads, step, now=1000.0 + step)
    store.expire_where(lambda ids, *_: ids == 6)


@functools.cache
def store_base() -> tuple[str, bytes, bytes]:
    """(directory of a snapshot, its bytes, the bytes of the delta that follows it)."""
    import native

    store = native.EmbeddingStore(_store_config())
    train_store(store, range(1, 4))
    base = os.path.join(workdir(), "store-base")
    snapshot = store.save(base)
    train_store(store, range(4, 6))
    delta = store.export_delta(os.path.join(workdir(), "store-deltas"))
    with open(snapshot, "rb") as f, open(delta, "rb") as g:
        return base, f.read(), g.read()


def check_store(store) -> None:
    """A loaded store must read back what it holds: unique ids, one row of ``dim`` values per
    id, and non-training lookups of its ids equal to its rows."""
    import numpy as np

    rows = store.to_numpy()
    ids, values = rows["ids"], rows["values"]
    if len(ids) != len(store) or len(np.unique(ids)) != len(ids):
        raise Inconsistent(f"{len(store)} rows but ids {ids}")
    if values.shape != (len(ids), store.dim):
        raise Inconsistent(f"values of shape {values.shape} for {len(ids)} rows")
    if len(ids) and store.lookup(ids, train=False).tobytes() != values.tobytes():
        raise Inconsistent("lookups do not read the loaded rows")
    store.stats()


def store_snapshot(data: bytes) -> None:
    """A snapshot directory whose ``store.snapshot`` is the input (see :func:`store_file`),
    loaded with ``native.EmbeddingStore.load``."""
    import native

    directory = input_path("-store")
    os.makedirs(directory, exist_ok=True)
    write(os.path.join(directory, "store.snapshot"), store_file(data))
    check_store(native.EmbeddingStore.load(directory))


def store_delta(data: bytes) -> None:
    """A delta file (see :func:`store_file`) read with ``store.read_delta`` and applied with
    ``store.apply_delta`` to the snapshot it follows: both refuse the same files, and what
    read_delta reads is what apply_delta applies."""
    import numpy as np

    import native

    base, _, _ = store_base()
    store = native.EmbeddingStore.load(base)
    path = write(input_path("-delta-000001.bin"), store_file(data))
    before = store.to_numpy()
    try:
        contents = store.read_delta(path)
    except ValueError:
        contents = None
    try:
        store.apply_delta(path)
    except ValueError:
        after = store.to_numpy()
        if any(before[k].tobytes() != after[k].tobytes() for k in before):
            raise Inconsistent("a refused delta changed the store") from None
        if contents is not None:
            raise Inconsistent("read_delta accepted a delta apply_delta refused") from None
        raise
    if contents is None:
        raise Inconsistent("read_delta refused a delta apply_delta applied")
    if len(contents["ids"]) and not np.array_equal(  # bit for bit: NaNs are rows too
            store.lookup(contents["ids"], train=False).view(np.uint32),
            contents["rows"].view(np.uint32)):
        raise Inconsistent("the rows read_delta read are not the rows apply_delta applied")
    if set(contents["tombstones"].tolist()) & set(store.to_numpy()["ids"].tolist()):
        raise Inconsistent("an id read_delta reads as removed is still in the store")
    check_store(store)


def store_rebase(data: bytes) -> None:
    """A snapshot (see :func:`store_file`) taken in by a store of another lineage with
    ``store.write_rebase_delta``: it refuses what ``EmbeddingStore.load`` refuses (writing
    nothing), accepts what load accepts for a store of its dim and optimizer, and the delta
    it writes, applied, leaves the store holding exactly the loaded snapshot's rows."""
    import numpy as np

    import native

    base, _, _ = store_base()
    store = native.EmbeddingStore.load(base)
    train_store(store, range(4, 6))  # rows the snapshot may hold otherwise, or not at all
    directory = input_path("-rebase")
    os.makedirs(directory, exist_ok=True)
    write(os.path.join(directory, "store.snapshot"), store_file(data))
    out = input_path("-rebase.bin")
    if os.path.exists(out):
        os.remove(out)
    try:
        loaded = native.EmbeddingStore.load(directory)
    except ValueError:
        loaded = None
    try:
        stats = store.write_rebase_delta(directory, out)
    except ValueError:
        if os.path.exists(out):
            raise Inconsistent("a refused rebase left its delta behind") from None
        if loaded is not None and loaded.dim == store.dim and type(
                loaded.config.optimizer) is type(store.config.optimizer):
            raise Inconsistent("write_rebase_delta refused a snapshot load accepts") from None
        raise
    if loaded is None:
        raise Inconsistent("write_rebase_delta accepted a snapshot load refuses")
    contents = store.read_delta(out)
    if contents["rebase"] != loaded.stats().delta_sequence or stats["rows"] != len(
            contents["ids"]):
        raise Inconsistent(f"rebase delta reads as {contents['rebase']}, {len(contents['ids'])}"
                           f" rows; wrote {stats}")
    store.apply_delta(out)
    mine, theirs = store.to_numpy(), loaded.to_numpy()
    a, b = np.argsort(mine["ids"]), np.argsort(theirs["ids"])
    for name in ("ids", "values", "state", "update_counts", "last_steps", "last_times"):
        if mine[name][a].tobytes() != theirs[name][b].tobytes():
            raise Inconsistent(f"after the rebase the store's {name} differ from the snapshot's")
    check_store(store)


# -- quantized exports ---------------------------------------------------------------------

@functools.cache
def quantized_base() -> tuple[str, bytes, bytes]:
    """(directory of the int8 quantized snapshot of :func:`store_base`'s snapshot, its bytes,
    the bytes of the quantized delta that follows it)."""
    from native import quantized

    base, _, delta = store_base()
    directory = os.path.join(workdir(), "quantized-base")
    quantized.quantize_snapshot(base, os.path.join(directory, quantized.SNAPSHOT_FILE), "int8")
    float_delta = write(os.path.join(workdir(), "quantized-float-delta.bin"), delta)
    out = os.path.join(workdir(), "quantized-delta-000001.bin")
    quantized.quantize_delta(float_delta, out, "int8")
    with open(os.path.join(directory, quantized.SNAPSHOT_FILE), "rb") as f, \
            open(out, "rb") as g:
        return directory, f.read(), g.read()


def check_quantized(table, contents: dict) -> None:
    """A loaded quantized table must serve what its file holds: ascending unique ids, and
    lookups of them equal to the file's dequantized rows, finite."""
    import numpy as np

    ids, rows = contents["ids"], contents["rows"]
    if len(ids) != len(table) or (len(ids) > 1 and not (np.diff(ids) > 0).all()):
        raise Inconsistent(f"{len(table)} rows but ids {ids}")
    if rows.shape != (len(ids), table.dim):
        raise Inconsistent(f"rows of shape {rows.shape} for {len(ids)} ids")
    got = table.lookup(ids)
    if got.tobytes() != rows.tobytes() or not np.isfinite(got).all():
        raise Inconsistent("lookups do not read the file's rows (or read non-finite values)")
    table.stats()


def quantized_snapshot(data: bytes) -> None:
    """A quantized snapshot (``store.quantized``, see :func:`store_file`) loaded with
    ``native.QuantizedStore.load``; ``read_quantized_snapshot`` must agree with it."""
    import native
    from native import quantized

    directory = input_path("-quantized")
    os.makedirs(directory, exist_ok=True)
    path = write(os.path.join(directory, quantized.SNAPSHOT_FILE), store_file(data))
    try:
        contents = quantized.read_quantized_snapshot(path)
    except ValueError:
        contents = None
    try:
        table = native.QuantizedStore.load(directory)
    except ValueError:
        if contents is not None:
            raise Inconsistent("read_quantized_snapshot accepted a file load refused") from None
        raise
    if contents is None:
        raise Inconsistent("load accepted a file read_quantized_snapshot refused")
    check_quantized(table, contents)


def quantized_delta(data: bytes) -> None:
    """A quantized delta (see :func:`store_file`) read with ``read_delta`` and applied with
    ``apply_delta`` to the quantized snapshot it follows: both refuse the same files (a refused
    one changes nothing), and what read_delta reads is what apply_delta applied."""
    import numpy as np

    import native

    base, _, _ = quantized_base()
    table = native.QuantizedStore.load(base)
    path = write(input_path("-qdelta-000001.bin"), store_file(data))
    probe = np.arange(-10, 120, dtype=np.int64)
    before = table.lookup(probe).tobytes(), len(table)
    try:
        contents = table.read_delta(path)
    except ValueError:
        contents = None
    try:
        table.apply_delta(path)
    except ValueError:
        if (table.lookup(probe).tobytes(), len(table)) != before:
            raise Inconsistent("a refused delta changed the table") from None
        if contents is not None:
            raise Inconsistent("read_delta accepted a delta apply_delta refused") from None
        raise
    if contents is None:
        raise Inconsistent("read_delta refused a delta apply_delta applied")
    if table.lookup(contents["ids"]).tobytes() != contents["rows"].tobytes():
        raise Inconsistent("the rows read_delta read are not the rows apply_delta applied")
    if len(contents["tombstones"]) and table.lookup(contents["tombstones"]).any():
        raise Inconsistent("an id read_delta reads as removed still has a row")
    if table.stats().delta_sequence != (contents["rebase"] if contents["rebase"] is not None
                                        else contents["sequence"]):
        raise Inconsistent("the table's sequence is not the delta's")


# -- trainer checkpoints ---------------------------------------------------------------------

CHECKPOINT_SCHEMA = {"name": "fuzz_ckpt", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"}]},
    {"name": "sample", "key": ["sid"], "features": [{"name": "sid", "kind": "id"}]}]}
CHECKPOINT_CONFIG = {"batch_size": 40, "seed": 7, "threads": 1,
                     "embedding": {"dim": 2, "optimizer": {"name": "adagrad", "lr": 0.3}}}
CHECKPOINT_FILES = ("trainer.json", "dense.npz", "state.json")


@functools.cache
def checkpoint_base():
    """(live trainer, run directory, {file: intact bytes}, checkpoint path): a small trainer
    saved once per process through CheckpointManager, as the online trainer does."""
    import pyarrow as pa

    import compression
    import schemas
    from trainer import models
    from trainer.checkpoints import CheckpointManager
    from trainer.config import TrainConfig
    from trainer.trainer import Trainer

    schema = schemas.from_dict(CHECKPOINT_SCHEMA)
    trainer = Trainer(schema, models.MLP(hidden=(3,)), TrainConfig.from_dict(CHECKPOINT_CONFIG))
    rows = [{"uid": sid % 11, "sid": sid, "click": float(sid % 3 == 0)} for sid in range(80)]
    table = pa.Table.from_pylist(rows).cast(schema.raw_arrow_schema())
    for batch in compression.iter_batches(compression.build_trees(table, schema), schema, 40):
        trainer.train_batch(batch)
    _pin_dense_values(trainer)
    run = input_path("-run")
    saved = CheckpointManager(run).save(lambda d: trainer.save(os.path.join(d, "model")),
                                        {"step": trainer.step, "offsets": {"0": 80}})
    files = {}
    for name in CHECKPOINT_FILES:
        with open(_checkpoint_file(saved.path, name), "rb") as f:
            files[name] = f.read()
    return trainer, run, files, saved.path


def _pin_dense_values(trainer) -> None:
    """Overwrite the trained floats of the dense weights and the optimizer's slots with values
    made without TensorFlow arithmetic. The kept seeds carry the sha256 of ``dense.npz``, and
    TensorFlow's results differ in the last bit from one CPU to another (an Intel Xeon and an
    AMD EPYC gave two hashes): a base checkpoint made of trained floats would be refused as
    damaged on every machine but the one that made the corpus. The optimizer's step count and
    learning rate are the same everywhere and stay as they are."""
    import numpy as np

    for index, variable in enumerate(trainer._dense_variables()):
        dtype = np.dtype(str(variable.dtype))
        if dtype.kind != "f" or variable.path.endswith("learning_rate"):
            continue
        shape = tuple(variable.shape)
        # small multiples of 1/64 (exact in float32), non-negative so that second-moment
        # slots stay valid
        pattern = (np.arange(int(np.prod(shape)), dtype=np.int64) * 7 + index) % 13
        variable.assign((pattern / 64).astype(dtype).reshape(shape))


def _checkpoint_file(path: str, name: str) -> str:
    return os.path.join(path, name) if name == "state.json" else os.path.join(path, "model", name)


def _resealed_json(text: bytes, **changes) -> bytes:
    """``text`` parsed, changed, and sealed with a valid checksum; unparsable text as it is."""
    from trainer.checkpoints import CHECKSUM_KEY, sealed

    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    if not isinstance(value, dict):
        return text
    value.pop(CHECKSUM_KEY, None)
    value.update(changes)
    try:
        return json.dumps(sealed(value)).encode()
    except (ValueError, TypeError, RecursionError):
        return text


def _trainer_fingerprint(trainer) -> bytes:
    digest = hashlib.sha256()
    for v in [*trainer.network.variables, *trainer.network.optimizer.variables]:
        digest.update(v.numpy().tobytes())
    digest.update(repr((trainer.step, trainer.samples, id(trainer.config),
                        sorted((t, id(s)) for t, s in trainer.stores.items()))).encode())
    return digest.digest()


def checkpoint(data: bytes) -> None:
    """A trainer checkpoint found by ``CheckpointManager.latest`` and loaded into a live
    trainer with ``Trainer.load``. The first byte picks the file the rest replaces:
    0 trainer.json as it is; 1 trainer.json sealed with a valid checksum (to reach the checks
    behind it); 2 dense.npz, with trainer.json resealed to its sha256; 3 the manager's
    state.json. A refused checkpoint must leave the live trainer as it was."""
    from trainer.checkpoints import CheckpointManager

    trainer, run, files, path = checkpoint_base()
    mode, body = (data[0] % 4, data[1:]) if data else (0, b"")
    contents = dict(files)
    if mode == 0:
        contents["trainer.json"] = body
    elif mode == 1:
        contents["trainer.json"] = _resealed_json(body)
    elif mode == 2:
        contents["dense.npz"] = body
        state = json.loads(files["trainer.json"])
        state["checksums"] = {"dense.npz": hashlib.sha256(body).hexdigest()}
        contents["trainer.json"] = _resealed_json(json.dumps(state).encode())
    else:
        contents["state.json"] = body
    for name, blob in contents.items():
        write(_checkpoint_file(path, name), blob)
    before = _trainer_fingerprint(trainer)
    try:
        latest = CheckpointManager(run).latest()
        if latest is None:
            raise Inconsistent("the saved checkpoint is not found")
        trainer.load(os.path.join(latest.path, "model"))
    except Exception:
        if _trainer_fingerprint(trainer) != before:
            raise Inconsistent("a refused checkpoint changed the live trainer") from None
        raise


# -- YAML files ------------------------------------------------------------------------------

def schema_yaml(data: bytes) -> None:
    """A schema YAML file through ``schemas.load``; an accepted schema must survive its own
    ``to_yaml`` and give its Arrow schemas."""
    import yaml

    import schemas

    schema = schemas.load(write(input_path(".yaml"), data))
    again = schemas.from_dict(yaml.safe_load(schema.to_yaml()))
    if again != schema:
        raise Inconsistent(f"{schema} does not survive to_yaml: {again}")
    schema.raw_arrow_schema()
    schema.tree_arrow_schema()


def config_yaml(data: bytes) -> None:
    """A training config YAML file through ``TrainConfig.load``, then checked against the
    fuzz schema (``TrainConfig.check``, as the commands do); an accepted config must survive
    ``to_dict``."""
    from trainer.config import TrainConfig

    from trainer.config import ConfigError

    path = write(input_path(".yaml"), data)
    config = TrainConfig.load(path)
    again = TrainConfig.from_dict(config.to_dict())
    if again != config:
        raise Inconsistent(f"{config} does not survive to_dict: {again}")
    try:
        config.check(fuzz_schema())
    except ConfigError as e:  # names the schema, as trainer.train reports it: a clean refusal
        raise ConfigError(f"{path} against the schema {fuzz_schema().name!r}: {e}") from None


# -- the prediction service ------------------------------------------------------------------

# A string id in each layer, so the request tables' string paths are reached too.
SERVE_SCHEMA = {"name": "fuzz_serve", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [
        {"name": "uid", "kind": "id"}, {"name": "city", "kind": "id", "dtype": "string"}]},
    {"name": "ad", "key": ["aid"], "features": [
        {"name": "aid", "kind": "id"}, {"name": "tags", "kind": "ids", "dtype": "string"},
        {"name": "price", "kind": "dense", "dim": 1}]}]}
SERVE_CONFIG = {"batch_size": 40, "seed": 5, "threads": 1,
                "embedding": {"dim": 2, "optimizer": {"name": "adagrad", "lr": 0.3}}}
SERVE_REPEAT_MAX = 200_000   # a generated body's repeat count is capped here (mode 2)
SERVE_SEGMENT = 4096         # bytes handed to the protocol per data_received, as TCP reads
SERVE_DEADLINE = 20.0        # seconds an exchange may take before it is a hang (a finding)
_CONTENT_TYPES = (b"application/json", None, b"text/plain",
                  b"application/json; charset=latin-1")


class ServerError(Exception):
    """The service answered 5xx, logged or printed a traceback, or its HTTP protocol code
    raised or hung (a finding). ``where``: what and where, to tell findings apart."""

    def __init__(self, message: str, where: str):
        super().__init__(message)
        self.where = where


class RefusedRequest(ValueError):
    """The service refused the request: a 4xx answer, or no answer because the request never
    arrived whole (a clean refusal)."""


def serve_request_bytes(data: bytes) -> tuple[bytes, bool]:
    """What the ``serve_request`` target sends for an input, and whether the client then
    half-closes its side of the connection. The first byte ``m`` says how to read the rest:

    - ``m & 3`` 0: the rest as it is: raw HTTP/1.1 (request lines, headers, any framing,
      pipelined requests);
      1: the rest is the body of ``POST /v1/predict``;
      2: the body is generated: the rest is a 3-byte big-endian count ``n`` (at most
      200,000) and up to four parts ``a, b, c, d`` separated by NUL bytes, the body
      ``a + b * n + c * n + d`` (100,000 nested ``[`` from 6 bytes);
      3: the rest is extra header lines, a NUL, then the body of ``POST /v1/predict``;
    - ``m & 4``: the body is sent chunked (``Transfer-Encoding: chunked``, chunks of 1, 2,
      4 ... bytes) instead of with ``Content-Length``;
    - ``m & 8``: the body is cut in half (the headers announce all of it; chunked: no end);
    - ``m & 16``: the client half-closes after sending (else it keeps the connection open
      until the service has nothing left to do, then drops it);
    - ``(m >> 5) & 3``: ``Content-Type``: application/json, none, text/plain,
      application/json; charset=latin-1;
    - ``m & 128``: ``Expect: 100-continue``.
    """
    if not data:
        return b"", False
    m, rest = data[0], data[1:]
    kind, half_close = m & 3, bool(m & 16)
    if kind == 0:
        return rest, half_close
    extra = b""
    if kind == 2:
        count = min(int.from_bytes(rest[:3], "big"), SERVE_REPEAT_MAX)
        a, b, c, d = (rest[3:].split(b"\0", 3) + [b""] * 4)[:4]
        body = a + b * count + c * count + d
    elif kind == 3:
        extra, _, body = rest.partition(b"\0")
        if extra and not extra.endswith(b"\r\n"):
            extra += b"\r\n"
    else:
        body = rest
    headers = b"POST /v1/predict HTTP/1.1\r\nHost: fuzz\r\n"
    content_type = _CONTENT_TYPES[(m >> 5) & 3]
    if content_type is not None:
        headers += b"Content-Type: " + content_type + b"\r\n"
    if m & 128:
        headers += b"Expect: 100-continue\r\n"
    cut = bool(m & 8)
    if m & 4:
        headers += b"Transfer-Encoding: chunked\r\n"
        chunks, at, size = [], 0, 1
        while at < len(body):
            chunks.append(b"%x\r\n%s\r\n" % (len(body[at:at + size]), body[at:at + size]))
            at, size = at + size, min(size * 2, 8192)
        framed = b"".join(chunks)
        framed = framed[:len(framed) // 2] if cut else framed + b"0\r\n\r\n"
    else:
        headers += b"Content-Length: %d\r\n" % len(body)
        framed = body[:len(body) // 2] if cut else body
    return headers + extra + b"\r\n" + framed, half_close


class _Transport:
    """An in-memory asyncio transport between the client (this harness) and uvicorn's HTTP
    protocol object: what the service writes is kept; the service closing it ends in the
    protocol's ``connection_lost`` on the next loop turn, as a socket transport does; the
    client leaving (:meth:`drop`) at once."""

    def __init__(self, loop):
        self.loop, self.protocol = loop, None
        self.written = bytearray()
        self.closing = self.lost = False
        self.reading = True

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8500),
                "peername": ("127.0.0.1", 40000)}.get(name, default)

    def write(self, data) -> None:
        if not self.lost:
            self.written += data

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            self.loop.call_soon(self._lose)

    def abort(self) -> None:
        self.close()

    def drop(self) -> None:
        """The client goes away."""
        self.closing = True
        self._lose()

    def _lose(self) -> None:
        if not self.lost:
            self.lost = True
            self.protocol.connection_lost(None)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def set_protocol(self, protocol) -> None:
        self.protocol = protocol

    def get_protocol(self):
        return self.protocol

    def get_write_buffer_size(self) -> int:
        return 0

    def can_write_eof(self) -> bool:
        return False


class _Exchange:
    """What the app saw and said on one connection: per request (in order) its method, path,
    body and the status it answered while the client was still there; and which requests'
    tasks are blocked waiting for more of their body."""

    def __init__(self):
        self.calls: list[dict] = []
        self.waiting: dict = {}  # task -> the uvicorn request cycle it waits on


class HttpHarness:
    """An ASGI app behind uvicorn's HTTP protocol class (the one ``trainer.serve.run`` gets),
    configured as ``trainer.serve.run`` configures it, on an event loop of its own; one
    in-memory connection per :meth:`talk`."""

    def __init__(self, app):
        import asyncio

        import uvicorn
        from uvicorn.server import ServerState

        self.exchange = _Exchange()

        async def watched(scope, receive, send):
            """The app, noting per request what the harness needs to judge the answers."""
            if scope["type"] != "http":
                return await app(scope, receive, send)
            exchange = self.exchange
            call = {"method": scope["method"], "path": scope["path"], "body": bytearray(),
                    "status": None}
            exchange.calls.append(call)
            cycle = getattr(receive, "__self__", None)

            async def receive_watched():
                task = asyncio.current_task()
                exchange.waiting[task] = cycle
                try:
                    message = await receive()
                finally:
                    exchange.waiting.pop(task, None)
                if message["type"] == "http.request":
                    call["body"] += message.get("body", b"")
                return message

            async def send_watched(message):
                if message["type"] == "http.response.start" and not getattr(
                        cycle, "disconnected", False):
                    call["status"] = message["status"]
                await send(message)

            await app(scope, receive_watched, send_watched)

        # as trainer.serve.run configures uvicorn, without its logging set-up: this process'
        # logging stays as it was, and the harness reads the records itself
        self.config = uvicorn.Config(watched, log_level="warning", access_log=False,
                                     timeout_graceful_shutdown=30, lifespan="off",
                                     log_config=None)
        self.config.load()
        self.state = ServerState()
        self.state.default_headers = [(b"date", b"Thu, 01 Jan 2026 00:00:00 GMT"),
                                      *self.config.encoded_headers]
        self.loop = asyncio.new_event_loop()
        atexit.register(self.loop.close)

    def quiet(self) -> bool:
        """Nothing will happen without more bytes from the client: every request task is done
        or blocked waiting for more of its body."""
        for task in self.state.tasks:
            if task.done():
                continue
            if task not in self.exchange.waiting:
                return False
            cycle = self.exchange.waiting[task]
            event = getattr(cycle, "message_event", None)
            if event is not None and event.is_set():
                return False
        return True

    async def talk(self, payload: bytes, half_close: bool) -> _Transport:
        import asyncio

        loop = asyncio.get_running_loop()
        deadline = loop.time() + SERVE_DEADLINE
        transport = _Transport(loop)
        protocol = self.config.http_protocol_class(config=self.config,
                                                   server_state=self.state, app_state={},
                                                   _loop=loop)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)

        async def step(what: str):
            if loop.time() > deadline:
                for task in self.state.tasks:
                    task.cancel()
                transport.drop()
                raise ServerError(f"no progress in {SERVE_DEADLINE:.0f} s while {what}",
                                  f"hang while {what}")
            await asyncio.sleep(0.0005)  # threads finish scoring meanwhile

        try:
            at = 0
            while at < len(payload) and not transport.closing:
                if not transport.reading:  # pipelining or a body past the high-water mark
                    if self.quiet():
                        break  # the service waits for nothing it could read: give up
                    await step("the service had reading paused")
                    continue
                protocol.data_received(payload[at:at + SERVE_SEGMENT])
                at += SERVE_SEGMENT
                await asyncio.sleep(0)
            if half_close and not transport.closing and not protocol.eof_received():
                transport.close()  # what a socket transport does when the protocol says so
            while not transport.lost and not self.quiet():
                await step("answering")
            transport.drop()
            while any(not t.done() for t in self.state.tasks):
                await step("finishing after the client left")
        except ServerError:
            raise
        except Exception as e:  # noqa: BLE001 - an asyncio transport logs these as fatal
            transport.drop()
            raise ServerError(f"the HTTP protocol raised {type(e).__name__}: {e}",
                              signature(e)) from e
        return transport


@functools.cache
def serve_base() -> HttpHarness:
    """The prediction service the ``serve_request`` target talks to: ``build_app`` over a
    LiveModel of a small model of :data:`SERVE_SCHEMA`, trained and exported once per
    process."""
    import pyarrow as pa

    import compression
    import schemas
    from trainer import models
    from trainer.config import TrainConfig
    from trainer.live import LiveModel
    from trainer.serve import build_app
    from trainer.serving import export_increment
    from trainer.trainer import Trainer

    schema = schemas.from_dict(SERVE_SCHEMA)
    trainer = Trainer(schema, models.MLP(hidden=(3,)), TrainConfig.from_dict(SERVE_CONFIG))
    rows = [{"uid": i % 7, "city": ("paris", "lyon", "")[i % 3], "aid": i % 11,
             "tags": ["a", "b", "é"][: i % 4], "price": [float(i % 5)],
             "click": float(i % 3 == 0)} for i in range(80)]
    table = pa.Table.from_pylist(rows).cast(schema.raw_arrow_schema())
    for batch in compression.iter_batches(compression.build_trees(table, schema), schema, 40):
        trainer.train_batch(batch)
    export = os.path.join(workdir(), "serve-export")
    export_increment(trainer, export)
    live = LiveModel(export)
    atexit.register(live.close)
    return HttpHarness(build_app(live))


def _http_answers(written: bytes, calls: list[dict]) -> list[tuple[int, dict, bytes]]:
    """``(status, headers, body)`` of every answer in what the service wrote before the
    connection closed, read as an HTTP/1.1 client reads it (h11, the methods the requests
    had: a HEAD answer has no body); :class:`Inconsistent` if it is not well-formed HTTP."""
    import h11

    client = h11.Connection(h11.CLIENT)

    def ask(i):
        method = calls[i]["method"] if i < len(calls) else "GET"
        client.send(h11.Request(method=method, target="/",
                                headers=[("Host", "fuzz"), ("Content-Length", "0")]))
        client.send(h11.EndOfMessage())

    answers, response, body = [], None, bytearray()
    if not written:
        return answers
    ask(0)
    client.receive_data(bytes(written))
    closed = False
    while True:
        try:
            event = client.next_event()
        except h11.RemoteProtocolError as e:
            raise Inconsistent(f"the service's bytes are not well-formed HTTP/1.1 after "
                               f"{len(answers)} whole answers: {e}: "
                               f"{bytes(written)[:300]!r}") from None
        if event is h11.NEED_DATA:
            if closed or (response is None and not client.trailing_data[0]):
                break  # every byte read, between answers (a 100 Continue may end it)
            # the connection is closed by now: h11 calls an answer cut short a protocol
            # error, and reads an answer without a length to the end
            client.receive_data(b"")
            closed = True
            continue
        if event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
            break
        if isinstance(event, h11.Response):
            response, body = event, bytearray()
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in response.headers}
            answers.append((response.status_code, headers, bytes(body)))
            response = None
            if not client.trailing_data[0]:
                break
            if client.our_state is h11.DONE and client.their_state is h11.DONE:
                client.start_next_cycle()
                ask(len(answers))
            # else the answer closes the connection: h11 calls bytes after it an error
    return answers


def _check_prediction(call: dict, body: bytes) -> None:
    """A 200 answer of /v1/predict: one prediction per sample or candidate, probabilities
    of the model's head, the version named."""
    import math

    answer = json.loads(body)
    request = json.loads(bytes(call["body"]))
    items = request["samples"] if "samples" in request else request["candidates"]
    predictions = answer.get("predictions")
    if not isinstance(predictions, list) or len(predictions) != len(items):
        raise Inconsistent(f"{len(items)} samples asked, answer {str(answer)[:300]}")
    for p in predictions:
        if set(p) != {"click"} or not (math.isfinite(p["click"]) and 0 <= p["click"] <= 1):
            raise Inconsistent(f"a prediction {p} is not a probability of the head 'click'")
    model = answer.get("model") or {}
    if not isinstance(model.get("version"), int) or not model.get("lineage"):
        raise Inconsistent(f"the answer does not name its version: {model}")


def _traceback_place(printed: str, logged: list) -> str:
    """What a traceback the service printed (the first) or logged was and where: the
    exception's type and the innermost frame of the project's code."""
    import re
    import traceback

    match = re.search(r"Traceback \(most recent call last\):\n(.*?)^(\w[\w.]*)(?::|$)",
                      printed, re.S | re.M)
    if match:
        frames = [traceback.FrameSummary(path, int(line), "") for path, line in
                  re.findall(r'^  File "([^"]+)", line (\d+)', match.group(1), re.M)]
        return f"{match.group(2).rsplit('.', 1)[-1]} at {project_place(frames)} (printed)"
    for record in logged:
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            frames = traceback.extract_tb(error.__traceback__)
            return f"{type(error).__name__} at {project_place(frames)} (logged)"
    return f"{logged[0].name}: {logged[0].getMessage()[:80]} (logged)"


def serve_request(data: bytes) -> None:
    """HTTP/1.1 bytes (see :func:`serve_request_bytes`) fed, in process, to the prediction
    service as it runs: uvicorn's HTTP protocol class over an in-memory transport, bound to
    ``trainer.serve.build_app`` over a LiveModel of a small model trained once per process
    (:func:`serve_base`), the answers read back as a client reads them (see :func:`judge`)."""
    judge(serve_base(), *serve_request_bytes(data))


def judge(harness: HttpHarness, payload: bytes, half_close: bool = False) -> None:
    """Send ``payload`` on one connection of ``harness`` and judge what came back. A finding:
    a 5xx answer, a traceback logged or printed, bytes that are not well-formed HTTP, an
    answer of the app that does not reach the client, a 200 prediction that does not match
    its request, a hang. A refusal (:class:`RefusedRequest`): a 4xx answer, or no answer
    because the request never arrived whole. Accepted: every request answered below 400."""
    import contextlib
    import io
    import logging

    harness.exchange = exchange = _Exchange()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    # the records go to the harness alone meanwhile: a refusal's warning ("Invalid HTTP
    # request received.") is no news at thousands of inputs a second
    # uvicorn's own logging set-up (by a uvicorn.Server run earlier in this process) keeps its
    # records from the root logger (the "uvicorn" logger does not propagate): they are read
    # there too, and printed by neither meanwhile
    root, printed = logging.getLogger(), io.StringIO()
    own = logging.getLogger("uvicorn")
    handlers, root.handlers = root.handlers, [Keep(logging.WARNING)]
    own_handlers, own_propagate, own.handlers, own.propagate = own.handlers, own.propagate, [], True
    try:
        with contextlib.redirect_stderr(printed):
            transport = harness.loop.run_until_complete(
                harness.talk(payload, half_close))
    finally:
        root.handlers = handlers
        own.handlers, own.propagate = own_handlers, own_propagate
    logged = [r for r in records if r.levelno >= logging.ERROR or r.exc_info]
    if logged or "Traceback (most recent call last)" in printed.getvalue():
        text = "\n".join(logging.Formatter().format(r) for r in logged) + printed.getvalue()
        raise ServerError(f"the service logged or printed an error:\n{text[-3000:]}",
                          _traceback_place(printed.getvalue(), logged))
    answers = _http_answers(transport.written, exchange.calls)
    statuses = [status for status, _, _ in answers]
    if any(status >= 500 for status in statuses):
        i = next(i for i, s in enumerate(statuses) if s >= 500)
        path = exchange.calls[i]["path"] if i < len(exchange.calls) else "the protocol"
        raise ServerError(f"answer {i} is {statuses[i]}: {answers[i][2][:300]!r}",
                          f"status {statuses[i]} of {path}")
    said = [call["status"] for call in exchange.calls if call["status"] is not None]
    extra = statuses[len(said):]
    if statuses[:len(said)] != said or extra not in ([], [400]):
        raise Inconsistent(f"the app answered {said}, the client read {statuses}")
    for i, (status, headers, body) in enumerate(answers):
        if "json" in headers.get("content-type", ""):
            try:
                json.loads(body)
            except ValueError:
                raise Inconsistent(f"answer {i} ({status}) is not JSON: {body[:300]!r}") \
                    from None
        if status == 200 and i < len(exchange.calls) and exchange.calls[i]["path"] == \
                "/v1/predict":
            _check_prediction(exchange.calls[i], body)
    refused = [(s, b) for s, _, b in answers if 400 <= s < 500]
    if refused:
        raise RefusedRequest(f"answered {statuses}: {refused[0][1][:300]!r}")
    if not answers or len(said) < len(exchange.calls):
        raise RefusedRequest(f"{len(exchange.calls)} requests reached the app, "
                             f"{len(answers)} answers: the rest never arrived whole")


TARGETS: dict[str, Target] = {t.name: t for t in [
    Target("json_decoder", json_decoder, native=True, names_file=False, max_len=8192,
           doc=json_decoder.__doc__),
    Target("request_envelope", request_envelope, native=True, names_file=False, max_len=8192,
           doc=request_envelope.__doc__),
    Target("csv_file", csv_file, doc=csv_file.__doc__),
    Target("parquet_file", parquet_file, doc=parquet_file.__doc__),
    Target("jsonl_file", jsonl_file, doc=jsonl_file.__doc__),
    Target("tree_parquet", tree_parquet, doc=tree_parquet.__doc__),
    Target("tree_ipc", tree_ipc, names_file=False, doc=tree_ipc.__doc__),
    Target("store_snapshot", store_snapshot, native=True, max_len=8192,
           doc=store_snapshot.__doc__),
    Target("store_delta", store_delta, native=True, max_len=8192, doc=store_delta.__doc__),
    Target("store_rebase", store_rebase, native=True, max_len=8192, doc=store_rebase.__doc__),
    Target("quantized_snapshot", quantized_snapshot, native=True, max_len=8192,
           doc=quantized_snapshot.__doc__),
    Target("quantized_delta", quantized_delta, native=True, max_len=8192,
           doc=quantized_delta.__doc__),
    Target("checkpoint", checkpoint, max_len=8192, doc=checkpoint.__doc__),
    Target("schema_yaml", schema_yaml, max_len=8192, doc=schema_yaml.__doc__),
    Target("config_yaml", config_yaml, max_len=8192, doc=config_yaml.__doc__),
    Target("serve_request", serve_request, names_file=False, max_len=16384,
           doc=serve_request.__doc__),
]}


def corpus_files(name: str, corpus_dir: str = CORPUS_DIR) -> list[str]:
    """The kept corpus files of target ``name``, sorted."""
    directory = os.path.join(corpus_dir, name)
    if not os.path.isdir(directory):
        return []
    return sorted(os.path.join(directory, n) for n in os.listdir(directory)
                  if not n.startswith("."))
