"""The prediction service as a real child process over HTTP, following an export that a trainer
publishes versions into: one version per answer, equal to the Predictor at every version,
problems never applied, bad requests answered, SIGTERM drains."""

import asyncio
import contextlib
import http.client
import json
import os
import shutil
import signal
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
import uvicorn

import compression
import schemas
from service import Service
from trainer import models
from trainer.config import TrainConfig
from trainer.live import LiveModel
from trainer.requests import BadRequest
from trainer.serve import build_app, listen
from trainer.serving import Predictor, export_increment, version_path
from trainer.trainer import Trainer

SCHEMA = schemas.from_dict({"name": "serve_test", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"},
                                                  {"name": "age", "kind": "id"}]},
    {"name": "sample", "key": ["item"], "features": [{"name": "item", "kind": "id"}]}]})
CONFIG = TrainConfig.from_dict({"batch_size": 400, "seed": 3, "threads": 1,
                                "embedding": {"dim": 4, "optimizer": {"name": "adagrad",
                                                                      "lr": 0.2}}})
# Every version trains the probe's users and items again: both tables' rows of every probe
# sample change together in every version, so an answer mixing two versions is off.
PROBE = [{"uid": u, "age": u % 5, "item": 100 + 7 * u} for u in range(12)]


def _samples(n, seed):
    rng = np.random.default_rng(seed)
    uid = rng.integers(0, 40, n)
    rows = [{"uid": int(u), "age": int(u % 5), "item": int(i), "click": float(c)}
            for u, i, c in zip(uid, rng.integers(0, 300, n), rng.random(n) < 0.3)]
    return rows + [{**p, "click": float(k % 2)} for k, p in enumerate(PROBE)]


def _train(trainer, seed, n=300):
    trees = compression.build_trees(pa.Table.from_pylist(_samples(n, seed)), SCHEMA)
    for batch in compression.iter_batches(trees, SCHEMA, 400):
        trainer.train_batch(batch)


def _trainer():
    trainer = Trainer(SCHEMA, models.MLP(hidden=(8,)), CONFIG)
    _train(trainer, 0)
    return trainer


def _predictions(answer):
    return np.array([p["click"] for p in answer["predictions"]])


def test_every_answer_is_one_published_version_while_versions_apply(tmp_path):
    export = tmp_path / "export"
    trainer = _trainer()
    export_increment(trainer, export)
    reference = Predictor(export)
    expected = {0: reference.predict(PROBE)}
    seen, answers, stop = threading.Condition(), [], threading.Event()
    with Service(export, "--poll-interval", "0.02") as service:
        errors = []

        def client():
            connection = service.connection()
            while not stop.is_set():
                status, answer = service.predict({"samples": PROBE}, connection)
                with seen:
                    if status != 200:
                        errors.append(answer)
                        stop.set()
                    else:
                        answers.append((answer["model"]["version"], _predictions(answer)))
                    seen.notify_all()

        clients = [threading.Thread(target=client) for _ in range(3)]
        for c in clients:
            c.start()
        try:
            for version in range(9):  # version 0 answered before version 1 is published
                if version:
                    _train(trainer, version)
                    assert export_increment(trainer, export)["version"] == version
                    assert reference.update() == len(trainer.tables)
                    expected[version] = reference.predict(PROBE)
                    assert not np.allclose(expected[version], expected[version - 1])
                with seen:  # a client got an answer of this version: the swap happened
                    assert seen.wait_for(lambda: errors or any(v == version for v, _ in answers),
                                         60), service.stderr
                    assert not errors, errors
        finally:
            stop.set()
            for c in clients:
                c.join(60)
        info = service.model()
        assert info["model"]["version"] == 8 and info["ready"] and info["failed_applies"] == 0
        assert info["model"]["lineage"] == reference.lineage
    assert service.child.returncode == 0, service.stderr
    versions = [v for v, _ in answers]
    assert set(versions) == set(range(9))
    for version, predictions in answers:  # each answer is exactly one version's
        np.testing.assert_allclose(predictions, expected[version], rtol=2e-5, atol=1e-7)


