"""Both engines of the one online loop, in one process and on Ray (1 worker x 1 shard), through
the same command and the same checks: runs killed at every crash point of a checkpoint's
offset commit (and once its checkpoint named), then restarted, train every sample exactly once
and dead-letter every malformed message exactly once; Kafka's committed offsets never run
ahead of a checkpoint; the summary and status.json have the same keys; and the model equals
a single-process replay of the step log (``--step-log``) the runs wrote."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

import compression
import schemas
from compression.messages import DeadLetter, decode_json_samples
from native import crash_points
from online_samples import CONFIG, SCHEMA, committed_offset
from online_samples import sample_message
from trainer.checkpoints import CheckpointManager
from trainer.distributed.manifest import read_manifest

SAMPLES = 1500
PER_RUN = 200  # each run up to the last stops once it trained this many (a unit of 250)
BAD_EVERY = 97  # a malformed message after every 97th sample: dead letters in most units

# (crash point of the final checkpoint's commit, whether Kafka holds the checkpoint's offsets):
# each run starts from the checkpoint the previous one left, trains PER_RUN more and is killed
# there; the checkpoint is durable at each point, so the next run starts after it
STEPS = [("offsets.commit", False), ("offsets.committed", True), ("checkpoint.latest", False)]

# every summary key, from either engine (status.json: the same)
SUMMARY_KEYS = {
    "engine", "samples", "messages", "units", "dead_letters", "steps", "seconds",
    "samples_per_sec", "steady_samples_per_sec", "rate", "pv", "broker_reachable", "idle_s",
    "assigned", "since_last_unit_s", "checkpoints", "exports", "store_rows", "store_bytes",
    "admitted", "rejected", "expired", "delay_s", "steady_delay_s", "lag", "trainer_waited_s",
    "offsets", "metrics_url", "workers", "shards", "assignment", "bytes_per_step",
    "recoveries", "busy_seconds", "timings"}


@pytest.fixture(scope="module")
def ray_address():
    """A Ray cluster for this module's runs on Ray (started only when one asks for it)."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    if started:
        ray.shutdown()


def _messages():
    """The topic's messages in order: samples 0..SAMPLES-1, a malformed one after every
    BAD_EVERY-th."""
    out = []
    for sid in range(SAMPLES):
        out.append(sample_message(sid))
        if sid % BAD_EVERY == BAD_EVERY - 1:
            out.append((b"bad", b"not json %d" % sid))
    return out


def _offsets(latest) -> dict:
    """A checkpoint's trained offsets: in its state (one process) or its manifest (Ray)."""
    if "offsets" in latest.state:
        return latest.state["offsets"]
    return read_manifest(os.path.join(latest.path, "model"))["online"]["offsets"]


def _model(latest, tmp_path):
    """A checkpoint's model as one in-process Trainer (a Ray checkpoint's shards merged)."""
    from trainer import Trainer

    run = tmp_path / f"as-run-{os.path.basename(latest.path)}"
    run.mkdir()
    (run / "checkpoint").symlink_to(os.path.join(latest.path, "model"))
    return Trainer.restore_run(run)


