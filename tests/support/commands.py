"""Commands run the two ways a test needs them: in a child process (what a user starts) or in
the test's own process (the same ``main(argv)``, without paying for a new interpreter).

A child that loads TensorFlow costs 4-5 CPU-s before it does anything (benchmarks/RESULTS.md,
Session 16), so a test runs a command in a child only where the process is what it checks:
signals, exit codes seen by a shell, start-up noise on file descriptor 2, a crash. Everything
else (results, files written, refusals and their one-line messages, which ``main`` prints
through the same error path) is checked in process with :func:`in_process`.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def in_child(module: str, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m module args`` from the repository root: exit code, stdout, stderr."""
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def in_process(module: str, *args) -> subprocess.CompletedProcess:
    """``module.main(args)`` in this process, with what it prints to ``sys.stdout`` and
    ``sys.stderr`` captured: the same fields as :func:`in_child` gives. argparse's exit (usage
    errors, ``--help``) becomes the exit code, as in a child."""
    argv = [str(a) for a in args]
    main = importlib.import_module(module).main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess([module, *argv], code or 0, out.getvalue(),
                                       err.getvalue())
