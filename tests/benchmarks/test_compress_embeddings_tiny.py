"""python -m benchmarks.compress_embeddings at its CI size: every variant exported in every
format, the ratios against both float32 baselines, and the service latencies measured."""
import benchmarks.compress_embeddings as bench


def test_compress_embeddings_benchmark_tiny(capsys):
    result = bench.run(["--tiny", "--datasets", "generated"])
    entry = result["datasets"]["generated-3k"]
    assert entry["train_samples"] == 2400 and entry["eval_samples"] == 600
    assert list(entry["variants"]) == [name for name, _ in bench.TRAINING_VARIANTS]
    variant = entry["variants"]["default"]
    rows = variant["formats"]
    assert list(rows) == list(bench.EXPORT_FORMATS)
    sizes = [rows[f]["export_bytes"] for f in ("float32", "float16", "int8", "int4")]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] > 0
    assert rows["float32"]["auc_delta"] == 0 and rows["float32"]["smaller_than_float32_export"] == 1
    # the float32 export holds optimizer state and headers: bigger than the values alone
    assert rows["float32"]["smaller_than_values_only"] < 1 < rows["int4"]["smaller_than_values_only"]
    for r in rows.values():
        assert 0.3 < r["auc"] < 1 and r["requests"] == 10 and r["p99_ms"] >= r["p50_ms"] > 0
        assert r["p99_ms"] >= r["best_p99_ms"] >= r["best_p50_ms"] > 0
    assert variant["training"]["samples_per_sec"] > 0
    assert "| default | int8 |" in bench.markdown(result)
    # the compact variants: the filter's rows are fewer than the default's, exported smaller
    # than its float32 export in every format, and each row is set against that export
    compact = entry["variants"]["compact: filter min_count 15, user_id own rows"]["formats"]
    assert all(r["smaller_than_default_float32"] > 1 for r in compact.values())
    assert rows["float32"]["smaller_than_default_float32"] == 1
    assert rows["float32"]["relative_auc_loss_vs_default"] == 0


def test_a_variant_for_another_schema_is_not_run_on_movielens():
    import schemas
    from benchmarks import datasets

    movielens = schemas.load(datasets.MOVIELENS_SCHEMA)
    generated = schemas.load(datasets.GENERATED_SCHEMA)
    for name, overrides in bench.TRAINING_VARIANTS:
        assert bench.missing_tables(overrides, generated) == []
        assert (bench.missing_tables(overrides, movielens) == []) == (name == "default")
