"""``python -m trainer.serve`` as a child process, and a small HTTP client for it."""
from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import threading
import time

from processes import python_child


class Service:
    """Starts the service on a free loopback port and waits for its "on http://..." line."""

    def __init__(self, export_dir, *args, timeout: float = 120):
        # signals at their default action even when the suite runs as a background job
        self.child = python_child(["-m", "trainer.serve", "--export-dir", export_dir,
                                   "--port", "0", *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        found = threading.Event()

        def read():
            for line in self.child.stderr:
                self.lines.append(line)
                if " on http://" in line:
                    found.set()
            found.set()  # ended

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        found.wait(timeout)
        match = next((re.search(r"on http://([0-9.]+):(\d+)", line) for line in self.lines
                      if " on http://" in line), None)
        if match is None:
            self.stop(signal.SIGKILL)
            raise AssertionError(f"the service did not start: {self.stderr}")
        self.host, self.port = match.group(1), int(match.group(2))

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def connection(self, timeout: float = 60) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(self, method: str, path: str, body=None, connection=None):
        """``(status, parsed JSON or text)``."""
        conn = connection or self.connection()
        try:
            payload = body if body is None or isinstance(body, bytes) else json.dumps(
                body).encode()
            conn.request(method, path, payload,
                         {"Content-Type": "application/json"} if payload else {})
            response = conn.getresponse()
            data = response.read()
        finally:
            if connection is None:
                conn.close()
        kind = response.getheader("Content-Type", "")
        return response.status, json.loads(data) if "json" in kind else data.decode()

    def predict(self, body, connection=None):
        return self.request("POST", "/v1/predict", body, connection)

    def model(self) -> dict:
        status, info = self.request("GET", "/v1/model")
        assert status == 200, info
        return info

    def wait_for(self, condition, timeout: float = 60, what: str = "a condition"):
        """Poll ``/v1/model`` until ``condition(info)``; returns that info."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.model()
            if condition(info):
                return info
            assert time.monotonic() < deadline, f"{what} not reached in {timeout} s: {info}"
            time.sleep(0.02)

    def metric(self, name: str) -> float:
        status, text = self.request("GET", "/metrics")
        assert status == 200
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no metric {name}")

    def stop(self, signum=signal.SIGTERM, timeout: float = 60) -> int:
        if self.child.poll() is None:
            self.child.send_signal(signum)
        try:
            code = self.child.wait(timeout)
        except subprocess.TimeoutExpired:
            self.child.kill()
            code = self.child.wait()
        self._reader.join(5)
        return code

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop(signal.SIGKILL if exc[0] else signal.SIGTERM)
