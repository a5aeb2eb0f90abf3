"""A sharded (Ray) run's quantized export: every shard's snapshot and deltas quantized where
the shard actors wrote them, served by a Predictor through ShardedStore within the format's
bound of the run's own rows, following its versions."""
import json
import os

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import compression  # noqa: E402
import native  # noqa: E402
from native import quantized as q  # noqa: E402
from trainer import TrainConfig, models  # noqa: E402
from trainer.distributed import DistributedTrainer  # noqa: E402
from trainer.serving import Predictor, ShardedStore, export_increment  # noqa: E402
from trainer_data import generated  # noqa: E402


def test_a_sharded_run_exports_quantized_shards_and_the_predictor_follows_them(
        cluster, schema, tmp_path):
    raw = generated(schema, 1600, seed=8).drop_columns(["p_click", "p_conversion"])
    trees = compression.build_trees(raw, schema)
    config = TrainConfig.from_dict({"batch_size": 200, "seed": 1, "embedding": {
        "dim": 4, "optimizer": {"name": "adagrad", "lr": 0.1}, "export_format": "int8"},
        "tables": {"cate_id": {"export_format": "int4"}}})
    export = tmp_path / "export"
    with DistributedTrainer(schema, models.MLP(hidden=(8,)), config, workers=1,
                            shards=2) as dt:
        dt.fit(trees.slice(0, trees.num_rows // 2), epochs=1)
        export_increment(dt, export)
        meta = json.loads((export / "export.json").read_text())
        assert meta["shards"] == 2 and meta["export_formats"]["cate_id"] == "int4"
        for shard in ("shard-0000", "shard-0001"):
            assert os.listdir(export / "stores" / "cate_id" / shard) == [q.SNAPSHOT_FILE]
        predictor = Predictor(export)
        dt.fit(trees.slice(trees.num_rows // 2), epochs=1)
        version = export_increment(dt, export)
        assert all(len(paths) == 2 for paths in version["deltas"].values())
        assert predictor.update() == 2 * len(meta["tables"])
        rows = dt.table_rows()  # {table: {"ids":..., "values":...}} of every shard
        for table, store in predictor.stores.items():
            assert isinstance(store, ShardedStore)
            assert all(isinstance(s, native.QuantizedStore) for s in store.shards)
            ids, values = rows[table]["ids"], rows[table]["values"]
            assert len(store) == len(ids)
            got = store.lookup(ids)
            bound = q.error_bound(meta["export_formats"][table], values)
            assert (np.abs(got - values) <= bound).all(), table
