"""DIEN on Ray: two workers and two store shards, on raw sequential samples (trees built in the
workers on the way), train as one process on the union of their batches (the auxiliary loss
included), and the sharded export serves ranking requests with the user's sequence once."""
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")

import schemas  # noqa: E402
from pipelines.generate import generate_tables  # noqa: E402
from trainer import TrainConfig, models  # noqa: E402
from trainer.distributed import DistributedTrainer  # noqa: E402
from ray_reference import assert_rows_equal, single_process_run  # noqa: E402
from trainer_data import PREDICTION_RTOL, ROOT  # noqa: E402

W, S = 2, 2
SAMPLES = 1600
EPOCHS = 2
SCHEMA_PATH = os.path.join(ROOT, "schemas", "examples", "taobao_sequence.yaml")


def dien():
    return models.DIEN(hidden=(16, 8), gru_units=8, aux_hidden=(8,))


def config():
    return TrainConfig.from_dict({
        "batch_size": 400, "seed": 3,
        # Adagrad: a row's step stays proportional to its gradient, so float rounding stays
        # float rounding (see test_exactness.py)
        "embedding": {"dim": 6, "optimizer": {"name": "adagrad", "lr": 0.05,
                                              "initial_accumulator": 0.1},
                      "filter": {"name": "counter", "min_count": 2}},
        "features": {"clicked_cats": {"table": "cate"}, "cate_id": {"table": "cate"}}})


@pytest.fixture(scope="module")
def seq_schema():
    """The example schema with its sequences cut to their 8 most recent items."""
    data = schemas.load(SCHEMA_PATH).to_dict()
    data["layers"][0]["features"][3]["sequence"]["max_length"] = 8
    return schemas.from_dict(data)


@pytest.fixture(scope="module")
def raw_file(seq_schema, tmp_path_factory):
    """Raw samples with a sequential signal (``pipelines.generate --sequential``), as a file:
    each worker builds its own trees from it."""
    raw = pa.concat_tables(list(generate_tables(seq_schema, SAMPLES, seed=13,
                                                samples_per_user=10, ctr=0.2,
                                                sequential=1.5)))
    path = tmp_path_factory.mktemp("dien") / "train.parquet"
    pq.write_table(raw, path)
    return str(path)


def test_two_workers_two_shards_equal_single_process_and_the_export_serves(
        cluster, seq_schema, raw_file, tmp_path):
    from trainer.live import LiveModel
    from trainer.serving import Predictor

    cfg = config()
    single, single_losses = single_process_run(seq_schema, dien(), cfg, raw_file, EPOCHS, W)
    with DistributedTrainer(seq_schema, dien(), cfg, workers=W, shards=S) as dt:
        for a, b in zip(dt.dense_weights(1), single.network.variables):
            assert a.shape == b.shape  # the same network: GRUs, attention, aux MLP, tower
        dt.fit(raw_file, epochs=EPOCHS)
        assert dt.step == single.step == len(single_losses) >= 8
        assert dt.samples == single.samples == EPOCHS * SAMPLES
        # the union batch's loss (click log loss plus the auxiliary loss, summed over the
        # workers' shares) step by step, the GRUs' sums in other orders
        np.testing.assert_allclose(dt.losses, single_losses, rtol=1e-5)
        for w in range(W):
            for a, b in zip(dt.dense_weights(w), single.network.variables):
                np.testing.assert_allclose(a, b.numpy(), rtol=1e-5, atol=1e-7)
        assert_rows_equal(dt.table_rows(), single.stores)
        assert "clicked_times" not in single.stores   # a time column has no table
        export = tmp_path / "export"
        dt.export(export)

    assert json.loads((export / "export.json").read_text())["shards"] == S
    raw = pq.read_table(raw_file)
    rows = raw.to_pylist()
    user = rows[int(np.argmax([len(r["clicked_cats"]) for r in rows]))]
    above = [f.name for f in seq_schema.layers[0].features]
    below = [f.name for layer in seq_schema.layers[1:] for f in layer.features]
    root = {name: user[name] for name in above}
    candidates = [{name: r[name] for name in below} for r in rows[:16]]
    assert len(root["clicked_cats"]) > 8   # cut to the 8 most recent by their times
    flat = pa.Table.from_pylist([{**root, **c, "click": 0} for c in candidates])
    # the sharded export scores the flat rows (each with its copy of the sequence), in
    # their order
    want = np.asarray(Predictor(str(export)).predict(flat)).reshape(-1)

    body = json.dumps({"root": root, "candidates": candidates}).encode()
    live = LiveModel(export)
    try:
        # the request decodes as one tree: the user node once, its sequence once (8 items
        # after the cut), the 16 candidates below it
        (tree,) = live.decode(body).trees
        assert tree.layers[0].size == 1 and tree.num_leaves == 16
        _, offsets = tree.layers[0].features["clicked_cats"]
        assert offsets.tolist() == [0, len(root["clicked_cats"])]
        # what the served network is fed: one user node's 8 most recent behaviours (not 16
        # copies), so its interest extractor runs once for the 16 candidates
        prepared = live.version.base.builder.prepare(tree)
        sizes = prepared.feed["sizes"].tolist()
        assert sizes[0] == 1 and sizes[-1] == 16
        assert prepared.feed["splits"]["clicked_cats"].tolist() == [0, 8]
        kind, got, _ = live.predict_request(body)
    finally:
        live.close()
    assert kind == "tree" and got.shape == (16, 1)
    np.testing.assert_allclose(got[:, 0], want, rtol=PREDICTION_RTOL, atol=1e-7)
    # and as the single process's model scores the same tree
    np.testing.assert_allclose(np.asarray(single.predict([tree])).reshape(-1), want,
                               rtol=PREDICTION_RTOL, atol=1e-7)
    assert np.ptp(got) > 0   # the candidates are told apart
