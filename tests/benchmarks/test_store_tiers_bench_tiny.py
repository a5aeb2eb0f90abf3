"""`python -m benchmarks.store --tiers` end to end at a tiny size (CI): the output's structure
and the exactness check it makes (the budgeted and unbounded stores' rows compared bit for bit
after the timed rounds and again after expiry and churn); no timing thresholds."""
import json

import benchmarks.store
import benchmarks.store_tiers


def test_tiered_store_benchmark_tiny(tmp_path, capsys):
    result = benchmarks.store.run([
        "--tiers", "--rows", "20000", "--dim", "4", "--batch", "2000", "--prefill", "20", "--batches", "4",
        "--warmup", "4", "--rounds", "2", "--calibration-batches", "3",
        "--calibration-passes", "2", "--rss-batches", "2", "--targets", "0.95,0.8",
        "--dir", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == json.loads(json.dumps(result))  # the final line is the JSON
    assert any(line.startswith("policy") for line in out) and any("RSS run" in l for l in out)
    assert result["benchmark"] == "store_tiers" and result["rows"] == 20000
    table = result["table_rows"]  # the ids 20 steps of 2000 saw
    assert 0 < table < 20 * 2000
    assert result["row_bytes"] == 20 + 4 * 4 * 2 and result["payload_bytes"] == 8 + 4 * 4 * 2
    assert result["memory_row_bytes"] == result["row_bytes"] + 5
    entries = {(e["policy"], e["target"]): e for e in result["results"]}
    assert set(entries) == {(p, t) for p in ("lru", "lfu") for t in (0.95, 0.8)}
    for (policy, target), e in entries.items():
        assert e["exact"] is True  # compare() raises on the first differing row
        assert 0 < e["memory_rows"] <= table <= e["table_rows"]  # + the warm-up's new ids
        assert e["new_rows"] >= 0
        assert e["memory_budget_bytes"] == e["memory_rows"] * result["memory_row_bytes"]
        assert 0 < e["hit_rate"] <= 1 and e["hit_rate_distinct"] <= e["hit_rate"]
        assert e["throughput_ratio"] > 0 and e["ratio_min"] <= e["ratio_max"]
        calibration = result["calibration"][f"{policy}@{target}"]
        assert 1 <= len(calibration["passes"]) <= 2
        assert e["memory_rows"] in {p["memory_rows"] for p in calibration["passes"]}
        for phase in ("disk_after_training", "disk_after_expiry", "disk_after_churn"):
            disk = e[phase]
            if disk["disk_rows"]:
                assert disk["disk_vs_payload"] == (
                    disk["disk_bytes"] / disk["disk_rows"] / result["payload_bytes"])
    # The smaller target needs no more memory rows than the larger one.
    for policy in ("lru", "lfu"):
        assert entries[(policy, 0.8)]["memory_rows"] <= entries[(policy, 0.95)]["memory_rows"]
    # RSS: one unbounded run and one per budget, each in its own process.
    assert len(result["rss"]) == 1 + len(entries)
    unbounded, *budgeted = result["rss"]
    assert unbounded["policy"] is None and unbounded["rows"] > table
    assert unbounded["rss_bytes_per_row"] > 0
    for r in budgeted:
        assert r["rows"] == unbounded["rows"] and r["memory_rows"] + r["disk_rows"] == r["rows"]
        assert r["memory_rows"] <= r["memory_rows_cap"] + 2 * 2000  # + pinned rows of 2 batches
        assert r["within_budget_plus_overhead"] is True


def test_zipf_calibration_helpers():
    zipf = benchmarks.store_tiers.Zipf(1000, 1.1)
    assert zipf.rows_for(0.5) < zipf.rows_for(0.9) < zipf.rows_for(0.99) <= 1000
    assert zipf.static_hit_rate(zipf.rows_for(0.9)) >= 0.9
    # Between a pass that fell short and one that overshot, the next guess lies between them.
    passes = [{"memory_rows": 100, "hit_rate": 0.8}, {"memory_rows": 400, "hit_rate": 0.97}]
    assert 100 < benchmarks.store_tiers.next_guess(zipf, passes, 0.9, 4) < 400
    # One pass short of the target: more rows than the CDF's, at least 1.25x the last.
    short = [{"memory_rows": 200, "hit_rate": 0.7}]
    assert benchmarks.store_tiers.next_guess(zipf, short, 0.9, 4) >= 250
