"""Schema loading, validation messages, Arrow schemas and the stable hash."""

import copy
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

import compression
import schemas
from schemas import SchemaError

EXAMPLE = "schemas/examples/taobao_like.yaml"

BASE = {"name": "t", "labels": ["click"], "layers": [
    {"name": "user", "key": ["uid"], "features": [{"name": "uid", "kind": "id"},
                                                   {"name": "hist", "kind": "ids"}]},
    {"name": "ad", "key": ["aid"], "features": [{"name": "aid", "kind": "id"},
                                                 {"name": "price", "kind": "dense", "dim": 2}]}]}


def _with(change):
    data = copy.deepcopy(BASE)
    change(data)
    return data


def test_example_schema_has_23_feature_groups_over_three_layers():
    schema = schemas.load(EXAMPLE)
    assert [layer.name for layer in schema.layers] == ["user", "ad", "creative"]
    assert len(schema.features) == 23
    assert schema.labels == ("click", "conversion")
    assert schema.feature("pid").dtype == "string"
    assert schema.layer_index("cate_id") == 1


def test_raw_arrow_schema_lists_every_column_with_its_type():
    schema = schemas.from_dict(BASE)
    assert schema.raw_arrow_schema().names == ["uid", "hist", "aid", "price", "click"]
    types = [f.type for f in schema.raw_arrow_schema()]
    assert types == [pa.int64(), pa.list_(pa.int64()), pa.int64(), pa.list_(pa.float32()),
                     pa.float32()]


def test_tree_arrow_schema_nests_children_under_the_child_layer_name():
    schema = schemas.from_dict(BASE)
    tree = schema.tree_arrow_schema()
    assert tree.names == ["uid", "hist", "ad"]
    ad = tree.field("ad").type
    assert pa.types.is_list(ad)
    assert [f.name for f in ad.value_type] == ["aid", "price", "click"]
    assert schemas.from_arrow_metadata(tree) == schema


def test_schema_round_trips_through_yaml(tmp_path):
    schema = schemas.load(EXAMPLE)
    path = tmp_path / "s.yaml"
    path.write_text(schema.to_yaml())
    assert schemas.load(path) == schema


@pytest.mark.parametrize("change, message", [
    (lambda d: d["layers"][0]["features"][1].update(kind="idz"),
     "layers[0] (user).features[1] (hist).kind: unknown kind 'idz'; expected one of id, ids, "
     "dense"),
    (lambda d: d["layers"][1]["features"].append({"name": "uid", "kind": "id"}),
     "layers[1].features[2]: name 'uid' is used twice (also layers[0].features[0]); every "
     "feature, label and layer needs its own name"),
    (lambda d: d["layers"][0].update(key=["age"]),
     "layers[0] (user).key: key column 'age' is not a feature of layer 'user'; add "
     "`{name: age, kind: id}` to its features or pick one of uid, hist"),
    (lambda d: d.update(labels=[]),
     "labels: no labels; list at least one leaf-level label column, e.g. `labels: [click]`"),
    (lambda d: d["layers"].extend([{"name": f"l{i}", "key": [f"k{i}"],
                                    "features": [{"name": f"k{i}", "kind": "id"}]}
                                   for i in range(3)]),
     "layers: 5 layers given, at most 4 are supported; merge layers (e.g. put context features "
     "on the leaves)"),
    (lambda d: d["layers"][1]["features"][1].pop("dim"),
     "layers[1] (ad).features[1] (price): a dense feature needs a dim, e.g. "
     "`{name: price, kind: dense, dim: 1}`"),
    (lambda d: d["layers"][0]["features"][0].update(dim=4),
     "layers[0] (user).features[0] (uid).dim: only dense features have a dim; the embedding "
     "dimension belongs in the trainer config"),
    (lambda d: d["layers"][0].update(key=["hist"]),
     "layers[0] (user).key: key column 'hist' has kind 'ids'; key columns must have kind id"),
    (lambda d: d["layers"][0].pop("key"),
     "layers[0] (user).key: missing; name the columns that identify a user node, e.g. "
     "`key: [uid]`"),
    (lambda d: d["layers"][0]["features"][0].update(dtype="float"),
     "layers[0] (user).features[0] (uid).dtype: 'float' is not an id dtype; expected one of "
     "int64, string"),
    (lambda d: d.update(extra=1), "schema: unknown field 'extra'; expected name, layers, labels"),
    (lambda d: d.update(labels=["uid"]),
     "labels[0]: name 'uid' is used twice (also layers[0].features[0])"),
])
def test_invalid_schemas_name_the_field_and_the_fix(change, message):
    with pytest.raises(SchemaError) as err:
        schemas.from_dict(_with(change))
    assert message in str(err.value)


