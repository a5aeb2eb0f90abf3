"""Fixtures shared by every test folder."""

import pytest

from kafka_broker import tansu_broker


@pytest.fixture(scope="session")
def kafka_broker():
    """A real Kafka-protocol broker (Tansu, memory storage) for the whole test session; create
    a fresh topic per test with ``kafka_broker.create_topic()``."""
    with tansu_broker() as broker:
        yield broker
