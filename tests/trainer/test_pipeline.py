"""The three-stage input pipeline: exact by default, errors surface, expiry runs."""
import numpy as np
import pytest

import compression
from trainer import TrainConfig, Trainer, models


def config(**changes):
    base = {"batch_size": 128, "embedding": {"dim": 4}}
    base.update(changes)
    return TrainConfig.from_dict(base)


def test_pipelined_fit_equals_the_sequential_loop(schema, trees_small):
    batches = list(compression.iter_batches(trees_small, schema, 128))
    piped = Trainer(schema, models.MLP(hidden=(8,)), config(pipeline_depth=3))
    piped.fit(trees_small, shuffle=False)   # read, batch, look up in threads
    sequential = Trainer(schema, models.MLP(hidden=(8,)), config())
    # fit's rows' L2: its default l2 (7 per pass) spread over the pass's samples
    assert sequential.config.embedding.l2 == 7.0
    sequential.row_l2_scale = 1.0 / sum(b.num_leaves for b in batches)
    for batch in batches:
        feed = sequential.builder.lookup(sequential.prepare_numpy(batch), sequential.stores,
                                         train=True)
        sequential._train_on(feed)
    assert piped.step == sequential.step == len(batches)
    for a, b in zip(piped.network.variables, sequential.network.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for table, store in piped.stores.items():
        ids = np.sort(store.to_numpy()["ids"])
        np.testing.assert_array_equal(store.lookup(ids, train=False),
                                      sequential.stores[table].lookup(ids, train=False))


def test_the_step_is_traced_while_the_first_batch_is_read(schema, trees_small):
    """fit traces the training step on its own thread while the reading stage makes the first
    batch (tree building from raw files takes as long as tracing): the source gives its first
    batch only once the step is traced, which would never happen if tracing waited for it."""
    import threading

    batches = list(compression.iter_batches(trees_small, schema, 128))
    trainer = Trainer(schema, models.MLP(hidden=(8,)), config())
    step = trainer.network.train_step
    traced, seen = threading.Event(), []
    trace = step.trace

    def recorded_trace():
        trace()
        traced.set()

    step.trace = recorded_trace    # around the real trace, to be told when it is done

    def source():
        seen.append(traced.wait(timeout=60))
        yield from batches

    trainer.fit(source())
    assert seen == [True] and trainer.step == len(batches)
    assert trainer.timings["trace"] > 0


def test_stale_lookups_run_ahead_and_still_train(schema, trees_small):
    """Lookups that run ahead of updates read rows one or more updates old: a different (not
    exact) result, with every sample still trained once."""
    exact = Trainer(schema, models.MLP(hidden=(8,)), config())
    stale = Trainer(schema, models.MLP(hidden=(8,)), config(stale_lookups=True,
                                                            pipeline_depth=4))
    a, b = exact.fit(trees_small), stale.fit(trees_small)
    assert a["samples"] == b["samples"] == 2000 and a["steps"] == b["steps"]
    assert a["id_compression"] == b["id_compression"] > 1.5
    flat = Trainer(schema, models.MLP(hidden=(8,)), config(compute="flat"))
    assert flat.fit(trees_small)["id_compression"] == 1.0
    assert flat.ids_fed == exact.leaf_ids    # the count of leaf-level ids is right
    assert any(not np.array_equal(x.numpy(), y.numpy())
               for x, y in zip(exact.network.variables, stale.network.variables))


def test_errors_in_the_reading_stage_reach_the_caller(schema, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("user_id,nonsense\n1,2\n")
    trainer = Trainer(schema, models.MLP(hidden=(8,)), config())
    with pytest.raises(ValueError, match="bad.csv"):
        trainer.fit(str(bad))
    with pytest.raises(FileNotFoundError, match="no input files match"):
        trainer.fit(str(tmp_path / "missing-*.parquet"))


def test_expiry_and_entry_filter_counters(schema, trees_small):
    trainer = Trainer(schema, models.MLP(hidden=(8,)), config(embedding={
        "dim": 4, "filter": {"name": "counter", "min_count": 2},
        "expire": {"every_steps": 4, "max_idle_steps": 1}}))
    trainer.fit(trees_small)
    stats = trainer.store_stats()
    assert stats["rejected"] > 0 and stats["admitted"] > 0
    assert trainer.expired == stats["expired"] > 0
    assert stats["rows"] == stats["admitted"] - stats["expired"] - stats.get("evicted", 0)


def test_expiry_by_a_user_function_named_in_the_config(schema, trees_small, tmp_path,
                                                       monkeypatch):
    # a user's rule: drop rows of odd ids updated fewer than 3 times, once past step 2
    (tmp_path / "my_expiry_rules.py").write_text(
        "import numpy as np\n"
        "calls = []\n"
        "def odd_and_rare(ids, update_counts, last_steps, last_times, l2_norms, step):\n"
        "    calls.append((len(ids), step))\n"
        "    return (ids % 2 == 1) & (update_counts < 3) & (step > 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    trainer = Trainer(schema, models.MLP(hidden=(8,)), config(embedding={
        "dim": 4, "expire": {"every_steps": 2, "function": "my_expiry_rules:odd_and_rare"}}))
    trainer.fit(trees_small)
    import my_expiry_rules

    steps = sorted({step for _, step in my_expiry_rules.calls})
    assert steps == list(range(2, trainer.step + 1, 2))  # every 2 steps, with the current step
    assert trainer.expired == trainer.store_stats()["expired"] > 0
    for table, store in trainer.stores.items():
        rows = store.to_numpy()
        # what is left of the odd ids was updated at least 3 times or after the last expiry
        odd = rows["ids"] % 2 == 1
        assert np.all((rows["update_counts"][odd] >= 3) |
                      (rows["last_steps"][odd] > steps[-1])), table
