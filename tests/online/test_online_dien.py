"""trainer.online --model dien: DIEN learns from a Kafka topic of JSON samples whose user
features carry the behaviour sequence and its click times (stored in any order, ordered by the
times as in files)."""

import json
import os

import numpy as np
import pyarrow as pa
from commands import in_process

import schemas
from pipelines.generate import generate_tables
from trainer import models
from trainer.checkpoints import CheckpointManager
from trainer.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = 1200


def test_online_dien_trains_every_sample_and_checkpoints_a_dien(kafka_broker, tmp_path):
    data = schemas.load(os.path.join(ROOT, "schemas", "examples",
                                     "taobao_sequence.yaml")).to_dict()
    data["layers"][0]["features"][3]["sequence"]["max_length"] = 8
    schema = schemas.from_dict(data)
    schema_path = tmp_path / "schema.yaml"
    schema_path.write_text(schema.to_yaml())
    config_path = tmp_path / "config.yaml"
    config_path.write_text(json.dumps({
        "batch_size": 200, "seed": 3, "threads": 1, "embedding": {"dim": 4},
        "features": {"clicked_cats": {"table": "cate"}, "cate_id": {"table": "cate"}}}))
    raw = pa.concat_tables(list(generate_tables(schema, SAMPLES, seed=5, samples_per_user=10,
                                                ctr=0.2, sequential=1.5)))
    rows = raw.to_pylist()
    topic = kafka_broker.create_topic()
    kafka_broker.produce(topic, [(str(r["user_id"]).encode(), json.dumps(r).encode())
                                 for r in rows])
    run_dir = tmp_path / "run"
    out = in_process("trainer.online", "--schema", schema_path, "--config", config_path,
                     "--bootstrap-servers", kafka_broker.bootstrap, "--topic", topic,
                     "--group", "dien-online", "--run-dir", run_dir, "--model", "dien",
                     "--idle-exit", "3")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["samples"] == SAMPLES

    latest = CheckpointManager(str(run_dir)).latest()
    kept = Trainer.restore(os.path.join(latest.path, "model"))
    assert isinstance(kept.model, models.DIEN)
    assert "cate" in kept.stores and "clicked_times" not in kept.stores   # one table, no times
    assert kept.store_rows() > 0
    scores = kept.predict(raw.slice(0, 300))
    assert np.isfinite(scores).all() and np.ptp(scores) > 0
