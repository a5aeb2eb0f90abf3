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


# -- the service target's verdicts ----------------------------------------------------------

@pytest.fixture(scope="module")
def buggy_app():
    """uvicorn's protocol in the fuzz harness around a small app with one bug per route."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Mount, Route

    async def raises(request):
        return 1 / 0

    async def prints(request):
        try:
            return {}["missing"]
        except KeyError:
            traceback.print_exc()  # what a handler that answers 500 itself does
        return PlainTextResponse("hidden")

    async def unfinished(scope, receive, send):
        return None  # an ASGI app that answers nothing

    def answer(status=200, body=b"ok", kind="text/plain"):
        async def endpoint(request):
            await request.body()
            return Response(body, status, media_type=kind)
        return endpoint

    async def wrong_count(request):
        await request.body()
        return JSONResponse({"predictions": [{"click": 0.5}], "model": {"version": 0,
                                                                         "lineage": "l"}})
    return T.HttpHarness(Starlette(routes=[
        Route("/raises", raises), Route("/prints", prints), Mount("/unfinished", unfinished),
        Route("/busy", answer(503)), Route("/bad-json", answer(kind="application/json")),
        Route("/ok", answer()), Route("/gone", answer(410)),
        Route("/v1/predict", wrong_count, methods=["POST"])]))


def _get(path: str) -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: t\r\n\r\n"


@pytest.mark.parametrize("payload,kind,what", [
    (_get("/raises"), "finding",
     "ServerError/ZeroDivisionError at tests/test_fuzz_corpus.py:"),
    (_get("/prints"), "finding", "ServerError/KeyError at tests/test_fuzz_corpus.py:"),
    (_get("/unfinished/"), "finding",
     "ServerError/uvicorn.error: ASGI callable returned without starting response"),
    (_get("/busy"), "finding", "ServerError/status 503 of /busy"),
    (_get("/bad-json"), "finding", "answer 0 (200) is not JSON"),
    (b"POST /v1/predict HTTP/1.1\r\nHost: t\r\nContent-Length: 33\r\n\r\n"
     b'{"samples": [{"a": 1}, {"a": 2}]}', "finding", "2 samples asked"),
    (_get("/ok") + _get("/gone"), "refused", "answered [200, 410]"),
    (_get("/ok") + b"GET /ok HTTP/1.1\r\nHo", "accepted", ""),
    (_get("/ok") + b"\x00\r\n\r\n", "refused", "answered [200, 400]"),
])
def test_the_service_target_judges_what_the_service_answers(buggy_app, payload, kind, what):
    outcome = T.run_input(T.Target("t", lambda data: T.judge(buggy_app, data),
                                   names_file=False), payload)
    assert outcome.kind == kind, outcome.describe()
    if kind == "finding":
        assert what in T.signature(outcome.error) + str(outcome.error), outcome.describe()
    elif what:
        assert what in str(outcome.error)


def test_the_service_target_reads_answers_as_a_client_does():
    whole = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    calls = [{"method": "GET"}, {"method": "HEAD"}, {"method": "GET"}]
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"  # no body: a HEAD's answer
    assert [a[0] for a in T._http_answers(whole + head + whole, calls)] == [200, 200, 200]
    with pytest.raises(T.Inconsistent, match="after 2 whole answers: peer closed"):
        T._http_answers(whole + head + whole[:-1], calls)
    closing = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
    with pytest.raises(T.Inconsistent, match="expecting EOF"):
        T._http_answers(closing + whole, calls)
    with pytest.raises(T.Inconsistent, match="not well-formed"):
        T._http_answers(whole + b"HTTP/1.1 2x0 OK\r\n\r\n", calls)


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
