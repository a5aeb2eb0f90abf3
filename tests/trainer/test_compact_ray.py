"""Compact tables on Ray: a cold table and multi-hash tables over 2 workers and 2 store shards
equal one process on the union of the batches, their checkpoint reshards into 1 and 3 shards,
and the sharded export serves new ids their bucket rows as the single process does."""
import numpy as np
import pyarrow as pa
import pytest

ray = pytest.importorskip("ray")

import compression  # noqa: E402
from trainer import TrainConfig, models  # noqa: E402
from trainer.distributed import DistributedTrainer  # noqa: E402
from trainer.distributed.manifest import read_manifest, shard_snapshot_spec  # noqa: E402
from trainer.distributed.shard import Shard, table_specs  # noqa: E402
from trainer.serving import Predictor  # noqa: E402
from ray_reference import assert_rows_equal, single_process_run, union_batches  # noqa: E402
from trainer_data import generated  # noqa: E402

W, S = 2, 2
SMALL = dict(hidden=(16, 8))
COUNTER = {"name": "counter", "min_count": 2}


def config():
    return TrainConfig.from_dict({
        "batch_size": 300, "seed": 3,
        "embedding": {"dim": 4, "optimizer": {"name": "adagrad", "lr": 0.05,
                                              "initial_accumulator": 0.1}},
        "tables": {"ad_id": {"filter": COUNTER, "cold_buckets": 6},
                   "clicked_items": {"filter": COUNTER, "cold_buckets": 9},
                   "creative_id": {"multi_hash": {"buckets": [3, 17], "combine": "sum"}},
                   "user_id": {"multi_hash": {"buckets": [2, 13], "combine": "product"}}}})


def test_compact_tables_on_shards_equal_one_process(cluster, schema, tmp_path):
    raw = generated(schema, 1600, seed=5).drop_columns(["p_click", "p_conversion"])
    trees = compression.build_trees(raw, schema)
    single, losses = single_process_run(schema, models.MLP(**SMALL), config(), trees, 2, W)
    dt = DistributedTrainer(schema, models.MLP(**SMALL), config(), workers=W, shards=S)
    try:
        result = dt.fit(trees, epochs=2)
        rows = dt.table_rows()
        assert_rows_equal(rows, single.stores)
        assert {"ad_id__cold", "clicked_items__cold"} <= set(rows)
        assert 0 < len(rows["ad_id__cold"]["ids"]) <= 6
        assert len(rows["creative_id"]["ids"]) <= 20
        np.testing.assert_allclose(result["loss"], losses[-1], rtol=1e-4)
        dt.export(tmp_path / "export")
        dt.save(tmp_path / "ckpt")
    finally:
        dt.close()
    # the checkpoint of 2 shards reshards into 1 and 3 with every row of every table, the
    # bucket rows and the multi-hash rows as any table's
    manifest = read_manifest(str(tmp_path / "ckpt"))
    for shards in (1, 3):
        parts = [Shard(i, shards, table_specs(config(), list(single.stores), shards),
                       restore=shard_snapshot_spec(str(tmp_path / "ckpt"), manifest, i, shards))
                 for i in range(shards)]
        joined = {t: {k: np.concatenate([p.stores[t].to_numpy()[k] for p in parts])
                      for k in ("ids", "values", "state", "update_counts", "last_steps")}
                  for t in single.stores}
        assert_rows_equal(joined, single.stores, f"{shards} shards: ")
    # new ads, never seen: the sharded export reads their bucket rows on the shards
    samples = raw.slice(0, 200)
    samples = samples.set_column(samples.schema.get_field_index("ad_id"), "ad_id",
                                 pa.array(
                                     np.arange(10**9, 10**9 + 200, dtype=np.int64)))
    served = Predictor(tmp_path / "export").predict(samples.drop_columns(list(schema.labels)))
    np.testing.assert_allclose(np.sort(served), np.sort(single.predict(samples)), rtol=1e-5)
    assert len(union_batches(schema, config(), trees, 1, W)) > 2  # several steps ran
