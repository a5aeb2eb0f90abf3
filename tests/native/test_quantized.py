"""Quantized exports (native/quantized.py): every format's round trip within its stated bound,
snapshots and deltas made from a store's files and followed by a QuantizedStore as the float32
store follows them, and damaged files refused with the file and the offset named."""
import os
import struct

import numpy as np
import pytest

import native
from native import quantized as q

FORMATS = ("float16", "int8", "int4")
TINY = np.float32(1e-40)  # a float32 subnormal


def special_rows(dim):
    rng = np.random.default_rng(dim)
    rows = [np.zeros(dim), np.full(dim, 0.25), np.full(dim, -3.0e4),
            rng.normal(0, 0.05, dim), rng.normal(0, 3, dim), rng.uniform(-1e-3, 1e-3, dim),
            np.full(dim, TINY), np.linspace(0, TINY * 9, dim), np.linspace(-1, 1, dim) * 1e-30]
    spread = np.zeros(dim)
    spread[0] = 1000.0
    rows.append(spread)
    return np.array(rows, np.float32)


def huge_rows(dim):
    """Values near float32's largest (not for float16, refused beyond 65504)."""
    row = np.linspace(-3.4e38, 3.4e38, dim).astype(np.float32)
    return np.stack([row, np.full(dim, np.finfo(np.float32).max), -row])


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("dim", [1, 2, 7, 16, 64])
def test_round_trip_within_the_stated_bound(format, dim):
    rows = special_rows(dim)
    if format != "float16":
        rows = np.concatenate([rows, huge_rows(dim)])
    stored = q.quantize_rows(rows, format)
    assert stored.shape == (len(rows), q.row_bytes(format, dim))
    back = q.dequantize_rows(stored, format, dim)
    assert back.dtype == np.float32 and np.isfinite(back).all()
    error = np.abs(back.astype(np.float64) - rows.astype(np.float64))
    bound = q.error_bound(format, rows)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert (error <= bound).all(), (worst, rows[worst], back[worst], bound[worst])
    # rows of equal values are exact in the integer formats, zeros in every format
    assert not back[0].any()
    if format != "float16":
        np.testing.assert_array_equal(back[1], rows[1])
        np.testing.assert_array_equal(back[2], rows[2])
        np.testing.assert_array_equal(back[6], rows[6])


def test_row_bytes_of_each_format():
    assert [q.row_bytes(f, 16) for f in ("float32",) + FORMATS] == [64, 32, 24, 16]
    assert q.row_bytes("int4", 7) == 12  # two values a byte, the last half-filled


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nan_and_infinities_are_refused(format, value):
    rows = np.zeros((3, 4), np.float32)
    rows[2, 1] = value
    with pytest.raises(native.InvalidInputError, match=r"row 2 .*non-finite.*column 1"):
        q.quantize_rows(rows, format)


def test_float16_refuses_values_beyond_its_range():
    with pytest.raises(native.InvalidInputError, match=r"beyond float16's range.*int8"):
        q.quantize_rows(np.array([[1.0, 70000.0]], np.float32), "float16")
    q.quantize_rows(np.array([[65504.0, -65504.0]], np.float32), "float16")  # the largest


def test_an_unknown_format_is_refused():
    with pytest.raises(native.InvalidInputError, match="float16, int8, int4"):
        q.quantize_rows(np.zeros((1, 2), np.float32), "int2")


# -- files made from a store's ------------------------------------------------------------

DIM = 5


def trained_store(seed=0):
    store = native.EmbeddingStore(native.StoreConfig(dim=DIM, optimizer=native.Adagrad(0.3),
                                                     seed=seed, num_shards=4))
    return store


def train(store, ids, step, rng):
    unique, _, _ = store.lookup_unique(np.asarray(ids, np.int64), now=1000.0 + step)
    store.apply_gradients(unique, rng.normal(size=(len(unique), DIM)), step, now=1000.0 + step)


