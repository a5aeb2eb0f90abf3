"""DIEN: the interest extractor once per user node, the AUGRU per ad node, the MLP per leaf;
structured compute equals flat compute, and the model reads the order of the behaviours."""
import os

import numpy as np
import pyarrow as pa
import pytest

import compression
import schemas
from pipelines.generate import generate_tables
from trainer import TrainConfig, Trainer, models
import test_exactness as exactness
from test_exactness import first_batch
from trainer_data import ROOT

SCHEMA_PATH = os.path.join(ROOT, "schemas", "examples", "taobao_sequence.yaml")
ADAGRAD = {"name": "adagrad", "lr": 0.05, "initial_accumulator": 0.1}
CONFIG = {"batch_size": 256, "embedding": {"dim": 6, "optimizer": ADAGRAD},
          "features": {"clicked_cats": {"table": "cate"}, "cate_id": {"table": "cate"}}}


def dien(**changes):
    return models.DIEN(**{"hidden": (16, 8), "gru_units": 8, "aux_hidden": (8,), **changes})


@pytest.fixture(scope="module")
def seq_schema():
    """The example schema with its sequences cut to their 8 most recent items (the data has
    longer ones)."""
    data = schemas.load(SCHEMA_PATH).to_dict()
    data["layers"][0]["features"][3]["sequence"]["max_length"] = 8
    return schemas.from_dict(data)


@pytest.fixture(scope="module")
def raw(seq_schema):
    return pa.concat_tables(list(generate_tables(seq_schema, 2000, seed=11, samples_per_user=10,
                                                 ctr=0.2, sequential=1.5)))


@pytest.fixture(scope="module")
def trees(seq_schema, raw):
    return compression.build_trees(raw, seq_schema)


def assert_same_gradients(a, b):
    exactness.assert_same_gradients(a, b, loss_rtol=1e-5)  # the GRUs' sums in other orders


