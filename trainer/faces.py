"""The prediction service's faces for the clients other ecosystems already have.

    TF Serving REST  POST /v1/models/NAME:predict  {"instances": [{...}, ...]} or
                                                   {"inputs": {"feature": [...], ...}}
                     GET  /v1/models/NAME, /v1/models/NAME/metadata
    TF Serving gRPC  tensorflow.serving.PredictionService/Predict, /GetModelMetadata
                     (``--grpc-port``; stubs and protos: PyPI tensorflow-serving-api)
    Open Inference   POST /v2/models/NAME/infer, GET /v2/models/NAME, /v2/models/NAME/ready,
    Protocol (v2)    /v2/health/live, /v2/health/ready, /v2 (KServe, Triton: tritonclient.http)

``NAME`` is the service's ``--model-name`` (default ``prefixrec``); another name is answered as
those servers answer an unknown model (HTTP 404, gRPC ``NOT_FOUND``). Every face scores flat
samples (each one its own tree, as ``/v1/predict``'s ``{"samples": [...]}``): a face's request
becomes the service's own ``{"samples": [...]}`` body, decoded by the same native decoder
(:mod:`trainer.requests`) and queued in the same :class:`trainer.batching.Batcher`, so
requests of every face that arrive together share one model call on one version, and a bad
sample gets the verdict it gets on ``/v1/predict``, naming the sample and its column
(``sample 3: not a valid sample: field 'uid': expected an integer ...``): HTTP 400
``{"error": ...}`` on REST and OIP, gRPC ``INVALID_ARGUMENT``. Too many samples: 413 /
``RESOURCE_EXHAUSTED``; no model loaded yet: 503 / ``UNAVAILABLE``.

Tensors (gRPC and OIP): one tensor per feature, named by the feature, the batch dimension
first. An ``id`` feature: rank 1 ``[n]`` (``[n, 1]`` is taken too), DT_INT64 / INT64 (any
integer type) or, for ``dtype: string``, DT_STRING / BYTES of UTF-8. A ``dense`` feature of
``dim`` d: ``[n, d]`` floats (``[n]`` when d is 1). An ``ids`` feature (a list per sample):
a ragged pair, the values of all samples one after another in ``NAME`` (rank 1) and each
sample's count in ``NAME/row_lengths`` (``[n]``, integers): what ``tf.RaggedTensor``'s
``flat_values`` and ``row_lengths()`` are; a rank-2 ``NAME`` ``[n, k]`` without row lengths
gives every sample a list of k. The answer: ``probabilities``, FP32 / DT_FLOAT ``[n, heads]``,
the columns in the order of the model's heads (``GET /v1/model``), with the served version
(gRPC ``model_spec.version``, OIP ``model_version``, REST ``model_version``).
"""

from __future__ import annotations

import json
import struct
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import numpy as np

from native.json_envelope import MalformedJsonError, scan_envelope
from trainer.requests import (MAX_DEPTH, BadRequest, RequestBody, malformed_message,
                              scan_request)

OUTPUT = "probabilities"
SIGNATURE = "serving_default"
ROW_LENGTHS = "/row_lengths"
DEFAULT_MODEL_NAME = "prefixrec"
# endpoint labels of prefixrec_serve_requests_total
TFSERVING_REST, TFSERVING_GRPC, OIP = "tfserving_rest", "tfserving_grpc", "oip"
# OIP datatypes: numpy type of their binary data (BYTES: 4-byte length, then the bytes)
DATATYPES = {"BOOL": "?", "UINT8": "u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
             "INT8": "i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "FP16": "<f2",
             "FP32": "<f4", "FP64": "<f8", "BYTES": None}


@dataclass
class Core:
    """What the faces share with ``/v1/predict`` (made by :func:`trainer.serve.build_app`):
    ``answer(endpoint, started, make, render)`` answers an HTTP predict request whose
    ``make()`` (run in a worker thread) gives a :class:`trainer.requests.RequestBody`;
    ``score_blocking(make)`` scores one from a thread that may block; ``read_body(request,
    endpoint)`` is the body or the refusal to send; ``refuse(status, message, endpoint)``."""

    live: object
    model_name: str
    max_samples: int
    max_body_bytes: int
    metrics: dict
    answer: Callable
    score_blocking: Callable
    read_body: Callable
    refuse: Callable


