"""A trainer publishing serving versions to a real S3 server (moto), killed at a crash point of
the publish: followers on the store see a whole version, never a mix."""

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
