"""The prediction service's faces for other ecosystems' clients, each driven by that ecosystem's
own client: TF Serving's REST API (its documented JSON, over `requests`: TF Serving ships no
REST client), TF Serving's gRPC PredictionService (the stubs of PyPI tensorflow-serving-api,
tensors made by tf.make_tensor_proto, over a real channel) and the Open Inference Protocol
(tritonclient.http). One service for the module (uvicorn and the gRPC server in threads of
this process, one LiveModel, one Batcher); answers are checked against the model scoring the
same samples in process, refusals name the sample and the column, requests of every face
arriving together share one model call. A last test runs the command with --grpc-port 0."""

import asyncio
import contextlib
import json
import re
import signal
import threading
import time
from types import SimpleNamespace

import grpc
import numpy as np
import pyarrow as pa
import pytest
import requests
import tensorflow as tf
import tritonclient.http as triton
import uvicorn
from tensorflow_serving.apis import (get_model_metadata_pb2, predict_pb2,
                                     prediction_service_pb2_grpc)
from tritonclient.utils import InferenceServerException

import compression
import schemas
from service import Service
from trainer import models
from trainer.faces import tfserving
from trainer.config import TrainConfig
from trainer.live import LiveModel
from trainer.serve import build_app, listen
from trainer.serving import export_increment
from trainer.trainer import Trainer

NAME = "ctr"
# every kind of feature: int64 and string ids, a list of ids, a dense vector
SCHEMA = schemas.from_dict({"name": "faces_test", "labels": ["click", "buy"], "layers": [
    {"name": "user", "key": ["uid"], "features": [
        {"name": "uid", "kind": "id"}, {"name": "tags", "kind": "ids"}]},
    {"name": "sample", "key": ["item"], "features": [
        {"name": "item", "kind": "id"}, {"name": "pid", "kind": "id", "dtype": "string"},
        {"name": "price", "kind": "dense", "dim": 2}]}]})
CONFIG = TrainConfig.from_dict({"batch_size": 200, "seed": 9, "threads": 1,
                                "embedding": {"dim": 4, "optimizer": {"name": "adagrad",
                                                                      "lr": 0.2}}})


def _rows(n, seed):
    rng = np.random.default_rng(seed)
    return [{"uid": int(u), "tags": [int(t) for t in rng.integers(0, 50, int(k))],
             "item": int(i), "pid": f"p{int(i) % 7}",
             "price": [float(np.float32(p)) for p in rng.random(2)]}
            for u, k, i in zip(rng.integers(0, 30, n), rng.integers(0, 4, n),
                               rng.integers(0, 200, n))]


SAMPLES = _rows(7, 1)  # what the tests send


def _tensors(rows):
    """The samples as TF tensors, as a TF user makes them: a RaggedTensor for the list."""
    tags = tf.ragged.constant([r["tags"] for r in rows], dtype=tf.int64)
    return {"uid": tf.make_tensor_proto(np.array([r["uid"] for r in rows], np.int64)),
            "tags": tf.make_tensor_proto(tags.flat_values),
            "tags/row_lengths": tf.make_tensor_proto(tags.row_lengths()),
            "item": tf.make_tensor_proto(np.array([[r["item"]] for r in rows], np.int64)),
            "pid": tf.make_tensor_proto([r["pid"] for r in rows]),
            "price": tf.make_tensor_proto(np.array([r["price"] for r in rows], np.float32))}


def _triton_inputs(rows, binary=True):
    """The samples as OIP tensors made with tritonclient (binary data or JSON)."""
    lengths = np.array([len(r["tags"]) for r in rows], np.int64)
    arrays = {"uid": np.array([r["uid"] for r in rows], np.int64),
              "tags": np.array([t for r in rows for t in r["tags"]], np.int64),
              "tags/row_lengths": lengths,
              "item": np.array([r["item"] for r in rows], np.int64),
              "pid": np.array([r["pid"].encode() for r in rows], object),
              "price": np.array([r["price"] for r in rows], np.float32)}
    types = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32",
             np.dtype(object): "BYTES"}
    inputs = []
    for name, array in arrays.items():
        tensor = triton.InferInput(name, list(array.shape), types[array.dtype])
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    return inputs


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    rows = [{**r, "click": float(k % 3 == 0), "buy": float(k % 5 == 0)}
            for k, r in enumerate(_rows(400, 0) + SAMPLES)]
    trainer = Trainer(SCHEMA, models.MLP(hidden=(8,)), CONFIG)
    trees = compression.build_trees(pa.Table.from_pylist(rows), SCHEMA)
    for batch in compression.iter_batches(trees, SCHEMA, 200):
        trainer.train_batch(batch)
    export = tmp_path_factory.mktemp("faces") / "export"
    export_increment(trainer, export)
    return export


