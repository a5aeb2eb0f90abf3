"""The Open Inference Protocol (KServe v2, what Triton's clients speak) over HTTP:
``/v2/models/NAME/infer`` with JSON tensors or the binary tensor data extension, health and
model metadata, over the service's decoder and batcher (:mod:`trainer.faces`)."""

from __future__ import annotations

import json
import struct
import time

import numpy as np

from native.json_envelope import MalformedJsonError, scan_envelope
from trainer.faces import OIP, OUTPUT, Core
from trainer.faces.columns import input_tensors, samples_request, tensor_columns
from trainer.requests import MAX_DEPTH, BadRequest

# datatypes: numpy type of their binary data (BYTES: 4-byte length, then the bytes)
DATATYPES = {"BOOL": "?", "UINT8": "u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
             "INT8": "i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "FP16": "<f2",
             "FP32": "<f4", "FP64": "<f8", "BYTES": None}


def input_arrays(header: dict, binary: bytes, limit: int) -> dict[str, np.ndarray]:
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
    """A tensor's JSON ``data`` (flat or nested lists, row-major) as a flat array; its values'
    types are checked at C speed (``set(map(type, ...))``), one by one only to name a bad one."""
    flat = data if type(data) is list else [data]
    kinds = set(map(type, flat))
    while list in kinds:  # nested: one level at a time (depth bounded by the body's scan)
        flat = [x for v in flat for x in (v if type(v) is list else (v,))]
        kinds = set(map(type, flat))
    if len(flat) != count:
        raise BadRequest(f"input {name!r}: {len(flat)} values, its shape holds {count}")
    allowed, expected = ({str}, "a string") if datatype == "BYTES" else \
        ({bool}, "true or false") if datatype == "BOOL" else \
        ({int, float}, "a number") if datatype.startswith("FP") else ({int}, "an integer")
    if not kinds <= allowed:
        i = next(i for i, v in enumerate(flat) if type(v) not in allowed)
        raise BadRequest(f"input {name!r}: value {i} is {json.dumps(flat[i])[:40]}, not "
                         f"{expected} (datatype {datatype})")
    if datatype == "BYTES":
        array = np.empty(len(flat), object)
        array[:] = flat
        return array
    if datatype == "BOOL" or datatype.startswith("FP"):
        return np.array(flat, bool if datatype == "BOOL" else np.float64)
    try:
        return np.array(flat, np.int64)
    except OverflowError:  # an integer beyond int64: kept, the decoder names it
        array = np.empty(len(flat), object)
        array[:] = flat
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


def routes(core: Core) -> list:
    """The protocol's endpoints (Starlette routes)."""
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    def unknown(name, endpoint=None):
        return core.unknown_model(f"Request for unknown model: {name!r} is not found", endpoint)

    async def infer(request):
        started = time.perf_counter()
        body = await core.read_body(request, OIP)  # read first, whatever the answer
        if isinstance(body, Response):
            return body
        name = request.path_params["name"]
        if name != core.model_name:
            return unknown(name, OIP)
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
            arrays = input_arrays(header, body[split:], core.max_body_bytes)
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
                       for n, t, s in input_tensors(version.base.schema)],
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