def predict_endpoint(path: str) -> str | None:
    """The metrics label of a face's predict path (it reads its own body), else None."""
    if path.startswith("/v1/models/") and path.endswith(":predict"):
        return TFSERVING_REST
    if path.startswith("/v2/models/") and path.endswith("/infer"):
        return OIP
    return None


# --- columns of per-sample values -> the service's own request --------------------------------

def samples_request(columns: dict[str, list], n: int, max_samples: int):
    """Columns of per-sample JSON values (a value, or a list for a list feature) as the
    service's ``{"samples": [...]}`` body, scanned: :meth:`trainer.live.LiveModel.decode`
    decodes it as it decodes ``/v1/predict``'s bodies."""
    if n > max_samples:
        raise BadRequest(f"{n} samples in one request; the limit is {max_samples} "
                         "(--max-samples): split the request", status=413)
    names = list(columns)
    rows = [dict(zip(names, values)) for values in zip(*columns.values())] if names else \
        [{}] * n
    body = json.dumps({"samples": rows}, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode()
    return scan_request(body, max_samples)


def tensor_columns(arrays: dict[str, np.ndarray], schema) -> tuple[dict[str, list], int]:
    """Tensors keyed by feature (the encoding of the module's doc) as columns of per-sample
    values and the number of samples; :class:`BadRequest` names the input (and the sample)."""
    features = {f.name: f for f in schema.features}
    lengths = {name[:-len(ROW_LENGTHS)]: a for name, a in arrays.items()
               if name.endswith(ROW_LENGTHS)}
    for name in lengths:
        if name not in arrays:
            raise BadRequest(f"input {name + ROW_LENGTHS!r} without the values it splits: give "
                             f"{name!r} too (all samples' values, one after another)")
    sizes = {}
    for name, a in arrays.items():
        if name.endswith(ROW_LENGTHS):
            continue
        if name in lengths:
            if lengths[name].ndim != 1:
                raise BadRequest(f"input {name + ROW_LENGTHS!r}: shape "
                                 f"{list(lengths[name].shape)}; row lengths are one count per "
                                 "sample (rank 1)")
            sizes[name] = len(lengths[name])
        elif a.ndim == 0:
            raise BadRequest(f"input {name!r}: a scalar; give one value per sample, the batch "
                             "dimension first")
        else:
            sizes[name] = a.shape[0]
    if not sizes:
        raise BadRequest("no inputs: give one tensor per feature, named by the feature")
    n = next(iter(sizes.values()))
    other = next((name for name, size in sizes.items() if size != n), None)
    if other is not None:
        first = next(iter(sizes))
        raise BadRequest(f"inputs disagree on the number of samples (their first dimension): "
                         f"{first!r} holds {n}, {other!r} holds {sizes[other]}")
    columns = {}
    for name, a in arrays.items():
        if name.endswith(ROW_LENGTHS):
            continue
        if name in lengths:
            columns[name] = _ragged(name, a, lengths[name])
            continue
        feature = features.get(name)
        if feature is not None and feature.kind == "id" and a.ndim == 2 and a.shape[1] == 1:
            a = a[:, 0]
        elif feature is not None and feature.kind == "dense" and feature.dim == 1 and \
                a.ndim == 1:
            a = a[:, None]
        if a.ndim > 2:
            raise BadRequest(f"input {name!r}: shape {list(a.shape)}; a feature is a tensor of "
                             "rank 1 (a value per sample) or 2 (a list per sample)")
        width = a.shape[1] if a.ndim == 2 else 1
        flat = _values(name, a.reshape(-1), lambda i: i // max(width, 1))
        columns[name] = flat if a.ndim == 1 else \
            [flat[i * width:(i + 1) * width] for i in range(a.shape[0])]
    return columns, n


def _ragged(name: str, values: np.ndarray, lengths: np.ndarray) -> list:
    """A ragged pair's per-sample lists."""
    label = name + ROW_LENGTHS
    if lengths.dtype.kind not in "iu":
        raise BadRequest(f"input {label!r}: integers expected (DT_INT64, INT64), got "
                         f"{lengths.dtype}")
    if values.ndim != 1:
        raise BadRequest(f"input {name!r} (with {label!r}): all samples' values one after "
                         f"another (rank 1), got shape {list(values.shape)}")
    negative = np.flatnonzero(lengths < 0) if lengths.dtype.kind == "i" else []
    if len(negative):
        raise BadRequest(f"sample {negative[0]}: input {label!r}: a negative length "
                         f"{lengths[negative[0]]}")
    if len(lengths) and lengths.max() > len(values):
        raise BadRequest(f"input {name!r}: {len(values)} values, fewer than {label!r} gives "
                         f"one sample ({lengths.max()})")
    offsets = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))])
    if offsets[-1] != len(values):
        raise BadRequest(f"input {name!r}: {len(values)} values, its {label!r} add up to "
                         f"{offsets[-1]}")
    flat = _values(name, values, lambda i: int(np.searchsorted(offsets, i, side="right")) - 1)
    bounds = offsets.tolist()
    return [flat[bounds[i]:bounds[i + 1]] for i in range(len(lengths))]


