"""SIGTERM and SIGINT at named moments of the start-up of trainer.train and trainer.online, in
one process and on Ray (``compression.signal_points``: the child signals itself there): the
documented exit code, no Ray abort dump or traceback on stderr, nothing half-written, and no
process of the run left behind (issue 39: a SIGTERM while Ray and its actors started ended
trainer.online with exit 15, or with SIGABRT and a stack dump)."""

import json
import os
import pathlib
import re
import signal
import subprocess
import time
import uuid

import pyarrow.parquet as pq
import pytest
import yaml

import native
from compression import signal_points
from online_samples import CONFIG as ONLINE_CONFIG
from online_samples import SCHEMA as ONLINE_SCHEMA
from processes import python_child
from trainer.checkpoints import CheckpointManager
from trainer.distributed.manifest import read_manifest
from trainer_data import ROOT, SCHEMA_PATH

SIGTERM, SIGINT = signal.SIGTERM, signal.SIGINT
# what Ray's C++ failure-signal handler and an abort print
ABORT_NOISE = ("SIGTERM received at time", "PC: @", "Aborted", "SIGABRT")
TRAIN_RAY = ["--workers", "1", "--shards", "2"]  # 1 x 1 would train in process
ONLINE_RAY = ["--workers", "1", "--shards", "1"]
MARKER = "PREFIXREC_TEST_RUN"  # in the environment of the child and of every process it starts


def test_every_point_is_named_once_reached_in_the_code_and_parsed_with_its_signal():
    assert len(set(signal_points.POINTS)) == len(signal_points.POINTS)
    code = "".join(path.read_text() for path in pathlib.Path(ROOT, "trainer").rglob("*.py"))
    assert set(re.findall(r'signal_point\("([^"]+)"\)', code)) == set(signal_points.POINTS)
    assert signal_points.parse("run.started") == ("run.started", SIGTERM)
    assert signal_points.parse("ray.init.returned:SIGINT") == ("ray.init.returned", SIGINT)
    with pytest.raises(ValueError, match="unknown signal point 'ray.init'; the points are"):
        signal_points.parse("ray.init")
    with pytest.raises(ValueError, match="expected run.started:SIGTERM or run.started:SIGINT, "
                                         "got 'SIGKILL'"):
        signal_points.parse("run.started:SIGKILL")


def test_a_signal_in_a_held_block_is_handled_when_the_block_ends():
    from trainer.runs import signals_held

    handled = []

    def record(signum, frame):
        handled.append(signum)

    previous = {SIGTERM: signal.signal(SIGTERM, record),
                SIGINT: signal.signal(SIGINT, signal.default_int_handler)}
    try:
        with signals_held():
            os.kill(os.getpid(), SIGTERM)
            os.kill(os.getpid(), SIGTERM)  # held once
            assert handled == []
        assert handled == [SIGTERM] and signal.getsignal(SIGTERM) is record
        with pytest.raises(KeyboardInterrupt):  # ended by an exception: the signal still wins
            with signals_held():
                os.kill(os.getpid(), SIGINT)
                raise ValueError("start-up failed")
        signal.signal(SIGINT, signal.SIG_IGN)
        with signals_held():  # an ignored signal stays ignored
            assert signal.getsignal(SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), SIGINT)
        assert signal.getsignal(SIGINT) is signal.SIG_IGN
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def processes_of(run: str) -> list[str]:
    """The processes whose environment holds ``MARKER=run``: the child's and every one it
    started (Ray's GCS, raylet, agents and actors inherit it)."""
    wanted = f"{MARKER}={run}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if wanted not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid} {command[:120]}")
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return found