@pytest.fixture(scope="module")
def service(export):
    """One service: HTTP (every face) on uvicorn, gRPC on its own port, one batcher."""
    live = LiveModel(export)
    app = build_app(live, model_name=NAME, max_batch_samples=4096, max_queue_delay=0.002)
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    rpc, port = tfserving.grpc_server(app.state.core, "127.0.0.1", 0, 8)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while not server.started:  # uvicorn sets it once it accepts connections
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        host, http_port = sock.getsockname()[:2]
        yield SimpleNamespace(
            live=live, app=app, url=f"http://{host}:{http_port}", address=f"{host}:{http_port}",
            stub=prediction_service_pb2_grpc.PredictionServiceStub(channel),
            triton=triton.InferenceServerClient(f"{host}:{http_port}", concurrency=4),
            expected=live.predict(SAMPLES)[0], heads=live.version.base.heads)
    finally:
        channel.close()
        rpc.stop(10).wait()
        server.should_exit = True
        thread.join(60)
        sock.close()
        app.state.batcher.close()
        live.close()


def _metric(service, name):
    text = requests.get(service.url + "/metrics", timeout=60).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def _requests_total(service, endpoint, status):
    return _metric(service, f'prefixrec_serve_requests_total{{endpoint="{endpoint}",'
                            f'status="{status}"}}')


def _grpc_request(rows, name=NAME, **tensors):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = name
    for key, proto in {**_tensors(rows), **tensors}.items():
        if proto is not None:
            request.inputs[key].CopyFrom(proto)
    return request


# --- TF Serving REST --------------------------------------------------------------------------

