"""Serving exports on a real S3 server (moto): published all or nothing by a manifest, and a
Predictor loaded from s3:// scores exactly as the same export on local disk."""

import json

import numpy as np
import pytest

import compression
from compression import cli, fs
from trainer_data import SCHEMA_PATH


def test_predictor_from_s3_predicts_what_the_local_export_predicts(schema, raw_small,
                                                                   trees_small, s3_bucket,
                                                                   tmp_path):
    from trainer import TrainConfig, Trainer, models
    from trainer.serving import Predictor

    trainer = Trainer(schema, models.MLP(hidden=(8,)),
                      TrainConfig.from_dict({"batch_size": 250, "embedding": {"dim": 4}}))
    trainer.fit(trees_small)
    local = trainer.export(tmp_path / "export")
    out = f"{s3_bucket}/export"
    assert trainer.export(out) == out
    manifest = fs.published_manifest(out)
    assert {"export.json", "saved_model/saved_model.pb"} <= set(manifest["files"])
    assert {f"stores/{t}/store.snapshot" for t in trainer.tables} <= set(manifest["files"])
    samples = raw_small.slice(0, 300).drop_columns(list(schema.labels))
    remote = Predictor(out, batch_size=120)
    np.testing.assert_array_equal(remote.predict(samples),
                                  Predictor(local, batch_size=120).predict(samples))
    assert remote.source == out and remote.lineage == json.loads(
        fs.read_text(fs.resolve_published(f"{out}/export.json")))["lineage"]
    assert remote.update() == 0 and remote.version == 0  # nothing published since

    # a new export replaces the old one whole: one generation under the manifest
    trainer.fit(trees_small)
    trainer.export(out)
    newer = Predictor(out, batch_size=120)
    assert newer.lineage != remote.lineage
    np.testing.assert_allclose(np.sort(newer.predict(samples)),
                               np.sort(trainer.predict(raw_small.slice(0, 300))), rtol=1e-5)
    assert {f[len(out) + 1:].split("/")[0] for f in fs.list_files(out)} == {
        fs.MANIFEST, fs.published_manifest(out)["generation"]}

    with pytest.raises(FileNotFoundError, match=rf"^{s3_bucket}/nothing: not a trainer export"):
        Predictor(f"{s3_bucket}/nothing")


def test_train_export_dir_on_s3_is_the_local_export(raw_small, trees_small, s3_bucket,
                                                     tmp_path):
    from trainer import train
    from trainer.serving import Predictor

    compression.write_trees(trees_small, str(tmp_path / "trees.parquet"))
    config = tmp_path / "trainer.yaml"
    config.write_text("embedding: {dim: 4}\n")

    def run(out, export_dir):
        return train.run(["--schema", SCHEMA_PATH, "--train-data", str(tmp_path / "trees.parquet"),
                          "--config", str(config), "--model", "mlp", "--hidden", "8",
                          "--batch-size", "500", "--epochs", "1", "--seed", "3",
                          "--no-progress", "--out", str(out), "--export-dir", export_dir])

    fs.write_text(f"{s3_bucket}/taken/notes.txt", "not an export\n")
    with pytest.raises(cli.UsageError, match="holds something other than an export"):
        run(tmp_path / "refused", f"{s3_bucket}/taken")
    assert not (tmp_path / "refused").exists()

    local = run(tmp_path / "local", str(tmp_path / "export"))
    remote = run(tmp_path / "remote", f"{s3_bucket}/export")
    assert remote["export_dir"] == f"{s3_bucket}/export"
    assert remote["train_auc"] == local["train_auc"]
    samples = raw_small.slice(0, 200)
    np.testing.assert_array_equal(Predictor(f"{s3_bucket}/export").predict(samples),
                                  Predictor(str(tmp_path / "export")).predict(samples))
