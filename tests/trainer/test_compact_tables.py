"""Compact tables in training (trainer/compact.py): the cold table of ids the entry filter has
not admitted and multi-hash (quotient-remainder) tables, through structured == flat, training,
snapshots, deltas, expiry and serving."""
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import compression
from trainer import TrainConfig, Trainer, models
from trainer.compact import cold_buckets, multi_hash_components
from trainer.serving import Predictor, export_increment

from test_exactness import ADAGRAD, SMALL, assert_same_gradients

COUNTER = {"name": "counter", "min_count": 2}
COLD = {"ad_id": {"filter": COUNTER, "cold_buckets": 5},
        "clicked_items": {"filter": COUNTER, "cold_buckets": 7}}
MULTI_HASH = {"creative_id": {"multi_hash": {"buckets": [3, 11], "combine": "product"}},
              "clicked_cats": {"multi_hash": {"buckets": [4, 5], "combine": "sum"}},
              "user_id": {"multi_hash": {"buckets": [2, 9], "combine": "sum"}}}


def config_of(tables, **changes):
    return TrainConfig.from_dict({"batch_size": 256, "embedding": {"dim": 6,
                                                                   "optimizer": ADAGRAD},
                                  "tables": tables, **changes})


def feature_rows(trainer, batch, feature):
    """Per node of ``feature``'s layer (an id feature): the row the feed gives it."""
    prepared = trainer.prepare_numpy(batch)
    feed = trainer.builder.lookup(prepared, trainer.stores, train=False)
    block = next(b for b in trainer.layout.blocks if feature in b.ids)
    positions = feed.feed["ids"][block.key][:, block.ids.index(feature)]
    return feed.feed["rows"][str(block.dim)][positions]


@pytest.mark.parametrize("option", ["cold", "multi_hash"])
@pytest.mark.parametrize("model", ["mlp", "din"])
def test_structured_equals_flat_with_each_option(schema, trees_small, option, model):
    tables = COLD if option == "cold" else MULTI_HASH
    config = config_of(tables)
    batches = list(compression.iter_batches(trees_small, schema, 256))
    make = {"mlp": lambda: models.MLP(**SMALL),
            "din": lambda: models.DIN(behaviour="clicked_cats", query="cate_id",
                                      attention_hidden=(8,), **SMALL)}[model]
    structured = Trainer(schema, make(), config)
    flat = Trainer(schema, make(), config.replace(compute="flat"))
    # an entry filter counts an id once per lookup in both modes: the same ids are admitted
    for trainer in (structured, flat):
        trainer.fit(batches[:2], shuffle=False)
    gs, gf = structured.compute_gradients(batches[2]), flat.compute_gradients(batches[2])
    assert_same_gradients(gs, gf)
    if option == "cold":
        for table in ("ad_id", "clicked_items"):
            ids, grads = gs["embeddings"][f"{table}__cold"]
            assert 0 < len(ids) and np.abs(grads).sum() > 0  # some ids read their bucket
            assert len(structured.stores[table]) > 0           # and some have their own row
    else:
        for table, entry in MULTI_HASH.items():
            q, r = entry["multi_hash"]["buckets"]
            ids, grads = gs["embeddings"][table]
            assert ids.min() >= 0 and ids.max() < q + r and np.abs(grads).sum() > 0
    structured.fit([batches[2]])
    flat.fit([batches[2]])
    for table, store in structured.stores.items():
        rows = store.to_numpy()
        other = flat.stores[table].to_numpy()
        np.testing.assert_array_equal(np.sort(rows["ids"]), np.sort(other["ids"]))
        a, b = np.argsort(rows["ids"]), np.argsort(other["ids"])
        np.testing.assert_allclose(rows["values"][a], other["values"][b], rtol=1e-5,
                                   atol=1e-7, err_msg=table)


def test_the_transforms_are_per_id_deterministic_and_in_range():
    ids = np.array([0, 1, -5, 2**62, 7, 7], np.int64)
    buckets = cold_buckets(ids, "ad_id", 5)
    assert buckets.dtype == np.int64 and buckets.min() >= 0 and buckets.max() < 5
    np.testing.assert_array_equal(buckets, cold_buckets(ids, "ad_id", 5))
    assert buckets[4] == buckets[5]
    pairs = multi_hash_components(ids, "creative_id", (3, 11))
    assert ((0 <= pairs[:, 0]) & (pairs[:, 0] < 3)).all()
    assert ((3 <= pairs[:, 1]) & (pairs[:, 1] < 14)).all()
    # two tables hash the same ids apart
    assert not np.array_equal(cold_buckets(np.arange(100), "a", 1000),
                              cold_buckets(np.arange(100), "b", 1000))
    # the quotient and remainder of one hash: 1000 ids in 3 * 400 pairs nearly all apart
    pairs = multi_hash_components(np.arange(1000), "t", (3, 400))
    assert len({tuple(p) for p in pairs}) > 600