def test_tf_serving_rest_predicts_rows_and_columns_on_the_served_version(service):
    before = _requests_total(service, "tfserving_rest", "200")
    answer = requests.post(f"{service.url}/v1/models/{NAME}:predict",
                           json={"signature_name": "serving_default", "instances": SAMPLES},
                           timeout=60)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["model_version"] == "0"
    np.testing.assert_allclose(body["predictions"], service.expected, rtol=2e-5, atol=1e-7)
    columns = {key: [r[key] for r in SAMPLES] for key in SAMPLES[0]}
    answer = requests.post(f"{service.url}/v1/models/{NAME}:predict",
                           json={"inputs": columns}, timeout=60)
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(answer.json()["outputs"], service.expected, rtol=2e-5,
                               atol=1e-7)
    assert _requests_total(service, "tfserving_rest", "200") == before + 2

    status = requests.get(f"{service.url}/v1/models/{NAME}", timeout=60)
    assert status.json() == {"model_version_status": [{
        "version": "0", "state": "AVAILABLE", "status": {"error_code": "OK",
                                                         "error_message": ""}}]}
    metadata = requests.get(f"{service.url}/v1/models/{NAME}/metadata", timeout=60).json()
    assert metadata["model_spec"] == {"name": NAME, "signature_name": "", "version": "0"}
    signature = metadata["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert signature["inputs"]["pid"]["dtype"] == "DT_STRING"
    assert signature["inputs"]["tags/row_lengths"]["dtype"] == "DT_INT64"
    assert [d["size"] for d in signature["inputs"]["price"]["tensor_shape"]["dim"]] == \
        ["-1", "2"]
    assert [d["size"] for d in signature["outputs"]["probabilities"]["tensor_shape"]["dim"]] \
        == ["-1", str(len(service.heads))]


@pytest.mark.parametrize("body, status, words", [
    ({"instances": SAMPLES[:2] + [{**SAMPLES[2], "uid": "u7"}]}, 400,
     "sample 2: not a valid sample: field 'uid': expected an integer"),
    ({"instances": [SAMPLES[0], {**SAMPLES[1], "price": [1.0]}]}, 400, "sample 1"),
    ({"instances": [{**SAMPLES[0], "colour": 1}]}, 400, "sample 0: not a valid sample: "
                                                        "unexpected field(s) 'colour'"),
    ({"inputs": {"uid": [1, 2], "item": [3]}}, 400, "'uid' holds 2, 'item' holds 1"),
    ({"inputs": {**{k: [SAMPLES[0][k]] for k in SAMPLES[0]}, "pid": [7]}}, 400,
     "sample 0: not a valid sample: field 'pid'"),
    ({"instances": SAMPLES, "inputs": {}}, 400, "not both"),
    ({"instances": []}, 400, "empty"),
    ({"signature_name": "other", "instances": SAMPLES}, 400, "serving_default"),
    (b'{"instances": [{"uid": 1,', 400, "malformed JSON"),
    (b'{"instances": [' + b"[" * 500 + b"]" * 500 + b"]}", 400,
     "sample 0: arrays and objects nested deeper than 64 levels"),
    ({"instances": SAMPLES * 2000}, 413, "the limit is 10000"),
])
def test_tf_serving_rest_refuses_a_bad_sample_naming_it_and_its_column(service, body, status,
                                                                       words):
    url = f"{service.url}/v1/models/{NAME}:predict"
    answer = requests.post(url, data=body, timeout=60) if isinstance(body, bytes) else \
        requests.post(url, json=body, timeout=60)
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"], answer.json()


def test_tf_serving_rest_answers_404_for_another_model_name(service):
    for method, path in (("post", "/v1/models/other:predict"), ("get", "/v1/models/other"),
                         ("get", "/v1/models/other/metadata")):
        answer = getattr(requests, method)(service.url + path, json={"instances": SAMPLES},
                                           timeout=60)
        assert answer.status_code == 404, answer.text
        assert "Servable not found" in answer.json()["error"]
        assert f"serves '{NAME}'" in answer.json()["error"]


# --- TF Serving gRPC --------------------------------------------------------------------------

def test_tf_serving_grpc_predicts_tensors_and_names_the_served_version(service):
    response = service.stub.Predict(_grpc_request(SAMPLES), timeout=60)
    assert response.model_spec.name == NAME and response.model_spec.HasField("version")
    assert response.model_spec.version.value == 0
    probabilities = tf.make_ndarray(response.outputs["probabilities"])
    assert probabilities.shape == (len(SAMPLES), len(service.heads))
    np.testing.assert_allclose(probabilities, service.expected, rtol=2e-5, atol=1e-7)
    # the version asked for is the one served
    request = _grpc_request(SAMPLES[:2])
    request.model_spec.version.value = 0
    request.model_spec.signature_name = "serving_default"
    response = service.stub.Predict(request, timeout=60)
    np.testing.assert_allclose(tf.make_ndarray(response.outputs["probabilities"]),
                               service.expected[:2], rtol=2e-5, atol=1e-7)

    metadata = get_model_metadata_pb2.GetModelMetadataRequest()
    metadata.model_spec.name = NAME
    metadata.metadata_field.append("signature_def")
    response = service.stub.GetModelMetadata(metadata, timeout=60)
    assert response.model_spec.version.value == 0
    signatures = get_model_metadata_pb2.SignatureDefMap()
    assert response.metadata["signature_def"].Unpack(signatures)
    signature = signatures.signature_def["serving_default"]
    assert set(signature.inputs) == {"uid", "tags", "tags/row_lengths", "item", "pid", "price"}
    assert signature.inputs["uid"].dtype == tf.int64.as_datatype_enum
    assert signature.outputs["probabilities"].dtype == tf.float32.as_datatype_enum


@pytest.mark.parametrize("tensors, code, words", [
    ({"uid": tf.make_tensor_proto(["a"] * len(SAMPLES))}, grpc.StatusCode.INVALID_ARGUMENT,
     "sample 0: not a valid sample: field 'uid': expected an integer"),
    ({"price": tf.make_tensor_proto(np.array([[0.5, np.nan]] * len(SAMPLES), np.float32))},
     grpc.StatusCode.INVALID_ARGUMENT, "sample 0: input 'price': nan is not a finite number"),
    ({"pid": tf.make_tensor_proto([b"ok"] * 4 + [b"\xff"] + [b"ok"] * 2)},
     grpc.StatusCode.INVALID_ARGUMENT, "sample 4: input 'pid': not valid UTF-8"),
    ({"tags/row_lengths": tf.make_tensor_proto(np.array([1, 0, 0, 0, 0, 0, 9], np.int64))},
     grpc.StatusCode.INVALID_ARGUMENT, "its 'tags/row_lengths' add up to 10"),
    ({"tags/row_lengths": tf.make_tensor_proto(np.array([0, -1, 0, 0, 0, 0, 0], np.int64))},
     grpc.StatusCode.INVALID_ARGUMENT, "sample 1: input 'tags/row_lengths': a negative"),
    ({"item": tf.make_tensor_proto(np.arange(3, dtype=np.int64))},
     grpc.StatusCode.INVALID_ARGUMENT, "holds 3"),
    ({"price": None}, grpc.StatusCode.INVALID_ARGUMENT, "sample 0: column 'price': null"),
    ({"colour": tf.make_tensor_proto(np.zeros(len(SAMPLES), np.int64))},
     grpc.StatusCode.INVALID_ARGUMENT, "sample 0: not a valid sample: unexpected field(s) "
                                       "'colour'"),
    ({"uid": tf.make_tensor_proto(7, shape=[1 << 30])}, grpc.StatusCode.RESOURCE_EXHAUSTED,
     "input 'uid': more than"),
    ({"uid": tf.make_tensor_proto(7, shape=[1 << 20])}, grpc.StatusCode.INVALID_ARGUMENT,
     "input 'uid': its shape holds 1048576 values, it carries"),
])
def test_tf_serving_grpc_refuses_bad_input_with_invalid_argument_naming_sample_and_column(
        service, tensors, code, words):
    with pytest.raises(grpc.RpcError) as refused:
        service.stub.Predict(_grpc_request(SAMPLES, **tensors), timeout=60)
    assert refused.value.code() == code, refused.value.details()
    assert words in refused.value.details(), refused.value.details()


def test_tf_serving_grpc_answers_not_found_for_another_model_or_version(service):
    before = _requests_total(service, "tfserving_grpc", "NOT_FOUND")
    with pytest.raises(grpc.RpcError) as refused:
        service.stub.Predict(_grpc_request(SAMPLES, name="other"), timeout=60)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert "Servable not found" in refused.value.details()
    request = _grpc_request(SAMPLES)
    request.model_spec.version.value = 3
    with pytest.raises(grpc.RpcError) as refused:
        service.stub.Predict(request, timeout=60)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert "the served version is 0" in refused.value.details()
    assert _requests_total(service, "tfserving_grpc", "NOT_FOUND") == before + 2


# --- Open Inference Protocol ------------------------------------------------------------------

def test_open_inference_protocol_with_tritonclient(service):
    client = service.triton
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(NAME) and not client.is_model_ready("other")
    metadata = client.get_model_metadata(NAME)
    assert metadata["versions"] == ["0"]
    assert {"name": "pid", "datatype": "BYTES", "shape": [-1]} in metadata["inputs"]
    assert metadata["outputs"] == [{"name": "probabilities", "datatype": "FP32",
                                    "shape": [-1, len(service.heads)]}]
    assert metadata["parameters"] == {"heads": service.heads}
    for binary in (True, False):  # the binary data extension (the client's default), JSON
        outputs = [triton.InferRequestedOutput("probabilities", binary_data=binary)]
        for asked in (None, outputs):
            result = client.infer(NAME, _triton_inputs(SAMPLES, binary), outputs=asked,
                                  request_id="r1")
            response = result.get_response()
            assert response["model_version"] == "0" and response["id"] == "r1"
            np.testing.assert_allclose(result.as_numpy("probabilities"), service.expected,
                                       rtol=2e-5, atol=1e-7)


def test_open_inference_protocol_refusals_name_sample_and_column(service):
    client = service.triton
    inputs = _triton_inputs(SAMPLES)
    bad = triton.InferInput("pid", [len(SAMPLES)], "INT64")
    bad.set_data_from_numpy(np.arange(len(SAMPLES), dtype=np.int64))
    with pytest.raises(InferenceServerException) as refused:
        client.infer(NAME, [i for i in inputs if i.name() != "pid"] + [bad])
    assert refused.value.status() == "400"
    assert "sample 0: not a valid sample: field 'pid': expected a string" in \
        refused.value.message(), refused.value.message()
    short = triton.InferInput("tags/row_lengths", [2], "INT64")
    short.set_data_from_numpy(np.array([1, 1], np.int64), binary_data=False)
    with pytest.raises(InferenceServerException) as refused:
        client.infer(NAME, [i for i in inputs if i.name() != "tags/row_lengths"] + [short])
    assert refused.value.status() == "400" and "'tags' holds 2" in refused.value.message()
    with pytest.raises(InferenceServerException) as refused:
        client.infer("other", inputs)
    assert refused.value.status() == "404" and "unknown model" in refused.value.message()
    with pytest.raises(InferenceServerException) as refused:
        client.infer(NAME, inputs, outputs=[triton.InferRequestedOutput("logits")])
    assert refused.value.status() == "400" and "no output 'logits'" in refused.value.message()
    # a value of the wrong kind for its datatype, in JSON data
    answer = requests.post(f"{service.url}/v2/models/{NAME}/infer", json={"inputs": [
        {"name": "uid", "shape": [2], "datatype": "INT64", "data": [1, "x"]}]}, timeout=60)
    assert answer.status_code == 400
    assert answer.json()["error"] == "input 'uid': value 1 is \"x\", not an integer " \
                                     "(datatype INT64)"
    # an integer beyond int64 gets the decoder's verdict, as on /v1/predict
    def json_inputs(uid):  # nested JSON data; every sample one tag: a [n, 1] tensor
        return {"inputs": [
            {"name": "uid", "shape": [2], "datatype": "INT64", "data": uid},
            {"name": "tags", "shape": [2, 1], "datatype": "INT64", "data": [[3], [4]]},
            {"name": "item", "shape": [2, 1], "datatype": "INT64", "data": [5, 6]},
            {"name": "pid", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]},
            {"name": "price", "shape": [2, 2], "datatype": "FP32",
             "data": [[0.5, 0.25], [1.0, 2.0]]}]}

    answer = requests.post(f"{service.url}/v2/models/{NAME}/infer", json=json_inputs([1, 2]),
                           timeout=60)
    assert answer.status_code == 200, answer.text
    rows = [{"uid": 1, "tags": [3], "item": 5, "pid": "a", "price": [0.5, 0.25]},
            {"uid": 2, "tags": [4], "item": 6, "pid": "b", "price": [1.0, 2.0]}]
    np.testing.assert_allclose(answer.json()["outputs"][0]["data"],
                               service.live.predict(rows)[0].reshape(-1), rtol=2e-5, atol=1e-7)
    answer = requests.post(f"{service.url}/v2/models/{NAME}/infer",
                           json=json_inputs([1, 2**64]), timeout=60)
    assert answer.status_code == 400
    assert "sample 1: not a valid sample: field 'uid': expected an integer (kind id, dtype " \
           "int64), got 18446744073709551616, out of the int64 range" in answer.json()["error"]


