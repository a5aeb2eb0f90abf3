"""The prediction service: HTTP/JSON over an export that online learning keeps fresh.

    python -m trainer.serve --export-dir export/ [--host 127.0.0.1] [--port 8500]

Endpoints:

- ``POST /v1/predict``: ``{"samples": [{...}, ...]}`` (raw samples in the schema's format, labels
  left out; each scored as its own tree) or ``{"root": {...}, "candidates": [{...}, ...]}`` (a
  ranking request: the root layer's features once, e.g. the user's, and the candidates' features
  of the layers below; the root's part of the network runs once per request). The answer:
  ``{"predictions": [{"<head>": p, ...}, ...], "model": {"lineage", "version", "step",
  "newest_sample_time", "freshness_lag_s"}}``, predictions in the request's order, all
  computed on that one version. Requests that arrive together are scored in one model call
  (:mod:`trainer.batching`, ``--max-batch-samples``, ``--max-queue-delay-ms``), all on one
  version; a lone request waits for nobody.
  Bodies are decoded by the project's native JSON decoders (:mod:`trainer.requests`), the ones
  that read files and Kafka messages, so a sample gets the verdict it would get there. Anything a
  client sends gets 2xx or 4xx: 400 for malformed JSON (nesting above 64 levels included) or a
  refused sample (the message names the sample and its field: ``sample 3: not a valid sample:
  field 'uid': expected an integer (kind id, dtype int64), got a string``), 413 above
  ``--max-samples`` samples or ``--max-body-bytes``; 503 before a model is loaded. A 500 is a
  fault of the service (or of the model it serves), counted in
  ``prefixrec_serve_internal_errors_total``. The service keeps serving.
  A request whose body never arrives whole (the client leaves, or its framing breaks and the
  connection is closed) is counted as status 499 in the requests metric, nothing logged; a
  client that stalls halfway is waited for (no read timeout: put a proxy with one in front of
  untrusted clients).
- The faces other ecosystems' clients speak (:mod:`trainer.faces`), named by ``--model-name``:
  TF Serving's REST ``POST /v1/models/NAME:predict`` (``{"instances": [...]}``),
  ``GET /v1/models/NAME`` and ``/metadata``; with ``--grpc-port``, TF Serving's gRPC
  ``PredictionService`` (``Predict``, ``GetModelMetadata``); the Open Inference Protocol (KServe
  v2, Triton's clients) ``POST /v2/models/NAME/infer``, ``GET /v2/health/ready`` and the rest.
  Their requests are decoded by the same decoder and batched with ``/v1/predict``'s.
- ``GET /livez`` (200 while the process serves), ``GET /readyz`` (200 once a model is loaded and
  warmed, the newest published version is applied and, with ``--max-lag``, the freshness lag is
  under it; else 503 with the reason), ``GET /metrics`` (Prometheus), ``GET /v1/model``.

A follower thread polls the export directory every ``--poll-interval`` seconds and applies each
new version in order (see :mod:`trainer.live`: one version per answer; a gap, a damaged or
foreign version is never applied). SIGTERM (and Ctrl-C) stop accepting connections, answer
every request already accepted and exit 0; SIGHUP reloads the full export.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
import sys
import textwrap
import threading
import time
import traceback

import numpy as np

from compression import cli, fs
from trainer import faces
from trainer.batching import Batcher
from trainer.faces import oip, tfserving
from trainer.requests import MAX_SAMPLES, BadRequest, scan_request

PROG = "python -m trainer.serve"
MAX_BODY_BYTES = 16 << 20
# request latency buckets (s): a few ms for one sample, tens for hundreds of candidates
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                   0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_SAMPLE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 4000, 8000, 16000)
BATCH_REQUEST_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
QUEUE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05,
                 0.1, 0.25, 0.5, 1.0)
MAX_BATCH_SAMPLES = 4096
MAX_QUEUE_DELAY_MS = 2.0
APPLY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


def _metrics(live, registry):
    """The service's Prometheus metrics; the model's state is read at every scrape."""
    from prometheus_client import Counter, Gauge, Histogram
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class ModelCollector:
        def collect(self):
            version = live.version
            g = GaugeMetricFamily("prefixrec_serve_model_version",
                                  "version number (in its lineage) of the model answering",
                                  labels=["lineage"])
            if version is not None:
                g.add_metric([str(version.lineage)], version.number)
            yield g
            lag = live.freshness_lag()
            g = GaugeMetricFamily("prefixrec_serve_freshness_lag_seconds",
                                  "now minus the arrival of the newest sample trained into the "
                                  "model answering (NaN: unknown)")
            g.add_metric([], float("nan") if lag is None else lag)
            yield g
            g = GaugeMetricFamily("prefixrec_serve_ready", "1 when /readyz answers 200")
            g.add_metric([], 1.0 if live.ready else 0.0)
            yield g
            for name, value, text in (
                    ("prefixrec_serve_versions_applied", live.applied,
                     "published versions applied"),
                    ("prefixrec_serve_failed_applies", live.failed,
                     "versions or full exports refused (gap, damage, foreign lineage)"),
                    ("prefixrec_serve_reloads", live.reloads,
                     "full exports taken in after the first (rebased or loaded whole)")):
                c = CounterMetricFamily(name, text)
                c.add_metric([], value)
                yield c
            if version is not None and live.memory_budget is not None:
                from trainer.tiers import tier_metric_families, tier_stats

                yield from tier_metric_families("prefixrec_serve", {
                    t: tier_stats(s) for t, s in version.base.stores.items()})

    registry.register(ModelCollector())
    return {
        "requests": Counter("prefixrec_serve_requests", "requests answered",
                            ["endpoint", "status"], registry=registry),
        "samples": Counter("prefixrec_serve_samples", "samples scored", registry=registry),
        "latency": Histogram("prefixrec_serve_request_seconds",
                             "time from a predict request's arrival to its answer",
                             ["kind"], buckets=LATENCY_BUCKETS, registry=registry),
        "apply": Histogram("prefixrec_serve_delta_apply_seconds",
                           "time to read, check and swap in one published version",
                           buckets=APPLY_BUCKETS, registry=registry),
        "in_flight": Gauge("prefixrec_serve_requests_in_flight", "predict requests being "
                           "computed", registry=registry),
        "batch_samples": Histogram("prefixrec_serve_batch_samples",
                                   "samples per model call of the batcher (requests scored "
                                   "together)", buckets=BATCH_SAMPLE_BUCKETS,
                                   registry=registry),
        "batch_requests": Histogram("prefixrec_serve_batch_requests",
                                    "requests per model call of the batcher",
                                    buckets=BATCH_REQUEST_BUCKETS, registry=registry),
        "queue_delay": Histogram("prefixrec_serve_queue_delay_seconds",
                                 "time a decoded request waited for its model call",
                                 buckets=QUEUE_BUCKETS, registry=registry),
        "internal_errors": Counter("prefixrec_serve_internal_errors",
                                   "predict requests answered 500: a fault of the service or of "
                                   "the model it serves, never of a client's input",
                                   registry=registry),
    }


def build_app(live, *, max_samples: int = MAX_SAMPLES, max_body_bytes: int = MAX_BODY_BYTES,
              registry=None, max_batch_samples: int = MAX_BATCH_SAMPLES,
              max_queue_delay: float = MAX_QUEUE_DELAY_MS / 1000,
              model_name: str = faces.DEFAULT_MODEL_NAME):
    """The Starlette app over a :class:`trainer.live.LiveModel` (and its metrics).
    ``max_batch_samples``: requests queued together are scored in one model call of up to
    that many samples (:mod:`trainer.batching`; 0: every request scored on its own, in the
    request's worker thread); ``max_queue_delay`` (s): how long the scoring thread waits for
    requests still being decoded before it calls the model. ``model_name``: the name the
    faces of other ecosystems' clients serve the model under (:mod:`trainer.faces`); their
    gRPC server is started on ``app.state.core`` by
    :func:`trainer.faces.tfserving.grpc_server`."""
    from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry,
                                   disable_created_metrics, generate_latest)
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from compression import RawDataError

    disable_created_metrics()  # no *_created series: they carry nothing a dashboard uses
    registry = registry if registry is not None else CollectorRegistry()
    metrics = _metrics(live, registry)

    def refuse(status, message, endpoint="predict"):
        """An error answer. ASCII JSON: a message quoting a client's text stays valid JSON
        whatever that text holds."""
        metrics["requests"].labels(endpoint, str(status)).inc()
        return Response(json.dumps({"error": message}), status_code=status,
                        media_type="application/json")

    def work(make):
        """Decode and score, in a worker thread (a large JSON body is CPU work too)."""
        request = make()
        if live.version is None:
            raise BadRequest(f"no model loaded yet: {live.problem}", status=503)
        return live.predict_request(request)

    def observe(samples, requests, delays):
        metrics["batch_samples"].observe(samples)
        metrics["batch_requests"].observe(requests)
        for delay in delays:
            metrics["queue_delay"].observe(delay)

    batcher = None
    if max_batch_samples > 0:
        batcher = Batcher(live.predict_decoded, max_batch_samples, max_queue_delay, observe)

    def decode_and_queue(make):
        """In a worker thread: the request ``make()`` gives (a
        :class:`trainer.requests.RequestBody`, from any face) decoded, with its own verdict,
        then scored here at once if no model call runs, else queued for the scoring thread,
        which scores it with the requests queued beside it."""
        try:
            decoded = live.decode(make())
        except BaseException:
            batcher.gone()
            raise
        # idle: scored here at once; else queued for the next model call
        return batcher.score_or_submit(decoded, len(decoded), arrived=True)

    async def score(make):
        """``(kind, probabilities, info)`` of the request ``make()`` gives, computed off the
        event loop (on one version, batched with the requests of every face)."""
        if batcher is None:
            return await run_in_threadpool(work, make)
        batcher.arriving()
        future = await run_in_threadpool(decode_and_queue, make)
        return future.result() if future.done() else await asyncio.wrap_future(future)

    def score_blocking(make):
        """As :func:`score`, for a thread that may block (the gRPC face's)."""
        if batcher is None:
            return work(make)
        batcher.arriving()
        return decode_and_queue(make).result()

    async def read_body(request, endpoint="predict"):
        """The request's body, or the refusal to send (413 above ``max_body_bytes``; 499, a
        client gone before its body arrived)."""
        length = request.headers.get("content-length")
        # ASCII digits only: str.isdigit() also passes '²', which int() refuses
        if length is not None and length.isascii() and length.isdigit() and \
                int(length) > max_body_bytes:
            return refuse(413, f"request body of {length} bytes; the limit is {max_body_bytes} "
                               "(--max-body-bytes)", endpoint)
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_body_bytes:
                    return refuse(413, f"request body above {max_body_bytes} bytes "
                                       "(--max-body-bytes)", endpoint)
        except ClientDisconnect:  # gone before its body arrived: nobody to answer
            metrics["requests"].labels(endpoint, "499").inc()
            return Response(status_code=499)
        return bytes(body)

    async def answer(endpoint, started, make, render):
        """A predict request of any HTTP face answered: ``make()`` (in a worker thread) gives
        its :class:`trainer.requests.RequestBody`, ``render(kind, probabilities, info)`` the
        200's Response; a refusal is the face's JSON ``{"error": ...}``."""
        metrics["in_flight"].inc()
        try:
            kind, probabilities, info = await score(make)
            response = render(kind, probabilities, info)
        except BadRequest as e:
            return refuse(e.status, str(e), endpoint)
        except RawDataError as e:
            return refuse(400, str(e), endpoint)
        except Exception as e:  # noqa: BLE001 - a fault of ours (client input is refused above)
            traceback.print_exc()
            metrics["internal_errors"].inc()
            return refuse(500, f"internal error: {type(e).__name__}: {e}", endpoint)
        finally:
            metrics["in_flight"].dec()
        metrics["samples"].inc(len(probabilities))
        metrics["latency"].labels(kind).observe(time.perf_counter() - started)
        metrics["requests"].labels(endpoint, "200").inc()
        return response

    async def predict(request):
        started = time.perf_counter()
        body = await read_body(request)
        if isinstance(body, Response):
            return body

        def render(kind, probabilities, info):
            lag = None if info["newest_sample_time"] is None else time.time() - info[
                "newest_sample_time"]
            model = {"lineage": info["lineage"], "version": info["version"],
                     "step": info["step"], "newest_sample_time": info["newest_sample_time"],
                     "freshness_lag_s": lag}
            text = predictions_json(info["heads"], probabilities, model)  # heads: its version's
            if text is None:  # a probability that is no JSON number: JSONResponse refuses it
                heads = info["heads"]
                return JSONResponse({"predictions": [dict(zip(heads, map(float, row)))
                                                     for row in probabilities], "model": model})
            return Response(text, media_type="application/json")

        return await answer("predict", started, lambda: scan_request(body, max_samples),
                            render)

    async def livez(request):
        return Response("ok\n", media_type="text/plain")

    async def readyz(request):
        if live.ready:
            return Response("ready\n", media_type="text/plain")
        reason = live.problem or (
            "no model loaded yet" if live.version is None else
            f"freshness lag {live.freshness_lag():.1f} s above --max-lag {live.max_lag} s")
        return Response(f"not ready: {reason}\n", status_code=503, media_type="text/plain")

    async def model_info(request):
        version = live.version
        return JSONResponse({
            "export_dir": live.source, "ready": live.ready, "problem": live.problem,
            "model": None if version is None else {**version.info(),
                                                   "heads": version.base.heads,
                                                   "schema": version.base.schema.name},
            "freshness_lag_s": live.freshness_lag(), "versions_applied": live.applied,
            "failed_applies": live.failed, "reloads": live.reloads,
            "last_reload": live.last_reload})

    async def prometheus(request):
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    core = faces.Core(live, model_name, max_samples, max_body_bytes, metrics, answer,
                      score_blocking, read_body, refuse)
    app = Starlette(routes=[
        Route("/v1/predict", predict, methods=["POST"]),
        Route("/v1/model", model_info, methods=["GET"]),
        Route("/livez", livez, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        *tfserving.rest_routes(core),
        *oip.routes(core),
    ])
    app.state.metrics = metrics
    app.state.batcher = batcher
    app.state.core = core
    return _AnswerGuard(app, max_body_bytes)


def predictions_json(heads, probabilities, model: dict) -> bytes | None:
    """``{"predictions": [{"<head>": p, ...}, ...], "model": model}`` as JSONResponse writes
    it (compact, UTF-8), without a Python loop over the samples: each head's column becomes
    Python floats at once and every sample's object is one ``%``-format of a template (a
    float's ``repr`` is how ``json`` writes it). None when a probability is not finite (NaN
    is no JSON number)."""
    probabilities = np.asarray(probabilities)
    if not np.isfinite(probabilities).all():
        return None
    dump = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False,
                             separators=(",", ":"))
    template = "{" + ",".join(dump(str(h)).replace("%", "%%") + ":%r" for h in heads) + "}"
    columns = [probabilities[:, j].astype(np.float64).tolist() for j in range(len(heads))]
    rows = ",".join(map(template.__mod__, zip(*columns)))
    return f'{{"predictions":[{rows}],"model":{dump(model)}}}'.encode()


class _ConnectionAnswered(Exception):
    """The server's connection refused an answer: the protocol answered the request itself
    already, or the connection is closed."""


class _AnswerGuard:
    """The app as uvicorn calls it. Every endpoint but the predict ones (``/v1/predict`` and
    the faces', which read their own body, under ``--max-body-bytes``) answers without
    reading a body: the request's body is read (and dropped) first, so that a body whose
    framing breaks (bad chunked encoding) ends the request as a client gone, counted as status
    499, instead of uvicorn answering 400 while the endpoint's answer is on its way and
    logging the clash. An answer the connection still refuses is counted as 499 too, never
    logged with a traceback as the service's fault.
    """

    def __init__(self, app, max_body_bytes: int):
        self.app, self.state, self.max_body_bytes = app, app.state, max_body_bytes

    def _client_gone(self, scope) -> None:
        self.state.metrics["requests"].labels(_predict_endpoint(scope) or "other", "499").inc()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if _predict_endpoint(scope) is None:
            read = 0
            while read <= self.max_body_bytes:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return self._client_gone(scope)
                read += len(message.get("body", b""))
                if not message.get("more_body"):
                    break
            receive = _after_body(receive)

        async def guarded(message):
            try:
                await send(message)
            except Exception as e:  # noqa: BLE001 - any refusal of the connection's
                raise _ConnectionAnswered(str(e)) from e

        try:
            await self.app(scope, receive, guarded)
        except _ConnectionAnswered:
            self._client_gone(scope)


def _predict_endpoint(scope) -> str | None:
    """The metrics label of a predict endpoint (of any face: it reads its own body)."""
    path = scope.get("path") or ""
    return "predict" if path == "/v1/predict" else faces.predict_endpoint(path)


def _after_body(receive):
    """``receive`` for an app whose request body was read: an empty body first, then what
    the connection says next (its close)."""
    given = False

    async def receive_after():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": b"", "more_body": False}
        return await receive()

    return receive_after


class Follower:
    """The thread that applies published versions (and reloads on request)."""

    def __init__(self, live, interval: float, metrics: dict, log):
        self.live, self.interval, self.metrics, self.log = live, interval, metrics, log
        self.stop = threading.Event()
        self.reload = threading.Event()
        self.thread = threading.Thread(target=self._run, name="follower", daemon=True)

    def _run(self):
        problem = None
        while not self.stop.is_set():
            if self.reload.is_set():
                self.reload.clear()
                self.live.poll(reload=True)
                self.log(f"reloaded the full export: {self._describe()}")
            before = self.live.version
            applied = self.live.poll()
            if applied and self.live.last_apply_seconds is not None:
                self.metrics["apply"].observe(self.live.last_apply_seconds)
            if self.live.version is not before and before is not None and \
                    self.live.version.lineage != before.lineage:
                self.log(f"loaded a new full export: {self._describe()}")
            if self.live.problem != problem:
                problem = self.live.problem
                self.log(f"not ready: {problem}" if problem else
                         f"ready: {self._describe()}")
            self.stop.wait(self.interval)

    def _describe(self) -> str:
        v = self.live.version
        return "no model" if v is None else f"lineage {v.lineage}, version {v.number}, " \
                                            f"step {v.step}"


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket. Made with ``IPPROTO_TCP`` so that asyncio sets TCP_NODELAY on
    the connections it accepts (it does so only for sockets that say so): without it, a
    keep-alive client waits out its delayed ACK (~40 ms here) for every answer whose headers
    and body go out in two writes."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=textwrap.fill(
            "Serve predictions over HTTP/JSON from a trainer export and follow the versions "
            "online learning publishes there; every answer names the model version that "
            "computed it."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=cli.epilog(
            f"{PROG} --export-dir export/ --port 8500",
            "curl -s localhost:8500/v1/predict -d '{\"samples\": [{\"user_id\": 7, ...}]}'",
            "curl -s localhost:8500/v1/predict -d '{\"root\": {\"user_id\": 7, ...}, "
            "\"candidates\": [{\"item_id\": 3, ...}, ...]}'",
            notes="Endpoints: POST /v1/predict, GET /v1/model, /livez, /readyz, /metrics "
                  "(Prometheus); TF Serving's POST /v1/models/NAME:predict, GET "
                  "/v1/models/NAME[/metadata] (and its gRPC PredictionService with "
                  "--grpc-port); the Open Inference Protocol's POST /v2/models/NAME/infer, GET "
                  "/v2/health/ready, /v2/health/live, /v2/models/NAME[/ready]. SIGTERM and "
                  "Ctrl-C answer every accepted request, then exit 0; SIGHUP reloads the full "
                  "export.",
            exit_codes=cli.SERVICE_EXIT_CODES))
    cli.add_debug_flag(parser)
    parser.add_argument("--export-dir", required=True,
                        help="the export to serve (trainer.train --export-dir, "
                             "trainer.online --export-dir): a local directory or s3://..., "
                             "gs://... (followed through a local copy)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8500,
                        help="port (default 8500; 0 picks a free one, printed on start)")
    parser.add_argument("--poll-interval", type=float, default=0.2,
                        help="seconds between looks for new versions (default 0.2)")
    parser.add_argument("--max-lag", type=float,
                        help="not ready while the freshness lag (now minus the newest sample "
                             "trained into the served version) is above this many seconds")
    parser.add_argument("--max-samples", type=int, default=MAX_SAMPLES,
                        help=f"samples per request (default {MAX_SAMPLES}; more: HTTP 413)")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                        help=f"request body size (default {MAX_BODY_BYTES}; more: HTTP 413)")
    parser.add_argument("--batch-size", type=int, default=4096,
                        help="samples per model call within a request (default 4096)")
    parser.add_argument("--max-batch-samples", type=int, default=MAX_BATCH_SAMPLES,
                        help="requests that arrive together are scored in one model call of "
                             f"up to this many samples (default {MAX_BATCH_SAMPLES}; a larger "
                             "request alone; 0: no batching, each request on its own)")
    parser.add_argument("--max-queue-delay-ms", type=float, default=MAX_QUEUE_DELAY_MS,
                        help="how long a model call may wait for requests still being decoded "
                             f"(default {MAX_QUEUE_DELAY_MS}); a lone request never waits")
    parser.add_argument("--threads", type=int, default=8,
                        help="requests computed at once, off the event loop (default 8)")
    parser.add_argument("--model-name", default=faces.DEFAULT_MODEL_NAME,
                        help="the model's name on the faces of TF Serving and KServe clients "
                             "(/v1/models/NAME:predict, /v2/models/NAME/infer, gRPC "
                             f"model_spec.name; default {faces.DEFAULT_MODEL_NAME})")
    parser.add_argument("--grpc-port", type=int,
                        help="also answer TF Serving's gRPC PredictionService (Predict, "
                             "GetModelMetadata) on this port (default: off; 0 picks a free "
                             "one, printed on start)")
    parser.add_argument("--grpc-threads", type=int, default=32,
                        help="gRPC requests in flight at once (each waits for its model call "
                             "in a thread of its own; default 32)")
    parser.add_argument("--access-log", action="store_true", help="log every request")
    parser.add_argument("--memory-budget", metavar="SIZE",
                        help="keep about SIZE (e.g. 2GiB, 512MiB or bytes) of embedding rows "
                             "in memory, the rest on local disk under --tier-dir; split over "
                             "the tables in proportion to their snapshots' bytes (default: "
                             "every row in memory)")
    parser.add_argument("--tier-dir", metavar="DIR",
                        help="with --memory-budget: a directory on local disk for the rows "
                             "beyond it (default: under the service's temporary directory; "
                             "emptied at exit)")
    return parser


