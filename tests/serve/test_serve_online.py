"""The service follows a real online trainer (child processes, Tansu broker) across a kill -9
between a published version and the trainer's checkpoint: the restarted trainer starts a new
lineage instead of renumbering deltas the service applied, and the service ends on exactly the
restarted trainer's export."""

import json
import os
import subprocess
import sys

import numpy as np
import yaml

from native import crash_points
from online_samples import CONFIG, PROBE, SCHEMA
from online_samples import sample_message as _sample
from service import Service
from trainer.checkpoints import CheckpointManager
from trainer.serving import Predictor, published_versions, read_lineage

SAMPLES = 1200


def test_a_trainer_killed_after_publishing_restarts_a_lineage_the_service_follows(
        kafka_broker, tmp_path):
    topic = kafka_broker.create_topic()
    kafka_broker.produce(topic, [_sample(i) for i in range(SAMPLES)])
    (tmp_path / "schema.yaml").write_text(yaml.safe_dump(SCHEMA))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    export, run_dir = tmp_path / "export", tmp_path / "run"
    export.mkdir()
    command = [sys.executable, "-m", "trainer.online", "--schema", str(tmp_path / "schema.yaml"),
               "--config", str(tmp_path / "config.yaml"), "--bootstrap-servers",
               kafka_broker.bootstrap, "--topic", topic, "--group", "g-serve-online",
               "--run-dir", str(run_dir), "--unit-samples", "100", "--report-every", "100",
               "--export-dir", str(export), "--export-every", "0", "-X",
               "max.poll.interval.ms=8000"]
    env = {k: v for k, v in os.environ.items() if k != crash_points.ENV}
    with Service(export, "--poll-interval", "0.02") as service:
        assert not service.model()["ready"]  # nothing exported yet
        # every unit is trained, then published, then checkpointed: killed right after the
        # second version is public, before the checkpoint of the unit it holds
        killed = subprocess.run(command + ["--checkpoint-every", "0"], capture_output=True,
                                text=True, timeout=300,
                                env={**env, crash_points.ENV: "export.published:2"})
        assert killed.returncode == crash_points.EXIT_CODE, killed.stderr[-3000:]
        first = read_lineage(str(export))
        assert published_versions(str(export)) == [1, 2]
        checkpoint = CheckpointManager(str(run_dir)).latest()
        assert 0 < checkpoint.state["samples"] < SAMPLES
        seen = service.wait_for(lambda i: i["model"] and i["model"]["version"] == 2,
                                what="the killed run's last version applied")
        assert seen["model"]["lineage"] == first

        # restarted: from the checkpoint, which lacks the last published unit
        final = subprocess.run(command + ["--checkpoint-every", "600", "--idle-exit", "2"],
                               capture_output=True, text=True, timeout=300, env=env)
        assert final.returncode == 0, final.stderr[-3000:]
        summary = json.loads(final.stdout.strip().splitlines()[-1])
        assert summary["samples"] == SAMPLES - checkpoint.state["samples"]
        second = read_lineage(str(export))
        assert second != first  # a new lineage, not renumbered deltas
        last = published_versions(str(export))[-1]
        info = service.wait_for(lambda i: i["model"]["lineage"] == second
                                and i["model"]["version"] == last and i["ready"],
                                what="the restarted run's last version applied")
        assert info["reloads"] >= 1
        status, answer = service.predict({"samples": PROBE})
        assert status == 200 and answer["model"] == {**answer["model"], "lineage": second,
                                                     "version": last}
        served = np.array([p["click"] for p in answer["predictions"]])
    # the restarted trainer's export, read from scratch
    reference = Predictor(export)
    assert reference.update() > 0 and reference.version == last
    np.testing.assert_allclose(served, reference.predict(PROBE), rtol=2e-5)
    assert service.child.returncode == 0, service.stderr