# --- every face, one batcher --------------------------------------------------------------------

def test_requests_of_every_face_arriving_together_share_one_model_call(service):
    """The scoring thread is held (the version's pin waits) while one request of each face
    queues: they are scored in one model call, each answer its own samples' predictions."""
    live, batcher = service.live, service.app.state.batcher
    calls = _metric(service, "prefixrec_serve_batch_requests_count")
    joined = _metric(service, "prefixrec_serve_batch_requests_sum")
    answers = {}

    def rest():
        answers["rest"] = requests.post(f"{service.url}/v1/models/{NAME}:predict",
                                        json={"instances": SAMPLES[:3]}, timeout=60).json()

    def own():
        answers["own"] = requests.post(f"{service.url}/v1/predict",
                                       json={"samples": SAMPLES[3:5]}, timeout=60).json()

    def rpc():
        answers["grpc"] = service.stub.Predict(_grpc_request(SAMPLES[2:6]), timeout=60)

    def oip():
        # a client of its own: tritonclient's connections are gevent's, bound to a thread
        client = triton.InferenceServerClient(service.address)
        answers["oip"] = client.infer(NAME, _triton_inputs(SAMPLES[1:7]))
        client.close()

    def first():
        answers["first"] = service.stub.Predict(_grpc_request(SAMPLES[:1]), timeout=60)

    threads = [threading.Thread(target=f) for f in (first, rest, own, rpc, oip)]
    with live._cond:  # the first call waits to pin its version: the others queue
        threads[0].start()
        _wait(lambda: batcher._decoding == 0 and batcher.queued == 0 and batcher._busy,
              "the first request did not reach its call")
        for t in threads[1:]:
            t.start()
        _wait(lambda: batcher.queued == 4, "the requests did not queue")
    for t in threads:
        t.join(60)
    expected = service.expected
    np.testing.assert_allclose(answers["rest"]["predictions"], expected[:3], rtol=2e-5,
                               atol=1e-7)
    own = [[p[h] for h in service.heads] for p in answers["own"]["predictions"]]
    np.testing.assert_allclose(own, expected[3:5], rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(tf.make_ndarray(answers["grpc"].outputs["probabilities"]),
                               expected[2:6], rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(answers["oip"].as_numpy("probabilities"), expected[1:7],
                               rtol=2e-5, atol=1e-7)
    assert answers["grpc"].model_spec.version.value == 0
    assert answers["oip"].get_response()["model_version"] == "0"
    # two model calls: the first request alone, then the four queued together
    assert _metric(service, "prefixrec_serve_batch_requests_count") == calls + 2
    assert _metric(service, "prefixrec_serve_batch_requests_sum") == joined + 5


def _wait(condition, what):
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


# --- before a model -----------------------------------------------------------------------------

def _asgi(app, method, path, body=b""):
    """``(status, JSON body)`` of ``app`` called as an ASGI server calls it."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "server": ("127.0.0.1", 80),
             "client": ("127.0.0.1", 1),
             "headers": [(b"content-length", str(len(body)).encode())]}
    asyncio.run(app(scope, receive, send))
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(text) if text else None


def test_before_a_model_is_loaded_every_face_answers_unavailable(tmp_path):
    live = LiveModel(tmp_path / "export")  # nothing exported yet
    app = build_app(live, model_name=NAME)
    rpc, port = tfserving.grpc_server(app.state.core, "127.0.0.1", 0, 2)
    try:
        rows = json.dumps({"instances": SAMPLES}).encode()
        for method, path, body in (("POST", f"/v1/models/{NAME}:predict", rows),
                                   ("GET", f"/v1/models/{NAME}", b""),
                                   ("GET", f"/v1/models/{NAME}/metadata", b""),
                                   ("POST", f"/v2/models/{NAME}/infer", b'{"inputs": []}'),
                                   ("GET", f"/v2/models/{NAME}", b""),
                                   ("GET", f"/v2/models/{NAME}/ready", b""),
                                   ("GET", "/v2/health/ready", b"")):
            status, answer = _asgi(app, method, path, body)
            assert status == 503, (path, answer)
        assert _asgi(app, "GET", "/v2/health/live")[0] == 200  # alive is not ready
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Predict(_grpc_request(SAMPLES), timeout=60)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no model loaded yet" in refused.value.details()
    finally:
        rpc.stop(0).wait()
        app.state.batcher.close()
        live.close()


# --- the command --------------------------------------------------------------------------------

def test_the_command_serves_grpc_on_a_free_port_and_counts_requests_per_face(export):
    """``--grpc-port 0`` picks a free port and says which; a request of each face is counted
    under its face in /metrics; SIGTERM stops both servers and exits 0."""
    with contextlib.ExitStack() as stack:
        service = Service(export, "--grpc-port", "0", "--model-name", NAME)
        stack.callback(service.stop, signal.SIGKILL)
        match = re.search(r"TF Serving gRPC \(PredictionService, model 'ctr'\) on "
                          r"127\.0\.0\.1:(\d+)", service.stderr)
        assert match, service.stderr
        channel = stack.enter_context(grpc.insecure_channel(f"127.0.0.1:{match.group(1)}"))
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        response = stub.Predict(_grpc_request(SAMPLES), timeout=60)
        assert response.model_spec.version.value == 0
        client = triton.InferenceServerClient(f"127.0.0.1:{service.port}")
        result = client.infer(NAME, _triton_inputs(SAMPLES))
        np.testing.assert_allclose(result.as_numpy("probabilities"),
                                   tf.make_ndarray(response.outputs["probabilities"]),
                                   rtol=1e-6)
        status, _ = service.request("POST", f"/v1/models/{NAME}:predict",
                                    {"instances": [{**SAMPLES[0], "uid": "x"}]})
        assert status == 400
        for face, status in (("tfserving_grpc", "OK"), ("oip", "200"),
                             ("tfserving_rest", "400")):
            assert service.metric(f'prefixrec_serve_requests_total{{endpoint="{face}",'
                                  f'status="{status}"}}') == 1
        assert service.stop() == 0
        assert "Traceback" not in service.stderr, service.stderr