def _values(name: str, flat: np.ndarray, sample_of) -> list:
    """A rank-1 array as JSON values; ``sample_of(i)``: the sample of element i."""
    kind = flat.dtype.kind
    if kind in "iub":
        return flat.tolist()
    if kind == "f":
        bad = np.flatnonzero(~np.isfinite(flat))
        if len(bad):
            raise BadRequest(f"sample {sample_of(int(bad[0]))}: input {name!r}: "
                             f"{flat[bad[0]]} is not a finite number")
        return flat.tolist()
    if kind in "OSU":
        out = flat.tolist()
        for i, v in enumerate(out):
            if isinstance(v, bytes):
                try:
                    out[i] = v.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise BadRequest(f"sample {sample_of(i)}: input {name!r}: not valid UTF-8 "
                                     f"({e.reason} at byte {e.start})") from None
            elif not isinstance(v, str):
                raise BadRequest(f"sample {sample_of(i)}: input {name!r}: expected a string, "
                                 f"got {type(v).__name__}")
        return out
    raise BadRequest(f"input {name!r}: values of type {flat.dtype} are no feature's; give "
                     "integers, floats or strings")


# --- TF Serving: REST ---------------------------------------------------------------------------

def rest_request(body: bytes, schema, max_samples: int):
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
    for name, dtype, dims in _inputs(schema):
        signature.inputs[name].CopyFrom(info(name, getattr(types_pb2, dtype), *dims))
    signature.outputs[OUTPUT].CopyFrom(info(OUTPUT, types_pb2.DT_FLOAT, -1, len(heads)))
    return signature


def _inputs(schema) -> list[tuple[str, str, tuple]]:
    """``(tensor name, TF dtype, shape)`` of every input tensor of the schema's features."""
    out = []
    for f in schema.features:
        dtype = "DT_STRING" if f.dtype == "string" else "DT_INT64"
        if f.kind == "id":
            out.append((f.name, dtype, (-1,)))
        elif f.kind == "dense":
            out.append((f.name, "DT_FLOAT", (-1, f.dim)))
        else:
            out += [(f.name, dtype, (-1,)), (f.name + ROW_LENGTHS, "DT_INT64", (-1,))]
    return out


def _signature_map(core: Core):
    from tensorflow_serving.apis import get_model_metadata_pb2

    version = core.live.version
    signatures = get_model_metadata_pb2.SignatureDefMap()
    signatures.signature_def[SIGNATURE].CopyFrom(
        _signature(version.base.schema, version.base.heads))
    return version, signatures