def test_cold_ids_read_and_train_their_bucket_row_admitted_ids_their_own(schema, trees_small):
    trainer = Trainer(schema, models.MLP(**SMALL), config_of(COLD))
    batches = list(compression.iter_batches(trees_small, schema, 256))
    trainer.fit(batches[:3], shuffle=False)
    store, cold = trainer.stores["ad_id"], trainer.stores["ad_id__cold"]
    assert 0 < len(cold) <= 5
    batch = batches[3]
    ads = batch.layers[1].features["ad_id"]
    admitted = store.contains(ads)
    assert admitted.any() and (~admitted).any()
    rows = feature_rows(trainer, batch, "ad_id")
    np.testing.assert_array_equal(rows[admitted], store.lookup(ads[admitted], train=False))
    buckets = cold_buckets(ads[~admitted], "ad_id", 5)
    np.testing.assert_array_equal(rows[~admitted], cold.lookup(buckets, train=False))
    assert np.abs(rows[~admitted]).sum() > 0  # learned, not zeros
    # the bucket rows train: a step on the batch moves them
    before = cold.lookup(np.arange(5), train=False)
    trainer.fit([batch])
    after = cold.lookup(np.arange(5), train=False)
    assert not np.array_equal(before, after)
    # without the option the same ids read zeros
    plain = Trainer(schema, models.MLP(**SMALL), config_of({"ad_id": {"filter": COUNTER}}))
    plain.fit(batches[:3], shuffle=False)
    fresh = ~plain.stores["ad_id"].contains(ads)
    assert fresh.any() and not feature_rows(plain, batch, "ad_id")[fresh].any()


def test_a_served_export_answers_new_ids_with_their_bucket_row(schema, raw_small, trees_small,
                                                                tmp_path):
    trainer = Trainer(schema, models.MLP(**SMALL), config_of(COLD))
    trainer.fit(trees_small)
    samples = raw_small.slice(0, 300)
    new_ads = samples.set_column(samples.schema.get_field_index("ad_id"), "ad_id",
                                 pa.array(
                                     np.arange(10**9, 10**9 + 300, dtype=np.int64)))
    assert not trainer.stores["ad_id"].contains(new_ads["ad_id"].to_numpy()).any()
    export = export_increment(trainer, tmp_path / "export")["full"]
    predictor = Predictor(export)
    unlabelled = new_ads.drop_columns(list(schema.labels))
    scores = predictor.predict(unlabelled)
    expected = trainer.predict(new_ads)  # tree order: compare as sorted multisets
    np.testing.assert_allclose(np.sort(scores), np.sort(expected), rtol=1e-5)
    # the bucket rows matter: with them removed the new ids read zeros and score otherwise
    cold = predictor.stores["ad_id__cold"]
    cold.expire_where(lambda ids, *rest: np.ones(len(ids), bool))
    assert not np.allclose(predictor.predict(unlabelled), scores)
    # the service follows the cold table through versions like any table
    trainer.fit(trees_small)
    export_increment(trainer, tmp_path / "export")
    again = Predictor(export)
    assert again.update() == len(trainer.tables)
    np.testing.assert_allclose(np.sort(again.predict(unlabelled)),
                               np.sort(trainer.predict(new_ads)), rtol=1e-5)


def test_multi_hash_rows_stay_within_q_plus_r_whatever_the_ids(schema, raw_small):
    table = raw_small
    # every sample a new creative: 2000 distinct ids into a table of 3 + 11 rows
    table = table.set_column(table.schema.get_field_index("creative_id"), "creative_id",
                             pa.array(np.arange(table.num_rows) * 7919))
    trainer = Trainer(schema, models.MLP(**SMALL), config_of(MULTI_HASH))
    trainer.fit(compression.build_trees(table, schema))
    assert len(trainer.stores["creative_id"]) == 14
    assert len(trainer.stores["clicked_cats"]) <= 9 and len(trainer.stores["user_id"]) <= 11
    ids = np.sort(trainer.stores["creative_id"].to_numpy()["ids"])
    np.testing.assert_array_equal(ids, np.arange(14))


