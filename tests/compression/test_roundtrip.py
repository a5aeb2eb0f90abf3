"""flat -> trees -> flat round trips, and the structure of the tree table."""

import numpy as np
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compression
import schemas
from sample_data import random_schemas, raw_tables, row_multiset, taobao_table

PROPERTY = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@PROPERTY
@given(st.data())
def test_flatten_of_build_trees_is_the_input_as_a_multiset(data):
    schema = data.draw(random_schemas())
    table = data.draw(raw_tables(schema))
    trees = compression.build_trees(table, schema)
    assert trees.schema.equals(schema.tree_arrow_schema())
    back = compression.flatten(trees, schema)
    assert back.schema.equals(schema.raw_arrow_schema())
    assert row_multiset(back) == row_multiset(table)


@PROPERTY
@given(st.data())
def test_upper_nodes_are_shared_exactly_when_all_their_features_match(data):
    schema = data.draw(random_schemas())
    table = data.draw(raw_tables(schema))
    trees = compression.build_trees(table, schema)
    layers = compression.flat_layers(trees, schema)
    # Each upper-layer node is distinct from its siblings (otherwise they would have merged),
    # and the number of roots equals the number of distinct root feature tuples.
    for level, (layer, nodes) in enumerate(zip(schema.layers[:-1], layers[:-1])):
        identity = [tuple(repr(nodes.columns[f.name][i].as_py()) for f in layer.features)
                    + ((int(nodes.parent[i]),) if nodes.parent is not None else ())
                    for i in range(len(nodes))]
        assert len(identity) == len(set(identity))
    if table.num_rows and len(schema.layers) > 1:
        root_tuples = {tuple(repr(row[f.name]) for f in schema.root.features)
                       for row in table.to_pylist()}
        assert trees.num_rows == len(root_tuples)


@PROPERTY
@given(st.data())
def test_tree_order_groups_leaves_by_every_ancestor(data):
    schema = data.draw(random_schemas())
    table = data.draw(raw_tables(schema))
    trees = compression.build_trees(table, schema)
    for nodes in compression.flat_layers(trees, schema)[1:]:
        assert np.all(np.diff(nodes.parent) >= 0)  # children contiguous under their parent


def test_input_order_does_not_change_the_trees():
    schema = schemas.load("schemas/examples/taobao_like.yaml")
    table = taobao_table(400)
    shuffled = table.take(np.random.default_rng(3).permutation(table.num_rows))
    a = compression.flatten(compression.build_trees(table, schema), schema)
    b = compression.flatten(compression.build_trees(shuffled, schema), schema)
    assert row_multiset(a) == row_multiset(b)
    assert compression.build_trees(shuffled, schema).num_rows == len(
        set(table.column("user_id").to_pylist()))


def test_users_whose_features_change_become_two_nodes():
    schema = schemas.from_dict({"name": "t", "layers": [
        {"name": "user", "key": ["uid"], "features": [
            {"name": "uid", "kind": "id"}, {"name": "age", "kind": "id"},
            {"name": "hist", "kind": "ids"}]},
        {"name": "ad", "key": ["aid"], "features": [{"name": "aid", "kind": "id"}]}],
        "labels": ["click"]})
    table = pa.table({
        "uid": [1, 1, 1, 2, 1], "age": [30, 30, 31, 30, 30],
        "hist": [[5], [5], [5], [5], [5, 6]],
        "aid": [9, 9, 9, 9, 9], "click": [0.0, 1.0, 0.0, 1.0, 1.0],
    }).cast(schema.raw_arrow_schema())
    trees = compression.build_trees(table, schema)
    roots = trees.select(["uid", "age", "hist"]).to_pylist()
    assert roots == [{"uid": 1, "age": 30, "hist": [5]}, {"uid": 1, "age": 31, "hist": [5]},
                     {"uid": 2, "age": 30, "hist": [5]}, {"uid": 1, "age": 30, "hist": [5, 6]}]
    # one ad node under each root, its leaves (here: the ad layer is the leaf layer) are that
    # user-version's samples in input order
    assert trees.column("ad").to_pylist() == [
        [{"aid": 9, "click": 0.0}, {"aid": 9, "click": 1.0}],
        [{"aid": 9, "click": 0.0}],
        [{"aid": 9, "click": 1.0}],
        [{"aid": 9, "click": 1.0}],
    ]


