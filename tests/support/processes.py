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

# A child whose reaction to a signal a test checks must start with that signal at its default
# action, whatever the test run inherited: a shell starts a background job (`make test &`,
# `nohup`, some CI runners) with SIGINT ignored, an ignored signal stays ignored across fork
# and exec, and Python then installs no KeyboardInterrupt handler, so the child never sees the
# test's SIGINT (a `pipelines.generate` child ran to completion, exit 0, in make test runs
# started that way; benchmarks/RESULTS.md, "Test suite time"). preexec_fn could reset it in the forked
# child, but is unsafe in a process with threads (a test worker that loaded TensorFlow or Ray
# has many), so a small interpreter resets the signals and execs the command in its place.
_DEFAULT_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_RESET_AND_EXEC = (
    "import os, signal, sys\n"
    "signals = [signal.Signals(int(s)) for s in sys.argv[1].split(',')]\n"
    "for s in signals:\n"
    "    signal.signal(s, signal.SIG_DFL)\n"
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n")


def python_child(argv, **popen_kwargs) -> subprocess.Popen:
    """``Popen`` of ``python argv`` (from the repository root unless ``cwd`` is given) with
    SIGINT and SIGTERM at their default action and unblocked."""
    popen_kwargs.setdefault("cwd", ROOT)
    return subprocess.Popen(
        [sys.executable, "-c", _RESET_AND_EXEC, ",".join(str(int(s)) for s in _DEFAULT_SIGNALS),
         *map(str, argv)], **popen_kwargs)


def signal_when(argv, ready: bytes | re.Pattern, signum=signal.SIGINT, timeout: float = 300,
                ) -> tuple[int, bytes, str]:
    """Run ``python argv`` from the repository root, send ``signum`` once its stderr holds
    ``ready`` (bytes, or a compiled bytes pattern), wait for it to end; returns the exit code,
    its stdout and its whole stderr. Fails the test if ``ready`` does not come within
    ``timeout`` seconds or the child ends before it."""
    child = python_child(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

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