def _copy_version(source, target, version, damage=None):
    """Publish ``source``'s version into ``target`` as a writer would: files, manifest last."""
    files = version_path(str(source), version)
    shutil.copytree(files, version_path(str(target), version))
    if damage is not None:
        damage(version_path(str(target), version))
    shutil.copy(f"{files}.json", f"{version_path(str(target), version)}.json")


def _truncate_a_delta(folder):
    path = next(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs
                if f.endswith(".bin"))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 5)
    return path


def test_damaged_missing_and_foreign_versions_are_never_applied(tmp_path):
    """The trainer publishes into ``source``; the test copies versions into the served
    directory, damaged or out of order: the service stays on the last good version, says why
    it is not ready, and recovers once what it needs appears."""
    source, served = tmp_path / "source", tmp_path / "served"
    trainer = _trainer()
    export_increment(trainer, source)
    shutil.copytree(source, served)
    reference = Predictor(source)
    expected = {0: reference.predict(PROBE)}
    for version in range(1, 5):
        _train(trainer, version)
        export_increment(trainer, source)
        reference.update()
        expected[version] = reference.predict(PROBE)

    def answers_on(service, version):
        status, answer = service.predict({"samples": PROBE})
        assert status == 200 and answer["model"]["version"] == version, answer
        np.testing.assert_allclose(_predictions(answer), expected[version], rtol=2e-5)

    def not_ready(service, version, reason):
        service.wait_for(lambda i: not i["ready"] and reason in (i["problem"] or ""),
                         what=f"not ready: {reason}")
        status, text = service.request("GET", "/readyz")
        assert status == 503 and reason in text
        answers_on(service, version)

    with Service(served, "--poll-interval", "0.02") as service:
        _copy_version(source, served, 1)
        service.wait_for(lambda i: i["model"]["version"] == 1 and i["ready"])
        # a truncated delta: refused before anything changes
        damaged = {}
        _copy_version(source, served, 2,
                      damage=lambda folder: damaged.setdefault("path", _truncate_a_delta(folder)))
        not_ready(service, 1, "version 2")
        assert service.metric("prefixrec_serve_failed_applies_total") >= 1
        # the writer's complete file appears: applied
        relative = os.path.relpath(damaged["path"], served)
        shutil.copy(source / relative, damaged["path"])
        service.wait_for(lambda i: i["model"]["version"] == 2 and i["ready"])
        answers_on(service, 2)
        # version 3 missing, 4 published: a gap
        _copy_version(source, served, 4)
        not_ready(service, 2, "version 3 is missing")
        _copy_version(source, served, 3)
        service.wait_for(lambda i: i["model"]["version"] == 4 and i["ready"])
        answers_on(service, 4)
        # a manifest of another lineage in place of version 5
        other = Trainer(SCHEMA, models.MLP(hidden=(8,)), CONFIG)
        _train(other, 9)
        export_increment(other, tmp_path / "other")
        _train(other, 10)
        export_increment(other, tmp_path / "other")
        shutil.copytree(version_path(str(tmp_path / "other"), 1), version_path(str(served), 5))
        shutil.copy(version_path(str(tmp_path / "other"), 1) + ".json",
                    version_path(str(served), 5) + ".json")
        manifest = json.loads(open(version_path(str(served), 5) + ".json").read())
        manifest["version"] = 5
        with open(version_path(str(served), 5) + ".json", "w") as f:
            json.dump(manifest, f)
        not_ready(service, 4, "lineage")
        # the export directory removed: still answering; a new full export: loaded
        shutil.rmtree(served)
        not_ready(service, 4, "export.json missing")
        export_increment(other, served)
        info = service.wait_for(lambda i: i["ready"] and i["model"]["lineage"] != reference
                                .lineage, what="the new export loaded")
        assert info["reloads"] == 1
        # the same model, trained apart: rebased (every row differs), not loaded beside
        assert info["last_reload"]["mode"] == "rebase" and info["last_reload"]["rows"] > 0
        status, answer = service.predict({"samples": PROBE})
        assert status == 200 and answer["model"]["version"] == 0
        np.testing.assert_allclose(_predictions(answer), Predictor(served).predict(PROBE),
                                   rtol=2e-5)
        # the new lineage's own versions follow the rebase
        _train(other, 11)
        export_increment(other, served)
        service.wait_for(lambda i: i["model"]["version"] == 1 and i["ready"])
        status, answer = service.predict({"samples": PROBE})
        assert answer["model"]["version"] == 1
        latest = Predictor(served)
        assert latest.update() > 0
        np.testing.assert_allclose(_predictions(answer), latest.predict(PROBE), rtol=2e-5)
        # an export of another model (a wider network) cannot be rebased: loaded whole
        wider = Trainer(SCHEMA, models.MLP(hidden=(6,)), CONFIG)
        _train(wider, 12)
        export_increment(wider, tmp_path / "wider")
        shutil.rmtree(served)
        os.rename(tmp_path / "wider", served)
        info = service.wait_for(lambda i: i["ready"] and i["reloads"] == 2,
                                what="the wider model loaded")
        assert info["last_reload"]["mode"] == "full"
        status, answer = service.predict({"samples": PROBE})
        np.testing.assert_allclose(_predictions(answer), Predictor(served).predict(PROBE),
                                   rtol=2e-5)