def test_duplicate_samples_stay_separate_leaves():
    schema = schemas.from_dict({"name": "t", "layers": [
        {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"}]},
        {"name": "item", "key": ["iid"], "features": [{"name": "iid", "kind": "id"}]}],
        "labels": ["click"]})
    table = pa.table({"uid": [7, 7, 7], "iid": [3, 3, 3], "click": [1.0, 1.0, 1.0]}
                     ).cast(schema.raw_arrow_schema())
    trees = compression.build_trees(table, schema)
    assert trees.num_rows == 1
    assert trees.column("item").to_pylist() == [[{"iid": 3, "click": 1.0}] * 3]


def test_empty_input_gives_an_empty_tree_table():
    schema = schemas.load("schemas/examples/taobao_like.yaml")
    empty = schema.raw_arrow_schema().empty_table()
    trees = compression.build_trees(empty, schema)
    assert trees.num_rows == 0 and trees.schema.equals(schema.tree_arrow_schema())
    assert compression.flatten(trees, schema).num_rows == 0


def test_compression_counts_ids_once_per_node():
    schema = schemas.load("schemas/examples/taobao_like.yaml")
    table = taobao_table(600)
    trees = compression.build_trees(table, schema)
    summary = compression.TreeStats(schema).add(trees).summary()
    assert summary["samples"] == 600
    assert summary["trees"] == len(set(table.column("user_id").to_pylist()))
    flat_ids = sum(
        (1 if f.kind == "id" else sum(len(v) for v in table.column(f.name).to_pylist()) / 600)
        for f in schema.features if f.kind != "dense") * 600
    assert summary["ids_flat"] == round(flat_ids)
    assert summary["ids_in_trees"] < summary["ids_flat"]
    assert summary["id_compression_ratio"] > 1


@PROPERTY
@given(st.data())
def test_build_trees_from_split_roots_of_chunks_equals_build_trees(data):
    # The Beam job's form: the root layer's features once per node of each chunk, chunks
    # merged in any order; the trees must be exactly those of the rows themselves.
    schema = data.draw(random_schemas())
    table = data.draw(raw_tables(schema))
    if len(schema.layers) < 2:
        return
    table = compression.validate_raw(table, schema)
    size = data.draw(st.integers(1, max(1, table.num_rows)))
    chunks = [table.slice(start, size) for start in range(0, max(table.num_rows, 1), size)]
    chunks = data.draw(st.permutations(chunks))
    parts = [compression.split_roots(chunk, schema) for chunk in chunks]
    for (roots, rows), chunk in zip(parts, chunks):
        assert rows.num_rows == chunk.num_rows
        assert roots.num_rows <= rows.num_rows
        index = rows.column(compression.ROOT_NODE).to_pylist()
        assert set(index) == set(range(roots.num_rows))  # every node used, none missing
        assert not set(roots.column_names) & set(rows.column_names)
    roots, rows = compression.concat_roots(parts)
    assert compression.build_trees(rows, schema, roots=roots).equals(
        compression.build_trees(pa.concat_tables(chunks), schema))


def test_split_roots_keeps_a_user_whose_features_change_as_two_nodes():
    table = taobao_table(400, seed=3)
    schema = schemas.load("schemas/examples/taobao_like.yaml")
    user = table.column("user_id")[0].as_py()
    rows = [i for i, u in enumerate(table.column("user_id").to_pylist()) if u == user]
    assert len(rows) > 1
    age = table.column("age_level").to_numpy().copy()
    age[rows[-1]] += 1
    items = table.column("clicked_items").to_pylist()
    items[rows[0]] = items[rows[0]] + [12345]
    table = table.set_column(table.column_names.index("age_level"), "age_level", pa.array(age))
    table = table.set_column(table.column_names.index("clicked_items"), "clicked_items",
                             pa.array(items, pa.list_(pa.int64())))
    roots, flat = compression.split_roots(table, schema)
    assert roots.filter(pa.compute.equal(roots.column("user_id"), user)).num_rows == 3
    trees = compression.build_trees(flat, schema, roots=roots)
    assert trees.equals(compression.build_trees(table, schema))
    assert row_multiset(compression.flatten(trees, schema)) == row_multiset(table)
