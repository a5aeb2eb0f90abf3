"""Fixtures shared by every test folder."""

import os

import pytest
from hypothesis import settings

from kafka_broker import tansu_broker


@pytest.fixture(scope="session")
def kafka_broker():
    """A real Kafka-protocol broker (Tansu, memory storage) for the whole test session; create
    a fresh topic per test with ``kafka_broker.create_topic()``."""
    with tansu_broker() as broker:
        yield broker


# Hypothesis draws new examples on every run unless told otherwise: in CI (CI=true) every run
# draws the same ones, so a red build is reproducible and a green one is not luck; on a
# developer's machine it keeps exploring. Examples it found failing are replayed from its
# database either way.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    settings.load_profile("ci")
