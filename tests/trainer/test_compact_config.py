"""The compact-table options of TrainConfig (cold_buckets, multi_hash): checked up front, each
error naming the key and the fix; a config without them writes what it always wrote."""
import pytest

from trainer import ConfigError, TrainConfig
from trainer.config import MultiHashConfig

COUNTER = {"name": "counter", "min_count": 2}


def test_options_parse_round_trip_and_add_the_cold_table_after_its_table(schema):
    config = TrainConfig.from_dict({"tables": {
        "ad_id": {"filter": COUNTER, "cold_buckets": 64},
        "creative_id": {"multi_hash": {"buckets": [8, 100], "combine": "sum"}},
        "user_id": {"multi_hash": {"buckets": [4, 50]}}}})
    assert config.table("ad_id").cold_buckets == 64
    assert config.table("creative_id").multi_hash == MultiHashConfig((8, 100), "sum")
    assert config.table("user_id").multi_hash == MultiHashConfig((4, 50), "product")
    tables = config.check(schema)
    names = list(tables)
    assert names[names.index("ad_id") + 1] == "ad_id__cold" and tables["ad_id__cold"] == []
    assert "creative_id__cold" not in tables
    cold = config.table("ad_id__cold")  # the table's settings without filter, cap or expiry
    assert cold.entry_filter is None and cold.cold_buckets is None and cold.dim == 18
    assert cold.optimizer == config.table("ad_id").optimizer
    assert set(config.compact_tables(tables)) == {"ad_id", "creative_id", "user_id"}
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_a_config_without_the_options_writes_what_it_always_wrote(schema):
    written = TrainConfig().to_dict()
    assert "cold_buckets" not in written["embedding"]
    assert "multi_hash" not in written["embedding"]
    tables = TrainConfig().check(schema)
    assert not any(t.endswith("__cold") for t in tables)


@pytest.mark.parametrize("data, message", [
    ({"tables": {"ad_id": {"cold_buckets": 8}}},
     "tables.ad_id.cold_buckets: the table has no entry filter, so every id is admitted at "
     "once and none would read the cold table; add a filter"),
    ({"tables": {"ad_id": {"filter": COUNTER, "cold_buckets": 0}}},
     "tables.ad_id.cold_buckets: expected an integer >= 1, got 0"),
    ({"tables": {"ad_id": {"filter": COUNTER, "cold_buckets": "many"}}},
     "tables.ad_id.cold_buckets: expected an integer >= 1, got 'many'"),
    ({"tables": {"ad_id": {"multi_hash": {"buckets": [8]}}}},
     "tables.ad_id.multi_hash.buckets: expected two bucket counts [Q, R]"),
    ({"tables": {"ad_id": {"multi_hash": {"buckets": [8, 0]}}}},
     "tables.ad_id.multi_hash.buckets[1]: expected an integer >= 1, got 0"),
    ({"tables": {"ad_id": {"multi_hash": {"buckets": [8, 9], "combine": "concat"}}}},
     "tables.ad_id.multi_hash.combine: 'concat' is not a combine; use one of product, sum"),
    ({"tables": {"ad_id": {"multi_hash": {"buckets": [8, 9], "size": 3}}}},
     "tables.ad_id.multi_hash: unknown key 'size'"),
    ({"tables": {"ad_id": {"multi_hash": [8, 9]}}},
     "tables.ad_id.multi_hash: expected a mapping like `{buckets: [1000, 1000]"),
    ({"tables": {"ad_id": {"multi_hash": {"buckets": [2**31, 2**31]}}}},
     "tables.ad_id.multi_hash.buckets: Q * R = 4611686018427387904 is too large"),
    ({"tables": {"ad_id": {"filter": COUNTER, "multi_hash": {"buckets": [8, 9]}}}},
     "tables.ad_id.multi_hash: a multi-hash table's rows are shared by many ids, so an entry "
     "filter only delays them; set `filter: null` for this table"),
    ({"tables": {"ad_id": {"filter": COUNTER, "cold_buckets": 4,
                           "multi_hash": {"buckets": [8, 9]}}}},
     "tables.ad_id: cold_buckets and multi_hash together are not supported"),
    ({"embedding": {"cold_buckets": 4}},
     "embedding.cold_buckets: the table has no entry filter"),
])
def test_bad_options_are_refused_naming_the_key_and_the_fix(data, message):
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(data)
    assert message in str(e.value)


def test_a_cold_table_name_taken_by_a_table_of_features_is_refused(schema):
    config = TrainConfig.from_dict({
        "features": {"cate_id": {"table": "ad_id__cold"}},
        "tables": {"ad_id": {"filter": COUNTER, "cold_buckets": 4}}})
    with pytest.raises(ConfigError, match=r"tables.ad_id.cold_buckets: its cold table is named "
                                          r"'ad_id__cold', which is already a table of "
                                          r"features \(cate_id\); rename that table"):
        config.check(schema)


def test_defaults_apply_the_options_to_every_table_that_does_not_override_them(schema):
    config = TrainConfig.from_dict({"embedding": {"filter": COUNTER, "cold_buckets": 16},
                                    "tables": {"gender": {"filter": None,
                                                          "cold_buckets": None}}})
    tables = config.check(schema)
    assert "ad_id__cold" in tables and "gender__cold" not in tables