@pytest.mark.parametrize("option", ["cold", "multi_hash"])
def test_snapshot_restore_and_a_delta_round_trip(schema, raw_small, trees_small, tmp_path,
                                                 option):
    trainer = Trainer(schema, models.MLP(**SMALL),
                      config_of(COLD if option == "cold" else MULTI_HASH))
    batches = list(compression.iter_batches(trees_small, schema, 256))
    trainer.fit(batches[:4], shuffle=False)
    trainer.save(tmp_path / "ckpt")
    base = trainer.export(tmp_path / "base")
    restored = Trainer.restore(tmp_path / "ckpt")
    assert list(restored.stores) == list(trainer.stores)
    samples = raw_small.slice(0, 200)
    np.testing.assert_array_equal(restored.predict(samples), trainer.predict(samples))
    # both go on alike; a follower of the first one's deltas holds its rows exactly
    trainer.fit(batches[4:], shuffle=False)
    restored.fit(batches[4:], shuffle=False)
    np.testing.assert_allclose(restored.predict(samples), trainer.predict(samples), rtol=1e-6)
    trainer.export_delta(tmp_path / "deltas")
    follower = Predictor(base)
    assert follower.update(tmp_path / "deltas") == len(trainer.tables)
    for table, store in trainer.stores.items():
        rows = store.to_numpy()
        np.testing.assert_array_equal(
            follower.stores[table].lookup(rows["ids"], train=False), rows["values"],
            err_msg=table)
        assert len(follower.stores[table]) == len(store)


def test_expiry_of_compact_tables(schema, trees_small):
    expire = {"every_steps": 1, "max_idle_steps": 0}
    tables = {"creative_id": {**MULTI_HASH["creative_id"], "expire": expire},
              "ad_id": {**COLD["ad_id"], "expire": expire}}
    trainer = Trainer(schema, models.MLP(**SMALL), config_of(tables))
    batches = list(compression.iter_batches(trees_small, schema, 256))
    trainer.fit(batches[:3], shuffle=False)
    assert trainer.expired > 0
    # an expired ad id is not admitted any more: it reads its bucket row again
    batch = batches[3]
    ads = batch.layers[1].features["ad_id"]
    rows = feature_rows(trainer, batch, "ad_id")
    gone = ~trainer.stores["ad_id"].contains(ads)
    assert gone.any()
    np.testing.assert_array_equal(
        rows[gone], trainer.stores["ad_id__cold"].lookup(cold_buckets(ads[gone], "ad_id", 5),
                                                         train=False))
    # the cold table has no expiry of its own; the multi-hash table's rows come back
    assert trainer.config.table("ad_id__cold").expire is None
    trainer.fit([batch])
    assert 0 < len(trainer.stores["creative_id"]) <= 14


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data(), st.sampled_from(["cold", "multi_hash sum", "multi_hash product"]))
def test_structured_equals_flat_on_random_schemas_with_every_table_compact(data, option):
    """Each option on every table (the embedding defaults) of random schemas: 1 to 4 layers,
    string and int ids, empty lists, dense features anywhere."""
    from sample_data import random_schemas, raw_tables

    schema = data.draw(random_schemas())
    table = data.draw(raw_tables(schema, max_rows=30))
    assume(table.num_rows > 0)
    trees = compression.build_trees(table, schema)
    batches = list(compression.iter_batches(trees, schema, 16))
    embedding = {"dim": 3}
    if option == "cold":
        embedding.update(filter={"name": "counter", "min_count": 2}, cold_buckets=3)
    else:
        embedding.update(multi_hash={"buckets": [2, 3], "combine": option.split()[1]})
    config = TrainConfig.from_dict({"batch_size": 16, "embedding": embedding})
    structured = Trainer(schema, models.MLP(hidden=(4,)), config)
    flat = Trainer(schema, models.MLP(hidden=(4,)), config.replace(compute="flat"))
    if len(batches) > 1:  # admit the ids of the first batch alike in both
        for trainer in (structured, flat):
            trainer.fit(batches[:1], shuffle=False)
    assert_same_gradients(structured.compute_gradients(batches[-1]),
                          flat.compute_gradients(batches[-1]))


def test_a_quantized_export_routes_new_ids_to_their_bucket_rows(schema, raw_small, trees_small,
                                                                 tmp_path):
    """A cold table and a quantized export together: the served int8 table says which ids have
    a row, so new ids read their (int8) bucket row, within int8's bound of the float32 export."""
    trainer = Trainer(schema, models.MLP(**SMALL), config_of(COLD))
    trainer.fit(trees_small)
    samples = raw_small.slice(0, 300)
    new_ads = samples.set_column(samples.schema.get_field_index("ad_id"), "ad_id",
                                 pa.array(np.arange(10**9, 10**9 + 300, dtype=np.int64)))
    unlabelled = new_ads.drop_columns(list(schema.labels))
    float32 = Predictor(trainer.export(tmp_path / "float32")).predict(unlabelled)
    trainer.config = trainer.config.with_export_format("int8")
    quantized = Predictor(trainer.export(tmp_path / "int8"))
    ads = new_ads["ad_id"].to_numpy()
    assert not quantized.stores["ad_id"].contains(ads).any()
    known = trainer.stores["ad_id"].to_numpy()["ids"]
    assert quantized.stores["ad_id"].contains(known).all()
    np.testing.assert_allclose(quantized.predict(unlabelled), float32, atol=0.01)