@pytest.fixture(scope="module")
def small_export(tmp_path_factory):
    export = tmp_path_factory.mktemp("serve") / "export"
    export_increment(_trainer(), export)
    return export


def test_bad_requests_get_a_clear_answer_and_sigterm_answers_what_was_accepted(small_export):
    good = {"samples": PROBE[:2]}
    service = Service(small_export, "--max-samples", "3000", "--max-body-bytes", "200000",
                      "--threads", "1")
    try:
        cases = [
            (b'{"samples": [', 400, "malformed JSON"),
            ({"samples": []}, 400, "empty"),
            ({"rows": PROBE}, 400, 'no "samples"'),
            # a sample's verdict is the one a file or a Kafka message would give it
            ({"samples": [PROBE[0], 7]}, 400,
             "sample 1: not a valid sample: expected a JSON object, got int"),
            ({"samples": [PROBE[0], {"uid": 1, "age": 1}]}, 400,
             "sample 1: key column 'item': null value"),
            ({"samples": [PROBE[0], {**PROBE[1], "age": "old"}]}, 400,
             "sample 1: not a valid sample: field 'age': expected an integer (kind id, dtype "
             "int64), got a string"),
            ({"samples": [{**PROBE[0], "colour": 3}]}, 400, "'colour'"),
            ({"root": {"uid": 1, "age": 1}, "candidates": [{"item": 1, "uid": 2}]}, 400,
             "candidate 0: 'uid' is a feature of the root layer"),
            ({"root": {"uid": 1, "age": 1}, "candidates": [{"item": 1}, {"item": 2, "x": 1}]},
             400, "candidate 1: not a valid sample: unexpected field(s) 'x'"),
            ({"root": {"uid": 1, "age": 1, "item": 3}, "candidates": [{"item": 1}]}, 400,
             "root: 'item' is not a feature of the root layer"),
            ({"root": {"uid": 1, "age": 1}, "candidates": [{"item": 1}, {"item": None}]}, 400,
             "candidate 1"),
            ({"root": {"uid": 1, "age": "x"}, "candidates": [{"item": 1}]}, 400,
             "root: not a valid sample: field 'age': expected an integer"),
            ({"samples": PROBE * 300}, 413, "the limit is 3000"),
            (json.dumps({"samples": PROBE, "pad": "x" * 300_000}).encode(), 413,
             "--max-body-bytes"),
            # issue 39: these were 500s with a traceback (RecursionError, UnicodeEncodeError)
            (b"[" * 100_000, 400, "malformed JSON: arrays and objects nested deeper than 64"),
            (b'{"samples": [' + b"[" * 50_000 + b"]" * 50_000 + b"]}", 400,
             "sample 0: arrays and objects nested deeper than 64 levels"),
            ({"samples": [PROBE[0], {**PROBE[1], "age": "\ud800"}]}, 400,
             "sample 1: not a valid sample: not JSON (invalid surrogate pair in a string at "
             "byte 19, in field 'age')"),
            ({"samples": [{**PROBE[1], "uid": 2**64}]}, 400,
             "sample 0: not a valid sample: field 'uid': expected an integer (kind id, dtype "
             "int64), got 18446744073709551616, out of the int64 range"),
            (b'{"samples": [{"uid": 1, "age": 1, "item": 1, "note": "\xff"}]}', 400,
             "sample 0: not a valid sample: not JSON (invalid UTF-8 in a string at byte 41, in "
             "field 'note')"),
        ]
        for body, status, words in cases:
            got, answer = service.predict(body)
            assert (got, words in answer["error"]) == (status, True), (body, answer)
            assert service.predict(good)[0] == 200  # still serving
        # nothing a client sent was a fault of the service (and no traceback: checked below)
        assert service.metric("prefixrec_serve_internal_errors_total") == 0
        # a ranking request: the user once, the candidates under it; as flat samples
        root = {"uid": 3, "age": 3}
        candidates = [{"item": i} for i in range(40)]
        status, tree = service.predict({"root": root, "candidates": candidates})
        assert status == 200
        status, flat = service.predict({"samples": [{**root, **c} for c in candidates]})
        np.testing.assert_allclose(_predictions(tree), _predictions(flat), rtol=1e-5)
        assert service.request("GET", "/livez")[0] == 200
        assert service.request("GET", "/readyz") == (200, "ready\n")
        service.child.send_signal(signal.SIGHUP)  # reload the full export
        info = service.wait_for(lambda i: i["reloads"] == 1 and i["ready"],
                                what="SIGHUP's reload")
        assert info["last_reload"]["mode"] == "rebase" and info["last_reload"]["rows"] == 0
        np.testing.assert_allclose(_predictions(service.predict({"root": root, "candidates":
                                                                 candidates})[1]),
                                   _predictions(tree), rtol=1e-6)

        # SIGTERM while requests are being computed: every accepted one is answered
        big = json.dumps({"samples": [{**PROBE[i % 12], "item": i} for i in range(3000)]}
                         ).encode()
        watcher = service.connection()

        def client(results, sent):
            connection = service.connection(120)
            connection.request("POST", "/v1/predict", big, {"Content-Type": "application/json"})
            sent.release()
            response = connection.getresponse()
            response.read()
            results.append(response.status)
            connection.close()

        for _ in range(20):  # waves of 4 requests (computed one at a time) until all 4 are
            results = []     # seen accepted (read, queued or being computed) at once
            sent = threading.Semaphore(0)
            clients = [threading.Thread(target=client, args=(results, sent)) for _ in range(4)]
            # the service stopped while the four bodies are sent: on a loaded host it answered
            # one before it had read the next (CI saw 20 waves in a row without 4 at once);
            # continued, it finds all four in its sockets
            service.child.send_signal(signal.SIGSTOP)
            try:
                for c in clients:
                    c.start()
                for _ in clients:
                    sent.acquire(timeout=10)
            finally:
                service.child.send_signal(signal.SIGCONT)
            caught = False
            while not caught and any(c.is_alive() for c in clients):
                caught = "prefixrec_serve_requests_in_flight 4.0" in service.request(
                    "GET", "/metrics", connection=watcher)[1]
            if caught:
                break
            for c in clients:
                c.join()
        assert caught, "never saw 4 requests in flight at once"
        service.child.send_signal(signal.SIGTERM)
        for c in clients:
            c.join(120)
        assert service.child.wait(120) == 0, service.stderr
        assert results == [200] * 4, results
        assert "stopped on SIGTERM" in service.stderr
        assert "Traceback" not in service.stderr, service.stderr  # read up to its last line
    finally:
        service.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def live(small_export):
    model = LiveModel(small_export)
    yield model
    model.close()