def test_load_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nlayers: []\nlabels: [click]\n")
    with pytest.raises(SchemaError, match=r"bad.yaml: layers: missing or empty"):
        schemas.load(path)
    with pytest.raises(SchemaError, match="schema file not found"):
        schemas.load(tmp_path / "nope.yaml")
    assert issubclass(SchemaError, ValueError)


def test_leaf_layer_key_is_optional():
    schema = schemas.from_dict({"name": "flat", "labels": ["y"], "layers": [
        {"name": "sample", "features": [{"name": "x", "kind": "id"}]}]})
    assert schema.leaf.key == ()


def test_stable_hash_is_fnv1a_64_as_signed_int64():
    assert schemas.stable_hash("") == -3750763034362895579  # 0xcbf29ce484222325 as int64
    assert schemas.stable_hash("a") == -5808556873153909620  # 0xaf63dc4c8601ec8c
    assert schemas.stable_hash(b"foobar") == schemas.stable_hash("foobar")
    words = ["", "a", "foobar", "héllo", "430548_1007", "a" * 300]
    assert schemas.stable_hash_strings(pa.array(words)).tolist() == [
        schemas.stable_hash(w) for w in words]


def test_mix64_is_splitmix64s_finalizer_of_the_int64_bits():
    from schemas.hashing import GOLDEN, mix64

    def reference(x: int) -> int:  # the formula in Python integers, mod 2**64
        x %= 1 << 64
        x ^= x >> 30
        x = x * 0xBF58476D1CE4E5B9 % (1 << 64)
        x ^= x >> 27
        x = x * 0x94D049BB133111EB % (1 << 64)
        return x ^ (x >> 31)

    values = [0, 1, 2, 3, -1, -(1 << 63), (1 << 63) - 1, 430548]
    assert mix64(values).tolist() == [reference(v) for v in values]
    assert mix64(np.array(values, np.int64).view(np.uint64)).tolist() == mix64(values).tolist()
    assert mix64(np.uint64(GOLDEN)).tolist() == 0xE220A8397B1DCDAF  # splitmix64(seed 0)'s first


def test_root_key_hash_is_the_same_for_raw_samples_and_their_trees():
    from sample_data import taobao_table

    from schemas.hashing import root_key_hash

    schema = schemas.load("schemas/examples/taobao_like.yaml")
    raw = taobao_table(300, seed=2)
    trees = compression.build_trees(raw, schema)
    by_user = dict(zip(raw.column("user_id").to_pylist(), root_key_hash(raw, schema).tolist()))
    assert root_key_hash(trees, schema).tolist() == [
        by_user[u] for u in trees.column("user_id").to_pylist()]
    assert len(set(by_user.values())) == len(by_user)


