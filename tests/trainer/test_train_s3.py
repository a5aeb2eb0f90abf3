"""trainer.train with --train-data and --eval-data on a real S3 server (moto): the run equals
the same run from local files."""

import json

import pyarrow.parquet as pq

import compression
from compression import fs
from trainer_data import SCHEMA_PATH

TIMING = ("samples_per_sec", "train_seconds", "run_dir")


def test_training_from_s3_trees_equals_training_from_local_trees(raw_small, trees_small,
                                                                 s3_bucket, tmp_path):
    from trainer import train

    compression.write_trees(trees_small.slice(0, 120), str(tmp_path / "trees" / "part-0.parquet"))
    compression.write_trees(trees_small.slice(120), str(tmp_path / "trees" / "part-1.parquet"))
    pq.write_table(raw_small.slice(0, 500), tmp_path / "eval.parquet")
    for name in ("trees/part-0.parquet", "trees/part-1.parquet", "eval.parquet"):
        fs.write_bytes(f"{s3_bucket}/{name}", (tmp_path / name).read_bytes())
    config = tmp_path / "trainer.yaml"
    config.write_text("embedding: {dim: 4}\n")

    def run(train_data, eval_data, out):
        return train.run(["--schema", SCHEMA_PATH, "--train-data", train_data,
                          "--eval-data", eval_data, "--config", str(config), "--model", "mlp",
                          "--hidden", "8", "--batch-size", "500", "--epochs", "1",
                          "--seed", "3", "--no-progress", "--out", str(out)])

    local = run(str(tmp_path / "trees" / "*.parquet"), str(tmp_path / "eval.parquet"),
                tmp_path / "local")
    remote = run(f"{s3_bucket}/trees/*.parquet", f"{s3_bucket}/eval.parquet",
                 tmp_path / "remote")
    assert local["samples"] == raw_small.num_rows and local["eval_samples"] == 500
    assert {k: v for k, v in remote.items() if k not in TIMING} == \
        {k: v for k, v in local.items() if k not in TIMING}
    settings = json.loads((tmp_path / "remote" / "result.json").read_text())
    assert settings["auc"] == remote["auc"]
