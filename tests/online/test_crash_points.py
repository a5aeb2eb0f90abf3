"""An online trainer killed at the crash points of its checkpoint and its Kafka offset commit,
one run after another on the same topic, then restarted: every sample is trained exactly once
in the model that comes out, Kafka's committed offsets never run ahead of a checkpoint, and an
idle run writes no checkpoint at all."""

import contextlib
import json
import os
import subprocess
import sys

import pytest
import yaml

import native
from commands import in_process
from compression import fs
from native import crash_points
from online_samples import CONFIG, SCHEMA, committed_offset
from online_samples import sample_message as _sample
from trainer.checkpoints import LATEST_FILE, CheckpointManager

SAMPLES = 1000
PER_RUN = 200  # samples each killed run trains (about two units of 100) before it checkpoints


def _listing(run_dir):
    directory = os.path.join(run_dir, "checkpoints")
    with open(os.path.join(directory, LATEST_FILE)) as f:
        latest = f.read()
    return sorted(os.listdir(directory)), latest, {
        n: os.stat(os.path.join(directory, n, "state.json")).st_mtime_ns
        for n in os.listdir(directory) if n.startswith("ckpt-")}


# (crash point, whether the run's checkpoint is the one restored after it, whether Kafka holds
# its offsets): each run starts from the checkpoint the previous one left and trains PER_RUN.
STEPS = [
    # the checkpoint is durable, the commit not sent: Kafka lags, the checkpoint rules
    ("offsets.commit", True, False),
    # the commit answered, then killed: both agree
    ("offsets.committed", True, True),
    # killed inside Trainer.save, the second table's snapshot in place, the checkpoint not
    # named yet: the run's samples are trained again
    ("store.snapshot.renamed:2", False, False),
    # LATEST names the new checkpoint, older ones not pruned yet: it is restored, uncommitted
    ("checkpoint.latest", True, False),
]


