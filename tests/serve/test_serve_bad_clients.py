"""The prediction service as a real process under load from 32 keep-alive ranking clients while
other clients send malformed, oversized, truncated and stalled requests: every valid request is
answered 200 naming its version, every invalid one 4xx, a client that leaves mid-body is counted
(status 499) without a traceback, a stalled one is waited for, /livez answers within a second
throughout, and the process's memory does not grow from one equal phase to the next."""

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pyarrow as pa
import pytest

import compression
import schemas
from service import Service
from trainer import models
from trainer.config import TrainConfig
from trainer.serving import export_increment
from trainer.trainer import Trainer

SCHEMA = schemas.from_dict({"name": "serve_bad_clients", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [
        {"name": "uid", "kind": "id"}, {"name": "city", "kind": "id", "dtype": "string"}]},
    {"name": "sample", "key": ["item"], "features": [{"name": "item", "kind": "id"}]}]})
CONFIG = TrainConfig.from_dict({"batch_size": 400, "seed": 4, "threads": 1,
                                "embedding": {"dim": 4, "optimizer": {"name": "adagrad",
                                                                      "lr": 0.2}}})
CITIES = ("paris", "lyon", "nantes")
MAX_SAMPLES, MAX_BODY_BYTES = 200, 200_000
GOOD_CLIENTS = 32
GOOD_REQUESTS = 12       # per good client and phase
CANDIDATES = 8
BAD_ROUNDS = 3           # per bad client and phase: every bad request of its kind this often
STALLED = 4              # connections half-sent before the first phase, finished after the last
# The service's RSS after the second phase may exceed its RSS after the first by this much: a
# leak of 12 KB per request over the 444 requests of a phase would show (a kept 100 KB body
# per bad request, or a kept connection's buffers); two equal phases here differ by under 1 MB.
RSS_TOLERANCE = 5 << 20
LIVEZ_SECONDS = 1.0      # the longest /livez may take to answer, at any time
TIMEOUT = 60             # a socket's timeout: a request not answered by then fails the test
# /livez polled on a keep-alive connection by a process of its own, so that the test's own
# client threads do not delay it: one "status seconds" line per poll, every 20 ms until its
# stdin closes
POLL_LIVEZ = """
import http.client, select, sys, time
connection = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=60)
while not select.select([sys.stdin], [], [], 0.02)[0]:
    started = time.monotonic()
    connection.request("GET", "/livez")
    response = connection.getresponse()
    response.read()
    print(response.status, time.monotonic() - started, flush=True)
"""


def ranking(uid: int, city: str = None) -> dict:
    return {"root": {"uid": uid, "city": city or CITIES[uid % 3]},
            "candidates": [{"item": 100 + 7 * uid + k} for k in range(CANDIDATES)]}