def rest_routes(core: Core) -> list:
    from google.protobuf import json_format
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def unknown(name, endpoint=None):
        message = f"Servable not found for request: Latest({name}): this service serves " \
                  f"{core.model_name!r} (--model-name)"
        if endpoint is not None:
            return core.refuse(404, message, endpoint)
        return Response(json.dumps({"error": message}), status_code=404,
                        media_type="application/json")

    def no_model():
        return Response(json.dumps({"error": f"no model loaded yet: {core.live.problem}"}),
                        status_code=503, media_type="application/json")

    async def predict(request):
        started = time.perf_counter()
        name = request.path_params["name"]
        if name != core.model_name:
            return unknown(name, TFSERVING_REST)
        body = await core.read_body(request, TFSERVING_REST)
        if isinstance(body, Response):
            return body
        form = []

        def make():
            version = core.live.version
            if version is None:
                raise BadRequest(f"no model loaded yet: {core.live.problem}", status=503)
            request_body, kind = rest_request(body, version.base.schema, core.max_samples)
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
        version, signatures = _signature_map(core)
        return JSONResponse({
            "model_spec": {"name": core.model_name, "signature_name": "",
                           "version": str(version.number)},
            "metadata": {"signature_def": json_format.MessageToDict(
                signatures, preserving_proto_field_name=True)}})

    return [Route("/v1/models/{name}:predict", predict, methods=["POST"]),
            Route("/v1/models/{name}/metadata", metadata, methods=["GET"]),
            Route("/v1/models/{name}", status, methods=["GET"])]


# --- TF Serving: gRPC ---------------------------------------------------------------------------

def _tensor_array(name: str, proto, limit: int) -> np.ndarray:
    """A TensorProto as an array; a shape above ``limit`` elements is refused before it is
    made (one value may be repeated to any shape)."""
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

    def check_spec(spec, context):
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
            problem = check_spec(request.model_spec, context)
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
            problem = check_spec(request.model_spec, context)
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


# --- Open Inference Protocol (KServe v2) ---------------------------------------------------------

def oip_arrays(header: dict, binary: bytes, limit: int) -> dict[str, np.ndarray]:
    """The request's input tensors as arrays (JSON ``data``, or the binary data extension's
    bytes after the JSON header)."""
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest('"inputs" must be a list of tensors {"name", "shape", "datatype", '
                         '"data"}, one per feature')
    arrays, at = {}, 0
    for k, tensor in enumerate(inputs):
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise BadRequest(f"inputs[{k}]: a tensor is an object with a \"name\"")
        name = tensor["name"]
        if name in arrays:
            raise BadRequest(f"input {name!r} given twice")
        shape, datatype = tensor.get("shape"), tensor.get("datatype")
        if not isinstance(shape, list) or not all(
                type(d) is int and d >= 0 for d in shape):
            raise BadRequest(f"input {name!r}: \"shape\" must be a list of sizes")
        if datatype not in DATATYPES:
            raise BadRequest(f"input {name!r}: datatype {datatype!r}; one of "
                             f"{', '.join(DATATYPES)}")
        count = int(np.prod(shape, dtype=np.float64))
        if count > limit:
            raise BadRequest(f"input {name!r}: more than {limit} elements", status=413)
        parameters = tensor.get("parameters") or {}
        size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
        if size is not None:
            if type(size) is not int or size < 0 or at + size > len(binary):
                raise BadRequest(f"input {name!r}: binary_data_size {size!r} beyond the "
                                 f"{len(binary) - at} bytes left after the JSON header")
            array = _binary(name, binary[at:at + size], datatype, count)
            at += size
        elif "data" in tensor:
            array = _json_data(name, tensor["data"], datatype, count)
        else:
            raise BadRequest(f"input {name!r}: no \"data\" (nor binary_data_size)")
        arrays[name] = array.reshape(shape)
    if at != len(binary):
        raise BadRequest(f"{len(binary) - at} bytes after the JSON header that no input's "
                         "binary_data_size claims")
    return arrays


