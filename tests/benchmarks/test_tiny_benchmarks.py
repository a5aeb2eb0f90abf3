"""Every benchmark runs end to end at a tiny size (CI); the real sizes are in RESULTS.md."""

import pytest

import benchmarks.compression


def test_compression_benchmark_tiny():
    result = benchmarks.compression.run(["--samples", "3000", "--repeats", "1",
                                         "--tfrecord-samples", "300", "--batch-size", "500"])
    assert result["samples"] == 3000
    assert set(result["bytes"]) == {"flat_unsorted.parquet", "flat_sorted.parquet",
                                    "trees.parquet", "flat.tfrecord.gz"}
    assert all(size > 0 for size in result["bytes"].values())
    assert result["id_compression_ratio"] > 1
    assert set(result["to_batches_s"]) == set(result["bytes"])


def test_trainer_benchmark_end_to_end_tiny():
    """python -m benchmarks.trainer's end-to-end runs (trainer.train on a raw file, structured
    and flat) next to the step level, at a tiny size and for DIEN only (each run is a process
    that imports TensorFlow; the MLP and DIN take the same path)."""
    import benchmarks.trainer

    result = benchmarks.trainer.run([
        "--samples", "1200", "--samples-per-user", "10", "--batch-size", "400", "--warmup", "1",
        "--rounds", "1", "--hidden", "8", "--quality-samples", "0", "--models", "dien",
        "--e2e-samples", "1200", "--e2e-samples-per-user", "10", "--e2e-epochs", "2"])
    (run,) = result["end_to_end"]
    assert run["model"] == "dien" and run["epochs"] == 2
    (step_run,) = result["runs"]
    assert run["step_level"] == step_run["step_structured_over_flat"]
    for mode in ("structured", "flat"):
        (one,) = run["rounds"][mode]
        assert one["samples"] == 2 * 1200
        assert one["wall_seconds"] > one["fit_seconds"] > 0
        assert all(one["stages"][stage] > 0 for stage in ("read", "lookup", "step", "update"))
    # structured compute looks up fewer ids than the samples hold; flat looks up all of them
    assert run["structured"]["id_compression"] > 1.5 and run["flat"]["id_compression"] == 1.0
    assert run["wall_over_step_level"] == run["wall_over"] / run["step_level"]


