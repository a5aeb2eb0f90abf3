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
from s3_server import moto_s3_server  # noqa: E402


@pytest.fixture(scope="session")
def kafka_broker():
    """A real Kafka-protocol broker (Tansu, memory storage) for the whole test session; create
    a fresh topic per test with ``kafka_broker.create_topic()``."""
    with tansu_broker() as broker:
        yield broker


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-protocol server (moto's server mode) for the whole test session."""
    with moto_s3_server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server):
    """``s3://<a fresh bucket>`` on the session's S3 server, with the test's environment
    (AWS_ENDPOINT_URL, keys, region) pointing at it."""
    with s3_server.environment():
        yield s3_server.create_bucket()


# Hypothesis draws new examples on every run unless told otherwise: in CI (CI=true) every run
# draws the same ones, so a red build is reproducible and a green one is not luck; on a
# developer's machine it keeps exploring. Examples it found failing are replayed from its
# database either way.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    settings.load_profile("ci")


# -- pytest-xdist scheduling (make test runs `-n 4`) -----------------------------------------
# xdist's default hands tests out in file order, a few at a time, so the slowest (Ray and
# end-to-end tests, most of them in tests/trainer/ near the end of the order) started last and
# one worker ran on alone for minutes. On xdist workers the tests below go first, slowest
# first, so the short ones fill the gaps at the end; serial runs keep the file order.
# (Measured durations under -n 4: benchmarks/RESULTS.md, Session 14. A test missing here or
# in the wrong place costs time, never correctness.)
SLOW_FIRST = (
    "tests/trainer/test_distributed_faults.py",
    "tests/trainer/test_online_ray.py",
    "tests/online/test_online_engines.py",
    "tests/benchmarks/test_tiny_benchmarks.py::test_quality_benchmark_tiny",
    "tests/benchmarks/test_tiny_benchmarks.py::test_distributed_benchmark_tiny",
    "tests/trainer/test_distributed.py::test_resharding_keeps_the_counter_filters_pending",
    "tests/trainer/test_resume.py::test_an_interrupted_ray_run_resumes",
    "tests/trainer/test_distributed.py::test_two_shards_two_workers_equal_single_process",
    "tests/trainer/test_distributed.py::test_cli_",
    "tests/online/test_crash_points.py",
    "tests/test_commands.py::test_trainer_train_output_policy",
    "tests/online/test_online.py::test_kill_9_at_random_moments",
    "tests/trainer/test_resume.py",
    "tests/trainer/test_tiers_ray.py",
    "tests/trainer/test_quantized_exports_ray.py",
    "tests/online/test_online_tiers.py",
    "tests/trainer/test_startup_signals.py",
    "tests/benchmarks/test_tiny_benchmarks.py::test_online_benchmark_tiny",
    "tests/benchmarks/test_tiers_end_to_end_tiny.py",
    "tests/online/test_checkpoint_crash_and_pv.py",
    "tests/online/test_online.py",
    "tests/test_commands.py::test_a_signal_stops_training",
    "tests/trainer/test_cli.py",
    "tests/online/test_bad_messages.py",
    "tests/serve/test_serve_online.py",
    "tests/benchmarks/test_tiny_benchmarks.py::test_serving_benchmark_tiny",
    "tests/serve/test_serve.py",
    "tests/serve/test_serve_quantized.py",
    "tests/serve/test_faces.py",
    "tests/serve/test_serve_bad_clients.py",
    "tests/trainer/test_train_out_s3.py",
    "tests/pipelines/test_compress_dask.py",
    "tests/trainer/test_export_s3.py",
    "tests/online/test_online_s3.py",
    "tests/serve/test_serve_s3.py",
)
# Tests that share an expensive module-scoped fixture go to one worker together (a node id
# prefix -> the name of its group): the `runs` fixture of test_distributed_faults.py is a 2 x 2
# Ray run killed twice and a single-process run (~35 CPU-s, built again by every worker that
# got one of its tests); every module's `cluster` is a Ray cluster (~7 CPU-s to start and stop,
# and 4 CPUs' worth of actors on 2 cores: a few side by side slow each other down).
# test_distributed.py's tests on its cluster form two groups, so two workers share them.
ONE_WORKER = {
    "tests/trainer/test_distributed_faults.py": "faults",
    "tests/trainer/test_online_ray.py": "online-ray",
    # both engines of the online loop; its Ray cluster not beside test_online_ray.py's
    "tests/online/test_online_engines.py": "online-ray",
    "tests/trainer/test_distributed.py::test_cli_": "distributed-cli",
    "tests/trainer/test_distributed.py::test_two_shards_two_workers": "distributed-fit",
    "tests/trainer/test_distributed.py::test_resharding": "distributed-fit",
    # one service (a trained model, uvicorn and a gRPC server) for the module, built once
    "tests/serve/test_faces.py": "serve-faces",
}


def _slow_rank(item) -> int:
    return next((i for i, prefix in enumerate(SLOW_FIRST) if item.nodeid.startswith(prefix)),
                len(SLOW_FIRST))


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike
        items.sort(key=_slow_rank)  # stable: file order within a rank


class _XdistScheduling:
    """Registered only when pytest-xdist is loaded (its hook is unknown to pytest otherwise,
    e.g. with ``-p no:xdist``)."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        """``--dist load`` (what ``-n`` means) with each ONE_WORKER group as a single work
        unit: xdist's loadscope scheduler, every other test a unit of its own."""
        if config.getvalue("dist") != "load":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class Scheduling(LoadScopeScheduling):
            def _split_scope(self, nodeid):
                return next((group for prefix, group in ONE_WORKER.items()
                             if nodeid.startswith(prefix)), nodeid)

        return Scheduling(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistScheduling(), "prefixrec-xdist-scheduling")
