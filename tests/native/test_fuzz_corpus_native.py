"""Replay of the kept fuzz corpus of the native targets (the JSON sample decoder, store
snapshots and deltas) in process; `make test-asan` runs this file under ASan + UBSan too.
Every kept input must end in a result or a clean refusal; ``*valid*`` seeds must be accepted."""
import os
import sys
import traceback

import pytest

# Under `make test-asan` the working directory is the sanitized build's site directory, whose
# native/ must win: the repository (for benchmarks/) goes last on the path.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.append(ROOT)

from benchmarks.fuzz import targets as T  # noqa: E402

CASES = [(name, path) for name, target in T.TARGETS.items() if target.native
         for path in T.corpus_files(name)]


@pytest.mark.parametrize("name,path", CASES,
                         ids=[f"{n}/{os.path.basename(p)}" for n, p in CASES])
def test_kept_native_input_ends_in_a_result_or_a_clean_refusal(name, path):
    with open(path, "rb") as f:
        outcome = T.run_input(T.TARGETS[name], f.read())
    detail = "".join(traceback.format_exception(outcome.error)) if outcome.error else ""
    assert outcome.kind in ("accepted", "refused"), f"{path}: {outcome.describe()}\n{detail}"
    if "valid" in os.path.basename(path):
        assert outcome.kind == "accepted", f"{path}: {outcome.describe()}"


def test_the_targets_seal_store_files_as_the_store_does():
    """The fuzz targets' Python copy of the store checksum gives the trailer save() writes
    (else every sealed input would stop at the checksum)."""
    _, snapshot, delta = T.store_base()
    for blob in (snapshot, delta):
        assert T.sealed_store_file(blob[:-T.TRAILER_BYTES]) == blob


def test_a_snapshot_whose_options_the_facade_refuses_is_a_corrupt_file(tmp_path):
    """Found by fuzzing (finding-options-max-rows-out-of-range): a sealed snapshot whose
    max_rows is above 2**63 - 1 loaded in C++ and then failed in the Python facade with
    InvalidInputError, naming no file."""
    import native

    _, snapshot, _ = T.store_base()
    body = bytearray(snapshot[:-T.TRAILER_BYTES])
    # PutOptions: magic 8, version 4, row bytes 4, dim 4, optimizer 4 + 9 floats, initializer
    # 4 + 4, seed 8, shards 4, filter 4 + 8 + 4 + 8 + 8, then max_rows (uint64)
    offset = 8 + 4 + 4 + 4 + 4 + 9 * 4 + 4 + 4 + 8 + 4 + 4 + 8 + 4 + 8 + 8
    body[offset:offset + 8] = (2**64 - 1).to_bytes(8, "little")
    (tmp_path / "store.snapshot").write_bytes(T.sealed_store_file(bytes(body)))
    with pytest.raises(native.CorruptFileError, match="max_rows") as error:
        native.EmbeddingStore.load(tmp_path)
    assert str(tmp_path / "store.snapshot") in str(error.value)