def test_pipeline_benchmark_tiny(kafka_broker, capsys):
    import json

    import benchmarks.pipeline

    assert benchmarks.pipeline.main(["--samples", "2000", "--shards", "2", "--stream-samples",
                                     "500", "--bootstrap-servers", kafka_broker.bootstrap]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["batch"]["samples"] == 2000
    assert result["stream"]["samples"] == 500 and result["stream"]["tree_messages"] > 0


def test_store_benchmark_tiny():
    import benchmarks.store

    result = benchmarks.store.run(["--rows", "20000", "--dims", "4", "--batch", "3000",
                                   "--batches", "2", "--no-tf"])
    (entry,) = result["results"]
    assert entry["rows"] == 20000 and entry["dim"] == 4
    native = entry["native"]
    for key in ("lookup_ids_per_s", "adagrad_ids_per_s", "snapshot_write_mb_per_s",
                "snapshot_read_mb_per_s", "delta_write_mb_per_s", "delta_apply_mb_per_s"):
        assert native[key] > 0, key
    assert native["floor_bytes_per_row"] == 8 + 8 * 4
    assert 0 < native["delta_rows"] <= 20000


def test_online_benchmark_tiny(kafka_broker):
    import benchmarks.online

    result = benchmarks.online.run(["--samples", "16000", "--rate", "2000", "--seconds", "2",
                                    "--export-every", "0.5", "--trees", "--unit-samples", "4000",
                                    "--budget", "--bootstrap-servers", kafka_broker.bootstrap])
    assert result["samples"] == 16000
    # waits counted only after the first unit: within the steady part of the run
    assert 0 <= result["trainer_waited_s"] <= 16000 / result["samples_per_sec"]
    assert result["trees"]["samples"] == 16000
    budget = result["budget"]  # the first unit (the group join) is not measured
    assert budget["samples"] == 12000
    stages = budget["cpu_s_per_100k"]  # no broker stage: the fixture's broker is not ours
    assert set(stages) == {"consume", "decode", "build_batch_prepare", "train"}
    assert stages["train"] > 0 and stages["decode"] > 0
    assert budget["total_cpu_s_per_100k"] == pytest.approx(sum(stages.values()), abs=0.01)
    delay = result["delay_phase"]
    # a version is published only when something was trained since the last one (an export
    # of an untrained model cannot be served): the phase's 4000 samples arrive during the
    # trainer's start-up and train as one unit of --unit-samples 4000
    assert delay["samples"] == 4000 and delay["exports"] >= 1
    assert 0 < delay["delay_p50_s"] <= delay["delay_p99_s"]
    assert "steady_delay_p99_s" in delay  # None when every sample arrived during start-up


def test_serving_benchmark_tiny(kafka_broker):
    import benchmarks.serving

    result = benchmarks.serving.run(["--tiny", "--bootstrap-servers", kafka_broker.bootstrap])
    fresh = result["freshness"]
    assert fresh["samples"] > 0 and 0 < fresh["p50_s"] <= fresh["p99_s"] and fresh["versions"] > 0
    for size in ("1", "100"):
        phases = result["latency"][size]
        assert phases["none"]["requests_per_sec"] > 0 and phases["updates"]["p99_ms"] > 0
        assert phases["p99_ratio"] > 0
    assert result["versions_applied"] >= 1 and result["failed_applies"] == 0
    assert result["throughput"]["ratio"] > 0
    structured = result["structured"]
    assert structured["candidates"] == 50 and structured["speedup_p50"] > 0


def test_serving_concurrency_benchmark_tiny():
    """locust clients in their own process against the service, with and without batching."""
    import benchmarks.serving

    result = benchmarks.serving.run(["--tiny", "--concurrency", "1,4"])["concurrency"]
    assert result["in_process_candidates_per_sec"] > 0
    for mode in ("batching", "no_batching"):
        runs = result["modes"][mode]["runs"]
        assert set(runs) == {"1", "4"}
        for r in runs.values():
            assert r["candidates_per_sec"] > 0 and r["p50_ms"] <= r["p99_ms"]
            assert r["non_200"] == 0
    assert result["modes"]["batching"]["model_calls"] > 0


@pytest.mark.parametrize("face", ["samples", "tfserving-rest", "oip"])
def test_serving_concurrency_benchmark_faces_tiny(face):
    """benchmarks.serving --concurrency --face: flat samples through each face, no non-200."""
    import benchmarks.serving

    result = benchmarks.serving.run(["--tiny", "--concurrency", "2", "--face", face])[
        "concurrency"]
    assert result["face"] == face and result["in_process_candidates_per_sec"] > 0
    for mode in ("batching", "no_batching"):
        r = result["modes"][mode]["runs"]["2"]
        assert r["candidates_per_sec"] > 0 and r["p50_ms"] <= r["p99_ms"]
        assert r["non_200"] == 0


def test_serving_ranking_vs_flat_benchmark_tiny():
    """benchmarks.serving --ranking-vs-flat: both forms over HTTP, alternating, answers equal."""
    import benchmarks.serving

    result = benchmarks.serving.run(["--tiny", "--ranking-vs-flat"])["ranking_vs_flat"]
    assert result["candidates"] == 50
    for name in ("tree", "flat"):
        r = result[name]
        assert r["requests"] > 0 and r["candidates_per_sec"] > 0 and r["p50_ms"] <= r["p99_ms"]
    assert result["tree"]["requests"] == result["flat"]["requests"]
    assert result["speedup"] > 0 and result["speedup_p50"] > 0
    assert result["one_candidate_p50_ms"] > 0


def test_serving_versions_under_load_benchmark_tiny():
    """benchmarks.serving --concurrency --versions-every: phases without and with versions
    published, every published version applied, no non-200 answer."""
    import benchmarks.serving

    result = benchmarks.serving.run(["--tiny", "--concurrency", "2", "--versions-every",
                                     "0.25"])["concurrency"]
    versions = result["versions"]
    assert set(versions["runs"]) == {"2"}
    run = versions["runs"]["2"]
    for phase in ("none", "updates"):
        assert run[phase]["requests"] > 0 and run[phase]["non_200"] == 0
        assert run[phase]["p50_ms"] <= run[phase]["p99_ms"]
    assert run["p99_ratio"] > 0
    assert versions["published"] >= 1
    assert versions["versions_applied"] == versions["published"]
    assert versions["failed_applies"] == 0 and versions["apply_seconds"]["count"] >= 1


def test_json_decode_benchmark_tiny():
    import benchmarks.json_decode

    result = benchmarks.json_decode.run(["--samples", "1500", "--batch", "500", "--repeats", "1"])
    assert result["samples"] == 1500
    assert set(result["samples_per_s"]) == {"pyarrow", "native_1_thread", "native_2_threads"}
    assert set(result["file_rows_per_s"]) == {"pyarrow", "native"}


def test_quality_benchmark_tiny(capsys, tmp_path):
    import json
    import math

    import benchmarks.quality
    from trainer import models

    path = tmp_path / "quality.json"
    assert benchmarks.quality.main(["--tiny", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    result = json.loads(path.read_text())
    names = ["default"] + [f"config/{m}" for m in models.MODELS] + ["lr", "keras", "lr+hidden"]
    assert result["models"] == names
    assert set(result["datasets"]) == {"generated-3k", "sequential-3k", "movielens-100k"}
    for dataset, entry in result["datasets"].items():
        assert f"### {dataset}:" in out
        info = entry["info"]
        assert info["train_samples"] > 0 and info["eval_samples"] > 0
        # the oracle needs the generator's hidden features: generated data only; --tiny runs
        # the models whose code does not differ on MovieLens on generated data only
        expected = names if dataset.startswith("generated") else [
            n for n in names[:-1] if n not in benchmarks.quality.TINY_GENERATED_ONLY]
        # DIEN reads an ordered behaviour sequence: taobao_like has none, the table says so
        if dataset.startswith("sequential"):   # --tiny: the rows of its comparison only
            expected = list(benchmarks.quality.TINY_SEQUENTIAL)
        skipped = ["config/dien"] if dataset.startswith("generated") else []
        expected = [n for n in expected if n not in skipped]
        assert list(entry.get("skipped", {})) == skipped
        if skipped:
            assert "config/dien: not run on this schema" in out.split(f"### {dataset}:")[1]
        assert list(entry["models"]) == expected
        for name in expected:
            stats = entry["models"][name]
            assert "error" not in stats, (dataset, name, stats.get("error"))
            assert math.isfinite(stats["auc"]["mean"]) and 0 <= stats["auc"]["mean"] <= 1
            assert math.isfinite(stats["logloss"]["mean"]) and stats["logloss"]["mean"] > 0
            assert len(stats["seeds"]) == 1
            if name not in ("lr", "lr+hidden"):  # the passes were chosen, 1 to --epochs
                assert 1 <= stats["runs"][0]["epochs"] <= 2
            row = next(line for line in out.split(f"### {dataset}:")[1].splitlines()
                       if line.startswith(f"| {name} |"))
            assert f"{stats['auc']['mean']:.4f} ± " in row
    bayes = result["datasets"]["generated-3k"]["bayes"]
    assert 0.5 < bayes["auc"] <= 1 and bayes["logloss"] > 0
    assert f"**{bayes['auc']:.4f}**" in out.split("### generated-3k:")[1]
    assert "gap_to_bayes_auc" in result["datasets"]["generated-3k"]["models"]["default"]
    assert result["datasets"]["movielens-100k"]["bayes"] is None
    # the sequential data: the order-blind Bayes AUC (on 600 eval rows it may even pass the
    # Bayes AUC), DIEN against DIN
    sequential = result["datasets"]["sequential-3k"]
    assert 0.5 < sequential["order_blind"]["auc"] <= 1
    assert sequential["order_blind"]["auc"] != sequential["bayes"]["auc"]
    assert f"*{sequential['order_blind']['auc']:.4f}*" in out.split("### sequential-3k:")[1]
    assert any(text.startswith("DIEN - DIN: ") and "target: DIEN above DIN" in text
               for text in sequential["comparisons"])


def test_baseline_next_to_a_run(tmp_path):
    """benchmarks.baseline (what make demo ends with) on tiny files, next to a trained run."""
    import json
    import os

    import pyarrow.parquet as pq
    from commands import in_process

    import schemas
    from pipelines.generate import generate_tables

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    schema_path = os.path.join(root, "schemas", "examples", "taobao_like.yaml")
    table = next(generate_tables(schemas.load(schema_path), 4000, seed=3))
    pq.write_table(table.slice(0, 3200), tmp_path / "train.parquet")
    pq.write_table(table.slice(3200), tmp_path / "eval.parquet")

    def run(*args):  # the commands' main in this process (what make demo runs in children)
        out = in_process(*args)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr

    trained, _ = run("trainer.train", "--schema", schema_path, "--train-data",
                     str(tmp_path / "train.parquet"), "--eval-data",
                     str(tmp_path / "eval.parquet"), "--batch-size", "400", "--no-progress",
                     "--out", str(tmp_path / "run"))
    result, stderr = run("benchmarks.baseline", "--schema", schema_path,
                         "--train", str(tmp_path / "train.parquet"),
                         "--eval", str(tmp_path / "eval.parquet"), "--run",
                         str(tmp_path / "run"), "--lr-c", "0.1", "--lr-bits", "16")
    assert (result["train_samples"], result["eval_samples"]) == (3200, 800)
    lr = result["logistic_regression"]
    assert 0.5 < lr["auc"] < 1 and lr["C"] == 0.1
    assert result["run"]["auc"] == trained["auc"]
    assert f"difference {trained['auc'] - lr['auc']:+.4f} AUC on the same 800 samples" in stderr


def test_distributed_benchmark_tiny():
    pytest.importorskip("ray")
    import benchmarks.distributed

    result = benchmarks.distributed.run(["--samples", "3000", "--batch-size", "500", "--hidden",
                                         "16", "--warmup", "1", "--rounds", "1", "--trips", "6"])
    assert result["inproc"]["steps"] == result["ray_1x1"]["steps"] == 5
    assert result["overhead_ratio"] > 0 and result["ray_2x2"]["samples_per_sec"] > 0
    assert result["ray_2x2"]["bytes_per_step_per_worker"] > 0
    assert result["ray_2x2"]["bytes_per_step_per_shard"] > 0
    transport = result["transport"]
    assert transport["send_bytes"] == int(result["ray_1x1"]["bytes_per_step"]["worker_sent"]) > 0
    assert 0 < transport["touched"] < 1
    for kind in ("empty", "whole", "split"):
        assert transport[kind]["median_ms"] >= transport[kind]["min_ms"] > 0
    assert transport["whole"]["ratio"] > 1 and transport["split"]["ratio"] > 1


def test_cloud_benchmark_tiny():
    """The Beam job on s3:// against local files. Its other parts run what other tests run
    (the Dask part: tests/pipelines/test_compress_dask.py, whose cluster alone takes seconds
    to start; the training part: tests/trainer/test_train_s3.py, ~8 s more here)."""
    import benchmarks.cloud

    result = benchmarks.cloud.run(["--samples", "3000", "--shards", "2",
                                   "--skip", "dask,train"])
    beam = result["beam_s3"]
    assert beam["samples"] == 3000 and beam["s3_over_local"] > 0
    assert beam["s3_server_cpu_s_per_million"] > 0 and beam["s3_job_cpu_s_per_million"] > 0
    assert "dask" not in result and "train_s3" not in result
