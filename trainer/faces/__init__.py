"""The prediction service's faces for the clients other ecosystems already have.

Modules: :mod:`trainer.faces.tfserving` (REST and gRPC), :mod:`trainer.faces.oip`, and
:mod:`trainer.faces.columns` (their requests as the service's own).

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
from dataclasses import dataclass
from typing import Callable

OUTPUT = "probabilities"
SIGNATURE = "serving_default"
ROW_LENGTHS = "/row_lengths"
DEFAULT_MODEL_NAME = "prefixrec"
# endpoint labels of prefixrec_serve_requests_total
TFSERVING_REST, TFSERVING_GRPC, OIP = "tfserving_rest", "tfserving_grpc", "oip"


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

    def unknown_model(self, message: str, endpoint: str | None = None):
        """The 404 of a request naming another model: counted as a refusal of ``endpoint``
        (a predict path), else a bare JSON error (a metadata or health path)."""
        from starlette.responses import Response

        message = f"{message}: this service serves {self.model_name!r} (--model-name)"
        if endpoint is not None:
            return self.refuse(404, message, endpoint)
        return Response(json.dumps({"error": message}), status_code=404,
                        media_type="application/json")


def predict_endpoint(path: str) -> str | None:
    """The metrics label of a face's predict path (it reads its own body), else None."""
    if path.startswith("/v1/models/") and path.endswith(":predict"):
        return TFSERVING_REST
    if path.startswith("/v2/models/") and path.endswith("/infer"):
        return OIP
    return None
