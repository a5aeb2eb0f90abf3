"""TF Serving's faces: its REST API (``/v1/models/NAME:predict``, model status and metadata) and
its gRPC ``PredictionService`` (``Predict``, ``GetModelMetadata``; protos and stubs from PyPI
tensorflow-serving-api), over the service's decoder and batcher (:mod:`trainer.faces`)."""

from __future__ import annotations

import json
import time
import traceback

import numpy as np

from native.json_envelope import MalformedJsonError, scan_envelope
from trainer.faces import OUTPUT, SIGNATURE, TFSERVING_GRPC, TFSERVING_REST, Core
from trainer.faces.columns import input_tensors, samples_request, tensor_columns
from trainer.requests import MAX_DEPTH, BadRequest, RequestBody, malformed_message


def rest_request(body: bytes, max_samples: int):
    """A TF Serving REST predict body: ``(RequestBody, "instances" | "inputs")``."""
    try:
        envelope = scan_envelope(body, ("instances", "inputs", "signature_name"),
                                 max_depth=MAX_DEPTH, max_elements=max_samples)
    except MalformedJsonError as e:
        raise BadRequest(malformed_message(e, {"instances": "sample"})) from None
    members = envelope.members
    if not envelope.is_object:
        raise BadRequest('the body must be a JSON object: {"instances": [{...}, ...]} or '
                         '{"inputs": {"feature": [...], ...}}')
    if "signature_name" in members:
        span = members["signature_name"]
        if json.loads(body[span.start:span.end]) not in ("", SIGNATURE):
            raise BadRequest(f"signature_name: the model has one signature, {SIGNATURE!r}")
    if "instances" in members and "inputs" in members:
        raise BadRequest('give either "instances" (rows) or "inputs" (columns), not both')
    if "instances" in members:
        items = members["instances"]
        if not items.is_array:
            raise BadRequest('"instances" must be a list of objects, one sample each')
        if items.count == 0:
            raise BadRequest('"instances" is empty: nothing to score')
        if items.count > max_samples:
            raise BadRequest(f"{items.count} instances in one request; the limit is "
                             f"{max_samples} (--max-samples): split the request", status=413)
        return RequestBody(body, "samples", items.starts, items.ends), "instances"
    if "inputs" not in members:
        raise BadRequest('no "instances" (or "inputs") in the request')
    inputs = json.loads(body)["inputs"]  # valid JSON of bounded depth: scanned above
    if not isinstance(inputs, dict) or not inputs or \
            not all(isinstance(v, list) for v in inputs.values()):
        raise BadRequest('"inputs" must be an object: feature -> a list of its values, one per '
                         "sample")
    n = len(next(iter(inputs.values())))
    other = next((k for k, v in inputs.items() if len(v) != n), None)
    if other is not None:
        raise BadRequest(f"inputs disagree on the number of samples: {next(iter(inputs))!r} "
                         f"holds {n}, {other!r} holds {len(inputs[other])}")
    if n == 0:
        raise BadRequest('"inputs" hold no sample: nothing to score')
    return samples_request(inputs, n, max_samples), "inputs"


def _version_status(core: Core) -> dict | None:
    version = core.live.version
    if version is None:
        return None
    return {"model_version_status": [{"version": str(version.number), "state": "AVAILABLE",
                                      "status": {"error_code": "OK", "error_message": ""}}]}


def _signature(schema, heads: list[str]):
    """The model's one signature (TF's SignatureDef): a TensorInfo per input tensor."""
    from tensorflow.core.framework import tensor_shape_pb2, types_pb2
    from tensorflow.core.protobuf import meta_graph_pb2

    def info(name, dtype, *dims):
        return meta_graph_pb2.TensorInfo(name=name, dtype=dtype, tensor_shape=(
            tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(
                size=d) for d in dims])))

    signature = meta_graph_pb2.SignatureDef(method_name="tensorflow/serving/predict")
    for name, dtype, dims in input_tensors(schema):
        signature.inputs[name].CopyFrom(info(name, getattr(types_pb2, dtype), *dims))
    signature.outputs[OUTPUT].CopyFrom(info(OUTPUT, types_pb2.DT_FLOAT, -1, len(heads)))
    return signature


