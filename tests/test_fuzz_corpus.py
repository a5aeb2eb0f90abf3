"""Replay of the kept fuzz corpus (tests/fuzz_corpus/<target>/) through every non-native
fuzz target, in process, plus checks of the harness's verdicts and of the fuzz command itself.

Every kept input must end in a result or a clean refusal (a ValueError naming its file); a
``*valid*`` seed must be accepted. The native targets' replay is in
tests/native/test_fuzz_corpus_native.py, so `make test-asan` replays it under the sanitizers.
"""
import json
import os
import shutil
import subprocess
import sys
import traceback

import pytest

from benchmarks.fuzz import targets as T

# Kept inputs that still show a finding in code this change does not own; each entry says
# where. The test fails once the input stops being a finding: then remove it from here.
PENDING: dict[tuple[str, str], str] = {}  # (target, file name) -> where the bug is

CASES = [(name, path) for name, target in T.TARGETS.items() if not target.native
         for path in T.corpus_files(name)]


def check_kept_input(name: str, path: str) -> None:
    with open(path, "rb") as f:
        data = f.read()
    outcome = T.run_input(T.TARGETS[name], data)
    key = (name, os.path.basename(path))
    if key in PENDING:
        assert outcome.kind == "finding", f"{key} is fixed ({outcome.describe()}); remove it " \
                                          "from PENDING"
        return
    detail = "".join(traceback.format_exception(outcome.error)) if outcome.error else ""
    assert outcome.kind in ("accepted", "refused"), f"{path}: {outcome.describe()}\n{detail}"
    if "valid" in os.path.basename(path) and "invalid" not in os.path.basename(path):
        assert outcome.kind == "accepted", f"{path}: {outcome.describe()}"


@pytest.mark.parametrize("name,path", CASES,
                         ids=[f"{n}/{os.path.basename(p)}" for n, p in CASES])
def test_kept_input_ends_in_a_result_or_a_clean_refusal(name, path):
    check_kept_input(name, path)


def test_every_target_has_a_small_kept_corpus():
    total = 0
    for name in T.TARGETS:
        files = T.corpus_files(name)
        assert len(files) >= 5, name
        assert any("valid" in os.path.basename(p) for p in files), name
        total += sum(os.path.getsize(p) for p in files)
    assert total < 1_000_000


# -- the verdicts --------------------------------------------------------------------------

def _recurse(data, depth=0):
    return _recurse(data, depth + 1)


@pytest.mark.parametrize("fn,kind,error", [
    (_recurse, "finding", RecursionError),
    (lambda data: {}["missing"], "finding", KeyError),
    (lambda data: data.decode("utf-8"), "finding", UnicodeDecodeError),
    (lambda data: (_ for _ in ()).throw(T.Inconsistent("parents out of range")), "finding",
     T.Inconsistent),
    (lambda data: (_ for _ in ()).throw(ValueError("bad row")), "finding", T.Finding),
    (lambda data: (_ for _ in ()).throw(ValueError(f"/x/{T.INPUT_MARK}.csv: bad row")),
     "refused", ValueError),
    (lambda data: None, "accepted", type(None)),
])
def test_run_input_judges_each_way_an_input_can_end(fn, kind, error):
    outcome = T.run_input(T.Target("t", fn), b"\xff")
    assert outcome.kind == kind
    assert isinstance(outcome.error, error)


def test_a_refusal_without_a_file_is_clean_for_targets_without_a_file():
    target = T.Target("t", lambda data: (_ for _ in ()).throw(ValueError("bad")),
                      names_file=False)
    assert T.run_input(target, b"").kind == "refused"


# -- the command -----------------------------------------------------------------------------

