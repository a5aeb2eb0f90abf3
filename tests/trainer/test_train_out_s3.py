"""trainer.train --out s3://: a run directory published by a manifest, interrupted by a real
signal and resumed from s3://, ends with the result of the same run on local disk."""

import json
import signal

import pyarrow.parquet as pq
import pytest

from compression import cli, fs
from processes import signal_when
from trainer_data import SCHEMA_PATH, assert_same_result, generated

def train_args(base, out):
    # 2,000 samples, 20 steps a pass, 2 passes, evaluated every 7 steps (as test_resume.py)
    return ["--schema", SCHEMA_PATH, "--train-data", str(base / "train-*.parquet"),
            "--eval-data", str(base / "eval.parquet"), "--config", str(base / "trainer.yaml"),
            "--hidden", "8", "--batch-size", "100", "--epochs", "2", "--eval-every", "7",
            "--patience", "2", "--seed", "3", "--out", str(out)]


@pytest.mark.slow
def test_a_run_on_s3_interrupted_and_resumed_equals_the_local_run(schema, raw_small, s3_bucket,
                                                                  tmp_path):
    from trainer import train

    pq.write_table(raw_small.slice(0, 1000), tmp_path / "train-0.parquet")
    pq.write_table(raw_small.slice(1000), tmp_path / "train-1.parquet")
    pq.write_table(generated(schema, 600, seed=12).drop_columns(["p_click", "p_conversion"]),
                   tmp_path / "eval.parquet")
    (tmp_path / "trainer.yaml").write_text("embedding: {dim: 4}\nlog_every: 5\n")
    expected = train.run([*train_args(tmp_path, tmp_path / "local"), "--no-progress"])
    assert expected["steps"] > 7

    out = f"{s3_bucket}/runs/mlp"
    code, stdout, stderr = signal_when(["-m", "trainer.train", *train_args(tmp_path, out)],
                                       b"eval after epoch 1 (step 7)", signal.SIGINT)
    assert code == 130, stderr
    assert stderr.strip().splitlines()[-1].endswith(f"--out {out} --resume")
    assert "prefixrec-run-" not in stderr  # the local working directory is never named
    published = fs.published_manifest(out)["files"]
    assert "interrupted.json" in published and "result.json" not in published
    assert any(name.startswith("checkpoint/") for name in published)

    with pytest.raises(cli.OutputExistsError, match=f"--out {out}: the directory is not empty"):
        train.run(train_args(tmp_path, out))
    result = train.run([*train_args(tmp_path, out), "--resume", "--no-progress"])
    assert result["run_dir"] == out
    assert_same_result(result, expected, out)
    published = fs.published_manifest(out)["files"]
    assert "interrupted.json" not in published
    stored = json.loads(fs.read_text(fs.resolve_published(f"{out}/result.json")))
    assert stored["steps"] == expected["steps"]
    assert {f[len(out) + 1:].split("/")[0] for f in fs.list_files(out)} == {
        fs.MANIFEST, fs.published_manifest(out)["generation"]}
    with pytest.raises(cli.UsageError, match=f"--out {s3_bucket}/none: no interrupted run"):
        train.run([*train_args(tmp_path, f"{s3_bucket}/none"), "--resume"])