def _signature_map(core: Core):
    from tensorflow_serving.apis import get_model_metadata_pb2

    version = core.live.version
    signatures = get_model_metadata_pb2.SignatureDefMap()
    signatures.signature_def[SIGNATURE].CopyFrom(
        _signature(version.base.schema, version.base.heads))
    return version, signatures


def rest_routes(core: Core) -> list:
    """The REST API's endpoints (Starlette routes)."""
    from google.protobuf import json_format
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def unknown(name, endpoint=None):
        return core.unknown_model(f"Servable not found for request: Latest({name})", endpoint)

    def no_model():
        return Response(json.dumps({"error": f"no model loaded yet: {core.live.problem}"}),
                        status_code=503, media_type="application/json")

    async def predict(request):
        started = time.perf_counter()
        body = await core.read_body(request, TFSERVING_REST)  # read first, whatever the answer
        if isinstance(body, Response):
            return body
        name = request.path_params["name"]
        if name != core.model_name:
            return unknown(name, TFSERVING_REST)
        form = []

        def make():
            version = core.live.version
            if version is None:
                raise BadRequest(f"no model loaded yet: {core.live.problem}", status=503)
            request_body, kind = rest_request(body, core.max_samples)
            form.append(kind)
            return request_body

        def render(kind, probabilities, info):
            member = "predictions" if form[0] == "instances" else "outputs"
            return JSONResponse({member: probabilities.tolist(),
                                 "model_version": str(info["version"])})

        return await core.answer(TFSERVING_REST, started, make, render)

    async def status(request):
        name = request.path_params["name"]
        if name != core.model_name:
            return unknown(name)
        answer = _version_status(core)
        return no_model() if answer is None else JSONResponse(answer)

    async def metadata(request):
        name = request.path_params["name"]
        if name != core.model_name:
            return unknown(name)
        if core.live.version is None:
            return no_model()
        version = core.live.version
        # TF Serving's SignatureDefMap in JSON, made without its package (the gRPC face's)
        signature = _signature(version.base.schema, version.base.heads)
        return JSONResponse({
            "model_spec": {"name": core.model_name, "signature_name": "",
                           "version": str(version.number)},
            "metadata": {"signature_def": {"signature_def": {
                SIGNATURE: json_format.MessageToDict(signature,
                                                     preserving_proto_field_name=True)}}}})

    return [Route("/v1/models/{name}:predict", predict, methods=["POST"]),
            Route("/v1/models/{name}/metadata", metadata, methods=["GET"]),
            Route("/v1/models/{name}", status, methods=["GET"])]


def _tensor_array(name: str, proto, limit: int) -> np.ndarray:
    """A TensorProto as an array. A shape above ``limit`` elements, or holding more elements
    than the tensor has bytes, is refused before it is made: every value sent costs a byte at
    least, and a TensorProto's last value repeated over a large shape would cost the service
    the memory the client did not send."""
    import tensorflow as tf

    if proto.tensor_shape.unknown_rank:
        raise BadRequest(f"input {name!r}: a tensor of unknown rank")
    count = 1
    for d in proto.tensor_shape.dim:
        if d.size < 0:
            raise BadRequest(f"input {name!r}: dimension of size {d.size}")
        count *= d.size
        if count > limit:
            raise BadRequest(f"input {name!r}: more than {limit} elements", status=413)
    if count > proto.ByteSize():
        raise BadRequest(f"input {name!r}: its shape holds {count} values, it carries "
                         f"{proto.ByteSize()} bytes: give every value (the repetition of a "
                         "tensor's last value is not read)")
    try:
        return tf.make_ndarray(proto)
    except Exception as e:  # noqa: BLE001 - whatever the proto's fault, the client's
        raise BadRequest(f"input {name!r}: not a valid tensor: {e}") from None