def lineage(tmp_path, format):
    """A store's snapshot and three deltas (upserts, removals, an id removed then back), each
    quantized; returns (store, quantized dir, [quantized delta paths], probe ids)."""
    rng = np.random.default_rng(5)
    store = trained_store()
    ids = np.concatenate([np.arange(-300, 300, 7), [-(2**63), 2**63 - 1, 0]])
    train(store, ids, 1, rng)
    store.save(tmp_path / "float")
    qdir = tmp_path / format
    q.quantize_snapshot(tmp_path / "float", qdir / q.SNAPSHOT_FILE, format)
    deltas = []
    for step in (2, 3, 4):
        train(store, rng.choice(np.arange(-400, 400), 60), step, rng)
        if step == 2:
            store.expire_where(lambda ids, *_: ids % 3 == 0)
        if step == 3:
            train(store, [3, 6, 9], step, rng)  # removed at step 2, back now
            store.expire_where(lambda ids, *_: ids == 2**63 - 1)
        path = store.export_delta(tmp_path / "float-deltas")
        out = qdir / "deltas" / os.path.basename(path)
        q.quantize_delta(path, out, format)
        deltas.append(out)
    probe = np.concatenate([ids, np.arange(-450, 450), [12345678]])
    return store, qdir, deltas, probe


@pytest.mark.parametrize("format", FORMATS)
def test_quantized_lineage_applied_in_order_equals_the_float32_one_within_the_bound(
        tmp_path, format):
    store, qdir, deltas, probe = lineage(tmp_path, format)
    table = native.QuantizedStore.load(qdir)
    assert (table.format, table.dim) == (format, DIM)
    for path in deltas:
        contents = table.read_delta(path)
        assert table.apply_delta(path) == contents["sequence"]
        # what read_delta reads is what apply_delta applied
        np.testing.assert_array_equal(table.lookup(contents["ids"]), contents["rows"])
        assert not table.lookup(contents["tombstones"]).any()
    want = store.lookup(probe, train=False)
    got = table.lookup(probe)
    assert len(table) == len(store)
    held = np.abs(want).sum(axis=1) > 0
    assert ((np.abs(got) > 0).any(axis=1) | ~held).all()
    assert not got[~held].any()  # unknown and removed ids read zeros, as in the store
    assert (np.abs(got - want) <= q.error_bound(format, want)).all()
    stats = table.stats()
    assert stats.delta_sequence == store.stats().delta_sequence == 3
    assert stats.global_step == 4 and stats.rows == len(store)
    unique, inverse, rows = table.lookup_unique(np.array([5, 1, 5]))
    np.testing.assert_array_equal(rows[inverse], table.lookup([5, 1, 5]))


def test_deltas_out_of_order_or_of_another_format_are_refused_and_change_nothing(tmp_path):
    store, qdir, deltas, probe = lineage(tmp_path, "int8")
    table = native.QuantizedStore.load(qdir)
    before = table.lookup(probe)
    with pytest.raises(native.DeltaOrderError, match="sequence 2 but this table expects 1"):
        table.apply_delta(deltas[1])
    other = tmp_path / "other.bin"
    q.quantize_delta(tmp_path / "float-deltas" / "delta-000001.bin", other, "int4")
    with pytest.raises(native.IncompatibleStoreError, match="int4 rows of dim 5; this table "
                                                            "holds int8"):
        table.apply_delta(other)
    with pytest.raises(native.CorruptFileError, match="not a quantized delta"):
        table.apply_delta(tmp_path / "float-deltas" / "delta-000001.bin")
    np.testing.assert_array_equal(table.lookup(probe), before)
    assert table.read_delta(deltas[1], ahead=1)["sequence"] == 2


