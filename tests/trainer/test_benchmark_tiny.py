"""python -m benchmarks.trainer runs end to end at a tiny size (the real sizes are in
benchmarks/RESULTS.md)."""
import benchmarks.trainer


def test_trainer_benchmark_tiny():
    result = benchmarks.trainer.run([
        "--samples", "4000", "--samples-per-user", "10", "--batch-size", "1000", "--warmup", "1",
        "--rounds", "1", "--keras-rows", "10000", "--hidden", "16,8", "--quality-samples", "0",
        "--ceiling"])
    (run,) = result["runs"]
    assert run["samples_per_user"] == 10 and run["timed_samples"] == 3000
    for mode in ("structured", "flat"):
        assert set(run[mode]["ms_per_step_sequential"]) == {"prepare", "lookup", "step", "update"}
    assert run["nodes_per_batch"][0] < run["nodes_per_batch"][-1] == 1000


def test_all_upper_shared_keeps_the_leaves_under_one_node_per_upper_layer():
    import numpy as np
    import schemas

    schema = schemas.load(benchmarks.trainer.SCHEMA)
    batches, _ = benchmarks.trainer.make_batches(schema, 600, 10, 200, seed=1)
    batch = batches[0]
    shared = benchmarks.trainer.all_upper_shared(batch)
    assert [layer.size for layer in shared.layers] == [1, 1, batch.num_leaves]
    leaves = batch.leaf_features()
    after = shared.leaf_features()
    for name, array in batch.layers[-1].features.items():  # leaf features untouched
        assert np.array_equal(after[name], array)
    for level in (0, 1):  # every leaf sees the first node of each upper layer
        for name in batch.layers[level].features:
            first = leaves[name]
            if isinstance(first, tuple):
                values, offsets = first
                expect = values[offsets[0]:offsets[1]]
                got_values, got_offsets = after[name]
                assert all(np.array_equal(got_values[got_offsets[i]:got_offsets[i + 1]], expect)
                           for i in range(batch.num_leaves))
            else:
                assert (after[name] == first[:1]).all()
    assert shared.labels is batch.labels


def test_matmul_bound_counts_the_first_layer_per_node_and_the_rest_per_leaf():
    import schemas

    schema = schemas.from_dict({"name": "b", "labels": ["y"], "layers": [
        {"name": "u", "key": ["a"], "features": [{"name": "a", "kind": "id"},
                                                 {"name": "d", "kind": "dense", "dim": 2}]},
        {"name": "s", "key": ["c"], "features": [{"name": "c", "kind": "id"}]}]})
    # widths: user 4 + 2 = 6, leaf 4; hidden 10 -> 1: rest = 10 per leaf
    bound = benchmarks.trainer.matmul_bound(schema, [2, 8], (10,), dim=4)
    flat = 8 * (10 * 10 + 10)
    assert bound["at_these_nodes"] == flat / (2 * 6 * 10 + 8 * 4 * 10 + 8 * 10)
    assert bound["all_upper_shared"] == flat / (8 * (4 * 10 + 10))
