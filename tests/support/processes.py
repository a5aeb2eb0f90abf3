"""Signals to real child processes at a point their own output shows, never after a sleep."""
from __future__ import annotations

import os
import pathlib
import re
import selectors
import signal
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def signal_when(argv, ready: bytes | re.Pattern, signum=signal.SIGINT, timeout: float = 300,
                ) -> tuple[int, bytes, str]:
    """Run ``python argv`` from the repository root, send ``signum`` once its stderr holds
    ``ready`` (bytes, or a compiled bytes pattern), wait for it to end; returns the exit code,
    its stdout and its whole stderr. Fails the test if ``ready`` does not come within
    ``timeout`` seconds or the child ends before it."""
    child = subprocess.Popen([sys.executable, *map(str, argv)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def seen_ready(seen: bytes) -> bool:
        return ready in seen if isinstance(ready, bytes) else bool(ready.search(seen))

    seen = b""
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(child.stderr, selectors.EVENT_READ)
            while not seen_ready(seen):
                assert sel.select(timeout=timeout), \
                    f"no {ready!r} within {timeout} s: {seen.decode(errors='replace')}"
                chunk = os.read(child.stderr.fileno(), 65536)
                assert chunk, f"the child ended before {ready!r}: {seen.decode(errors='replace')}"
                seen += chunk
        child.send_signal(signum)
        stdout, stderr = child.communicate(timeout=timeout)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, stdout, (seen + stderr).decode(errors="replace")
