"""Tests of the synthetic ads-log generator: shape, realism, labels and the command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import schemas
from pipelines import generate as gen

ROOT = Path(__file__).resolve().parents[2]
TAOBAO_PATH = ROOT / "schemas" / "examples" / "taobao_like.yaml"
TAOBAO = schemas.load(TAOBAO_PATH)
TAOBAO_USER_COLUMNS = ["user_id", "cms_segid", "cms_group_id", "gender", "age_level",
                       "pvalue_level", "shopping_level", "occupation", "city_level"]

FLAT = schemas.from_dict({
    "name": "flat",
    "layers": [{"name": "sample", "features": [
        {"name": "item_id", "kind": "id", "dtype": "string"},
        {"name": "hour", "kind": "id"},
        {"name": "price", "kind": "dense", "dim": 1},
        {"name": "tags", "kind": "ids"},
    ]}],
    "labels": ["click"],
})
TWO_LAYERS = schemas.from_dict({
    "name": "two_layers",
    "layers": [
        {"name": "user", "key": ["user_id"], "features": [
            {"name": "user_id", "kind": "id"},
            {"name": "age_level", "kind": "id"},
            {"name": "clicked_items", "kind": "ids"},
            {"name": "profile", "kind": "dense", "dim": 4},
        ]},
        {"name": "sample", "key": ["item_id"], "features": [
            {"name": "item_id", "kind": "id"},
            {"name": "cate_id", "kind": "id"},
            {"name": "position", "kind": "id"},
        ]},
    ],
    "labels": ["click", "conversion", "purchase"],
})
FOUR_LAYERS = schemas.from_dict({
    "name": "four_layers",
    "layers": [
        {"name": "user", "key": ["user_id"], "features": [
            {"name": "user_id", "kind": "id", "dtype": "string"},
            {"name": "gender", "kind": "id"},
            {"name": "clicked_cats", "kind": "ids"},
        ]},
        {"name": "adgroup", "key": ["adgroup_id"], "features": [
            {"name": "adgroup_id", "kind": "id"},
            {"name": "campaign_id", "kind": "id"},
            {"name": "keywords", "kind": "ids", "dtype": "string"},
        ]},
        {"name": "ad", "key": ["ad_id"], "features": [
            {"name": "ad_id", "kind": "id"},
            {"name": "cate_id", "kind": "id"},
            {"name": "image_embedding", "kind": "dense", "dim": 3},
        ]},
        {"name": "creative", "key": ["creative_id"], "features": [
            {"name": "creative_id", "kind": "id"},
            {"name": "pid", "kind": "id", "dtype": "string"},
            {"name": "weekday", "kind": "id"},
            {"name": "context", "kind": "dense", "dim": 2},
        ]},
    ],
    "labels": ["click"],
})
ALL_SCHEMAS = [TAOBAO, FLAT, TWO_LAYERS, FOUR_LAYERS]


def concat(tables) -> pa.Table:
    return pa.concat_tables(list(tables))


def reference_auc(scores, labels) -> float:
    """P(positive scores above negative) + half of P(tie), by counting with searchsorted."""
    scores = np.asarray(scores, np.float64)
    labels = np.asarray(labels).astype(bool)
    neg = np.sort(scores[~labels])
    below = np.searchsorted(neg, scores[labels], "left")
    ties = np.searchsorted(neg, scores[labels], "right") - below
    return float((below.sum() + 0.5 * ties.sum()) / (labels.sum() * len(neg)))


@pytest.fixture(scope="module")
def taobao_run(tmp_path_factory):
    """200k taobao_like samples written once, shared by the statistics tests."""
    out = tmp_path_factory.mktemp("taobao")
    truth = gen.generate(TAOBAO, 200_000, out, seed=11)
    return out, truth, pq.read_table(out)


# --- shape -----------------------------------------------------------------------------------

@pytest.mark.parametrize("schema", ALL_SCHEMAS, ids=lambda s: s.name)
def test_columns_and_types_are_the_raw_schema(schema):
    table = concat(gen.generate_tables(schema, 5_000, seed=3, chunk_rows=2_000))
    assert table.num_rows == 5_000
    assert table.schema.equals(schema.raw_arrow_schema(), check_metadata=True)
    assert table.column_names == list(schema.columns)
    for name in table.column_names:
        assert table.column(name).null_count == 0, name
    for f in schema.features:
        if f.kind == "dense":
            lengths = pc.list_value_length(table.column(f.name)).to_numpy()
            assert (lengths == f.dim).all(), f.name
    for label in schema.labels:
        values = np.unique(table.column(label).to_numpy())
        assert set(values) <= {0.0, 1.0}, label


def test_string_ids_look_like_placement_ids():
    table = concat(gen.generate_tables(TAOBAO, 2_000, seed=3))
    pids = table.column("pid").to_pylist()
    head, tail = pids[0].split("_")
    assert head.isdigit() and tail.isdigit() and len(tail) == 4
    assert 1 < len(set(pids)) <= 8


def test_four_layers_upper_nodes_are_functions_of_their_key():
    table = concat(gen.generate_tables(FOUR_LAYERS, 20_000, seed=5))
    for key, attr in [("adgroup_id", "campaign_id"), ("ad_id", "cate_id"),
                      ("ad_id", "image_embedding"), ("adgroup_id", "keywords")]:
        values = table.column(attr)
        if not pa.types.is_integer(values.type):
            # Lists are not group keys in Arrow; compare a printable form instead.
            values = pa.array([repr(x) for x in values.to_pylist()])
        distinct = pa.table({"k": table.column(key), "v": values})
        per_key = distinct.group_by("k").aggregate([("v", "count_distinct")])
        assert pc.max(per_key.column("v_count_distinct")).as_py() == 1, (key, attr)
    # Deeper layers really nest: a creative belongs to exactly one ad.
    per_creative = table.group_by("creative_id").aggregate([("ad_id", "count_distinct")])
    assert pc.max(per_creative.column(1)).as_py() == 1


# --- determinism -------------------------------------------------------------------------

def test_same_seed_same_rows_whatever_the_chunking():
    a = concat(gen.generate_tables(TWO_LAYERS, 7_000, seed=9))
    b = concat(gen.generate_tables(TWO_LAYERS, 7_000, seed=9, chunk_rows=1_000))
    c = concat(gen.generate_tables(TWO_LAYERS, 7_000, seed=10))
    assert a.equals(b)
    assert not a.equals(c)


def test_same_seed_same_files(tmp_path):
    one = gen.generate(FOUR_LAYERS, 6_000, tmp_path / "one", seed=4, shards=2)
    two = gen.generate(FOUR_LAYERS, 6_000, tmp_path / "two", seed=4, shards=2)
    assert one == two
    for name in one["files"] + [gen.TRUTH_FILE]:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


# --- realism ---------------------------------------------------------------------------------

def test_samples_per_user_mean_and_heavy_tail(taobao_run):
    _, truth, table = taobao_run
    per_user = table.group_by("user_id").aggregate([("click", "count")]).column(1).to_numpy()
    assert abs(per_user.mean() - 57) < 0.03 * 57
    assert np.percentile(per_user, 99) > 8 * np.percentile(per_user, 50)
    # The truth counts root nodes, where a changed user counts twice.
    assert truth["users"] == truth["user_keys"] + truth["users_with_feature_change"]
    assert abs(truth["samples_per_user_mean"] - 200_000 / truth["users"]) < 1e-9
    assert truth["samples_per_user_p99"] > 8 * truth["samples_per_user_p50"]
    assert 10 * truth["samples_per_user_p50"] < truth["samples_per_user_max"] <= per_user.max()


def test_samples_per_user_follows_the_option():
    table = concat(gen.generate_tables(TWO_LAYERS, 30_000, seed=2, samples_per_user=10))
    users = len(pc.unique(table.column("user_id")))
    assert abs(30_000 / users - 10) < 0.5


def test_click_rate_is_close_to_the_target(taobao_run):
    _, truth, table = taobao_run
    ctr = float(table.column("click").to_numpy().mean())
    assert ctr == pytest.approx(truth["ctr"])
    assert abs(ctr - 0.04) < 0.004
    high = concat(gen.generate_tables(TAOBAO, 50_000, seed=2, ctr=0.15))
    assert abs(high.column("click").to_numpy().mean() - 0.15) < 0.015


def test_rows_are_interleaved_not_grouped_by_user(taobao_run):
    _, truth, table = taobao_run
    user = table.column("user_id").to_numpy()
    changes = int((user[1:] != user[:-1]).sum())
    assert changes > 10 * truth["user_keys"]
    # Rows are in time order: the day of the week never goes back.
    weekday = table.column("weekday").to_numpy()
    assert (np.diff(weekday) >= 0).all() and weekday[0] == 0 and weekday[-1] == 6


def test_some_users_change_a_feature_and_give_two_nodes(taobao_run):
    _, truth, table = taobao_run
    per_user = table.group_by("user_id").aggregate([("age_level", "count_distinct")])
    two = int((per_user.column(1).to_numpy() == 2).sum())
    assert two == truth["users_with_feature_change"]
    assert 0.002 * truth["user_keys"] < two < 0.03 * truth["user_keys"]
    assert (per_user.column(1).to_numpy() <= 2).all()
    nodes = table.select(TAOBAO_USER_COLUMNS).group_by(TAOBAO_USER_COLUMNS).aggregate([])
    assert nodes.num_rows == truth["users"]
    # The other user features never change: one value per user.
    for column in ["gender", "cms_segid", "city_level"]:
        counts = table.group_by("user_id").aggregate([(column, "count_distinct")]).column(1)
        assert pc.max(counts).as_py() == 1, column


def test_ads_are_consistent_popular_and_repeated_per_user(taobao_run):
    _, _, table = taobao_run
    for attr in ["cate_id", "brand_id", "campaign_id", "customer_id"]:
        per_ad = table.group_by("ad_id").aggregate([(attr, "count_distinct")]).column(1)
        assert pc.max(per_ad).as_py() == 1, attr
    counts = np.sort(pc.value_counts(table.column("ad_id")).field("counts").to_numpy())[::-1]
    assert counts[0] > 50 * np.median(counts)          # Zipf-like: a head and a long tail
    user_ad = table.select(TAOBAO_USER_COLUMNS + ["ad_id"]).group_by(
        TAOBAO_USER_COLUMNS + ["ad_id"]).aggregate([])
    assert user_ad.num_rows < 0.8 * table.num_rows     # users see some ads again


def test_behaviour_lists_are_variable_and_share_the_pools(taobao_run):
    _, _, table = taobao_run
    _, first_rows = np.unique(table.column("user_id").to_numpy(), return_index=True)
    for name in ["clicked_items", "clicked_cats", "clicked_brands"]:
        lengths = pc.list_value_length(table.column(name).take(first_rows)).to_numpy()
        assert 7 <= lengths.mean() <= 13, name
        assert 0.02 < (lengths == 0).mean() < 0.2, name
        assert lengths.max() > 4 * lengths.mean(), name
    cats = set(table.column("cate_id").to_numpy().tolist())
    listed = pc.list_flatten(table.column("clicked_cats")).to_numpy()
    assert np.isin(listed, list(cats)).mean() > 0.9
    items = set(table.column("ad_id").to_numpy().tolist())
    assert np.isin(pc.list_flatten(table.column("clicked_items")).to_numpy(),
                   list(items)).mean() > 0.5


def test_dense_features_are_plausible(taobao_run):
    _, _, table = taobao_run
    price = pc.list_flatten(table.column("price")).to_numpy()
    assert (price > 0).all()
    assert np.percentile(price, 99) > 10 * np.percentile(price, 50)  # lognormal tail


# --- labels and truth -------------------------------------------------------------------------

def test_truth_file_matches_the_labels_written(taobao_run):
    out, truth, table = taobao_run
    on_disk = json.loads((out / gen.TRUTH_FILE).read_text())
    assert on_disk == truth
    assert on_disk["schema"] == "taobao_like" and on_disk["seed"] == 11
    assert on_disk["samples"] == table.num_rows == 200_000
    assert 0.65 < truth["bayes_auc"] < 0.9
    assert 0.65 < truth["conversion_bayes_auc"] < 0.95
    # The true probabilities regenerate with the same seed and explain the labels on disk.
    truth_tables = concat(gen.generate_tables(TAOBAO, 200_000, seed=11, with_probabilities=True))
    for label in ["click", "conversion"]:
        assert truth_tables.column(label).equals(table.column(label))
    p_click = truth_tables.column("p_click").to_numpy()
    p_conv = truth_tables.column("p_conversion").to_numpy()
    click = table.column("click").to_numpy()
    conv = table.column("conversion").to_numpy()
    assert reference_auc(p_click, click) == pytest.approx(truth["bayes_auc"], abs=1e-4)
    assert reference_auc(p_conv, conv) == pytest.approx(truth["conversion_bayes_auc"], abs=1e-4)
    assert conv.mean() == pytest.approx(truth["conversion_rate"])
    assert (conv <= click).all()                       # a conversion needs a click
    assert abs(conv.sum() / click.sum() - 0.1) < 0.02
    # Calibrated: the mean true probability matches the realised rate.
    assert abs(p_click.mean() - click.mean()) < 0.003


def test_flat_schema_has_one_sample_per_root(tmp_path):
    truth = gen.generate(FLAT, 3_000, tmp_path, seed=2)
    assert truth["users"] == truth["samples"] == 3_000
    assert truth["samples_per_user_max"] == 1
    assert truth["users_with_feature_change"] == 0 and truth["changed_feature"] is None


def test_funnel_of_three_labels():
    table = concat(gen.generate_tables(TWO_LAYERS, 30_000, seed=1, with_probabilities=True))
    click, conv, buy = (table.column(n).to_numpy() for n in ["click", "conversion", "purchase"])
    assert (buy <= conv).all() and (conv <= click).all() and click.sum() > conv.sum() > 0
    p = table.column("p_click").to_numpy()
    assert 0.6 < reference_auc(p, click) < 0.95


def test_auc_handles_ties_and_one_class():
    assert gen.auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == 0.75
    assert gen.auc([0.5, 0.5, 0.5, 0.5], [0, 1, 0, 1]) == 0.5
    assert gen.auc([0.1, 0.5, 0.5, 0.9], [0, 1, 0, 1]) == 0.875
    assert np.isnan(gen.auc([0.1, 0.2], [1, 1]))
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 20, 2_000).astype(float)     # many ties
    labels = rng.random(2_000) < 0.3 + scores / 40
    assert gen.auc(scores, labels) == pytest.approx(reference_auc(scores, labels), abs=1e-12)


# --- files and validation ---------------------------------------------------------------------

def test_shards_are_replaced_not_left_behind(tmp_path):
    gen.generate(TWO_LAYERS, 3_000, tmp_path, seed=1, shards=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "_truth.json", "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert [pq.read_metadata(tmp_path / f"part-0000{i}.parquet").num_rows
            for i in range(3)] == [1_000, 1_000, 1_000]
    truth = gen.generate(TWO_LAYERS, 2_000, tmp_path, seed=1, shards=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_truth.json", "part-00000.parquet"]
    assert pq.read_table(tmp_path).num_rows == truth["samples"] == 2_000
    assert pq.read_metadata(tmp_path / "part-00000.parquet").row_group(0).column(0) \
        .compression == "ZSTD"


@pytest.mark.parametrize("kwargs, message", [
    ({"samples": 0}, "samples: expected a positive integer, got 0"),
    ({"samples": 100, "ctr": 1.5}, "ctr: expected a click rate strictly between 0 and 1"),
    ({"samples": 100, "samples_per_user": 0.5}, "samples_per_user: expected a mean of at least 1"),
    ({"samples": 100, "shards": 200}, "shards: 200 shards for 100 samples"),
])
def test_bad_arguments_are_named(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        gen.generate(TAOBAO, out_dir=tmp_path, **kwargs)


def test_output_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        gen.generate(TAOBAO, 100, target)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "pipelines.generate", *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_cli_help_explains_the_options():
    result = run_cli("--help")
    assert result.returncode == 0
    for option in ["--schema", "--samples", "--out", "--seed", "--shards", "--samples-per-user",
                   "--ctr"]:
        assert option in result.stdout


def test_cli_writes_shards_and_truth(tmp_path):
    out = tmp_path / "raw"
    result = run_cli("--schema", TAOBAO_PATH, "--samples", 4_000, "--out", out, "--seed", 3,
                     "--shards", 2)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert "4,000 samples of taobao_like" in lines[0]
    assert lines[-1] == str(out / "_truth.json")
    assert sorted(os.listdir(out)) == ["_truth.json", "part-00000.parquet", "part-00001.parquet"]
    table = pq.read_table(out)
    assert table.num_rows == 4_000
    assert table.schema.equals(TAOBAO.raw_arrow_schema())
    assert concat(gen.generate_tables(TAOBAO, 4_000, seed=3)).equals(
        table.replace_schema_metadata(table.schema.metadata))


def test_cli_rejects_bad_input(tmp_path):
    result = run_cli("--schema", tmp_path / "missing.yaml", "--samples", 10, "--out", tmp_path)
    assert result.returncode == 2 and "schema file not found" in result.stderr
    result = run_cli("--schema", TAOBAO_PATH, "--samples", 0, "--out", tmp_path)
    assert result.returncode == 2 and "samples: expected a positive integer" in result.stderr


def test_cli_errors_take_the_shared_path(tmp_path):
    """One line ``python -m pipelines.generate: error: ...``, exit 2 for bad input, the
    traceback only with --debug (compression.cli.run_command, as every command)."""
    missing = tmp_path / "missing.yaml"
    result = run_cli("--schema", missing, "--samples", 10, "--out", tmp_path / "a")
    assert result.returncode == 2
    assert result.stderr == (f"python -m pipelines.generate: error: {missing}: schema file not "
                             "found\n")
    result = run_cli("--schema", TAOBAO_PATH, "--samples", 100, "--shards", 200, "--out",
                     tmp_path / "b")
    assert result.returncode == 2
    assert result.stderr.startswith("python -m pipelines.generate: error: shards: 200 shards "
                                    "for 100 samples")
    assert len(result.stderr.splitlines()) == 1 and result.stdout == ""
    (tmp_path / "file").write_text("x")
    result = run_cli("--schema", TAOBAO_PATH, "--samples", 10, "--out", tmp_path / "file",
                     "--debug")
    assert result.returncode == 2
    assert "Traceback" in result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"python -m pipelines.generate: error: --out {tmp_path / 'file'}: exists and is not a "
        "directory")
    assert sorted(os.listdir(tmp_path)) == ["file"]
    help_text = run_cli("--help").stdout
    assert "--debug" in help_text and "exit status: 0 done; 2 usage or input error" in help_text


def test_cli_output_policy(tmp_path):
    """A non-empty --out is refused (exit 2) and left as it was; --overwrite replaces it whole;
    a run that fails midway leaves no --out and no temporary directory."""
    out = tmp_path / "raw"
    out.mkdir()
    (out / "stray.txt").write_text("mine")
    result = run_cli("--schema", TAOBAO_PATH, "--samples", 1_000, "--out", out)
    assert result.returncode == 2
    assert result.stderr == (f"python -m pipelines.generate: error: --out {out}: the directory "
                             "is not empty (1 entry); pass --overwrite to replace it whole, "
                             "or choose another directory\n")
    assert sorted(os.listdir(out)) == ["stray.txt"]
    result = run_cli("--schema", TAOBAO_PATH, "--samples", 1_000, "--out", out, "--overwrite")
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(out)) == ["_truth.json", "part-00000.parquet"]
    assert pq.read_table(out).num_rows == 1_000
    result = run_cli("--schema", TAOBAO_PATH, "--samples", 100, "--shards", 200, "--out",
                     tmp_path / "failed")
    assert result.returncode == 2
    assert sorted(os.listdir(tmp_path)) == ["raw"]


def test_cli_interrupted_leaves_no_output(tmp_path):
    """SIGINT once rows are being written (the progress bar counts some): exit 130, the message
    on a line of its own, no --out and no temporary directory."""
    from processes import signal_when

    out = tmp_path / "raw"
    code, stdout, stderr = signal_when(
        ["-m", "pipelines.generate", "--schema", TAOBAO_PATH, "--samples", 5_000_000, "--out",
         out], re.compile(rb"\| [1-9][0-9.]*[kM]?/5\.00M"))
    assert code == 130, stderr
    assert stderr.strip().splitlines()[-1] == "python -m pipelines.generate: interrupted"
    assert os.listdir(tmp_path) == []


def test_taste_oracles_bound_what_a_users_history_can_tell():
    """The planted model with each user's taste group inferred from their train rows: better
    than with the group unknown when users have many rows; equal to it for a user with none;
    worse than knowing the group (the planted probabilities)."""
    samples, train = 40_000, 32_000
    kwargs = dict(samples_per_user=400.0, chunk_rows=7_000)
    oracles = gen.taste_oracles(TAOBAO, samples, seed=3, train_rows=train, **kwargs)
    table = concat(gen.generate_tables(TAOBAO, samples, seed=3, with_probabilities=True,
                                       **kwargs)).slice(train)
    y, p = table.column("click").to_numpy(), table.column("p_click").to_numpy()
    history, prior = oracles["history"], oracles["prior"]
    assert history.shape == prior.shape == (samples - train,)
    assert reference_auc(p, y) > reference_auc(history, y) > reference_auc(prior, y) + 0.005
    # a user without train rows: the posterior is the prior
    users = concat(gen.generate_tables(TAOBAO, samples, seed=3, **kwargs)).column(
        "user_id").to_numpy(zero_copy_only=False)
    unseen = ~np.isin(users[train:], users[:train])
    assert unseen.any() and (~unseen).any()
    np.testing.assert_allclose(history[unseen], prior[unseen], rtol=1e-12)
    assert not np.allclose(history[~unseen], prior[~unseen])
    assert gen.taste_oracles(FLAT, 3_000, seed=2, train_rows=2_000) is None
    with pytest.raises(ValueError, match="train_rows"):
        gen.taste_oracles(TAOBAO, 3_000, seed=2, train_rows=3_000)
