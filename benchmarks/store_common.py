"""What the store benchmarks share (benchmarks/store.py, benchmarks/store_tiers.py): the ids and
the machine's description."""
from __future__ import annotations

import os
import platform

import numpy as np

SCATTER = np.uint64(0x9E3779B97F4A7C15)


def machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "numpy": np.__version__, "load_average_1min": os.getloadavg()[0]}


def row_ids(index: np.ndarray) -> np.ndarray:
    """Scatters row numbers 0..rows-1 over positive int64 ids (never TF's empty/deleted keys)."""
    return ((index.astype(np.uint64) * SCATTER) >> np.uint64(2)).astype(np.int64) + 1