# (what, body, the status it gets) sent by http.client on keep-alive connections
BAD_BODIES = [
    ("malformed JSON", b'{"root": {"uid": 1', 400),
    ("100,000 nested [", b"[" * 100_000, 400),
    ("samples nested 50,000 deep", b'{"samples": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400),
    ("a lone surrogate in a string column",
     json.dumps(ranking(1, "paris")).replace('"paris"', '"\\ud800"').encode(), 400),
    ("a lone surrogate in a column name",
     json.dumps({"samples": [{"uid": 1, "city": "x", "item": 2, "\ud800": 1}]}).encode(), 400),
    ("not UTF-8", json.dumps(ranking(1, "p\xe4ris"), ensure_ascii=False).encode("latin-1"),
     400),
    ("an id that is a string", json.dumps({**ranking(2), "root": {"uid": "two",
                                                                  "city": "x"}}).encode(), 400),
    ("a root column among the candidates",
     json.dumps({"root": {"uid": 1, "city": "x"}, "candidates": [{"item": 1, "uid": 2}]})
     .encode(), 400),
    ("not an object", b"[1, 2]", 400),
    ("more candidates than --max-samples",
     json.dumps({"root": {"uid": 1, "city": "x"},
                 "candidates": [{"item": i} for i in range(MAX_SAMPLES + 1)]}).encode(), 413),
    ("a body above --max-body-bytes",
     json.dumps({**ranking(1), "pad": "x" * MAX_BODY_BYTES}).encode(), 413),
]
# (what, bytes, the status it gets, whether the body broke off) sent on a connection of their
# own; the service answers and closes the connection. A request whose body broke off (the
# service closed the connection on it) is counted as status 499 too.
_POST = b"POST /v1/predict HTTP/1.1\r\nHost: t\r\n"
BAD_REQUESTS = [
    ("bytes that are not HTTP", b"\x00\x01\x02 \xff\r\n\r\n", 400, False),
    ("a negative Content-Length", _POST + b"Content-Length: -1\r\n\r\n{}", 400, False),
    ("two Content-Lengths", _POST + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400,
     False),
    ("a chunk size that is not hex", _POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", 400,
     True),
    ("a header block past 16 KiB", _POST + b"X-Pad: " + b"a" * 17_000, 400, False),
    ("10**9 body bytes announced", _POST + b"Content-Length: 1000000000\r\n"
                                           b"Connection: close\r\n\r\n{", 413, False),
    ("GET /v1/predict", b"GET /v1/predict HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
     405, False),
]
# requests cut short, then the client closes the connection
_VALID = json.dumps(ranking(3)).encode()
TRUNCATED = [
    _POST + b"Content-Length: %d\r\n\r\n" % len(_VALID) + _VALID[:len(_VALID) // 2],
    _POST + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(_VALID) + _VALID[:10],
]


def _trainer():
    rng = np.random.default_rng(5)
    uid = rng.integers(0, 40, 400)
    rows = [{"uid": int(u), "city": CITIES[u % 3], "item": int(i), "click": float(c)}
            for u, i, c in zip(uid, rng.integers(100, 400, 400), rng.random(400) < 0.3)]
    trainer = Trainer(SCHEMA, models.MLP(hidden=(8,)), CONFIG)
    trees = compression.build_trees(pa.Table.from_pylist(rows).cast(SCHEMA.raw_arrow_schema()),
                                    SCHEMA)
    for batch in compression.iter_batches(trees, SCHEMA, 400):
        trainer.train_batch(batch)
    return trainer


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad_clients") / "export"
    export_increment(_trainer(), path)
    return path


def _status_line(sock: socket.socket) -> int:
    """The status of the answer on ``sock``, read to the service's close."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    match = re.match(rb"HTTP/1\.1 (\d{3}) ", data)
    assert match, f"not an HTTP answer: {data[:200]!r}"
    return int(match.group(1))


class Phase:
    """One phase of load: the clients' threads and what each saw."""

    def __init__(self, service: Service):
        self.service = service
        self.good: list = []      # (status, version, predictions) per valid request
        self.bad: list = []       # (what, expected status, status, answer) per invalid request
        self.errors: list = []    # what a client thread raised
        self.broke_off = 0        # requests whose body never arrived whole

    def _guard(self, fn, *args):
        def run():
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - reported by the test, with the rest
                self.errors.append(f"{fn.__name__}{args}: {type(e).__name__}: {e}")
        return threading.Thread(target=run)

    def good_client(self, i: int) -> None:
        connection = self.service.connection(TIMEOUT)
        try:
            for k in range(GOOD_REQUESTS):
                status, answer = self.service.predict(ranking((i * GOOD_REQUESTS + k) % 40),
                                                      connection)
                self.good.append((status, answer["model"]["version"] if status == 200 else
                                  answer, len(answer["predictions"]) if status == 200 else 0))
        finally:
            connection.close()

    def bad_body_client(self, half: int) -> None:
        connection = self.service.connection(TIMEOUT)
        try:
            for _ in range(BAD_ROUNDS):
                for what, body, expected in BAD_BODIES[half::2]:
                    status, answer = self.service.predict(body, connection)
                    self.bad.append((what, expected, status, answer))
        finally:
            connection.close()

    def bad_request_client(self) -> None:
        for _ in range(BAD_ROUNDS):
            for what, data, expected, broke_off in BAD_REQUESTS:
                with socket.create_connection((self.service.host, self.service.port),
                                              TIMEOUT) as sock:
                    sock.sendall(data)
                    self.bad.append((what, expected, _status_line(sock), None))
                self.broke_off += broke_off

    def truncating_client(self) -> None:
        for _ in range(BAD_ROUNDS):
            for data in TRUNCATED:
                with socket.create_connection((self.service.host, self.service.port),
                                              TIMEOUT) as sock:
                    sock.sendall(data)
                self.broke_off += 1

    def run(self) -> None:
        threads = [self._guard(self.good_client, i) for i in range(GOOD_CLIENTS)]
        threads += [self._guard(self.bad_body_client, half) for half in (0, 1)]
        threads += [self._guard(self.bad_request_client), self._guard(self.truncating_client)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def _requests_counted(service: Service, status: int) -> int:
    _, text = service.request("GET", "/metrics")
    match = re.search(r'^prefixrec_serve_requests_total\{endpoint="predict",status="%d"\} '
                      r"(\S+)$" % status, text, re.M)
    return int(float(match.group(1))) if match else 0


def test_bad_clients_under_load_get_4xx_while_good_ones_get_answers(export):
    service = Service(export, "--max-samples", str(MAX_SAMPLES), "--max-body-bytes",
                      str(MAX_BODY_BYTES))
    try:
        process = psutil.Process(service.child.pid)
        cpu_before = process.cpu_times()
        poller = subprocess.Popen([sys.executable, "-c", POLL_LIVEZ, service.host,
                                   str(service.port)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        stalled, leaving = [], None
        try:
            first = poller.stdout.readline()  # polling before the load starts
            assert first, "the /livez poller did not start"
            # stalled clients: half the headers, or the headers and half the body, then
            # nothing until both phases are over; the service waits for them (it has no read
            # timeout)
            valid = json.dumps(ranking(7)).encode()
            whole = _POST + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(
                valid) + valid
            cuts = [len(_POST) // 2, len(whole) - len(valid) // 2]
            for k in range(STALLED):
                sock = socket.create_connection((service.host, service.port), TIMEOUT)
                stalled.append((sock, whole[cuts[k % 2]:]))
                sock.sendall(whole[:cuts[k % 2]])
            leaving = socket.create_connection((service.host, service.port), TIMEOUT)
            leaving.sendall(whole[:cuts[1]])  # stalls too, then leaves without the rest
            phases, rss = [], []
            for _ in range(2):  # two equal phases: the first warms up what a process keeps
                phase = Phase(service)
                phase.run()
                phases.append(phase)
                rss.append(process.memory_info().rss)
            stalled_answers = []
            for sock, rest in stalled:
                sock.sendall(rest)
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
                stalled_answers.append(data)
        finally:
            if leaving is not None:
                leaving.close()
            for sock, _ in stalled:
                sock.close()
            out, _ = poller.communicate(timeout=TIMEOUT)  # its stdin closed: it stops
        livez = [(int(status), float(seconds)) for status, seconds in map(
            str.split, [first, *out.splitlines()])]
        broke_off = sum(p.broke_off for p in phases) + 1  # + the stalled one that left
        deadline = time.monotonic() + TIMEOUT  # the service sees the last close soon after
        while _requests_counted(service, 499) < broke_off and time.monotonic() < deadline:
            time.sleep(0.02)
        counted = _requests_counted(service, 499)
        cpu = process.cpu_times()
        requests = sum(len(p.good) + len(p.bad) + len(TRUNCATED) * BAD_ROUNDS for p in phases)
        print(f"service CPU {cpu.user + cpu.system - cpu_before.user - cpu_before.system:.1f} s"
              f" for {requests} requests; RSS after each phase {[r >> 20 for r in rss]} MiB; "
              f"/livez at most {max(t for _, t in livez) * 1000:.0f} ms over {len(livez)} polls")

        for phase in phases:
            assert not phase.errors, phase.errors
            assert len(phase.good) == GOOD_CLIENTS * GOOD_REQUESTS
            assert {g for g in phase.good} == {(200, 0, CANDIDATES)}, \
                [g for g in phase.good if g != (200, 0, CANDIDATES)][:3]
            wrong = {f"{what}: {status}, not {expected} ({str(answer)[:120]})"
                     for what, expected, status, answer in phase.bad if status != expected}
            assert not wrong, "\n".join(sorted(wrong))
            assert len(phase.bad) == BAD_ROUNDS * (len(BAD_BODIES) + len(BAD_REQUESTS))
            assert all("error" in answer for _, _, _, answer in phase.bad if answer is not None)
        for data in stalled_answers:  # waited for, and answered once whole
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 "), data[:300]
            answer = json.loads(body)
            assert answer["model"]["version"] == 0
            assert len(answer["predictions"]) == CANDIDATES
        assert counted == broke_off, (counted, broke_off)
        assert poller.returncode == 0 and {status for status, _ in livez} == {200}
        assert max(t for _, t in livez) < LIVEZ_SECONDS
        assert rss[1] - rss[0] < RSS_TOLERANCE, [r >> 20 for r in rss]
        assert "Traceback" not in service.stderr, service.stderr[-5000:]
        service.child.send_signal(signal.SIGTERM)
        assert service.child.wait(TIMEOUT) == 0, service.stderr[-5000:]
    finally:
        service.stop(signal.SIGKILL)
