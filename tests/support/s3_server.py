"""A real S3-protocol server for tests: moto's server mode (``moto_server``) on loopback.

    with moto_s3_server() as server:
        with server.environment():            # AWS_ENDPOINT_URL, keys, region for clients
            bucket = server.create_bucket()   # a fresh, empty bucket: "s3://<bucket>"

moto in server mode is an HTTP server that speaks the S3 protocol (its in-memory backend):
pyarrow's S3 file system, boto3 and Beam's S3 file system talk to it exactly as to AWS. The
instance metadata service is switched off in the environment, so no client looks for
credentials anywhere but the variables set here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from typing import Iterator

ACCESS_KEY = "testing-key-id"
SECRET_KEY = "testing-secret-key"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """A running server: ``endpoint`` is its ``http://127.0.0.1:PORT``."""

    def __init__(self, endpoint: str, process: subprocess.Popen, log_path: str):
        self.endpoint = endpoint
        self.process = process
        self.log_path = log_path

    def env(self) -> dict[str, str]:
        """The variables a client of this server needs (for child processes too)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION,
                "AWS_EC2_METADATA_DISABLED": "true"}

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """Set :meth:`env` in ``os.environ`` meanwhile (other ``AWS_*`` variables removed)."""
        saved = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        for name in saved:
            del os.environ[name]
        os.environ.update(self.env())
        try:
            yield
        finally:
            for name in [k for k in os.environ if k.startswith("AWS_")]:
                del os.environ[name]
            os.environ.update(saved)

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name when None); returns ``s3://<name>``."""
        name = name or f"test-{uuid.uuid4().hex[:16]}"
        request = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200, response.status
        return f"s3://{name}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def _answers(endpoint: str) -> bool:
    """Whether the server answers HTTP (any status: with authentication on it says 403)."""
    try:
        with urllib.request.urlopen(f"{endpoint}/", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


@contextlib.contextmanager
def moto_s3_server(timeout: float = 60.0, env: dict | None = None) -> Iterator[S3Server]:
    """Start ``moto_server`` on a free loopback port, wait until it answers, stop it after.
    ``env``: moto settings, e.g. ``{"INITIAL_NO_AUTH_ACTION_COUNT": "4"}`` to check
    credentials and IAM policies after the first four requests (the first is the readiness
    probe here)."""
    binary = os.path.join(os.path.dirname(sys.executable), "moto_server")
    if not os.path.exists(binary):
        binary = shutil.which("moto_server") or binary
    directory = tempfile.mkdtemp(prefix="moto-")
    log_path = os.path.join(directory, "server.log")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(port)],
                                   stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    server = S3Server(endpoint, process, log_path)
    try:
        deadline = time.monotonic() + timeout
        while not _answers(endpoint):
            if process.poll() is not None:
                raise RuntimeError(f"moto_server exited with {process.returncode}:\n"
                                   f"{server.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"moto_server did not answer on {endpoint} within "
                                   f"{timeout} s:\n{server.log()}")
            time.sleep(0.05)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(directory, ignore_errors=True)
