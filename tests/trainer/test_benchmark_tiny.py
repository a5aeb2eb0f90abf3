"""python -m benchmarks.trainer runs end to end at a tiny size (the real sizes are in
benchmarks/RESULTS.md)."""
import benchmarks.trainer


def test_trainer_benchmark_tiny():
    result = benchmarks.trainer.run([
        "--samples", "4000", "--samples-per-user", "10", "--batch-size", "1000", "--warmup", "1",
        "--rounds", "1", "--keras-rows", "10000", "--hidden", "16,8", "--quality-samples", "0",
        "--ceiling", "--models", "mlp", "--e2e-samples", "0"])
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


def test_trainer_benchmark_times_din_and_dien_against_their_bounds():
    result = benchmarks.trainer.run([
        "--samples", "1500", "--samples-per-user", "10", "--batch-size", "500", "--warmup", "1",
        "--rounds", "1", "--hidden", "16,8", "--quality-samples", "0", "--models", "din,dien",
        "--e2e-samples", "0"])
    assert [r["model"] for r in result["runs"]] == ["din", "dien"]
    for run in result["runs"]:
        assert run["timed_samples"] == 1000 and run["nodes_per_batch"][-1] == 500
        sequence = run["sequence"]
        assert 1 <= sequence["steps"] <= 50            # the schema's max_length
        # every ad node and leaf sees its user's sequence: pairs per node agree in scale
        assert sequence["pairs_per_node"][0] > 0
        assert run["matmul_bound"]["at_these_nodes"] > 1.0
        assert run["step_structured_over_flat"] > 0
        for mode in ("structured", "flat"):
            assert set(run[mode]["ms_per_step_sequential"]) == {"prepare", "lookup", "step",
                                                                "update"}


def test_matmul_bound_of_every_model_is_one_without_sharing_and_grows_with_it():
    import schemas

    schema = schemas.load(benchmarks.trainer.SEQUENCE_SCHEMA)
    sequence = {"steps": 20.0, "pairs_per_node": [8.0, 8.0, 8.0]}
    for model in ("mlp", "din", "dien"):
        alone = benchmarks.trainer.matmul_bound(schema, [100, 100, 100], (200, 80),
                                                model=model, sequence=sequence)
        assert abs(alone["at_these_nodes"] - 1.0) < 1e-12     # one leaf per node: no saving
        shared = benchmarks.trainer.matmul_bound(schema, [10, 40, 100], (200, 80),
                                                 model=model, sequence=sequence)
        assert 1.0 < shared["at_these_nodes"] < shared["all_upper_shared"]
    # DIEN: the GRUs dominate and run per user/ad node, so sharing pays more than for the MLP
    by_model = {m: benchmarks.trainer.matmul_bound(schema, [2, 20, 114], (200, 80), model=m,
                                                   sequence=sequence)["at_these_nodes"]
                for m in ("mlp", "dien")}
    assert by_model["dien"] > 2 * by_model["mlp"]


def test_sequence_shape_counts_the_padded_steps_and_each_nodes_pairs():
    import numpy as np
    import schemas

    schema = schemas.load(benchmarks.trainer.SEQUENCE_SCHEMA)
    batches, _ = benchmarks.trainer.make_batches(schema, 600, 10, 200, seed=1)
    shape = benchmarks.trainer.sequence_shape(batches[:1], schema, "clicked_cats")
    batch = batches[0]
    _, offsets = batch.layers[0].features["clicked_cats"]
    lengths = np.minimum(np.diff(offsets), 50)
    assert shape["steps"] == max(int(lengths.max()), 1)
    leaf_users = batch.layers[1].parent[batch.layers[2].parent]
    assert np.isclose(shape["pairs_per_node"][2], lengths[leaf_users].mean())
    assert np.isclose(shape["pairs_per_node"][0], lengths.mean())
