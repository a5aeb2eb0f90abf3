"""Online learning with its run directory and export directory on a real S3 server (moto):
stopped and resumed from the store with nothing lost or trained twice, and a LiveModel that
follows the export on the store across the restart serves what a fresh Predictor loads."""

import contextlib
import json
import signal

import numpy as np
import yaml

import native
from compression import fs
from online_samples import CONFIG, PROBE, SCHEMA
from online_samples import sample_message as _sample
from trainer import online
from trainer.checkpoints import LATEST_FILE, CheckpointManager

SAMPLES = 400


@contextlib.contextmanager
def _own_signal_handlers():
    """trainer.online.run installs its SIGINT/SIGTERM handlers: give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_online_run_and_export_on_s3_resume_and_are_followed(kafka_broker, s3_bucket,
                                                             tmp_path):
    from trainer.live import LiveModel
    from trainer.serving import Predictor, published_versions, read_lineage

    topic = kafka_broker.create_topic()
    kafka_broker.produce(topic, [_sample(i) for i in range(SAMPLES)])
    (tmp_path / "schema.yaml").write_text(yaml.safe_dump(SCHEMA))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    run_dir, export = f"{s3_bucket}/online/run", f"{s3_bucket}/online/export"
    argv = ["--schema", str(tmp_path / "schema.yaml"), "--config", str(tmp_path / "config.yaml"),
            "--bootstrap-servers", kafka_broker.bootstrap, "--topic", topic,
            "--group", "g-online-s3", "--run-dir", run_dir, "--export-dir", export,
            "--export-every", "0", "--checkpoint-every", "0", "--unit-samples", "100",
            "--report-every", "100", "-X", "max.poll.interval.ms=8000"]
    with _own_signal_handlers():
        first = online.run(argv + ["--max-samples", "200"])
    assert first["samples"] == 200 and first["checkpoints"] >= 1
    published = fs.published_manifest(run_dir)["files"]
    assert f"checkpoints/{LATEST_FILE}" in published and "status.json" in published
    status = json.loads(fs.read_text(fs.resolve_published(f"{run_dir}/status.json")))
    assert status["samples"] == 200  # the final status, published after the last checkpoint
    first_lineage = read_lineage(export)
    assert first_lineage and published_versions(export)
    live = LiveModel(export)  # follows the export on the store through a local copy
    try:
        assert live.ready and live.version.lineage == first_lineage
        assert live.poll() >= 1 and live.version.number == published_versions(export)[-1]

        # the restart resumes from the checkpoint on the store, then stops when idle
        with _own_signal_handlers():
            second = online.run(argv + ["--idle-exit", "1"])
        assert second["samples"] == SAMPLES - 200 and second["offsets"] == {"0": SAMPLES}
        with fs.working_copy(run_dir) as local:
            latest = CheckpointManager(local).latest()
            assert latest.state["offsets"] == {"0": SAMPLES}
            assert latest.state["samples"] == SAMPLES
            rows = native.EmbeddingStore.load(f"{latest.path}/model/stores/sid").to_numpy()
        assert sorted(rows["ids"].tolist()) == list(range(SAMPLES))  # nothing lost
        assert set(rows["update_counts"].tolist()) == {1}            # nothing trained twice

        # a new process, a new lineage: the follower takes it in and applies its versions
        second_lineage, last = read_lineage(export), published_versions(export)[-1]
        assert second_lineage != first_lineage
        assert live.poll() >= 1 and live.ready
        assert (live.version.lineage, live.version.number) == (second_lineage, last)
        served, info = live.predict(PROBE)
        assert info["version"] == last
    finally:
        live.close()
    fresh = Predictor(export)
    assert fresh.update() > 0 and fresh.version == last
    np.testing.assert_allclose(served[:, 0], fresh.predict(PROBE), rtol=2e-5)
    # on the store: the manifest and one generation per published directory, no leftovers
    for directory in (run_dir, export):
        generation = fs.published_manifest(directory)["generation"]
        tops = {f[len(directory) + 1:].split("/")[0] for f in fs.list_files(directory)}
        assert tops <= {fs.MANIFEST, generation, "versions"}, (directory, tops)