def _fuzz(*args, cwd=T.ROOT):
    return subprocess.run([sys.executable, "-m", "benchmarks.fuzz", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_the_fuzz_command_runs_atheris_on_a_target_and_reports_it(tmp_path):
    corpus = tmp_path / "corpus"
    shutil.copytree(os.path.join(T.CORPUS_DIR, "schema_yaml"), corpus / "schema_yaml")
    done = _fuzz("--seconds", "6", "--target", "schema_yaml", "--json", "--corpus", str(corpus),
                 "--work-dir", str(tmp_path / "work"))
    assert done.returncode == 0, done.stderr
    [row] = json.loads(done.stdout.splitlines()[-1])["targets"]
    assert row["target"] == "schema_yaml" and row["findings"] == []
    assert row["executions"] > len(os.listdir(corpus / "schema_yaml"))
    assert row["cov"] > 0 and row["ft"] > 0  # the schema code is coverage-instrumented
    assert row["corpus"] >= len(os.listdir(corpus / "schema_yaml"))
    assert os.listdir(tmp_path / "work" / "schema_yaml" / "corpus")


def test_the_fuzz_command_refuses_bad_arguments_in_one_line():
    done = _fuzz("--seconds", "0", "--target", "schema_yaml")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "python -m benchmarks.fuzz: error: --seconds and --jobs must be positive"]
    assert _fuzz("--target", "nope").returncode == 2


# -- named regressions of the tree readers (found by fuzzing) ------------------------------

def _tree_table():
    import compression
    from benchmarks.fuzz import seeds

    return compression.build_trees(seeds._raw_table(), T.fuzz_schema())


def test_a_tree_message_with_an_empty_children_list_is_refused():
    """finding-empty-children-list: a root without children was accepted and gave a batch
    whose layer had nodes without children."""
    import pyarrow as pa

    import compression

    trees = _tree_table()
    ads = trees.column("ad").combine_chunks()
    offsets = pa.array([0, 0] + ads.offsets.to_pylist()[2:], pa.int32())
    broken = trees.set_column(trees.column_names.index("ad"), "ad",
                              pa.ListArray.from_arrays(offsets, ads.values, type=ads.type))
    decoder = compression.TreeMessageDecoder(T.fuzz_schema().tree_arrow_schema())
    with pytest.raises(ValueError, match="nodes with an empty 'ad' list"):
        list(compression.iter_batches(decoder(compression.encode_trees(broken)),
                                      T.fuzz_schema(), 3))


def test_a_tree_file_of_another_schema_is_refused_naming_it(tmp_path):
    """seed-wrong-leaf-type: a tree file whose label is a string column was batched, its
    strings parsed as floats."""
    import compression
    from benchmarks.fuzz import seeds

    path = str(tmp_path / "trees.parquet")
    compression.write_trees(seeds._retyped_trees(_tree_table()), path)
    with pytest.raises(ValueError, match=r"trees.parquet: not a tree table of schema 'fuzz': "
                                         r"column 'ad.sample.click' is string, expected float"):
        list(compression.iter_trees(path, schema=T.fuzz_schema()))
    with pytest.raises(ValueError, match="column 'ad.sample.click' is string"):
        list(compression.iter_batches(compression.read_trees(path), T.fuzz_schema(), 3))


def test_the_checkpoint_seeds_hold_on_other_float_kernels():
    """The kept checkpoint seeds carry the sha256 of the harness's dense.npz. With oneDNN's
    kernels off, TensorFlow's training floats differ in the last bit here, as they do from one
    CPU to another: the seeds must hold all the same (the harness pins its dense values)."""
    valid = [p for p in T.corpus_files("checkpoint") if "valid" in os.path.basename(p)]
    code = ("import sys; from benchmarks.fuzz import targets as T\n"
            "for path in sys.argv[1:]:\n"
            "    outcome = T.run_input(T.TARGETS['checkpoint'], open(path, 'rb').read())\n"
            "    print(path, outcome.describe()) if outcome.kind != 'accepted' else None\n")
    done = subprocess.run([sys.executable, "-c", code, *valid], cwd=T.ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "TF_ENABLE_ONEDNN_OPTS": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == ""
    assert len(valid) >= 4