def test_a_tree_request_runs_the_root_once_and_equals_flat_scoring(live):
    """In process, over the same export: the candidates' answers equal flat scoring."""
    candidates = [{"item": i} for i in range(25)]
    tree, info = live.predict_tree({"uid": 5, "age": 0}, candidates)
    flat, _ = live.predict([{"uid": 5, "age": 0, **c} for c in candidates])
    np.testing.assert_allclose(tree, flat, rtol=1e-5)
    assert tree.shape == (25, 1) and info["version"] == 0


def test_request_bodies_are_scored_as_the_library_scores_rows(live):
    """The service's path (a body, decoded natively) answers what the library calls on rows
    (json.loads + pyarrow, as the service did before) answer."""
    kind, got, info = live.predict_request(json.dumps({"samples": PROBE}).encode())
    want, _ = live.predict(PROBE)
    assert kind == "samples" and info["version"] == 0
    np.testing.assert_allclose(got, want, rtol=1e-6)
    root, candidates = {"uid": 5, "age": 0}, [{"item": i, "click": 1} for i in range(30)]
    kind, got, _ = live.predict_request(json.dumps({"root": root, "candidates": candidates})
                                        .encode())
    want, _ = live.predict_tree(root, [{"item": c["item"]} for c in candidates])
    assert kind == "tree" and got.shape == (30, 1)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("flaw", [b'"age": "\\ud800"', b'"age": 99999999999999999999',
                                  b'"age": [1]', b'"age": 1, "colour": "red"', b'"age": 1 1'])
