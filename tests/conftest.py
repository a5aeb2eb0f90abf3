"""Fixtures shared by every test folder."""

import os

# No Ray cluster starts as a side effect. Ray starts a local cluster of os.cpu_count() CPUs on
# the first ray.get/put/kill/get_runtime_context of a process where it is not initialised
# (trainer.distributed.shard.reconstructed() calls get_runtime_context, also when a test uses
# the Shard class without Ray), and leaves it running: the `cluster` fixture of a later test in
# that process would then find a 2-CPU cluster that is not its own. Which test runs before
# which depends on how pytest-xdist hands tests out, so this made Ray tests fail now and then.
# Read by Ray when it is imported (only tests and their child processes see it; every Ray
# cluster of the suite is started by an explicit ray.init).
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from kafka_broker import tansu_broker  # noqa: E402


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
