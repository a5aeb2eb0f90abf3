"""benchmarks.compact_tables at a tiny size: every variant trains, the table and the JSON line
come out, and the compact variants hold fewer rows than the default."""
import json

import benchmarks.compact_tables as compact_tables


def test_compact_tables_benchmark_tiny(capsys):
    assert compact_tables.main(["--tiny"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    results = result["results"]
    assert list(results) == [name for name, _ in compact_tables.VARIANTS]
    default = results["default"]
    assert default["auc_loss"] == 0 and default["x_smaller"] == 1
    for name, r in results.items():
        assert 0 < r["auc"] < 1 and r["samples_per_sec"] > 0, name
        assert r["model_bytes"] == sum(r["tables"].values()) * 18 * 4, name
    assert results["multi_hash sum"]["rows"] < default["rows"]
    assert results["filter min_count 10"]["rows"] < default["rows"]
    cold = results["filter min_count 10 + cold 1000"]["tables"]
    assert all(f"{t}__cold" in cold for t in compact_tables.BIG_TABLES)
    assert "| multi_hash sum |" in "\n".join(out)


def test_compact_tables_online_tiny(kafka_broker, capsys):
    assert compact_tables.main(["--online", "--tiny", "--bootstrap-servers",
                                kafka_broker.bootstrap]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["samples"] == 4000
    for name, r in result["results"].items():
        assert r["samples"] == 4000 and 0 < r["pv_logloss"] < 1, name
    rows = {name: r["rows"] for name, r in result["results"].items()}
    names = [name for name, _ in compact_tables.ONLINE_VARIANTS]
    # the filter keeps rows from the rare ids; the cold table adds its bucket rows
    assert rows[names[0]] < rows[names[1]] and rows[names[0]] < rows[names[2]]