@pytest.mark.parametrize("format", ["int8", "int4"])
def test_a_rebase_delta_turns_a_table_into_another_snapshot(tmp_path, format):
    store, qdir, deltas, probe = lineage(tmp_path, format)
    table = native.QuantizedStore.load(qdir)
    table.apply_delta(deltas[0])
    other = tmp_path / "other"
    other.mkdir()
    store.save(other / "float")  # the store three deltas on: another export of the model
    q.quantize_snapshot(other / "float", other / "q" / q.SNAPSHOT_FILE, format)
    target = native.QuantizedStore.load(other / "q")
    stats = table.write_rebase_delta(other / "q", tmp_path / "rebase.bin")
    contents = table.read_delta(tmp_path / "rebase.bin")
    assert contents["rebase"] == store.stats().delta_sequence
    assert stats["rows"] == len(contents["ids"]) and stats["unchanged"] > 0
    table.apply_delta(tmp_path / "rebase.bin")
    np.testing.assert_array_equal(table.lookup(probe), target.lookup(probe))
    assert len(table) == len(target)
    assert table.stats().delta_sequence == store.stats().delta_sequence


def test_ids_are_stored_compactly(tmp_path):
    store = trained_store()
    train(store, np.arange(10_000), 1, np.random.default_rng(1))
    store.save(tmp_path / "float")
    size = q.quantize_snapshot(tmp_path / "float", tmp_path / "q" / q.SNAPSHOT_FILE, "int8")
    # consecutive ids: one byte each (after the first); the rows 8 + dim bytes
    assert size <= 10_000 * (1 + q.row_bytes("int8", DIM)) + 200
    assert os.path.getsize(tmp_path / "float" / "store.snapshot") > 3 * size


def test_float16_export_of_a_row_beyond_its_range_names_the_id(tmp_path):
    store = native.EmbeddingStore(native.StoreConfig(dim=2, optimizer=native.SGD(1.0)))
    store.lookup([41], train=True)
    store.apply_gradients([41], [[-1e6, 0.0]], 1)
    store.save(tmp_path / "float")
    with pytest.raises(native.InvalidInputError, match="id 41 .*beyond float16's range"):
        q.quantize_snapshot(tmp_path / "float", tmp_path / "q" / q.SNAPSHOT_FILE, "float16")
    assert not os.path.exists(tmp_path / "q" / q.SNAPSHOT_FILE)
    q.quantize_snapshot(tmp_path / "float", tmp_path / "q" / q.SNAPSHOT_FILE, "int8")


# -- damage -------------------------------------------------------------------------------

def small_files(tmp_path):
    store, qdir, deltas, _ = lineage(tmp_path, "int4")
    with open(qdir / q.SNAPSHOT_FILE, "rb") as f:
        snapshot = f.read()
    with open(deltas[1], "rb") as f:
        delta = f.read()
    return qdir, snapshot, deltas, delta


