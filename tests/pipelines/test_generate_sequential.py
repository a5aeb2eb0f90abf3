"""The generator's sequential signal: the click depends on the order of the user's behaviour
sequence, so a model that sees the behaviours as a bag cannot reach the Bayes AUC."""
import copy
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import schemas
from pipelines import generate as gen

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQUENCE_PATH = os.path.join(ROOT, "schemas", "examples", "taobao_sequence.yaml")
SEQUENCE = schemas.load(SEQUENCE_PATH)
TAOBAO = schemas.load(os.path.join(ROOT, "schemas", "examples", "taobao_like.yaml"))


def _table(schema, samples, **kwargs):
    kwargs = {"seed": 5, "samples_per_user": 20, "ctr": 0.2, **kwargs}
    return pa.concat_tables(list(gen.generate_tables(schema, samples, **kwargs)))


def _without_times(schema):
    data = copy.deepcopy(schema.to_dict())
    user = data["layers"][0]["features"]
    data["layers"][0]["features"] = [
        {**f, "sequence": True} if f["name"] == "clicked_cats" else f
        for f in user if f["name"] != "clicked_times"]
    return schemas.from_dict(data)


def test_the_sequential_signal_is_beyond_a_bag_of_behaviours(tmp_path):
    truth = gen.generate(SEQUENCE, 20_000, tmp_path, seed=5, samples_per_user=20, ctr=0.2,
                         sequential=1.5)
    seq = truth["sequential"]
    assert (seq["strength"], seq["sequence"], seq["target"]) == (1.5, "clicked_cats", "cate_id")
    # the order is worth several points of AUC that no order-blind model can have
    assert truth["bayes_auc"] - seq["order_blind_bayes_auc"] > 0.03, truth
    assert 0.15 < truth["ctr"] < 0.25
    # the same rows as generate_tables, whose probabilities give the same two AUCs
    table = _table(SEQUENCE, 20_000, sequential=1.5, with_probabilities=True)
    y = table["click"].to_numpy()
    assert gen.auc(table["p_click"].to_numpy(), y) == pytest.approx(truth["bayes_auc"],
                                                                    abs=1e-6)
    assert gen.auc(table["p_click_order_blind"].to_numpy(), y) == pytest.approx(
        seq["order_blind_bayes_auc"], abs=1e-5)


def test_without_the_option_the_data_and_truth_have_no_sequential_part(tmp_path):
    truth = gen.generate(SEQUENCE, 3_000, tmp_path, seed=5, samples_per_user=20, ctr=0.2)
    assert "sequential" not in truth
    plain = _table(SEQUENCE, 3_000, with_probabilities=True)
    assert "p_click_order_blind" not in plain.column_names
    planted = _table(SEQUENCE, 3_000, sequential=1.5)
    # the features are the same rows; only the labels' model differs
    features = [f.name for f in SEQUENCE.features]
    assert planted.select(features).equals(plain.select(features))
    assert not planted["click"].equals(plain["click"])


def test_a_time_column_stores_the_sequence_shuffled_and_orders_it():
    table = _table(SEQUENCE, 3_000).to_pydict()
    blind = _table(_without_times(SEQUENCE), 3_000, sequential=1.5,
                   with_probabilities=True).to_pydict()
    timed = _table(SEQUENCE, 3_000, sequential=1.5, with_probabilities=True).to_pydict()
    shuffled = 0
    for cats, times in zip(table["clicked_cats"], table["clicked_times"]):
        assert len(cats) == len(times) and len(set(times)) == len(times)
        assert all(t > 1_704_067_200 for t in times)
        shuffled += times != sorted(times)
    assert shuffled > 0.3 * len(table["clicked_cats"])
    # ordered by their times, the categories are the sequence of the schema without a time
    # column (same lengths, same draws), and the planted probabilities are the same
    for cats, times, plain in zip(table["clicked_cats"], table["clicked_times"],
                                  blind["clicked_cats"]):
        assert [c for _, c in sorted(zip(times, cats))] == plain
    np.testing.assert_allclose(timed["p_click"], blind["p_click"], rtol=1e-12)


@pytest.mark.parametrize("schema, kwargs, message", [
    (TAOBAO, {"sequential": 1.0},
     "sequential: the schema declares no behaviour sequence on its first (user) layer"),
    (SEQUENCE, {"sequential": -1.0},
     "sequential: expected the strength of the sequential signal, a number >= 0"),
    (SEQUENCE, {"sequential": True},
     "sequential: expected the strength of the sequential signal"),
])
def test_bad_sequential_options_are_named(schema, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        next(gen.generate_tables(schema, 100, **kwargs))


def test_a_sequence_no_ad_can_match_is_refused():
    data = copy.deepcopy(SEQUENCE.to_dict())
    data["layers"][1]["features"] = [f for f in data["layers"][1]["features"]
                                     if f["name"] != "cate_id"]
    with pytest.raises(ValueError, match="no id feature below the user layer draws from the "
                                         "pool of the sequence 'clicked_cats'"):
        next(gen.generate_tables(schemas.from_dict(data), 100, sequential=1.0))


def test_cli_plants_the_signal_and_reports_it(tmp_path):
    out = tmp_path / "raw"
    result = subprocess.run(
        [sys.executable, "-m", "pipelines.generate", "--schema", SEQUENCE_PATH, "--samples",
         "3000", "--out", str(out), "--seed", "5", "--sequential", "1.5"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    truth = json.loads((out / "_truth.json").read_text())
    assert truth["sequential"]["strength"] == 1.5
    assert pq.read_table(out).num_rows == 3000
