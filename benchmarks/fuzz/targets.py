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
    project's code where it was raised (the cause's, for a refusal without the file name)."""
    import traceback

    root = error.__cause__ if isinstance(error, Finding) and error.__cause__ else error
    frames = traceback.extract_tb(root.__traceback__)
    ours = [f for f in frames if f.filename.startswith(ROOT) or "/native/" in f.filename]
    where = (ours or frames)[-1] if (ours or frames) else None
    place = f"{os.path.relpath(where.filename, ROOT)}:{where.lineno}" if where else "?"
    return f"{type(error).__name__}/{type(root).__name__} at {place}"


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
    Target("checkpoint", checkpoint, max_len=8192, doc=checkpoint.__doc__),
    Target("schema_yaml", schema_yaml, max_len=8192, doc=schema_yaml.__doc__),
    Target("config_yaml", config_yaml, max_len=8192, doc=config_yaml.__doc__),
]}


def corpus_files(name: str, corpus_dir: str = CORPUS_DIR) -> list[str]:
    """The kept corpus files of target ``name``, sorted."""
    directory = os.path.join(corpus_dir, name)
    if not os.path.isdir(directory):
        return []
    return sorted(os.path.join(directory, n) for n in os.listdir(directory)
                  if not n.startswith("."))