def test_every_truncation_and_flipped_byte_is_a_clean_error_naming_the_file(tmp_path):
    qdir, snapshot, deltas, delta = small_files(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    path = bad / q.SNAPSHOT_FILE
    for cut in list(range(0, 80)) + list(range(80, len(snapshot), 97)):
        path.write_bytes(snapshot[:cut])
        with pytest.raises(native.CorruptFileError, match=str(path)):
            native.QuantizedStore.load(bad)
    for at in range(0, len(snapshot), 41):
        flipped = bytearray(snapshot)
        flipped[at] ^= 0x10
        path.write_bytes(bytes(flipped))
        with pytest.raises(native.CorruptFileError, match=str(path)):
            native.QuantizedStore.load(bad)
    table = native.QuantizedStore.load(qdir)
    table.apply_delta(deltas[0])
    delta_path = tmp_path / "bad-delta.bin"
    for cut in range(0, len(delta), 13):
        delta_path.write_bytes(delta[:cut])
        with pytest.raises(native.CorruptFileError, match=str(delta_path)):
            table.apply_delta(delta_path)
    assert table.apply_delta(deltas[1]) == 2


def sealed(body: bytes) -> bytes:
    from benchmarks.fuzz.targets import sealed_store_file

    return sealed_store_file(body)


def test_damage_behind_a_valid_checksum_is_named_with_its_offset(tmp_path):
    _, snapshot, _, _ = small_files(tmp_path)
    body = bytearray(snapshot[:-16])
    path = tmp_path / "bad" / q.SNAPSHOT_FILE
    path.parent.mkdir()
    # header: magic 8, version 4, format 4 (offset 12), dim 4, row bytes 4, step 8, seq 8,
    # rows 8 (offset 40), id bytes 8 (offset 48), ids (offset 56)...
    cases = []
    wrong_format = bytearray(body)
    wrong_format[12:16] = struct.pack("<I", 9)
    cases.append((wrong_format, "unknown row format 9 at offset 12"))
    huge_count = bytearray(body)
    huge_count[40:48] = struct.pack("<Q", 2**40)
    cases.append((huge_count, "row count .* too large at offset 40"))
    huge_ids = bytearray(body)
    huge_ids[48:56] = struct.pack("<Q", 2**40)
    cases.append((huge_ids, "row ids of 1099511627776 bytes at offset 48 do not fit"))
    rows = struct.unpack("<Q", body[40:48])[0]
    id_bytes = struct.unpack("<Q", body[48:56])[0]
    descending = bytearray(body)
    descending[56 + 1] = 0  # the second id's difference: 0, not ascending
    cases.append((descending, "not strictly ascending at id 1 \\(offset 57\\)"))
    nan_scale = bytearray(body)
    first_row = 56 + id_bytes
    nan_scale[first_row:first_row + 4] = struct.pack("<f", float("nan"))
    cases.append((nan_scale, f"row 0 \\(id .*\\) at offset {first_row}: scale -?nan"))
    short = body[:first_row + rows * 11 - 3]
    cases.append((short, f"{rows} rows of 11 bytes at offset {first_row} do not fit"))
    for damaged, message in cases:
        path.write_bytes(sealed(bytes(damaged)))
        with pytest.raises(native.CorruptFileError, match=message):
            native.QuantizedStore.load(path.parent)


def test_lookups_beside_applies_see_one_version_whole(tmp_path):
    """A delta is applied under the table's lock: a concurrent lookup reads every row of one
    version (here all rows equal the version number), never a mix."""
    import threading

    store = native.EmbeddingStore(native.StoreConfig(dim=4, optimizer=native.SGD(1.0),
                                                     initializer=native.Zeros()))
    ids = np.arange(5000)
    store.lookup(ids, train=True)
    store.save(tmp_path / "float")
    q.quantize_snapshot(tmp_path / "float", tmp_path / "q" / q.SNAPSHOT_FILE, "int8")
    deltas = []
    for version in range(1, 31):
        store.apply_gradients(ids, np.full((len(ids), 4), -1.0), version)
        path = store.export_delta(tmp_path / "deltas")
        q.quantize_delta(path, path, "int8")
        deltas.append(path)
    table = native.QuantizedStore.load(tmp_path / "q")
    problems, done = [], threading.Event()
    seen = {0: [], 1: []}
    reads = threading.Condition()

    def read(me):
        while not done.is_set():
            values = np.unique(table.lookup(ids))
            if len(values) != 1:
                problems.append(values)
            with reads:
                seen[me].append(float(values[0]))
                reads.notify_all()

    readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for reader in readers:
        reader.start()
    for path in deltas:
        with reads:  # a read between every two applies (and others across them)
            count = len(seen[0]) + len(seen[1])
            assert reads.wait_for(lambda: len(seen[0]) + len(seen[1]) > count, timeout=60)
        table.apply_delta(path)
    done.set()
    for reader in readers:
        reader.join()
    assert not problems, problems[:3]
    for mine in seen.values():  # each reader sees the versions in order
        assert mine == sorted(mine)
    assert len(set(seen[0]) | set(seen[1])) > 10
    assert np.unique(table.lookup(ids)).tolist() == [30.0]
