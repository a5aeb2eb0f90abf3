"""python -m trainer.train and python -m trainer.evaluate, end to end on tiny data (their
``main`` in this process: what a child process adds is checked in tests/test_commands.py)."""
import glob
import json
import os

import pyarrow.parquet as pq
import pytest
from commands import in_process

import compression

from trainer_data import SCHEMA_PATH, auc_tolerance


def run(args):
    out = in_process(*args)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def scalar_tags(directory):
    """Tags of the TensorBoard scalars in a directory's event files."""
    import tensorflow as tf

    tags = set()
    for path in glob.glob(str(directory / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "scalars":
                    tags.add(value.tag)
    return tags


def test_train_then_evaluate(schema, raw_small, trees_small, tmp_path):
    compression.write_trees(trees_small, str(tmp_path / "trees" / "part-00000.parquet"))
    pq.write_table(raw_small.slice(0, 600), tmp_path / "eval.parquet")
    config = tmp_path / "trainer.yaml"
    config.write_text("embedding: {dim: 4}\nlog_every: 2\n")
    run_dir = tmp_path / "run"
    result, stderr = run(["trainer.train", "--schema", SCHEMA_PATH,
                          "--train-data", str(tmp_path / "trees" / "*.parquet"),
                          "--eval-data", str(tmp_path / "eval.parquet"),
                          "--config", str(config), "--model", "mlp", "--hidden", "8",
                          "--compute", "structured", "--batch-size", "200", "--epochs", "2",
                          "--out", str(run_dir), "--export-dir", str(tmp_path / "export")])
    assert result["samples"] == 2 * raw_small.num_rows and result["eval_samples"] == 600
    assert result["steps"] == 20
    assert result["id_compression"] > 1.5   # ~10 samples per user: user ids looked up once
    assert result["store_rows"] > 0 and result["admitted"] >= result["store_rows"]
    assert "train" in stderr and "samples" in stderr      # the progress bar
    assert (f"eval AUC {result['auc']:.4f} (epoch {result['checkpoint_epoch']}, kept) | "
            in stderr)                                        # the summary line
    assert "eval after epoch 1 (step 10): AUC" in stderr     # each evaluation
    assert scalar_tags(run_dir / "train") >= {"loss", "auc", "samples_per_sec", "store/rows",
                                              "store/admitted", "store/rejected",
                                              "store/expired"}
    assert scalar_tags(run_dir / "eval") >= {"auc", "logloss"}
    assert json.loads((run_dir / "result.json").read_text()) == result

    evaluation, _ = run(["trainer.evaluate", "--run", str(run_dir),
                         "--data", str(tmp_path / "eval.parquet"), "--no-progress"])
    # evaluated after each of the 2 epochs; the checkpoint is the better one
    assert [e["step"] for e in result["evaluations"]] == [10, 20]
    best = max(result["evaluations"], key=lambda e: e["auc"])
    assert (result["checkpoint_step"], result["auc"]) == (best["step"], best["auc"])
    assert evaluation["samples"] == 600 and evaluation["step"] == best["step"]
    assert evaluation["auc"] == result["auc"]  # the run's AUC is its kept checkpoint's
    assert evaluation["logloss"] == pytest.approx(result["logloss"], rel=1e-6)
    assert evaluation["store_rows"] == result["store_rows"]

    # --export-dir: a serving export of the kept model, which scores the eval data as it did
    from trainer.metrics import auc
    from trainer.serving import Predictor

    assert result["export_dir"] == str(tmp_path / "export")
    assert f"| serving export in {tmp_path / 'export'}" in stderr
    eval_table = pq.read_table(tmp_path / "eval.parquet")
    scores = Predictor(tmp_path / "export").predict(eval_table)
    labels = eval_table.column("click").to_numpy()
    # the run scored in batches of 200, the export all 600 rows at once: equal scores to
    # float rounding only (not bit for bit on every CPU)
    assert auc(scores, labels) == pytest.approx(result["auc"],
                                                abs=auc_tolerance(scores, labels))
    from trainer import Trainer

    kept = Trainer.restore_run(run_dir)  # what trainer.online --init-from starts from
    assert kept.step == best["step"] and kept.store_rows() == result["store_rows"]
    # a directory holding something else is refused before any work
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    refused = in_process("trainer.train", "--schema", SCHEMA_PATH,
                         "--train-data", tmp_path / "eval.parquet", "--out", tmp_path / "run2",
                         "--export-dir", tmp_path / "other")
    assert refused.returncode == 2
    assert "--export-dir" in refused.stderr and "no export.json" in refused.stderr
    assert not (tmp_path / "run2").exists()


def test_bad_config_is_a_usage_error(tmp_path):
    config = tmp_path / "trainer.yaml"
    config.write_text("features: {nope: {pooling: sum}}\n")
    out = in_process("trainer.train", "--schema", SCHEMA_PATH, "--train-data", tmp_path,
                     "--config", config, "--out", tmp_path / "run")
    assert out.returncode == 2
    assert "features.nope: the schema 'taobao_like' has no feature 'nope'" in out.stderr
    assert not os.path.exists(tmp_path / "run")


def test_count_samples_of_tree_files_from_their_footers(schema, raw_small, trees_small,
                                                        tmp_path):
    """The progress bar's total for tree data: the leaves, exact, without reading the data."""
    from trainer.data import count_samples

    n = raw_small.num_rows
    path = str(tmp_path / "trees.parquet")
    compression.write_trees(trees_small, path, row_group_rows=7)  # many row groups
    assert pq.ParquetFile(path).metadata.num_row_groups > 1
    assert count_samples(path, schema) == n
    assert count_samples([path, path], schema) == 2 * n
    legacy = str(tmp_path / "legacy.parquet")  # lists spelled list.item (older writers)
    pq.write_table(trees_small.cast(_items_lists(trees_small.schema)), legacy,
                   use_compliant_nested_type=False)
    assert pq.ParquetFile(legacy).metadata.schema.column(
        pq.ParquetFile(legacy).metadata.num_columns - 1).path.startswith("ad.list.item.")
    assert count_samples(legacy, schema) == n
    assert count_samples(trees_small, schema) == n  # in-memory tree tables too
    part = trees_small.slice(5, 20)
    assert count_samples(part, schema) == sum(
        len(ad["creative"]) for row in part.column("ad").to_pylist() for ad in row)


def _items_lists(schema):
    """``schema`` with every list's value field named ``item``."""
    import pyarrow as pa

    def rename(t):
        if pa.types.is_list(t):
            return pa.list_(pa.field("item", rename(t.value_type)))
        if pa.types.is_struct(t):
            return pa.struct([pa.field(f.name, rename(f.type), f.nullable) for f in t])
        return t
    return pa.schema([pa.field(f.name, rename(f.type), f.nullable) for f in schema],
                     metadata=schema.metadata)