def grpc_server(core: Core, host: str, port: int, threads: int):
    """The TF Serving gRPC face, started: ``(grpc.Server, the port bound)``. Raises
    ImportError without tensorflow-serving-api, RuntimeError when the port cannot be bound."""
    from concurrent import futures

    import grpc
    import tensorflow as tf
    from tensorflow_serving.apis import (get_model_metadata_pb2, predict_pb2,
                                         prediction_service_pb2_grpc)

    codes = {400: grpc.StatusCode.INVALID_ARGUMENT, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
             503: grpc.StatusCode.UNAVAILABLE}
    requests = core.metrics["requests"]
    from compression import RawDataError

    def check_spec(spec):
        """Abort unless ``spec`` names the served model (and version, if it names one)."""
        problem = None
        if spec.name != core.model_name:
            problem = (grpc.StatusCode.NOT_FOUND,
                       f"Servable not found for request: Latest({spec.name}): this service "
                       f"serves {core.model_name!r} (--model-name)")
        elif spec.signature_name not in ("", SIGNATURE):
            problem = (grpc.StatusCode.INVALID_ARGUMENT,
                       f"signature_name {spec.signature_name!r}: the model has one signature, "
                       f"{SIGNATURE!r}")
        elif core.live.version is None:
            problem = (grpc.StatusCode.UNAVAILABLE, f"no model loaded yet: {core.live.problem}")
        elif spec.HasField("version_label"):
            problem = (grpc.StatusCode.NOT_FOUND, "the service serves its newest version and "
                                                  "has no version labels")
        elif spec.HasField("version") and spec.version.value != core.live.version.number:
            problem = (grpc.StatusCode.NOT_FOUND,
                       f"Servable not found for request: Specific({spec.name}, "
                       f"{spec.version.value}): the served version is "
                       f"{core.live.version.number}")
        return problem

    class Servicer(prediction_service_pb2_grpc.PredictionServiceServicer):
        def Predict(self, request, context):
            started = time.perf_counter()
            problem = check_spec(request.model_spec)
            if problem is None:
                unknown = [n for n in request.output_filter if n != OUTPUT]
                if unknown:
                    problem = (grpc.StatusCode.INVALID_ARGUMENT,
                               f"output_filter: no output {unknown[0]!r}; the model's output is "
                               f"{OUTPUT!r}")
            if problem is None:
                def make():
                    version = core.live.version
                    if version is None:
                        raise BadRequest(f"no model loaded yet: {core.live.problem}", 503)
                    arrays = {name: _tensor_array(name, proto, core.max_body_bytes)
                              for name, proto in request.inputs.items()}
                    columns, n = tensor_columns(arrays, version.base.schema)
                    return samples_request(columns, n, core.max_samples)

                core.metrics["in_flight"].inc()
                try:
                    kind, probabilities, info = core.score_blocking(make)
                except BadRequest as e:
                    problem = (codes.get(e.status, grpc.StatusCode.INVALID_ARGUMENT), str(e))
                except RawDataError as e:
                    problem = (grpc.StatusCode.INVALID_ARGUMENT, str(e))
                except Exception as e:  # noqa: BLE001 - a fault of ours
                    traceback.print_exc()
                    core.metrics["internal_errors"].inc()
                    problem = (grpc.StatusCode.INTERNAL,
                               f"internal error: {type(e).__name__}: {e}")
                finally:
                    core.metrics["in_flight"].dec()
            if problem is not None:
                requests.labels(TFSERVING_GRPC, problem[0].name).inc()
                context.abort(*problem)
            response = predict_pb2.PredictResponse()
            response.model_spec.name = core.model_name
            response.model_spec.signature_name = SIGNATURE
            response.model_spec.version.value = info["version"]
            response.outputs[OUTPUT].CopyFrom(tf.make_tensor_proto(probabilities))
            core.metrics["samples"].inc(len(probabilities))
            core.metrics["latency"].labels(kind).observe(time.perf_counter() - started)
            requests.labels(TFSERVING_GRPC, "OK").inc()
            return response

        def GetModelMetadata(self, request, context):
            problem = check_spec(request.model_spec)
            fields = list(request.metadata_field)
            if problem is None and fields != ["signature_def"]:
                problem = (grpc.StatusCode.INVALID_ARGUMENT,
                           f"metadata_field {fields}: the service has 'signature_def' only")
            if problem is not None:
                context.abort(*problem)
            version, signatures = _signature_map(core)
            response = get_model_metadata_pb2.GetModelMetadataResponse()
            response.model_spec.name = core.model_name
            response.model_spec.version.value = version.number
            response.metadata["signature_def"].Pack(signatures)
            return response

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc"),
        options=[("grpc.max_receive_message_length", core.max_body_bytes),
                 ("grpc.so_reuseport", 0)])
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(Servicer(), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_insecure_port(address)
    if not bound:  # grpcio versions that answer 0 instead of raising
        raise RuntimeError(f"Failed to bind to address {address}")
    server.start()
    return server, bound
