"""Serving and evaluation from a real S3 server (moto): a trainer killed at a crash point of its
versions' publish leaves followers on the store a whole version, never a mix; the commands
refuse a missing bucket in one line; trainer.evaluate --run reads a run on the store."""

import os
import subprocess
import sys

import numpy as np

import online_samples
from native import crash_points
from online_samples import CONFIG, PROBE, SCHEMA

# a full export after 100 samples, then a version after each further 100
_CHILD = f"""
import sys
import pyarrow as pa
import schemas
from online_samples import sample_value
from trainer import TrainConfig, Trainer, models
from trainer.serving import export_increment
samples = [sample_value(i) for i in range(400)]
trainer = Trainer(schemas.from_dict({SCHEMA!r}), models.MLP(hidden=(8,)),
                  TrainConfig.from_dict({CONFIG!r}))
for k in range(4):
    trainer.fit(pa.Table.from_pylist(samples[100 * k:100 * (k + 1)]), shuffle=False)
    export_increment(trainer, sys.argv[1])
"""


def test_an_export_to_s3_killed_after_a_version_is_followed_to_that_version(s3_server):
    """Killed right after version 2's manifest went up (``export.published:2``): a follower
    on the store serves version 2 whole, as a Predictor loading the store from scratch does.
    (A kill inside the full export's publish, ``publish.*``, is the one of
    tests/online/test_crash_points.py: the same StagedObjectOutput.)"""
    from trainer.live import LiveModel
    from trainer.serving import Predictor, published_versions

    with s3_server.environment():
        export = f"{s3_server.create_bucket()}/export"
        env = {k: v for k, v in os.environ.items() if k != crash_points.ENV}
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(online_samples.__file__),
                                             env.get("PYTHONPATH", "")])
        child = subprocess.run([sys.executable, "-c", _CHILD, export], capture_output=True,
                               text=True, timeout=300,
                               env={**env, crash_points.ENV: "export.published:2"})
        assert child.returncode == crash_points.EXIT_CODE, child.stderr[-3000:]
        assert published_versions(export) == [1, 2]
        live = LiveModel(export)
        try:
            assert live.poll() == 2 and live.ready and live.problem is None
            served, info = live.predict(PROBE)
            assert info["version"] == 2
        finally:
            live.close()
        reference = Predictor(export)
        assert reference.update() == 4 and reference.version == 2  # 2 tables x 2 versions
        np.testing.assert_allclose(served[:, 0], reference.predict(PROBE), rtol=2e-5)


def test_serve_and_evaluate_name_a_missing_bucket_in_one_line(s3_server, capsys):
    """``trainer.serve --export-dir`` and ``trainer.evaluate --run`` on a store: a missing
    bucket is refused before anything loads (the export itself may come later)."""
    from trainer import evaluate, serve

    with s3_server.environment():
        assert serve.main(["--export-dir", "s3://no-such-bucket/export", "--port", "0"]) != 0
        assert evaluate.main(["--run", "s3://no-such-bucket/run", "--data", "x.parquet"]) != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"python -m trainer.{name}: error: s3://no-such-bucket/{what}: the bucket "
        "'no-such-bucket' does not exist; create it or fix the path"
        for name, what in (("serve", "export"), ("evaluate", "run"))]


def test_evaluate_a_run_on_s3_as_the_same_run_on_disk(s3_server, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    import schemas
    from compression import fs
    from online_samples import sample_value
    from trainer import TrainConfig, Trainer, evaluate, models

    samples = pa.Table.from_pylist([sample_value(i) for i in range(300)])
    trainer = Trainer(schemas.from_dict(SCHEMA), models.MLP(hidden=(8,)),
                      TrainConfig.from_dict(CONFIG))
    trainer.fit(samples.slice(0, 200), shuffle=False)
    trainer.save(tmp_path / "run" / "checkpoint")
    pq.write_table(samples.slice(200), tmp_path / "eval.parquet")
    with s3_server.environment():
        run = f"{s3_server.create_bucket()}/run"
        fs.publish_directory(str(tmp_path / "run"), run)
        argv = ["--data", str(tmp_path / "eval.parquet"), "--no-progress"]
        remote = evaluate.run(["--run", run, *argv])
        local = evaluate.run(["--run", str(tmp_path / "run"), *argv])
        timing = ("samples_per_sec", "seconds")
        assert {k: v for k, v in remote.items() if k not in timing} == \
            {k: v for k, v in local.items() if k not in timing}
        assert remote["samples"] == 100 and remote["step"] == trainer.step
        published = fs.published_manifest(run)["files"]  # published back with its eval logs
        assert "checkpoint/trainer.json" in published
        assert any(name.startswith("eval/") for name in published)