def _json_data(name: str, data, datatype: str, count: int) -> np.ndarray:
    flat, stack = [], [data]
    while stack:  # nested lists, row-major (depth bounded by the scan of the body)
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            flat.append(item)
    if len(flat) != count:
        raise BadRequest(f"input {name!r}: {len(flat)} values, its shape holds {count}")
    if datatype == "BYTES":
        ok, expected, dtype = str, "a string", object
    elif datatype == "BOOL":
        ok, expected, dtype = bool, "true or false", bool
    elif datatype.startswith("FP"):
        ok, expected, dtype = (int, float), "a number", np.float64
    else:
        ok, expected, dtype = int, "an integer", object
    for i, v in enumerate(flat):
        if type(v) not in (ok if isinstance(ok, tuple) else (ok,)):
            raise BadRequest(f"input {name!r}: value {i} is {json.dumps(v)[:40]}, not "
                             f"{expected} (datatype {datatype})")
    if dtype is object:  # integers keep their value whatever their size: the decoder judges it
        array = np.empty(len(flat), object)
        array[:] = flat
        return array if datatype == "BYTES" else _integers(array)
    return np.array(flat, dtype)


def _integers(array: np.ndarray) -> np.ndarray:
    """Python integers as int64 when they fit (else kept: the decoder names the one beyond)."""
    try:
        return array.astype(np.int64)
    except OverflowError:
        return array


def _binary(name: str, data: bytes, datatype: str, count: int) -> np.ndarray:
    if datatype != "BYTES":
        dtype = np.dtype(DATATYPES[datatype])
        if len(data) != count * dtype.itemsize:
            raise BadRequest(f"input {name!r}: {len(data)} bytes of binary data, its shape and "
                             f"datatype take {count * dtype.itemsize}")
        return np.frombuffer(data, dtype).astype(dtype.newbyteorder("="))
    out, at = [], 0
    while at < len(data):
        if at + 4 > len(data):
            raise BadRequest(f"input {name!r}: BYTES data cut inside an element's length")
        size, = struct.unpack_from("<I", data, at)
        if at + 4 + size > len(data):
            raise BadRequest(f"input {name!r}: BYTES element {len(out)} of {size} bytes runs "
                             "past the data")
        out.append(data[at + 4:at + 4 + size])
        at += 4 + size
    if len(out) != count:
        raise BadRequest(f"input {name!r}: {len(out)} BYTES elements, its shape holds {count}")
    array = np.empty(len(out), object)
    array[:] = out
    return array


