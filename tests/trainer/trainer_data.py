"""Helpers of the trainer tests: paths and small generated tables of the taobao_like schema."""
import os

import numpy as np
import pyarrow as pa
import pytest

from pipelines.generate import generate_tables

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA_PATH = os.path.join(ROOT, "schemas", "examples", "taobao_like.yaml")
TIMINGS = ("samples_per_sec", "train_seconds")
# How far two computations of one model's predictions may differ (other batch shapes, the
# SavedModel of an export, another process): test_exactness.py's bound for predictions over
# other batchings. oneDNN's AVX2 kernels (CPUs without AVX-512) round a row differently in
# batches of other sizes (3.4e-7 of it measured with ONEDNN_MAX_CPU_ISA=AVX2).
PREDICTION_RTOL = 1e-5


def generated(schema, samples, seed, samples_per_user=10.0, ctr=0.2):
    """Raw samples from the project's generator, with the true probabilities ``p_<label>``."""
    return pa.concat_tables(list(generate_tables(schema, samples, seed=seed,
                                                 samples_per_user=samples_per_user, ctr=ctr,
                                                 with_probabilities=True)))


def auc_tolerance(scores, labels, rtol: float = PREDICTION_RTOL) -> float:
    """How much the AUC of ``scores`` can change when each score moves by up to ``rtol`` of
    the largest: the share of (positive, negative) pairs close enough to swap order or tie
    (one pair of 600 samples is about 2e-5 of AUC), plus float rounding of the rank sums. AUCs
    of two computations of the same model agree to this on any CPU, not exactly."""
    scores = np.asarray(scores, np.float64).ravel()
    positive = np.asarray(labels).ravel() > 0.5
    negatives = np.sort(scores[~positive])
    width = 2 * rtol * np.abs(scores).max()
    close = (np.searchsorted(negatives, scores[positive] + width, "right")
             - np.searchsorted(negatives, scores[positive] - width, "left")).sum()
    return close / (positive.sum() * len(negatives)) + 1e-12


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