def _replay(run_dir, by_offset: dict):
    """A single-process Trainer that trained, step by step, the batches the step log records:
    a unit's messages (malformed ones dropped) compressed at once and cut into batches of
    the batch size, the i-th of them on the step that records ``batch`` [i, m]; a new run
    shifts its output bias on the first one. Returns it and the offsets the log trained."""
    from trainer import Trainer, models
    from trainer.config import TrainConfig

    schema = schemas.from_dict(SCHEMA)
    single = Trainer(schema, models.MLP(), TrainConfig.from_dict(CONFIG))
    with open(os.path.join(run_dir, "steps.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    batches, pending, trained = {}, [], []
    for number, step in enumerate(steps):
        assert step["step"] == number + 1
        (worker,) = step["workers"]  # one worker: the process, or Ray's 1 x 1
        pending.append((number, *worker["batch"]))
        assert worker["batch"][0] == len(pending) - 1
        if worker["ranges"]:
            (first, end), = worker["ranges"].values()
            trained += range(first, end)
            table, _ = decode_json_samples([by_offset[o] for o in range(first, end)], schema)
            cut = list(compression.iter_batches(compression.build_trees(table, schema), schema,
                                                CONFIG["batch_size"]))
            assert [m for *_, m in pending] == [len(cut)] * len(pending)
            for (at, _, _), batch in zip(pending, cut):
                assert batch.num_leaves == steps[at]["workers"][0]["samples"]
                batches[at] = batch
            pending = []
    assert not pending, "a unit not ended at the last step"
    for number in range(len(steps)):
        if number == 0:
            single.calibrate_output(batches[0])
        single.train_batch(batches[number])
    return single, trained


@pytest.mark.parametrize("engine", ["process", "ray"])
def test_killed_at_each_commit_point_every_message_trains_once_and_equals_its_replay(
        kafka_broker, tmp_path, request, engine):
    topic = kafka_broker.create_topic()
    messages = _messages()
    by_offset = dict(zip(kafka_broker.produce(topic, messages), (v for _, v in messages)))
    end = len(messages)
    malformed = sorted(o for o, v in by_offset.items() if v.startswith(b"not json"))
    good_before = np.cumsum([not v.startswith(b"not json") for _, v in sorted(by_offset.items())])

    def samples_before(offset: int) -> int:
        return int(good_before[offset - 1]) if offset else 0

    (tmp_path / "schema.yaml").write_text(yaml.safe_dump(SCHEMA))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    run_dir = str(tmp_path / "run")
    group = f"g-engines-{engine}"
    on_ray = (["--workers", "1", "--shards", "1", "--ray-address",
               request.getfixturevalue("ray_address")] if engine == "ray" else [])
    command = [sys.executable, "-m", "trainer.online", "--schema", str(tmp_path / "schema.yaml"),
               "--config", str(tmp_path / "config.yaml"), "--bootstrap-servers",
               kafka_broker.bootstrap, "--topic", topic, "--group", group, "--run-dir", run_dir,
               "--unit-samples", "250", "--report-every", "100", "--step-log", "-X",
               "max.poll.interval.ms=8000", *on_ray]
    env = {k: v for k, v in os.environ.items() if k != crash_points.ENV}

    def run(*extra, point=None):
        return subprocess.run(command + list(extra), capture_output=True, text=True,
                              timeout=300, env={**env, crash_points.ENV: point} if point else env)

    # a first run, not killed: the checkpoint the killed ones start from (--checkpoint-every
    # is longer than every run: each writes its final checkpoint only)
    first = run("--max-samples", str(PER_RUN), "--checkpoint-every", "600")
    assert first.returncode == 0, first.stderr[-3000:]
    restored = committed = int(_offsets(CheckpointManager(run_dir).latest())["0"])
    assert samples_before(restored) >= PER_RUN
    for point, commits in STEPS:
        child = run("--max-samples", str(PER_RUN), "--checkpoint-every", "600", point=point)
        assert child.returncode == crash_points.EXIT_CODE, (point, child.stderr[-3000:])
        latest = CheckpointManager(run_dir).latest()
        offset = int(_offsets(latest)["0"])
        assert offset > restored, point  # the checkpoint is durable at every point
        # each sample before its offset trained once, none after
        assert latest.state["samples"] == samples_before(offset), point
        restored = offset
        committed = offset if commits else committed
        assert committed_offset(kafka_broker, topic, group) == committed, point
    assert restored < end

    # restarted without a crash point: it trains the rest and stops when the topic is idle
    final = run("--idle-exit", "2", "--checkpoint-every", "0.2")
    assert final.returncode == 0, final.stderr[-3000:]
    summary = json.loads(final.stdout.strip().splitlines()[-1])
    assert summary["engine"] == engine and set(summary) == SUMMARY_KEYS
    with open(os.path.join(run_dir, "status.json")) as f:
        assert json.load(f) == summary  # the final status is the summary
    assert summary["samples"] == SAMPLES - samples_before(restored)
    assert summary["offsets"] == {"0": end} and summary["assigned"] == [0]
    assert summary["broker_reachable"] is True and summary["steps"] > 0
    latest = CheckpointManager(run_dir).latest()
    assert _offsets(latest) == {"0": end} and latest.state["samples"] == SAMPLES
    assert committed_offset(kafka_broker, topic, group) == end
    model = _model(latest, tmp_path)
    rows = model.stores["sid"].to_numpy()
    assert sorted(rows["ids"].tolist()) == list(range(SAMPLES))  # nothing lost
    assert set(rows["update_counts"].tolist()) == {1}            # nothing trained twice
    # every malformed message dead-lettered once, though polls ahead of the stops were
    # dropped untrained and read again by the next run
    letters = [DeadLetter.from_message(m.value(), m.headers(), m.key())
               for m in kafka_broker.consume_all(f"{topic}.dlq", idle_seconds=1.0)]
    assert sorted(d.offset for d in letters) == malformed

    # the step log, replayed in one process, trains the same messages into the same model
    single, trained = _replay(run_dir, by_offset)
    assert len(trained) == len(set(trained))  # (a unit of malformed messages only trains
    assert set(range(end)) - set(malformed) <= set(trained)  # nothing: no step records it)
    assert single.step == model.step == summary["steps"] and single.samples == SAMPLES
    for table, store in single.stores.items():
        want, got = store.to_numpy(), model.stores[table].to_numpy()
        want_order, got_order = np.argsort(want["ids"]), np.argsort(got["ids"])
        np.testing.assert_array_equal(got["ids"][got_order], want["ids"][want_order])
        for key in ("values", "state"):
            np.testing.assert_allclose(got[key][got_order], want[key][want_order], rtol=1e-5,
                                       atol=1e-7, err_msg=f"{table} {key}")
        for key in ("update_counts", "last_steps"):
            np.testing.assert_array_equal(got[key][got_order], want[key][want_order],
                                          err_msg=f"{table} {key}")
    dense, want = model.dense_arrays(), single.dense_arrays()
    assert sorted(dense) == sorted(want)
    for name in want:
        np.testing.assert_allclose(dense[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_online_loop_loads_neither_tensorflow_nor_ray_nor_an_engine():
    """trainer.online_loop knows its engines only by what they do (OnlineEngine)."""
    modules = ("tensorflow", "keras", "ray", "confluent_kafka", "trainer.trainer",
               "trainer.online_process", "trainer.distributed.online")
    code = f"import sys, trainer.online_loop; print([m for m in {modules!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
