"""Coverage-guided fuzzing of every parser of outside bytes (see ``python -m benchmarks.fuzz``).

- :mod:`benchmarks.fuzz.targets`: one ``target(data: bytes) -> None`` per parser and
  :func:`~benchmarks.fuzz.targets.run_input`, which decides whether an input ended in a result,
  an acceptable refusal or a finding. Importable without atheris (the replay tests use it).
- :mod:`benchmarks.fuzz.worker`: one target under atheris/libFuzzer (one process per target).
- ``python -m benchmarks.fuzz``: the command that runs the workers and reports.

This package imports nothing of the project at import time, so the worker can import the
project's modules under ``atheris.instrument_imports()``.
"""
