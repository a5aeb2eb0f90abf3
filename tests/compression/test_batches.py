"""TreeBatch invariants: exact sizes, valid parents, every leaf exactly once, split trees."""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compression
import schemas
from compression.batches import take
from sample_data import random_schemas, raw_tables, taobao_table

PROPERTY = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _leaf_rows(features: dict, labels: dict) -> list:
    """One hashable tuple per leaf, in order."""
    columns = []
    for name in sorted(features):
        array = features[name]
        if isinstance(array, tuple):
            values, offsets = array
            columns.append([tuple(values[offsets[i]:offsets[i + 1]].tolist())
                            for i in range(len(offsets) - 1)])
        else:
            columns.append([repr(v) for v in array.tolist()])
    columns += [labels[name].tolist() for name in sorted(labels)]
    return list(zip(*columns)) if columns else []


@PROPERTY
@given(st.data())
def test_batches_cover_every_leaf_once_in_order_with_valid_parents(data):
    schema = data.draw(random_schemas())
    table = data.draw(raw_tables(schema, max_rows=30))
    trees = compression.build_trees(table, schema)
    batch_size = data.draw(st.integers(1, 35))
    # stream the trees in several tables to exercise carrying a split tree across tables
    cut = data.draw(st.integers(0, trees.num_rows))
    stream = [trees.slice(0, cut), trees.slice(cut)]
    batches = list(compression.iter_batches(stream, schema, batch_size))
    everything = compression.TreeBatch.from_trees(trees, schema)

    assert sum(b.num_leaves for b in batches) == table.num_rows
    for b in batches[:-1]:
        assert b.num_leaves == batch_size
    got = []
    for b in batches:
        b.check()
        assert [layer.name for layer in b.layers] == [layer.name for layer in schema.layers]
        for layer in b.layers[1:]:
            assert layer.parent.dtype == np.int32
        got += _leaf_rows(b.leaf_features(), b.labels)
    assert got == _leaf_rows(everything.leaf_features(), everything.labels)


@PROPERTY
@given(st.data())
def test_without_splitting_batches_end_at_tree_boundaries(data):
    schema = data.draw(random_schemas())
    table = data.draw(raw_tables(schema, max_rows=30))
    trees = compression.build_trees(table, schema)
    batch_size = data.draw(st.integers(1, 12))
    batches = list(compression.iter_batches(trees, schema, batch_size, split_trees=False))
    assert sum(b.num_leaves for b in batches) == table.num_rows
    roots = compression.TreeBatch.from_trees(trees, schema).leaf_ancestors(0)
    tree_size = np.bincount(roots, minlength=trees.num_rows)
    position = 0
    for b in batches:
        assert 1 <= b.num_leaves <= batch_size
        end = position + b.num_leaves
        if end < len(roots):
            if roots[end] != roots[end - 1]:
                # ended at a tree boundary: the next tree did not fit
                assert b.num_leaves + tree_size[roots[end]] > batch_size
            else:
                # ended inside a tree: only a tree larger than a batch is ever split
                assert tree_size[roots[end]] > batch_size
        position = end


def test_a_split_tree_repeats_its_ancestors_in_the_next_batch():
    schema = schemas.from_dict({"name": "t", "layers": [
        {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"}]},
        {"name": "ad", "key": ["aid"], "features": [{"name": "aid", "kind": "id"}]},
        {"name": "sample", "key": ["sid"], "features": [{"name": "sid", "kind": "id"}]}],
        "labels": ["click"]})
    # user 1: ad 10 with 3 samples, ad 11 with 2 samples; user 2: ad 10 with 1 sample
    table = pa.table({"uid": [1, 1, 1, 1, 1, 2], "aid": [10, 10, 10, 11, 11, 10],
                      "sid": [0, 1, 2, 3, 4, 5], "click": [0.0, 1, 0, 0, 1, 1]}
                     ).cast(schema.raw_arrow_schema())
    trees = compression.build_trees(table, schema)
    batches = list(compression.iter_batches(trees, schema, batch_size=4))
    assert [b.num_leaves for b in batches] == [4, 2]
    first, second = batches
    assert first.layers[0].features["uid"].tolist() == [1]
    assert first.layers[1].features["aid"].tolist() == [10, 11]
    assert first.layers[1].parent.tolist() == [0, 0]
    assert first.layers[2].parent.tolist() == [0, 0, 0, 1]
    # the rest of user 1 (ad 11, sample 4) opens the second batch with user 1 and ad 11 repeated
    assert second.layers[0].features["uid"].tolist() == [1, 2]
    assert second.layers[1].features["aid"].tolist() == [11, 10]
    assert second.layers[1].parent.tolist() == [0, 1]
    assert second.layers[2].features["sid"].tolist() == [4, 5]
    assert second.layers[2].parent.tolist() == [0, 1]
    assert second.labels["click"].tolist() == [1.0, 1.0]


def test_batches_hash_string_ids_and_shape_features():
    schema = schemas.load("schemas/examples/taobao_like.yaml")
    table = taobao_table(250)
    trees = compression.build_trees(table, schema)
    batch = next(compression.iter_batches(trees, schema, batch_size=100))
    assert batch.num_leaves == 100
    creative = batch.layers[2]
    assert creative.features["pid"].dtype == np.int64
    hashed = set(schemas.stable_hash_strings(table.column("pid")).tolist())
    assert set(creative.features["pid"].tolist()) <= hashed
    values, offsets = batch.layers[0].features["clicked_items"]
    assert values.dtype == np.int64 and offsets.dtype == np.int32
    assert len(offsets) == batch.layers[0].size + 1 and offsets[-1] == len(values)
    assert batch.layers[1].features["price"].shape == (batch.layers[1].size, 1)
    assert batch.labels["click"].dtype == np.float32
    # structured sizes: fewer user and ad nodes than leaves
    assert batch.layers[0].size < batch.layers[1].size <= 100


def test_take_gathers_ragged_rows():
    values = np.array([1, 2, 3, 4, 5, 6], np.int64)
    offsets = np.array([0, 2, 2, 6], np.int32)
    got_values, got_offsets = take((values, offsets), np.array([2, 0, 1, 0]))
    assert got_values.tolist() == [3, 4, 5, 6, 1, 2, 1, 2]
    assert got_offsets.tolist() == [0, 4, 6, 6, 8]


def test_batch_size_must_be_positive():
    schema = schemas.load("schemas/examples/taobao_like.yaml")
    trees = compression.build_trees(taobao_table(10), schema)
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        list(compression.iter_batches(trees, schema, 0))