def test_a_requests_sample_gets_the_verdict_of_a_kafka_message(live, flaw):
    sample = b'{"uid": 3, ' + flaw + b', "item": 4, "click": 1}'
    _, dead = compression.decode_json_samples([sample], SCHEMA)
    with pytest.raises(BadRequest) as error:
        live.predict_request(b'{"samples": [' + sample + b"]}")
    assert (error.value.status, str(error.value)) == (400, f"sample 0: {dead[0][1]}")


def test_a_fault_of_the_service_is_a_counted_500_and_it_keeps_serving(live):
    """A served model that outputs NaN (dense weights gone bad) cannot be answered in JSON:
    500, counted for an operator to alert on; once the weights are back, 200 again."""
    body = json.dumps({"samples": PROBE[:3]}).encode()
    version = live.version
    variables = version.base.slots[version.slot].variables_
    saved = [v.numpy() for v in variables]
    with _serving(build_app(live)) as connection:
        def post():
            connection.request("POST", "/v1/predict", body)
            response = connection.getresponse()
            return response.status, json.loads(response.read())

        assert post()[0] == 200
        try:
            for v in variables:
                v.assign(np.full(v.shape, np.nan, v.dtype.as_numpy_dtype))
            status, answer = post()
            assert status == 500 and answer["error"].startswith("internal error: ValueError")
        finally:
            for v, value in zip(variables, saved):
                v.assign(value)
        assert post()[0] == 200
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    assert "prefixrec_serve_internal_errors_total 1.0" in text
    assert 'prefixrec_serve_requests_total{endpoint="predict",status="500"} 1.0' in text


def test_a_content_length_header_of_other_digits_is_not_a_fault(live):
    """'²' passes str.isdigit() but not int(): the app (called as an ASGI server calls it, for
    servers that hand such a header on) reads the body instead of failing."""
    body = json.dumps({"samples": PROBE[:2]}).encode()
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/predict", "raw_path": b"",
             "root_path": "", "query_string": b"", "server": ("127.0.0.1", 80),
             "client": ("127.0.0.1", 1), "headers": [(b"content-length", "²".encode("latin-1"))]}
    asyncio.run(build_app(live)(scope, receive, send))
    assert sent[0]["status"] == 200, sent


@contextlib.contextmanager
def _serving(app):
    """``app`` served over HTTP by uvicorn in a thread of this process; a connection to it."""
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    connection = http.client.HTTPConnection(*sock.getsockname()[:2], timeout=60)
    try:
        deadline = time.monotonic() + 60
        while not server.started:  # uvicorn sets it once it accepts connections
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield connection
    finally:
        connection.close()
        server.should_exit = True
        thread.join(60)
        sock.close()
