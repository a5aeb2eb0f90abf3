"""trainer.serve on a quantized export (README, "Smaller exports"): it answers what a Predictor
of the same export answers, follows the quantized versions the trainer publishes, and refuses
--memory-budget up front."""

import numpy as np
import pyarrow as pa
from commands import in_process
from service import Service

import compression
import schemas
from trainer import models
from trainer.config import TrainConfig
from trainer.serving import Predictor, export_increment
from trainer.trainer import Trainer

SCHEMA = schemas.from_dict({"name": "quantized_service", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"}]},
    {"name": "sample", "key": ["item"], "features": [{"name": "item", "kind": "id"}]}]})
CONFIG = TrainConfig.from_dict({"batch_size": 500, "seed": 4, "threads": 1,
                                "embedding": {"dim": 5, "export_format": "int8"},
                                "tables": {"item": {"export_format": "int4"}}})


def samples(n, seed):
    rng = np.random.default_rng(seed)
    return [{"uid": int(u), "item": int(i), "click": float(c)}
            for u, i, c in zip(rng.integers(0, 800, n), rng.integers(0, 1500, n),
                               rng.random(n) < 0.3)]


def train(trainer, seed):
    trees = compression.build_trees(pa.Table.from_pylist(samples(2000, seed)), SCHEMA)
    for batch in compression.iter_batches(trees, SCHEMA, 500):
        trainer.train_batch(batch)


def test_service_answers_a_quantized_export_and_follows_its_versions(tmp_path):
    trainer = Trainer(SCHEMA, models.MLP(hidden=(8,)), CONFIG)
    train(trainer, 0)
    export = tmp_path / "export"
    export_increment(trainer, export)
    rows = [{k: s[k] for k in ("uid", "item")} for s in samples(150, 9)]
    reference = Predictor(export)
    with Service(export, "--threads", "1") as service:
        status, answer = service.predict({"samples": rows})
        assert status == 200
        np.testing.assert_allclose([p["click"] for p in answer["predictions"]],
                                   reference.predict(rows), rtol=1e-5, atol=1e-7)
        train(trainer, 1)
        assert export_increment(trainer, export)["version"] == 1
        service.wait_for(lambda info: info["model"]["version"] == 1, what="version 1 served")
        assert reference.update() == 2
        status, answer = service.predict({"samples": rows})
        assert status == 200 and answer["model"]["version"] == 1
        np.testing.assert_allclose([p["click"] for p in answer["predictions"]],
                                   reference.predict(rows), rtol=1e-5, atol=1e-7)
    out = in_process("trainer.serve", "--export-dir", export, "--port", "0",
                     "--memory-budget", "1GiB", "--tier-dir", tmp_path / "tiers")
    assert out.returncode == 2
    assert "--memory-budget applies to exports of float32 tables only" in out.stderr, out.stderr