def test_stable_hash_is_the_same_in_another_process():
    code = ("import schemas, pyarrow as pa; "
            "print(schemas.stable_hash_strings(pa.array(['x1', 'user_42'])).tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=".")
    assert out.stdout.strip() == str([schemas.stable_hash("x1"), schemas.stable_hash("user_42")])


# -- carried columns: kept with every sample, never trained ---------------------------------

WITH_ROW_IDS = "schemas/examples/with_row_ids.yaml"


def _carried(*columns):
    return _with(lambda d: d["layers"][-1].update(carried=list(columns)))


def test_carried_columns_come_after_the_labels_and_are_not_features():
    schema = schemas.load(WITH_ROW_IDS)
    assert schema.carried_names == ("request_id", "row_id", "event_time")
    assert [c.dtype for c in schema.carried] == ["string", "int64", "timestamp"]
    assert schema.raw_arrow_schema().names == ["user_id", "clicked_cats", "ad_id", "price",
                                               "click", "request_id", "row_id", "event_time"]
    assert [f.type for f in schema.raw_arrow_schema()][-3:] == [
        pa.string(), pa.int64(), pa.timestamp("us", tz="UTC")]
    assert schema.columns == tuple(schema.raw_arrow_schema().names)
    leaf = schema.tree_arrow_schema().field("ad").type.value_type
    assert [f.name for f in leaf] == ["ad_id", "price", "click", "request_id", "row_id",
                                      "event_time"]
    # never a feature: the trainer (which iterates features) cannot see them
    assert [f.name for f in schema.features] == ["user_id", "clicked_cats", "ad_id", "price"]
    with pytest.raises(KeyError):
        schema.feature("row_id")


def test_carried_columns_round_trip_through_dict_yaml_and_tree_metadata(tmp_path):
    schema = schemas.load(WITH_ROW_IDS)
    assert schemas.from_dict(schema.to_dict()) == schema
    assert schema.to_dict()["layers"][-1]["carried"] == [
        {"name": "request_id", "dtype": "string"}, {"name": "row_id", "dtype": "int64"},
        {"name": "event_time", "dtype": "timestamp"}]
    path = tmp_path / "s.yaml"
    path.write_text(schema.to_yaml())
    assert schemas.load(path) == schema
    assert schemas.from_arrow_metadata(schema.tree_arrow_schema()) == schema
    # a schema without carried columns writes no `carried` key (tree files stay as they were)
    assert "carried" not in schemas.from_dict(BASE).to_dict()["layers"][-1]
    assert schemas.from_dict(_carried()) == schemas.from_dict(BASE)


@pytest.mark.parametrize("dtype, arrow", [("int64", pa.int64()), ("float64", pa.float64()),
                                          ("string", pa.string()),
                                          ("timestamp", pa.timestamp("us", tz="UTC"))])
def test_carried_dtypes(dtype, arrow):
    schema = schemas.from_dict(_carried({"name": "x", "dtype": dtype}))
    assert schema.raw_arrow_schema().field("x").type == arrow


@pytest.mark.parametrize("data, message", [
    (_with(lambda d: d["layers"][0].update(carried=[{"name": "rid", "dtype": "int64"}])),
     "layers[0] (user).carried: carried columns are per sample and belong on the last (leaf) "
     "layer; on an upper layer a value would become part of the node's identity"),
    (_carried({"name": "rid"}),
     "layers[1] (ad).carried[0] (rid): a carried column needs a dtype, e.g. "
     "`{name: rid, dtype: int64}`; one of int64, float64, string, timestamp"),
    (_carried({"name": "rid", "dtype": "int32"}),
     "layers[1] (ad).carried[0] (rid).dtype: 'int32' is not a carried dtype; expected one of "
     "int64, float64, string, timestamp"),
    (_carried({"name": "rid", "dtype": "int64", "kind": "id"}),
     "layers[1] (ad).carried[0]: unknown field 'kind'; expected name, dtype"),
    (_carried({"name": "9x", "dtype": "int64"}),
     "layers[1] (ad).carried[0].name: '9x' is not a valid column name"),
    (_carried("rid"), "layers[1] (ad).carried[0]: a carried column is a mapping like"),
    (_with(lambda d: d["layers"][-1].update(carried={"name": "rid", "dtype": "int64"})),
     "layers[1] (ad).carried: expected a list like"),
    (_carried({"name": "aid", "dtype": "int64"}),
     "layers[1].carried[0]: name 'aid' is used twice (also layers[1].features[0])"),
    (_carried({"name": "click", "dtype": "int64"}),
     "layers[1].carried[0]: name 'click' is used twice (also labels[0])"),
    (_carried({"name": "r", "dtype": "int64"}, {"name": "r", "dtype": "string"}),
     "layers[1].carried[1]: name 'r' is used twice (also layers[1].carried[0])"),
    (_with(lambda d: d["layers"][-1].update(key=["rid"],
                                            carried=[{"name": "rid", "dtype": "int64"}])),
     "layers[1] (ad).key: 'rid' is a carried column; carried columns are never part of a "
     "node's identity"),
    (_with(lambda d: d["layers"][-1]["features"].append({"name": "rid", "kind": "carried"})),
     "layers[1] (ad).features[2] (rid).kind: a column that is carried but not trained is not "
     "a feature; list it under the leaf layer's `carried:` instead"),
])
def test_invalid_carried_columns_name_the_column_and_the_fix(data, message):
    with pytest.raises(SchemaError) as err:
        schemas.from_dict(data)
    assert message in str(err.value)


@pytest.mark.parametrize("data,message", [
    ("name: café\n".encode("latin-1"), r"not UTF-8 text \(byte 0xe9 at offset 9\); save the "
                                       "schema file as UTF-8"),
    (b"[" * 5000, "nested too deeply to be a schema"),
])
def test_a_schema_file_not_utf8_or_nested_too_deeply_is_a_schema_error(tmp_path, data, message):
    """Found by fuzzing (tests/fuzz_corpus/schema_yaml): these escaped as UnicodeDecodeError
    and RecursionError."""
    path = tmp_path / "schema.yaml"
    path.write_bytes(data)
    with pytest.raises(SchemaError, match=message) as error:
        schemas.load(path)
    assert str(path) in str(error.value)