def oip_routes(core: Core) -> list:
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def unknown(name, endpoint=None):
        message = f"Request for unknown model: {name!r} is not found; this service serves " \
                  f"{core.model_name!r} (--model-name)"
        if endpoint is not None:
            return core.refuse(404, message, endpoint)
        return Response(json.dumps({"error": message}), status_code=404,
                        media_type="application/json")

    async def infer(request):
        started = time.perf_counter()
        name = request.path_params["name"]
        if name != core.model_name:
            return unknown(name, OIP)
        body = await core.read_body(request, OIP)
        if isinstance(body, Response):
            return body
        header_length = request.headers.get("inference-header-content-length")
        encoding = request.headers.get("content-encoding", "identity")
        wanted = {}

        def make():
            if encoding != "identity":
                raise BadRequest(f"Content-Encoding {encoding!r}: send the request "
                                 "uncompressed")
            split = len(body)
            if header_length is not None:
                if not (header_length.isascii() and header_length.isdigit()) or \
                        int(header_length) > len(body):
                    raise BadRequest(f"Inference-Header-Content-Length {header_length!r}: "
                                     f"the body has {len(body)} bytes")
                split = int(header_length)
            text = body[:split]
            try:
                scan_envelope(text, ("inputs",), max_depth=MAX_DEPTH)
            except MalformedJsonError as e:
                raise BadRequest(f"malformed JSON: {e}") from None
            header = json.loads(text)
            if not isinstance(header, dict):
                raise BadRequest('the body must be a JSON object {"inputs": [...]}')
            wanted.update(_outputs(header))
            version = core.live.version
            if version is None:
                raise BadRequest(f"no model loaded yet: {core.live.problem}", status=503)
            arrays = oip_arrays(header, body[split:], core.max_body_bytes)
            columns, n = tensor_columns(arrays, version.base.schema)
            return samples_request(columns, n, core.max_samples)

        def render(kind, probabilities, info):
            output = {"name": OUTPUT, "datatype": "FP32", "shape": list(probabilities.shape)}
            data = None
            if wanted["binary"]:
                data = np.ascontiguousarray(probabilities, "<f4").tobytes()
                output["parameters"] = {"binary_data_size": len(data)}
            else:
                output["data"] = probabilities.reshape(-1).tolist()
            answer = {"model_name": core.model_name, "model_version": str(info["version"]),
                      "outputs": [output],
                      "parameters": {"lineage": str(info["lineage"]), "step": info["step"]}}
            if wanted.get("id") is not None:
                answer["id"] = wanted["id"]
            text = json.dumps(answer).encode()
            if data is None:
                return Response(text, media_type="application/json")
            return Response(text + data, media_type="application/octet-stream",
                            headers={"Inference-Header-Content-Length": str(len(text))})

        return await core.answer(OIP, started, make, render)

    def _outputs(header) -> dict:
        """Whether the answer's tensor goes as binary data, and the request's id."""
        parameters = header.get("parameters") or {}
        binary = isinstance(parameters, dict) and parameters.get("binary_data_output") is True
        outputs = header.get("outputs")
        if outputs is not None:
            if not isinstance(outputs, list):
                raise BadRequest('"outputs" must be a list of {"name": ...}')
            for out in outputs:
                if not isinstance(out, dict) or out.get("name") != OUTPUT:
                    got = out.get("name") if isinstance(out, dict) else out
                    raise BadRequest(f"no output {got!r}; the model's output is {OUTPUT!r}")
                p = out.get("parameters") or {}
                binary = binary or (isinstance(p, dict) and p.get("binary_data") is True)
        request_id = header.get("id")
        return {"binary": binary, "id": request_id if isinstance(request_id, str) else None}

    async def live_(request):
        return JSONResponse({"live": True})

    async def ready(request):
        return JSONResponse({"ready": core.live.ready}, status_code=200 if core.live.ready
                            else 503)

    async def server_metadata(request):
        return JSONResponse({"name": "prefixrec", "version": "1", "extensions": [
            "binary_tensor_data"]})

    async def model_metadata(request):
        name = request.path_params["name"]
        if name != core.model_name:
            return unknown(name)
        version = core.live.version
        if version is None:
            return Response(json.dumps({"error": f"no model loaded yet: {core.live.problem}"}),
                            status_code=503, media_type="application/json")
        types = {"DT_INT64": "INT64", "DT_STRING": "BYTES", "DT_FLOAT": "FP32"}
        return JSONResponse({
            "name": core.model_name, "versions": [str(version.number)], "platform": "prefixrec",
            "inputs": [{"name": n, "datatype": types[t], "shape": list(s)}
                       for n, t, s in _inputs(version.base.schema)],
            "outputs": [{"name": OUTPUT, "datatype": "FP32",
                         "shape": [-1, len(version.base.heads)]}],
            "parameters": {"heads": list(version.base.heads)}})

    async def model_ready(request):
        name = request.path_params["name"]
        if name != core.model_name:
            return unknown(name)
        ready = core.live.version is not None
        return JSONResponse({"name": core.model_name, "ready": ready},
                            status_code=200 if ready else 503)

    return [Route("/v2/health/live", live_, methods=["GET"]),
            Route("/v2/health/ready", ready, methods=["GET"]),
            Route("/v2", server_metadata, methods=["GET"]),
            Route("/v2/models/{name}/infer", infer, methods=["POST"]),
            Route("/v2/models/{name}/ready", model_ready, methods=["GET"]),
            Route("/v2/models/{name}", model_metadata, methods=["GET"])]