def run(args) -> int:
    for name in ("poll_interval", "max_samples", "max_body_bytes", "batch_size", "threads",
                 "grpc_threads"):
        if getattr(args, name) <= 0:
            raise cli.UsageError(f"--{name.replace('_', '-')} must be positive, got "
                                 f"{getattr(args, name)}")
    if args.max_batch_samples < 0 or args.max_queue_delay_ms < 0:
        raise cli.UsageError("--max-batch-samples and --max-queue-delay-ms must be 0 or more")
    if args.max_lag is not None and args.max_lag <= 0:
        raise cli.UsageError(f"--max-lag must be positive, got {args.max_lag}")
    if not 0 <= args.port <= 65535:
        raise cli.UsageError(f"--port must be 0-65535, got {args.port}")
    if args.grpc_port is not None and not 0 <= args.grpc_port <= 65535:
        raise cli.UsageError(f"--grpc-port must be 0-65535, got {args.grpc_port}")
    if not args.model_name or "/" in args.model_name or ":" in args.model_name:
        raise cli.UsageError(f"--model-name {args.model_name!r}: a non-empty name without '/' "
                             "or ':'")
    budget, tier_dir = _memory_budget(args)
    if not fs.is_local(args.export_dir):
        fs.check_bucket(args.export_dir)  # the export itself may come later
    elif not os.path.isdir(args.export_dir):
        raise cli.UsageError(f"--export-dir {args.export_dir}: no such directory; write an "
                             "export with trainer.train --export-dir or trainer.online "
                             "--export-dir")
    try:
        sock = listen(args.host, args.port)
    except OSError as e:
        raise cli.UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror}; "
                             "pick another --port") from None

    from trainer import runs

    def log(message):
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)

    runs.load_tensorflow(args.debug)
    from trainer.live import LiveModel

    live = LiveModel(args.export_dir, batch_size=args.batch_size, max_lag=args.max_lag,
                     memory_budget=budget, tier_dir=tier_dir)
    if budget is not None and live.problem is not None and "--memory-budget" in live.problem:
        live.close()
        raise cli.UsageError(live.problem)
    try:  # its staging directory goes also when a signal ends the start-up
        return _serve(args, sock, live, log)
    finally:
        live.close()


