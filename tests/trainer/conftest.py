"""Fixtures of the trainer tests; makes trainer_data.py (beside this file) importable.

The suite runs with --import-mode=importlib, which does not put test directories on sys.path.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compression  # noqa: E402
import schemas  # noqa: E402
from trainer_data import SCHEMA_PATH, generated  # noqa: E402


@pytest.fixture(scope="session")
def schema():
    return schemas.load(SCHEMA_PATH)


@pytest.fixture(scope="session")
def raw_small(schema):
    """2,000 raw samples, ~10 per user, a planted signal, click rate ~0.2."""
    return generated(schema, 2000, seed=11).drop_columns(["p_click", "p_conversion"])


@pytest.fixture(scope="session")
def trees_small(schema, raw_small):
    return compression.build_trees(raw_small, schema)


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for a module's distributed tests (4 CPUs' worth of actors on this
    machine's cores), started unless one is running, and shut down after the module."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()
