"""Runs one ``python -m`` command's ``main`` on many argument lists in one process.

    python tests/support/sweep.py MODULE CASES.json

``CASES.json`` holds ``[{"name": ..., "argv": [...]}, ...]``. For each case this prints a line
``start NAME`` before calling ``MODULE.main(argv)`` and a JSON line ``{"name", "code",
"stderr"}`` after it, flushing both: a case that kills the process (a signal) is the last one
started and never finished. One process per command instead of one per case: the command's
imports (TensorFlow, Beam) are paid once.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys


def main() -> int:
    module = importlib.import_module(sys.argv[1])
    with open(sys.argv[2]) as f:
        cases = json.load(f)
    for case in cases:
        print(f"start {case['name']}", flush=True)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = module.main(case["argv"])
            except SystemExit as e:  # argparse
                code = e.code
        print(json.dumps({"name": case["name"], "code": code, "stderr": err.getvalue()}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
