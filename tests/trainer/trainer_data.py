"""Helpers of the trainer tests: paths and small generated tables of the taobao_like schema."""
import os

import numpy as np
import pyarrow as pa
import pytest

from pipelines.generate import generate_tables

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA_PATH = os.path.join(ROOT, "schemas", "examples", "taobao_like.yaml")
TIMINGS = ("samples_per_sec", "train_seconds")


def generated(schema, samples, seed, samples_per_user=10.0, ctr=0.2):
    """Raw samples from the project's generator, with the true probabilities ``p_<label>``."""
    return pa.concat_tables(list(generate_tables(schema, samples, seed=seed,
                                                 samples_per_user=samples_per_user, ctr=ctr,
                                                 with_probabilities=True)))


def assert_same_result(result: dict, expected: dict, run) -> None:
    """A resumed run's result line equals the uninterrupted run's (timings aside; floats and
    evaluation AUCs to float rounding; its own run directory)."""
    for key in set(expected) | set(result):
        if key in TIMINGS:
            continue
        if key == "run_dir":
            assert result[key] == str(run)
        elif key == "evaluations":
            assert [(e["epoch"], e["step"]) for e in result[key]] == [
                (e["epoch"], e["step"]) for e in expected[key]]
            np.testing.assert_allclose([e["auc"] for e in result[key]],
                                       [e["auc"] for e in expected[key]], rtol=1e-5)
        elif isinstance(expected[key], float):
            assert result[key] == pytest.approx(expected[key], rel=1e-5), key
        else:
            assert result[key] == expected[key], key
