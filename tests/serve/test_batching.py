"""Dynamic batching of the prediction service, over real HTTP (uvicorn on loopback, keep-alive
clients in threads): requests queued together are scored in one model call, each gets exactly
its own predictions (flat samples and ranking trees side by side, a bad request refused
alone), every answer names the one version it was scored on while versions are applied, and a
lone request waits for nobody."""

import contextlib
import http.client
import json
import re
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
import uvicorn

import compression
import schemas
from trainer import models
from trainer.config import TrainConfig
from trainer.live import LiveModel
from trainer.serve import build_app, listen
from trainer.serving import Predictor, export_increment
from trainer.trainer import Trainer

SCHEMA = schemas.from_dict({"name": "batching_test", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"},
                                                  {"name": "age", "kind": "id"}]},
    {"name": "sample", "key": ["item"], "features": [{"name": "item", "kind": "id"}]}]})
CONFIG = TrainConfig.from_dict({"batch_size": 400, "seed": 5, "threads": 1,
                                "embedding": {"dim": 4, "optimizer": {"name": "adagrad",
                                                                      "lr": 0.2}}})
# every version trains these users and items again: an answer mixing versions is off
PROBE = [{"uid": u, "age": u % 5, "item": 100 + 7 * u} for u in range(12)]


def _train(trainer, seed, n=300):
    rng = np.random.default_rng(seed)
    uid = rng.integers(0, 40, n)
    rows = [{"uid": int(u), "age": int(u % 5), "item": int(i), "click": float(c)}
            for u, i, c in zip(uid, rng.integers(0, 300, n), rng.random(n) < 0.3)]
    rows += [{**p, "click": float((k + seed) % 2)} for k, p in enumerate(PROBE)]
    trees = compression.build_trees(pa.Table.from_pylist(rows), SCHEMA)
    for batch in compression.iter_batches(trees, SCHEMA, 400):
        trainer.train_batch(batch)


def _trainer():
    trainer = Trainer(SCHEMA, models.MLP(hidden=(8,)), CONFIG)
    _train(trainer, 0)
    return trainer


def _requests():
    """Flat and ranking requests of different sizes (and one bad one, at index 5)."""
    out = []
    for k in range(12):
        if k == 5:
            out.append({"samples": [PROBE[0], {**PROBE[1], "age": "old"}]})
        elif k % 2:
            out.append({"root": {"uid": k, "age": k % 5},
                        "candidates": [{"item": 100 + 7 * j} for j in range(k + 1)]})
        else:
            out.append({"samples": PROBE[k % 4:k % 4 + 3 + k]})
    return out


def _alone(live, request):
    """What the model answers to ``request`` scored on its own, in process."""
    if "samples" in request:
        return live.predict(request["samples"])[0][:, 0]
    return live.predict_tree(request["root"], request["candidates"])[0][:, 0]


def _post(connection, request):
    connection.request("POST", "/v1/predict", json.dumps(request).encode())
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def _metric(text, name):
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


@contextlib.contextmanager
def _serving(app):
    """``app`` served by uvicorn in a thread of this process; its address."""
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:  # uvicorn sets it once it accepts connections
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield sock.getsockname()[:2]
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
        if app.state.batcher is not None:
            app.state.batcher.close()


def _scrape(address):
    connection = http.client.HTTPConnection(*address, timeout=60)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    return text


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    export = tmp_path_factory.mktemp("batching") / "export"
    export_increment(_trainer(), export)
    return export


@pytest.fixture(scope="module")
def live(export):
    model = LiveModel(export)
    yield model
    model.close()


def _wait(condition, what):
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_requests_queued_together_are_one_model_call_and_each_gets_its_own(live):
    """The scoring thread is held (the version's pin waits) while every request but the first
    queues: they are then scored in one model call, flat samples and trees mixed, and each
    answer equals the model scoring that request alone; the bad one gets its own 400."""
    requests = _requests()
    app = build_app(live, max_batch_samples=4096, max_queue_delay=0.002)
    batcher = app.state.batcher
    answers = [None] * len(requests)
    with _serving(app) as address:
        def client(k):
            connection = http.client.HTTPConnection(*address, timeout=60)
            answers[k] = _post(connection, requests[k])
            connection.close()

        threads = [threading.Thread(target=client, args=(k,)) for k in range(len(requests))]
        with live._cond:  # the first call waits to pin its version: the others queue
            threads[0].start()
            _wait(lambda: batcher._decoding == 0 and batcher.queued == 0 and batcher._busy,
                  "the first request did not reach its call")
            for t in threads[1:]:
                t.start()
            # all but the bad request queue (it is refused in its worker thread, not queued)
            _wait(lambda: batcher.queued == len(requests) - 2, "requests did not queue")
        for t in threads:
            t.join(60)
        text = _scrape(address)
    status, bad = answers[5]
    assert status == 400 and bad["error"].startswith("sample 1: not a valid sample: field "
                                                     "'age'"), bad
    for k, (status, answer) in enumerate(answers):
        if k == 5:
            continue
        assert status == 200, answer
        assert answer["model"]["version"] == 0
        got = np.array([p["click"] for p in answer["predictions"]])
        np.testing.assert_allclose(got, _alone(live, requests[k]), rtol=2e-5, atol=1e-7)
    # two model calls for eleven good requests: the first alone, then the ten queued
    assert _metric(text, "prefixrec_serve_batch_requests_count") == 2
    assert _metric(text, "prefixrec_serve_batch_requests_sum") == len(requests) - 1
    assert _metric(text, 'prefixrec_serve_batch_requests_bucket{le="1.0"}') == 1
    sizes = [len(r.get("samples", r.get("candidates"))) for r in requests]
    assert _metric(text, "prefixrec_serve_batch_samples_sum") == sum(sizes) - sizes[5]
    assert 'prefixrec_serve_requests_total{endpoint="predict",status="400"} 1.0' in text


