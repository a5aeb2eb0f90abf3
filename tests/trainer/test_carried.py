"""Carried columns (row ids, request ids, timestamps) are never trained: the same model and the
same store rows as without them, and predictions can be joined back to them."""
import os

import numpy as np
import pyarrow as pa

import compression
import schemas
from trainer import TrainConfig, Trainer, models
from trainer.feed import Layout
from trainer_data import ROOT, generated

WITH_ROW_IDS = schemas.load(os.path.join(ROOT, "schemas", "examples", "with_row_ids.yaml"))


def _without_carried(schema):
    data = schema.to_dict()
    data["layers"][-1].pop("carried", None)
    return schemas.from_dict(data)


def _config():
    return TrainConfig.from_dict({"batch_size": 128, "embedding": {"dim": 4}})


def test_training_ignores_carried_columns(tmp_path):
    plain = _without_carried(WITH_ROW_IDS)
    raw = generated(WITH_ROW_IDS, 1500, seed=5).drop_columns(["p_click"])
    assert set(WITH_ROW_IDS.carried_names) <= set(raw.column_names)
    trees = compression.build_trees(raw, WITH_ROW_IDS)
    ours = Trainer(WITH_ROW_IDS, models.MLP(hidden=(8,)), _config())
    theirs = Trainer(plain, models.MLP(hidden=(8,)), _config())
    a = ours.fit(trees)
    b = theirs.fit(compression.build_trees(raw.drop_columns(list(WITH_ROW_IDS.carried_names)),
                                           plain))
    assert a["samples"] == b["samples"] == 1500 and a["steps"] == b["steps"]
    # no table, no row, no input for a carried column
    assert set(ours.stores) == set(theirs.stores)
    assert ours.store_rows() == theirs.store_rows()
    layout = ours.builder.layout
    fed = {n for block in layout.blocks for n in block.ids + block.lists}
    fed |= {n for names in layout.dense.values() for n in names}
    assert fed == {f.name for f in WITH_ROW_IDS.features}
    assert not fed & set(WITH_ROW_IDS.carried_names)
    assert isinstance(layout, Layout) and not set(layout.table_of) & set(WITH_ROW_IDS.carried_names)
    for x, y in zip(ours.network.variables, theirs.network.variables):
        np.testing.assert_array_equal(x.numpy(), y.numpy())
    for table, store in ours.stores.items():
        ids = np.sort(store.to_numpy()["ids"])
        np.testing.assert_array_equal(ids, np.sort(theirs.stores[table].to_numpy()["ids"]))

    # predictions come in the batches' leaf order: join them to the carried row ids
    probabilities = ours.predict(trees)
    batches = compression.iter_batches(trees, WITH_ROW_IDS, 128)
    row_ids = pa.concat_arrays([b.carried["row_id"] for b in batches])
    assert len(row_ids) == len(probabilities) == 1500
    assert row_ids.equals(compression.flatten(trees, WITH_ROW_IDS).column("row_id")
                          .combine_chunks())
    np.testing.assert_array_equal(probabilities, theirs.predict(compression.build_trees(
        raw.drop_columns(list(WITH_ROW_IDS.carried_names)), plain)))

    # the checkpoint keeps the schema, carried columns included
    ours.save(tmp_path / "ckpt")
    restored = Trainer.restore(tmp_path / "ckpt")
    assert restored.schema == WITH_ROW_IDS and restored.schema.carried == WITH_ROW_IDS.carried
    np.testing.assert_array_equal(restored.predict(trees), probabilities)