def signalled(argv, point: str, signum) -> subprocess.CompletedProcess:
    """``python -m argv`` with ``signum`` sent to itself at ``point``; once it has ended, waits
    for every process it started to end too (fails naming those left after 60 s)."""
    run = uuid.uuid4().hex
    env = {**os.environ, MARKER: run,
           signal_points.ENV: f"{point}:{signal.Signals(signum).name}"}
    child = python_child(["-m", *map(str, argv)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    try:
        stdout, stderr = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    deadline = time.monotonic() + 60
    while left := processes_of(run):
        assert time.monotonic() < deadline, f"processes of the run left behind: {left}"
        time.sleep(0.1)  # polling for the processes to end, not waiting a fixed time
    stderr = stderr.decode(errors="replace")
    assert "Traceback" not in stderr, stderr
    for noise in ABORT_NOISE:
        assert noise not in stderr, stderr
    return subprocess.CompletedProcess(argv, child.returncode, stdout.decode(), stderr)


def assert_nothing_half_written(directory) -> None:
    """No temporary file or directory under ``directory``, every JSON file whole, and every
    checkpoint of an online run complete: its state, and every file its model names."""
    for root, dirs, names in os.walk(directory):
        for name in dirs + names:
            assert ".tmp" not in name, os.path.join(root, name)
        for name in names:
            if name.endswith(".json"):
                with open(os.path.join(root, name)) as f:
                    json.load(f)
    for run_dir in {root for root, dirs, _ in os.walk(directory) if "checkpoints" in dirs}:
        for checkpoint in CheckpointManager(run_dir).all():
            model = os.path.join(checkpoint.path, "model")
            manifest = read_manifest(model)
            for shard in manifest["shard_dirs"]:
                for table in manifest["tables"]:
                    native.EmbeddingStore.load(os.path.join(model, shard, table))
            assert os.path.isfile(os.path.join(model, "dense.npz"))


def case_id(value) -> str:
    if isinstance(value, bool):
        return "ray" if value else "in-process"
    return value.name if isinstance(value, signal.Signals) else value


# -- trainer.train: 143 / 130, nothing written before the fit's first step --------------------

@pytest.fixture(scope="module")
def train_data(raw_small, tmp_path_factory):
    path = tmp_path_factory.mktemp("startup_signals") / "train.parquet"
    pq.write_table(raw_small, path)  # 2,000 samples: 4 steps of 500
    return path


# Ray costs ~6 CPU-s a case: a point of Ray's start per command (trainer.online's covers
# start_ray, shared by both), the others in one process
TRAIN_CASES = [  # (on Ray, point, signal)
    (False, "config.loaded", SIGTERM),
    (False, "run.started", SIGTERM),
    (True, "actors.created", SIGINT),  # after ray.init, the actors' processes starting
]


@pytest.mark.parametrize("on_ray, point, signum", TRAIN_CASES, ids=case_id)
def test_trainer_train_stopped_during_start_up(train_data, tmp_path, on_ray, point, signum):
    """Before the fit's first step a signal ends the run with nothing written; from then on
    (``run.started``) the step finishes and the run is left resumable, as at any later
    moment."""
    run = tmp_path / "run"
    args = ["--schema", SCHEMA_PATH, "--train-data", train_data, "--batch-size", "500",
            "--hidden", "8", "--no-progress", "--out", run, *(TRAIN_RAY if on_ray else [])]
    out = signalled(["trainer.train", *args], point, signum)
    assert out.returncode == 128 + signum, out.stderr
    assert out.stdout == ""
    last = out.stderr.strip().splitlines()[-1]
    if point != "run.started":
        assert last == ("python -m trainer.train: "
                        + ("terminated" if signum == SIGTERM else "interrupted"))
        assert os.listdir(tmp_path) == []  # no run directory, no temporary one
        return
    assert last.startswith("SIGTERM: stopped after step 1 (500 samples); checkpoint written to "
                           f"{run}/checkpoint. "), last
    assert sorted(os.listdir(tmp_path)) == ["run"]
    assert_nothing_half_written(tmp_path)
    # resumable (tests/trainer/test_resume.py resumes such runs to the uninterrupted result)
    state = json.loads((run / "interrupted.json").read_text())
    assert state["signal"] == "SIGTERM" and state["step"] == 1 and "fit" in state
    assert json.loads((run / "checkpoint" / "trainer.json").read_text())["step"] == 1


# -- trainer.online: exit 0, a run directory that restarts cleanly ----------------------------

@pytest.fixture(scope="module")
def online_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup_signals_online")
    (root / "schema.yaml").write_text(yaml.safe_dump(ONLINE_SCHEMA))
    (root / "config.yaml").write_text(yaml.safe_dump(ONLINE_CONFIG))
    return root


ONLINE_CASES = [  # (on Ray, point, signal)
    (False, "args.parsed", SIGINT),
    (False, "source.opened", SIGTERM),   # the broker reached, the model built, a consumer
    (False, "run.started", SIGINT),
    (True, "ray.init.returned", SIGTERM),  # the window of issue 39: exit 15 or SIGABRT then
    (True, "run.started", SIGTERM),  # the actors up, before the first checkpoint and step
]


@pytest.mark.parametrize("on_ray, point, signum", ONLINE_CASES, ids=case_id)
def test_trainer_online_stopped_during_start_up(kafka_broker, online_files, tmp_path, on_ray,
                                                point, signum):
    """Exit 0 at every moment, as for a signal during the run. Before the run starts nothing
    is trained or written but the empty checkpoints directory (the next start begins anew);
    from ``run.started`` on the run ends as usual (a final status; on Ray its first
    checkpoint, whole)."""
    topic = kafka_broker.create_topic()
    run = tmp_path / "run"
    out = signalled(["trainer.online", "--schema", online_files / "schema.yaml", "--config",
                     online_files / "config.yaml", "--bootstrap-servers", kafka_broker.bootstrap,
                     "--topic", topic, "--group", f"g-{point}", "--run-dir", run,
                     *(ONLINE_RAY if on_ray else [])], point, signum)
    assert out.returncode == 0, out.stderr
    assert_nothing_half_written(tmp_path)
    if point != "run.started":
        name = signal.Signals(signum).name
        assert out.stderr.strip().splitlines()[-1] == \
            f"python -m trainer.online: stopped by {name}"
        assert out.stdout == ""
        assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == (
            [] if point == "args.parsed" else ["run", "run/checkpoints"])
        return
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 0 and summary["steps"] == 0
    assert json.loads((run / "status.json").read_text())["samples"] == 0
    latest = CheckpointManager(str(run)).latest()
    # on Ray the run writes a checkpoint before its first step (what an actor's death before
    # the first regular checkpoint goes back to); in one process there is nothing to keep
    assert (latest is not None and latest.step == 0) if on_ray else latest is None
