"""python -m benchmarks.trainer runs end to end at a tiny size (the real sizes are in
benchmarks/RESULTS.md)."""
import benchmarks.trainer


def test_trainer_benchmark_tiny():
    result = benchmarks.trainer.run([
        "--samples", "4000", "--samples-per-user", "10", "--batch-size", "1000", "--warmup", "1",
        "--rounds", "1", "--keras-rows", "10000", "--hidden", "16,8", "--quality-samples", "0"])
    (run,) = result["runs"]
    assert run["samples_per_user"] == 10 and run["timed_samples"] == 3000
    for mode in ("structured", "flat", "keras"):
        assert run[mode]["samples_per_sec"] > 0
    for mode in ("structured", "flat"):
        assert set(run[mode]["ms_per_step_sequential"]) == {"prepare", "lookup", "step", "update"}
    assert run["nodes_per_batch"][0] < run["nodes_per_batch"][-1] == 1000