def test_killed_at_every_point_of_a_checkpoint_and_commit_nothing_is_lost_or_repeated(
        kafka_broker, tmp_path):
    topic = kafka_broker.create_topic()
    kafka_broker.produce(topic, [_sample(i) for i in range(SAMPLES)])
    (tmp_path / "schema.yaml").write_text(yaml.safe_dump(SCHEMA))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    run_dir = str(tmp_path / "run")
    group = "g-crash-points"
    command = [sys.executable, "-m", "trainer.online", "--schema", str(tmp_path / "schema.yaml"),
               "--config", str(tmp_path / "config.yaml"), "--bootstrap-servers",
               kafka_broker.bootstrap, "--topic", topic, "--group", group, "--run-dir", run_dir,
               "--unit-samples", "100", "--report-every", "100", "-X",
               "max.poll.interval.ms=8000"]
    env = {k: v for k, v in os.environ.items() if k != crash_points.ENV}

    restored, committed = 0, None  # the offset the next run starts from; Kafka's
    for point, checkpointed, commits in STEPS:
        # only the final checkpoint of the run (--checkpoint-every is longer than the run)
        child = subprocess.run(command + ["--max-samples", str(PER_RUN),
                                          "--checkpoint-every", "600"],
                               env={**env, crash_points.ENV: point}, capture_output=True,
                               text=True, timeout=300)
        assert child.returncode == crash_points.EXIT_CODE, (point, child.stderr[-3000:])
        latest = CheckpointManager(run_dir).latest()
        offset = latest.state["offsets"]["0"]
        assert (offset > restored) if checkpointed else (offset == restored), (point, offset)
        assert latest.state["samples"] == offset, point  # each sample before it trained once
        restored = offset
        committed = offset if commits else committed
        assert committed_offset(kafka_broker, topic, group) == committed, point
    assert 0 < restored < SAMPLES

    # restarted without a crash point: it trains the rest and stops when the topic is idle
    # the restarts need no process of their own: run in this one (no crash point is set here)
    assert crash_points.ENV not in os.environ
    final = in_process(*command[2:], "--idle-exit", "2", "--checkpoint-every", "0.2")
    assert final.returncode == 0, final.stderr[-3000:]
    summary = json.loads(final.stdout.strip().splitlines()[-1])
    assert summary["samples"] == SAMPLES - restored and summary["offsets"] == {"0": SAMPLES}
    latest = CheckpointManager(run_dir).latest()
    assert latest.state["offsets"] == {"0": SAMPLES} and latest.state["samples"] == SAMPLES
    rows = native.EmbeddingStore.load(
        os.path.join(latest.path, "model", "stores", "sid")).to_numpy()
    assert sorted(rows["ids"].tolist()) == list(range(SAMPLES))  # nothing lost
    assert set(rows["update_counts"].tolist()) == {1}            # nothing trained twice
    assert committed_offset(kafka_broker, topic, group) == SAMPLES

    # nothing new: a run that trains nothing writes no checkpoint, not even its final one
    before = _listing(run_dir)
    idle = in_process(*command[2:], "--idle-exit", "1", "--checkpoint-every", "0.1")
    assert idle.returncode == 0, idle.stderr[-3000:]
    summary = json.loads(idle.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 0 and summary["checkpoints"] == 0
    assert _listing(run_dir) == before


# (point, the step of the newest checkpoint a restart finds): on local disk the run directory
# itself; on s3:// the run directory as published (a local working copy published after each
# save, CheckpointManager(publish_to=)), so its local points all leave the previous publish
CHECKPOINT_CASES = [
    ("local", "checkpoint.written:3", 2), ("local", "checkpoint.renamed:3", 3),
    ("local", "checkpoint.latest:3", 3), ("local", "checkpoint.removing", 3),
    ("s3", "checkpoint.written:3", 2), ("s3", "checkpoint.removing", 2),  # and all between
    ("s3", "publish.copied:3", 2), ("s3", "publish.committed:3", 3),
]


@pytest.mark.parametrize("root, point, survivor", CHECKPOINT_CASES)
def test_every_checkpoint_point_leaves_one_complete_checkpoint(request, tmp_path, root, point,
                                                               survivor):
    """The manager alone, the n-th save killed: the newest complete checkpoint is the last
    save that got its name (on s3://: that got published), and the next start cleans up and
    carries on."""
    script = ("import os, sys\nfrom trainer.checkpoints import CheckpointManager\n"
              "m = CheckpointManager(sys.argv[1], keep=2, publish_to=sys.argv[2] or None)\n"
              "for step in (1, 2, 3):\n"
              "    m.save(lambda d, s=step: open(os.path.join(d, 'w'), 'w').write(str(s)),"
              " {'step': step})\n")
    env = {k: v for k, v in os.environ.items() if k != crash_points.ENV}
    published = ""
    if root == "s3":
        server = request.getfixturevalue("s3_server")
        env.update(server.env())
        published = f"{server.create_bucket()}/run"
    run_dir = str(tmp_path / "run")
    # removing happens from the third save on (keep=2): its first hit is in save 3
    child = subprocess.run([sys.executable, "-c", script, run_dir, published],
                           capture_output=True, text=True, timeout=120,
                           env={**env, crash_points.ENV: point})
    assert child.returncode == crash_points.EXIT_CODE, child.stderr
    with contextlib.ExitStack() as stack:
        if published:  # a restart reads what is published, in a fresh working copy
            stack.enter_context(request.getfixturevalue("s3_server").environment())
            run_dir = stack.enter_context(fs.working_copy(published))
        manager = CheckpointManager(run_dir, keep=2, publish_to=published or None)
        assert manager.latest().step == survivor
        assert open(os.path.join(manager.latest().path, "w")).read() == str(survivor)
        assert not [n for n in os.listdir(manager.directory) if n.startswith(".tmp-")]
        manager.save(lambda d: open(os.path.join(d, "w"), "w").write("4"), {"step": 4})
        assert [c.step for c in manager.all()] == [survivor, 4]
        if published:  # published again: the manifest and its generation, nothing else
            generation = fs.published_manifest(published)["generation"]
            assert {f[len(published) + 1:].split("/")[0] for f in fs.list_files(published)} \
                == {fs.MANIFEST, generation}
            with fs.working_copy(published) as again:
                assert [c.step for c in CheckpointManager(again).all()] == [survivor, 4]
