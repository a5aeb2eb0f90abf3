"""One fuzz target under atheris (libFuzzer): ``python -m benchmarks.fuzz.worker TARGET
[libFuzzer flags and corpus directories]``. Started by ``python -m benchmarks.fuzz``, one
process per target (``atheris.Fuzz()`` never returns).

Third-party libraries are imported first, uninstrumented; the project's packages are imported
under ``atheris.instrument_imports`` so libFuzzer gets coverage of their Python code. A finding
(see :func:`benchmarks.fuzz.targets.run_input`) is raised as an exception: atheris prints it
and libFuzzer writes the input as a ``crash-*`` artifact.
"""

import hashlib
import os
import sys
import traceback

PROJECT_PACKAGES = ["compression", "schemas", "native", "trainer", "benchmarks.fuzz.targets"]


def main(argv: list[str]) -> None:
    name, flags = argv[0], argv[1:]
    import atheris

    import numpy  # noqa: F401  - uninstrumented third-party code
    import pyarrow  # noqa: F401
    import pyarrow.compute  # noqa: F401
    import pyarrow.csv  # noqa: F401
    import pyarrow.json  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    import yaml  # noqa: F401

    if name in ("checkpoint", "serve_request"):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow  # noqa: F401
    if name == "serve_request":  # the HTTP stack is not the project's: no coverage of it
        import h11  # noqa: F401
        import prometheus_client  # noqa: F401
        import starlette.applications  # noqa: F401
        import starlette.routing  # noqa: F401
        import uvicorn  # noqa: F401
        import uvicorn.protocols.http.auto  # noqa: F401
    with atheris.instrument_imports(include=PROJECT_PACKAGES):
        from benchmarks.fuzz import targets

        target = targets.TARGETS[name]
        targets.run_input(target, b"")  # imports what the target uses, builds its state

    # Findings already reported (by an earlier run of this target: their signatures are kept
    # beside the artifacts) do not stop the run again, so a restart fuzzes past them.
    known_path = os.path.join(_artifact_dir(flags), "signatures.txt")
    known = set()
    if os.path.exists(known_path):
        with open(known_path) as f:
            known = {line.rstrip("\n") for line in f}

    def test_one_input(data: bytes) -> None:
        outcome = targets.run_input(target, data)
        if outcome.kind == "finding":
            sig = targets.signature(outcome.error)
            if sig in known:
                return
            with open(known_path, "a") as f:
                f.write(sig + "\n")
            # the input under the name libFuzzer gives it, written here too: a worker holding
            # TensorFlow takes seconds to end, and SIGALRM was seen to kill one meanwhile,
            # before libFuzzer's report, its finding's input lost
            with open(os.path.join(_artifact_dir(flags),
                                   f"crash-{hashlib.sha1(data).hexdigest()}"), "wb") as f:
                f.write(data)
            print(f"fuzz worker: new finding {sig}", flush=True)
            traceback.print_exception(outcome.error)  # where it happened, before libFuzzer's
            raise targets.Finding(outcome.describe()) from outcome.error

    atheris.Setup([sys.argv[0], *flags], test_one_input)
    print(f"fuzz worker: target {name}, native module {sys.modules['native._store'].__file__}"
          if "native._store" in sys.modules else f"fuzz worker: target {name}", flush=True)
    atheris.Fuzz()


def _artifact_dir(flags: list[str]) -> str:
    for flag in flags:
        if flag.startswith("-artifact_prefix="):
            return os.path.dirname(flag.split("=", 1)[1]) or "."
    return "."


if __name__ == "__main__":
    main(sys.argv[1:])