def _memory_budget(args) -> tuple[int | None, str | None]:
    """``--memory-budget`` in bytes and ``--tier-dir`` checked (a usage error otherwise)."""
    from trainer import tiers

    if args.memory_budget is None:
        if args.tier_dir is not None:
            raise cli.UsageError("--tier-dir holds the rows beyond --memory-budget; give "
                                 "--memory-budget too")
        return None, None
    try:
        budget = tiers.parse_size(args.memory_budget, "--memory-budget")
        tier_dir = (None if args.tier_dir is None
                    else tiers.check_tier_dir(args.tier_dir, "--tier-dir"))
    except tiers.BudgetError as e:
        raise cli.UsageError(str(e)) from None
    return budget, tier_dir


def _serve(args, sock, live, log) -> int:
    """Serve ``live`` on ``sock`` until a signal; 0 once every accepted request is answered."""
    import uvicorn

    app = build_app(live, max_samples=args.max_samples, max_body_bytes=args.max_body_bytes,
                    max_batch_samples=args.max_batch_samples,
                    max_queue_delay=args.max_queue_delay_ms / 1000, model_name=args.model_name)
    grpc_server = None
    if args.grpc_port is not None:
        try:
            grpc_server, grpc_port = tfserving.grpc_server(app.state.core, args.host,
                                                       args.grpc_port, args.grpc_threads)
        except ImportError as e:
            raise cli.UsageError(f"--grpc-port needs tensorflow-serving-api ({e}): pip install "
                                 "--no-deps -r requirements-faces.txt") from None
        except RuntimeError as e:
            raise cli.UsageError(f"cannot listen on {args.host}:{args.grpc_port} for gRPC "
                                 f"({e}); pick another --grpc-port") from None
        log(f"TF Serving gRPC (PredictionService, model {args.model_name!r}) on "
            f"{args.host}:{grpc_port}")
    follower = Follower(live, args.poll_interval, app.state.metrics, log)
    signals = []

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # stop cleanly (uvicorn drains the accepted requests) and exit 0; uvicorn's own
            # handler would re-raise the signal at the end and end the process by it
            def stop(signum, frame):
                signals.append(signum)
                self.should_exit = True

            previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
            previous[signal.SIGHUP] = signal.signal(signal.SIGHUP,
                                                    lambda *_: follower.reload.set())
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    from anyio import to_thread

    async def serve():
        to_thread.current_default_thread_limiter().total_tokens = args.threads
        host, port = sock.getsockname()[:2]
        version = live.version
        log(f"serving {live.source} ("
            + ("no model yet: " + str(live.problem) if version is None else
               f"lineage {version.lineage}, version {version.number}, step {version.step}")
            + f") on http://{host}:{port}")
        await server.serve(sockets=[sock])

    config = uvicorn.Config(app, log_level="warning", access_log=args.access_log,
                            timeout_graceful_shutdown=30, lifespan="off")
    server = Server(config)
    follower.thread.start()
    try:
        asyncio.run(serve())
    finally:
        if grpc_server is not None:  # new calls refused; those accepted answered (30 s)
            grpc_server.stop(30).wait()
        follower.stop.set()
        follower.thread.join(timeout=10)
        if app.state.batcher is not None:
            app.state.batcher.close()
    log("stopped" + (f" on {signal.Signals(signals[0]).name}" if signals else ""))
    return 0


def main(argv=None) -> int:
    return cli.run_command(PROG, lambda a: run(build_parser().parse_args(a)), argv,
                           service=True)


if __name__ == "__main__":
    sys.exit(main())