def test_structured_and_flat_first_step_equal(seq_schema, trees):
    batch = first_batch(seq_schema, trees)
    assert batch.layers[0].size < batch.num_leaves / 3  # the trees really share user nodes
    lengths = np.diff(batch.layers[0].features["clicked_cats"][1])
    # sequences cut to 8 items, shorter ones and empty ones
    assert lengths.max() > 8 and ((0 < lengths) & (lengths < 8)).any() and (lengths == 0).any()
    config = TrainConfig.from_dict(CONFIG)
    structured = Trainer(seq_schema, dien(), config)
    flat = Trainer(seq_schema, dien(), config.replace(compute="flat"))
    # every part built: two GRUs, the aux MLP, the attention, the tower (3 layers + bias)
    assert len(structured.network.variables) == 2 * 3 + 4 + 1 + (4 + 2 + 2)
    for vs, vf in zip(structured.network.variables, flat.network.variables):
        np.testing.assert_array_equal(vs.numpy(), vf.numpy())
    gs, gf = structured.compute_gradients(batch), flat.compute_gradients(batch)
    assert_same_gradients(gs, gf)
    # every part of the model learns: the GRUs, the attention, the auxiliary network
    assert all(np.abs(g).sum() > 0 for g in gs["dense"])

    # the first real step (dense optimizer, store update) lands on the same parameters; the
    # rows move by their update, proportional to the gradient: to the gradients' tolerance
    ids, _ = gs["embeddings"]["cate"]
    before = structured.stores["cate"].lookup(ids, train=False)
    np.testing.assert_array_equal(before, flat.stores["cate"].lookup(ids, train=False))
    structured.fit([batch])
    flat.fit([batch])
    for vs, vf in zip(structured.network.variables, flat.network.variables):
        np.testing.assert_allclose(vs.numpy(), vf.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(structured.stores["cate"].lookup(ids, train=False) - before,
                               flat.stores["cate"].lookup(ids, train=False) - before,
                               rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("compute", ["structured", "flat"])
def test_the_sequence_runs_once_per_user_node_and_the_augru_once_per_ad_node(
        seq_schema, trees, compute):
    """What each recurrent layer runs on in one forward pass: structured, the extractor's
    sequences are the batch's user nodes and the AUGRU's its ad nodes; flat, both run on every
    leaf."""
    batch = first_batch(seq_schema, trees)
    trainer = Trainer(seq_schema, dien(), TrainConfig.from_dict(CONFIG).replace(compute=compute))
    model, seen = trainer.model, {}
    for part in ("extractor", "evolver"):
        layer = getattr(model, part)

        def recorded(x, mask, attention=None, layer=layer, part=part):
            seen[part] = int(x.shape[0])
            return layer(x, mask, attention)

        object.__setattr__(model, part, recorded)   # around the real layer, for one call
    feed = trainer.builder.lookup(trainer.prepare(batch), trainer.stores, train=False).feed
    trainer.network.outputs(feed)
    if compute == "structured":
        assert seen == {"extractor": batch.layers[0].size, "evolver": batch.layers[1].size}
        assert batch.layers[0].size < batch.layers[1].size < batch.num_leaves
    else:
        assert seen == {"extractor": batch.num_leaves, "evolver": batch.num_leaves}


def test_the_auxiliary_loss_is_part_of_training_only(seq_schema, trees):
    batch = first_batch(seq_schema, trees)
    config = TrainConfig.from_dict(CONFIG)
    with_aux = Trainer(seq_schema, dien(aux_weight=1.0), config)
    without = Trainer(seq_schema, dien(aux_weight=0.0), config)
    # the same click model (aux variables aside): the same predictions
    np.testing.assert_allclose(with_aux.predict([batch]), without.predict([batch]), rtol=1e-6)
    extra = with_aux.compute_gradients(batch)["loss"] - without.compute_gradients(batch)["loss"]
    # a next-behaviour classifier that knows nothing yet: about 2 log 2 per pair
    assert 0.5 < extra < 2.0


def test_the_order_of_the_behaviours_matters(raw):
    """Reversing the click times reverses the sequences: DIEN's predictions change, a pooling
    model's do not (sequences not cut: the same bags either way)."""
    data = schemas.load(SCHEMA_PATH).to_dict()
    data["layers"][0]["features"][3]["sequence"] = {"time": "clicked_times"}
    seq_schema = schemas.from_dict(data)
    times = raw["clicked_times"].to_pylist()
    late_first = pa.array([[-t for t in ts] for ts in times], pa.list_(pa.int64()))
    reversed_raw = raw.set_column(raw.column_names.index("clicked_times"), "clicked_times",
                                  late_first)
    batches = [first_batch(seq_schema, compression.build_trees(r, seq_schema))
               for r in (raw, reversed_raw)]
    config = TrainConfig.from_dict(CONFIG)
    for model, changes in ((dien(), True), (models.MLP(hidden=(16, 8)), False)):
        trainer = Trainer(seq_schema, model, config)
        trainer.fit(batches[:1])  # rows for the ids (an unseen id reads as zeros)
        a, b = (trainer.predict([batch]) for batch in batches)
        assert (np.abs(a - b).max() > 1e-4) == changes, type(model).__name__


@pytest.mark.parametrize("model, message", [
    (models.DIEN(behaviour="clicked_times"), "DIEN behaviour='clicked_times': the schema must "
     "declare it an ordered sequence"),
    (models.DIEN(query="age_level", behaviour="clicked_cats"), None),
    (models.DIEN(query="hour", behaviour="nope"), "DIEN behaviour='nope': the schema needs an "
     "'ids' feature"),
    (models.DIEN(query="clicked_cats"), "DIEN query='clicked_cats': the schema needs an 'id' "
     "feature"),
])
def test_check_names_what_is_wrong(seq_schema, model, message):
    if message is None:
        model.check(seq_schema)  # a query on the behaviour's own layer is allowed
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        model.check(seq_schema)


def test_dien_needs_a_declared_sequence():
    taobao = schemas.load(os.path.join(ROOT, "schemas", "examples", "taobao_like.yaml"))
    with pytest.raises(ValueError, match="must declare it an ordered sequence"):
        models.DIEN().check(taobao)


@pytest.mark.parametrize("kwargs, message", [
    ({"gru_units": 0}, "DIEN gru_units: expected a positive integer, got 0"),
    ({"aux_weight": -1}, "DIEN aux_weight: expected a number >= 0, got -1"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        models.DIEN(**kwargs)


def test_spec_rebuilds_the_model():
    model = dien(aux_weight=0.5)
    again = models.from_spec(model.spec())
    assert isinstance(again, models.DIEN) and again.spec() == model.spec()


def test_train_evaluate_and_export_with_the_command(seq_schema, raw, tmp_path):
    """``trainer.train --model dien`` with trainer/examples/dien.yaml on raw files (trees
    built on the way), evaluated after each epoch, exported; the export scores the eval data as the run did, and
    ``trainer.evaluate`` gives the kept checkpoint's AUC."""
    import json

    import pyarrow.parquet as pq
    from commands import in_process

    from trainer.metrics import auc
    from trainer.serving import Predictor
    from trainer_data import auc_tolerance

    schema_path = tmp_path / "schema.yaml"
    schema_path.write_text(seq_schema.to_yaml())
    pq.write_table(raw.slice(0, 1600), tmp_path / "train.parquet")
    pq.write_table(raw.slice(1600), tmp_path / "eval.parquet")
    config = os.path.join(ROOT, "trainer", "examples", "dien.yaml")
    run_dir, export = tmp_path / "run", tmp_path / "export"
    out = in_process("trainer.train", "--schema", schema_path,
                     "--train-data", tmp_path / "train.parquet",
                     "--eval-data", tmp_path / "eval.parquet", "--config", config,
                     "--model", "dien", "--hidden", "8", "--batch-size", "400", "--epochs", "2",
                     "--no-progress", "--out", run_dir, "--export-dir", export)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["samples"] == 2 * 1600 and result["eval_samples"] == 400
    assert [e["step"] for e in result["evaluations"]] == [4, 8]
    assert 0.0 < result["auc"] < 1.0 and result["logloss"] > 0

    evaluation = in_process("trainer.evaluate", "--run", run_dir,
                            "--data", tmp_path / "eval.parquet", "--no-progress")
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    assert json.loads(evaluation.stdout.strip().splitlines()[-1])["auc"] == result["auc"]

    eval_table = pq.read_table(tmp_path / "eval.parquet")
    scores = Predictor(export).predict(eval_table)
    labels = eval_table.column("click").to_numpy()
    assert auc(scores, labels) == pytest.approx(result["auc"],
                                                abs=auc_tolerance(scores, labels))
    kept = Trainer.restore_run(run_dir)
    assert isinstance(kept.model, models.DIEN) and kept.model.spec()["gru_units"] == 36
    assert set(kept.stores) == {"cate", "user_id", "age_level", "gender", "ad_id", "brand_id",
                                "creative_id", "pid", "hour"}   # no table of clicked_times


def test_a_served_ranking_request_answers_as_the_predictor(seq_schema, raw, trees, tmp_path):
    """The served path (trainer.live, what trainer.serve answers with) for a ranking request:
    the user's features and sequence once (one user node, so the interest extractor runs once
    for every candidate), the candidates' ads below; its answers equal the Predictor's on the
    flat rows, where every row carries the user's sequence."""
    import json

    from trainer.live import LiveModel
    from trainer.serving import Predictor, export_increment

    trainer = Trainer(seq_schema, dien(), TrainConfig.from_dict(CONFIG))
    for batch in compression.iter_batches(trees, seq_schema, 256):
        trainer.train_batch(batch)
    export = tmp_path / "export"
    export_increment(trainer, export)

    user_features = [f.name for f in seq_schema.layers[0].features]
    below = [f.name for layer in seq_schema.layers[1:] for f in layer.features]
    rows = raw.to_pylist()
    lengths = [len(r["clicked_cats"]) for r in rows]
    user = rows[int(np.argmax(lengths))]            # a user with a long sequence
    root = {name: user[name] for name in user_features}
    candidates = [{name: r[name] for name in below} for r in rows[:12]]
    assert len(root["clicked_cats"]) > 1 and len({c["cate_id"] for c in candidates}) > 1

    live = LiveModel(export)
    try:
        kind, got, _ = live.predict_request(
            json.dumps({"root": root, "candidates": candidates}).encode())
    finally:
        live.close()
    assert kind == "tree" and got.shape == (12, 1)
    flat = pa.Table.from_pylist([{**root, **c, "click": 0} for c in candidates])
    want = Predictor(export).predict(flat)
    np.testing.assert_allclose(got[:, 0], np.asarray(want).reshape(-1), rtol=1e-5, atol=1e-7)
    assert np.ptp(got) > 0          # the candidates are told apart