def test_a_lone_request_waits_for_nobody(live):
    """With a queue delay of a minute, a request alone is still scored at once: its model
    call holds it alone and its time in the queue is within the smallest bucket but one."""
    app = build_app(live, max_batch_samples=4096, max_queue_delay=60.0)
    with _serving(app) as address:
        connection = http.client.HTTPConnection(*address, timeout=120)
        for request in ({"samples": PROBE[:4]}, {"root": {"uid": 3, "age": 3},
                                                 "candidates": [{"item": 5}, {"item": 9}]}):
            status, answer = _post(connection, request)
            assert status == 200, answer
        connection.close()
        text = _scrape(address)
    assert _metric(text, "prefixrec_serve_batch_requests_count") == 2
    assert _metric(text, 'prefixrec_serve_batch_requests_bucket{le="1.0"}') == 2
    assert _metric(text, 'prefixrec_serve_queue_delay_seconds_bucket{le="0.25"}') == 2


def test_every_answer_is_one_version_while_versions_apply_under_concurrent_batches(tmp_path):
    """Clients send flat and ranking requests at once while the trainer publishes versions and
    the model applies them: every answer equals the named version's scoring of that request
    (no batch mixes versions), and calls joined requests (fewer calls than requests)."""
    export = tmp_path / "export"
    trainer = _trainer()
    export_increment(trainer, export)
    reference = Predictor(export)
    flat = {"samples": PROBE}
    tree = {"root": {"uid": 4, "age": 4}, "candidates": [{"item": 100 + 7 * j}
                                                         for j in range(12)]}
    rows = [{"uid": 4, "age": 4, **c} for c in tree["candidates"]]
    expected = {0: (reference.predict(PROBE), reference.predict(rows))}
    live = LiveModel(export)
    app = build_app(live, max_batch_samples=4096, max_queue_delay=0.002)
    seen, answers, errors, stop = threading.Condition(), [], [], threading.Event()
    try:
        with _serving(app) as address:
            def client(request, which):
                connection = http.client.HTTPConnection(*address, timeout=60)
                while not stop.is_set():
                    status, answer = _post(connection, request)
                    with seen:
                        if status != 200:
                            errors.append(answer)
                            stop.set()
                        else:
                            answers.append((which, answer["model"]["version"], np.array(
                                [p["click"] for p in answer["predictions"]])))
                        seen.notify_all()
                connection.close()

            clients = [threading.Thread(target=client, args=(r, w))
                       for r, w in ((flat, 0), (tree, 1)) * 3]
            for c in clients:
                c.start()
            try:
                for version in range(5):
                    if version:
                        _train(trainer, version)
                        assert export_increment(trainer, export)["version"] == version
                        reference.update()
                        expected[version] = (reference.predict(PROBE),
                                             reference.predict(rows))
                        assert live.poll() == 1
                    with seen:  # answers of this version, of both kinds
                        assert seen.wait_for(lambda: errors or {
                            w for w, v, _ in answers if v == version} == {0, 1}, 60)
                        assert not errors, errors
            finally:
                stop.set()
                for c in clients:
                    c.join(60)
            text = _scrape(address)
    finally:
        live.close()
    assert {v for _, v, _ in answers} == set(range(5))
    for which, version, got in answers:
        np.testing.assert_allclose(got, expected[version][which], rtol=2e-5, atol=1e-7)
    calls = _metric(text, "prefixrec_serve_batch_requests_count")
    assert _metric(text, "prefixrec_serve_batch_requests_sum") == len(answers)
    assert calls < len(answers)  # six clients at once: requests shared calls


def test_joined_trees_keep_each_request_s_nodes_parents_and_list_features():
    """A ranking request (one root, three candidates) and two flat samples joined: the root
    stays one node, parents point into the joined layer above, list features' offsets run on."""
    from compression import LayerBatch, TreeBatch

    def ids(values, offsets):
        return np.array(values, np.int64), np.array(offsets, np.int32)

    tree = TreeBatch([
        LayerBatch("user", 1, None, {"u": np.array([7]), "tags": ids([1, 2], [0, 2])}),
        LayerBatch("item", 3, np.zeros(3, np.int32), {"i": np.array([4, 5, 6]),
                                                      "d": np.ones((3, 2), np.float32)})],
        {"click": np.zeros(3, np.float32)})
    flat = TreeBatch([
        LayerBatch("user", 2, None, {"u": np.array([8, 9]), "tags": ids([3, 4, 5], [0, 1, 3])}),
        LayerBatch("item", 2, np.arange(2, dtype=np.int32), {
            "i": np.array([1, 2]), "d": np.zeros((2, 2), np.float32)})],
        {"click": np.zeros(2, np.float32)})
    joined = TreeBatch.concat([tree, flat])
    user, item = joined.layers
    assert user.size == 3 and item.size == 5 and joined.num_leaves == 5
    assert user.features["u"].tolist() == [7, 8, 9]
    values, offsets = user.features["tags"]
    assert values.tolist() == [1, 2, 3, 4, 5] and offsets.tolist() == [0, 2, 3, 5]
    assert item.parent.tolist() == [0, 0, 0, 1, 2]
    assert item.features["i"].tolist() == [4, 5, 6, 1, 2]
    assert item.features["d"].shape == (5, 2) and joined.labels["click"].shape == (5,)
