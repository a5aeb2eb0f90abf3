"""benchmarks.tiers_end_to_end at CI size: the output's structure, and the budgeted training
run equal to the unbounded one (same eval AUC) with rows on disk."""


def test_tiers_end_to_end_benchmark_tiny(tmp_path):
    import benchmarks.tiers_end_to_end

    result = benchmarks.tiers_end_to_end.run([
        "--samples", "4000", "--eval-samples", "1000", "--batch-size", "1000", "--rounds", "1",
        "--clients", "2",
        "--serve-seconds", "1", "--work", str(tmp_path)])
    plain, budgeted = result["train"]["unbounded"][0], result["train"]["budgeted"][0]
    assert budgeted["auc"] == plain["auc"] and result["auc_difference"] == 0
    assert budgeted["store_rows"] == plain["store_rows"]
    assert budgeted["disk_rows"] > 0 and 0 < budgeted["hit_rate"] < 1
    assert plain["disk_rows"] == 0 and plain["hit_rate"] is None
    assert result["budget_bytes"] < result["budgeted_row_bytes"]
    assert result["train_ratio"] > 0
    for mode in ("in_memory", "budgeted"):
        served = result["serve"][mode]
        assert served["requests"] > 0 and served["non_200"] == 0
        assert served["p50_ms"] <= served["p99_ms"]
