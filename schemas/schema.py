"""Schema, Layer and Feature: the validated, frozen form of a schema YAML file."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import pyarrow as pa
import yaml

KINDS = ("id", "ids", "dense")
ID_DTYPES = ("int64", "string")
CARRIED_DTYPES = ("int64", "float64", "string", "timestamp")
MAX_LAYERS = 4
SCHEMA_YAML_KEY = b"prefixrec.schema_yaml"  # tree tables carry their schema in the metadata
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SchemaError(ValueError):
    """A schema file or dict that does not describe a valid schema; the message names the field."""


@dataclass(frozen=True)
class Feature:
    """One input column of a layer.

    ``kind`` is ``id`` (one id per node), ``ids`` (a variable-length, possibly empty list of ids)
    or ``dense`` (a float32 vector of exactly ``dim`` values). Ids are int64 in the raw data, or
    strings (``dtype: string``) that batches turn into int64 with :func:`schemas.stable_hash`.
    """

    name: str
    kind: str
    dim: int | None = None
    dtype: str = "int64"
    sequence: "Sequence | None" = None   # ids only: the list is ordered (oldest first)

    def raw_arrow_type(self) -> pa.DataType:
        """The Arrow type of this column in raw (flat) data and in the tree table."""
        if self.kind == "dense":
            return pa.list_(pa.float32())
        scalar = pa.int64() if self.dtype == "int64" else pa.string()
        return scalar if self.kind == "id" else pa.list_(scalar)

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind == "dense":
            out["dim"] = self.dim
        elif self.dtype != "int64":
            out["dtype"] = self.dtype
        if self.sequence is not None:
            out["sequence"] = self.sequence.to_dict()
        return out


@dataclass(frozen=True)
class Sequence:
    """How an ``ids`` feature is an ordered behaviour sequence (``sequence:`` on the feature).

    The list's order is the order of the behaviours, oldest first, so its last item is the most
    recent one; with ``time`` (another ``ids`` feature of the same layer, int64, one value per
    item) the items are ordered by those times instead (ties keep their list order), and the
    time column is not embedded. ``max_length`` keeps the most recent ``max_length`` items of
    every list, for every model that reads the feature (pooling, DIN and DIEN alike).
    """

    max_length: int | None = None
    time: str | None = None

    def to_dict(self) -> Any:
        out = {}
        if self.max_length is not None:
            out["max_length"] = self.max_length
        if self.time is not None:
            out["time"] = self.time
        return out or True


@dataclass(frozen=True)
class Carried:
    """A column that is carried with every sample but never trained: a row id, a request id,
    a timestamp. Declared in the leaf layer's ``carried`` list; it travels losslessly through
    trees, Parquet files, tree messages and batches (``batch.carried[name]``), is never part
    of a node's identity, and is never embedded or fed to the model. Values may be null.

    ``dtype``: ``int64``, ``float64``, ``string`` or ``timestamp`` (microseconds, UTC; naive
    timestamps are read as UTC).
    """

    name: str
    dtype: str

    def raw_arrow_type(self) -> pa.DataType:
        """The Arrow type of this column in raw (flat) data, the tree table and batches."""
        return _CARRIED_TYPES[self.dtype]

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype}


_CARRIED_TYPES = {"int64": pa.int64(), "float64": pa.float64(), "string": pa.string(),
                  "timestamp": pa.timestamp("us", tz="UTC")}


@dataclass(frozen=True)
class Layer:
    """A level of the multi-prefix tree (user, ad, creative...).

    A node of an upper layer is identified by its ``key`` columns plus all its features' values;
    the last layer's nodes are the samples themselves (one leaf per raw row).
    """

    name: str
    key: tuple[str, ...]
    features: tuple[Feature, ...]
    carried: tuple[Carried, ...] = ()  # leaf layer only: columns carried but not trained

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)

    def feature(self, name: str) -> Feature:
        for f in self.features:
            if f.name == name:
                return f
        raise KeyError(f"layer {self.name!r} has no feature {name!r}")

    def to_dict(self) -> dict:
        out = {"name": self.name, "key": list(self.key),
               "features": [f.to_dict() for f in self.features]}
        if self.carried:
            out["carried"] = [c.to_dict() for c in self.carried]
        return out


@dataclass(frozen=True)
class Schema:
    """A validated schema: ``layers`` from root to leaves, and the leaf-level float ``labels``."""

    name: str
    layers: tuple[Layer, ...]
    labels: tuple[str, ...]
    _by_name: dict = field(default=None, init=False, repr=False, compare=False, hash=False)
    # Arrow schemas built once: the tree schema's metadata holds the YAML text, and emitting it
    # cost as much as building the trees of a 5000-sample micro-batch (online learning).
    _arrow: dict = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        index = {f.name: (li, f) for li, layer in enumerate(self.layers) for f in layer.features}
        object.__setattr__(self, "_by_name", index)
        object.__setattr__(self, "_arrow", {})

    @property
    def root(self) -> Layer:
        return self.layers[0]

    @property
    def leaf(self) -> Layer:
        return self.layers[-1]

    @property
    def features(self) -> tuple[Feature, ...]:
        """Every feature, root layer first, in file order."""
        return tuple(f for layer in self.layers for f in layer.features)

    @property
    def carried(self) -> tuple[Carried, ...]:
        """The columns carried with every sample but not trained (the leaf layer's)."""
        return self.leaf.carried

    @property
    def carried_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.leaf.carried)

    @property
    def columns(self) -> tuple[str, ...]:
        """The raw columns: every feature, then the labels, then the carried columns."""
        return tuple(f.name for f in self.features) + self.labels + self.carried_names

    @property
    def leaf_columns(self) -> tuple[str, ...]:
        """The columns of a leaf node in the tree table: its features, the labels, the
        carried columns."""
        return self.leaf.feature_names + self.labels + self.carried_names

    def feature(self, name: str) -> Feature:
        return self._by_name[name][1]

    def layer_index(self, feature_name: str) -> int:
        """Index of the layer a feature belongs to."""
        return self._by_name[feature_name][0]

    @property
    def sequences(self) -> tuple[Feature, ...]:
        """The ``ids`` features declared ordered sequences, schema order."""
        return tuple(f for f in self.features if f.sequence is not None)

    @property
    def time_columns(self) -> frozenset:
        """Names of the features that are some sequence's time column: they order their
        sequences and are not embedded."""
        return frozenset(f.sequence.time for f in self.sequences if f.sequence.time)

    @property
    def embedded_features(self) -> tuple[Feature, ...]:
        """The ``id`` and ``ids`` features that get embeddings (all but time columns)."""
        times = self.time_columns
        return tuple(f for f in self.features if f.kind != "dense" and f.name not in times)

    def raw_arrow_schema(self) -> pa.Schema:
        """Arrow schema of flat samples: one column per feature (root layer first), then the
        labels, then the carried columns."""
        if "raw" not in self._arrow:
            self._arrow["raw"] = self._raw_arrow_schema()
        return self._arrow["raw"]

    def _raw_arrow_schema(self) -> pa.Schema:
        fields = [pa.field(f.name, f.raw_arrow_type()) for f in self.features]
        fields += [pa.field(label, pa.float32()) for label in self.labels]
        fields += [pa.field(c.name, c.raw_arrow_type()) for c in self.carried]
        return pa.schema(fields, metadata={b"prefixrec.schema": self.name.encode()})

    def layer_fields(self, level: int) -> list[pa.Field]:
        """Fields of one node of layer ``level`` in the tree table: its features, then either
        the list of its children (named after the child layer) or, for leaves, the labels and
        then the carried columns."""
        layer = self.layers[level]
        fields = [pa.field(f.name, f.raw_arrow_type()) for f in layer.features]
        if level + 1 < len(self.layers):
            child = pa.struct(self.layer_fields(level + 1))
            fields.append(pa.field(self.layers[level + 1].name, pa.list_(child)))
        else:
            fields += [pa.field(label, pa.float32()) for label in self.labels]
            fields += [pa.field(c.name, c.raw_arrow_type()) for c in layer.carried]
        return fields

    def tree_arrow_schema(self) -> pa.Schema:
        """Arrow schema of the tree table: one row per root node, children nested as lists::

            user_id age_level ... ad: list<struct<ad_id ... creative: list<struct<... click>>>>
        """
        if "tree" not in self._arrow:
            self._arrow["tree"] = self._tree_arrow_schema()
        return self._arrow["tree"]

    def _tree_arrow_schema(self) -> pa.Schema:
        return pa.schema(self.layer_fields(0), metadata={
            b"prefixrec.schema": self.name.encode(),
            SCHEMA_YAML_KEY: self.to_yaml().encode(),
        })

    def to_dict(self) -> dict:
        return {"name": self.name, "layers": [layer.to_dict() for layer in self.layers],
                "labels": list(self.labels)}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def from_arrow_metadata(arrow_schema: pa.Schema) -> Schema | None:
    """The schema a tree table (or its Parquet file) carries in its metadata, if any."""
    raw = (arrow_schema.metadata or {}).get(SCHEMA_YAML_KEY)
    return from_dict(yaml.safe_load(raw.decode())) if raw else None


def load(path: str | os.PathLike) -> Schema:
    """Read and validate a schema YAML file."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise SchemaError(f"{path}: schema file not found") from None
    except yaml.YAMLError as e:
        raise SchemaError(f"{path}: not valid YAML: {e}") from None
    except UnicodeDecodeError as e:
        raise SchemaError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                          f"{e.start}); save the schema file as UTF-8") from None
    except RecursionError:
        raise SchemaError(f"{path}: nested too deeply to be a schema (a schema nests a few "
                          "levels: layers, features, their fields)") from None
    try:
        return from_dict(data)
    except SchemaError as e:
        raise SchemaError(f"{path}: {e}") from None


def from_dict(data: Any) -> Schema:
    """Validate a schema given as a dict (the parsed YAML)."""
    if not isinstance(data, Mapping):
        raise SchemaError("a schema is a mapping with keys name, layers, labels")
    _no_unknown_keys(data, ("name", "layers", "labels"), "schema")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise SchemaError("name: missing; give the schema a name, e.g. `name: my_ads`")
    raw_layers = data.get("layers")
    if not isinstance(raw_layers, list) or not raw_layers:
        raise SchemaError("layers: missing or empty; list the layers from root to leaves")
    if len(raw_layers) > MAX_LAYERS:
        raise SchemaError(f"layers: {len(raw_layers)} layers given, at most {MAX_LAYERS} are "
                          "supported; merge layers (e.g. put context features on the leaves)")
    layers = tuple(_layer(raw, i, last=(i == len(raw_layers) - 1))
                   for i, raw in enumerate(raw_layers))

    labels = data.get("labels")
    if isinstance(labels, str):
        labels = [labels]
    if not isinstance(labels, list) or not labels:
        raise SchemaError("labels: no labels; list at least one leaf-level label column, "
                          "e.g. `labels: [click]`")
    for i, label in enumerate(labels):
        if not isinstance(label, str) or not _NAME.match(label):
            raise SchemaError(f"labels[{i}]: {label!r} is not a valid column name")

    seen: dict[str, str] = {}

    def claim(column: str, where: str):
        if column in seen:
            raise SchemaError(f"{where}: name {column!r} is used twice (also {seen[column]}); "
                              "every feature, label and layer needs its own name")
        seen[column] = where

    for li, layer in enumerate(layers):
        claim(layer.name, f"layers[{li}].name")
    for li, layer in enumerate(layers):
        for fi, feat in enumerate(layer.features):
            claim(feat.name, f"layers[{li}].features[{fi}]")
    for i, label in enumerate(labels):
        claim(label, f"labels[{i}]")
    for ci, carried in enumerate(layers[-1].carried):
        claim(carried.name, f"layers[{len(layers) - 1}].carried[{ci}]")
    return Schema(name=name, layers=layers, labels=tuple(labels))


def _layer(raw: Any, index: int, last: bool) -> Layer:
    where = f"layers[{index}]"
    if not isinstance(raw, Mapping):
        raise SchemaError(f"{where}: a layer is a mapping with keys name, key, features "
                          "(and, on the leaf layer, carried)")
    _no_unknown_keys(raw, ("name", "key", "features", "carried"), where)
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise SchemaError(f"{where}.name: {name!r} is not a valid layer name")
    where = f"layers[{index}] ({name})"
    raw_features = raw.get("features")
    if not isinstance(raw_features, list) or not raw_features:
        raise SchemaError(f"{where}.features: missing or empty; a layer needs at least one feature")
    features = tuple(_feature(f, f"{where}.features[{i}]") for i, f in enumerate(raw_features))
    names = [f.name for f in features]
    _check_times(features, where)
    carried = _carried_list(raw.get("carried"), where, last)

    key = raw.get("key", [] if last else None)
    if isinstance(key, str):
        key = [key]
    if not isinstance(key, list) or (not key and not last):
        raise SchemaError(f"{where}.key: missing; name the columns that identify a {name} node, "
                          f"e.g. `key: [{names[0]}]`")
    for k in key:
        if k not in names and k in [c.name for c in carried]:
            raise SchemaError(f"{where}.key: {k!r} is a carried column; carried columns are "
                              "never part of a node's identity; key on a feature instead")
        if k not in names:
            raise SchemaError(f"{where}.key: key column {k!r} is not a feature of layer {name!r}; "
                              f"add `{{name: {k}, kind: id}}` to its features or pick one of "
                              f"{', '.join(names)}")
        feat = features[names.index(k)]
        if feat.kind != "id":
            raise SchemaError(f"{where}.key: key column {k!r} has kind {feat.kind!r}; "
                              "key columns must have kind id")
    return Layer(name=name, key=tuple(key), features=features, carried=carried)


def _carried_list(raw: Any, where: str, last: bool) -> tuple[Carried, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise SchemaError(f"{where}.carried: expected a list like "
                          "`carried: [{name: request_id, dtype: string}]`")
    if raw and not last:
        raise SchemaError(
            f"{where}.carried: carried columns are per sample and belong on the last (leaf) "
            "layer; on an upper layer a value would become part of the node's identity and "
            "split its nodes. Move them to the leaf layer's carried list (or make them "
            "features of this layer if they describe the node)")
    return tuple(_carried(c, f"{where}.carried[{i}]") for i, c in enumerate(raw))


def _carried(raw: Any, where: str) -> Carried:
    if not isinstance(raw, Mapping):
        raise SchemaError(f"{where}: a carried column is a mapping like "
                          "{name: request_id, dtype: string}")
    _no_unknown_keys(raw, ("name", "dtype"), where)
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise SchemaError(f"{where}.name: {name!r} is not a valid column name")
    where = f"{where} ({name})"
    dtype = raw.get("dtype")
    if dtype is None:
        raise SchemaError(f"{where}: a carried column needs a dtype, e.g. "
                          f"`{{name: {name}, dtype: int64}}`; one of "
                          f"{', '.join(CARRIED_DTYPES)}")
    if dtype not in CARRIED_DTYPES:
        raise SchemaError(f"{where}.dtype: {dtype!r} is not a carried dtype; expected one of "
                          f"{', '.join(CARRIED_DTYPES)} (store other values as strings)")
    return Carried(name=name, dtype=dtype)


def _feature(raw: Any, where: str) -> Feature:
    if not isinstance(raw, Mapping):
        raise SchemaError(f"{where}: a feature is a mapping like {{name: user_id, kind: id}}")
    _no_unknown_keys(raw, ("name", "kind", "dim", "dtype", "sequence"), where)
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise SchemaError(f"{where}.name: {name!r} is not a valid column name")
    where = f"{where} ({name})"
    kind = raw.get("kind")
    if kind == "carried":
        raise SchemaError(f"{where}.kind: a column that is carried but not trained is not a "
                          "feature; list it under the leaf layer's `carried:` instead, e.g. "
                          f"`carried: [{{name: {name}, dtype: int64}}]`")
    if kind not in KINDS:
        raise SchemaError(f"{where}.kind: unknown kind {kind!r}; expected one of "
                          f"{', '.join(KINDS)}")
    dim = raw.get("dim")
    dtype = raw.get("dtype", "int64")
    if kind == "dense":
        if dim is None:
            raise SchemaError(f"{where}: a dense feature needs a dim, e.g. "
                              f"`{{name: {name}, kind: dense, dim: 1}}`")
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise SchemaError(f"{where}.dim: {dim!r} is not a positive integer")
        if "dtype" in raw:
            raise SchemaError(f"{where}.dtype: dense features are always float32; remove dtype")
        dtype = "float32"
    else:
        if dim is not None:
            raise SchemaError(f"{where}.dim: only dense features have a dim; the embedding "
                              "dimension belongs in the trainer config")
        if dtype not in ID_DTYPES:
            raise SchemaError(f"{where}.dtype: {dtype!r} is not an id dtype; expected one of "
                              f"{', '.join(ID_DTYPES)}")
    sequence = _sequence(raw.get("sequence"), kind, f"{where}.sequence")
    return Feature(name=name, kind=kind, dim=dim, dtype=dtype, sequence=sequence)


def _sequence(raw: Any, kind: str, where: str) -> Sequence | None:
    if raw is None or raw is False:
        return None
    if kind != "ids":
        raise SchemaError(f"{where}: only ids features can be sequences (a list of behaviours, "
                          f"oldest first); this feature has kind {kind!r}")
    if raw is True:
        return Sequence()
    if not isinstance(raw, Mapping):
        raise SchemaError(f"{where}: expected true or a mapping like "
                          "`sequence: {max_length: 50, time: clicked_times}`, got "
                          f"{raw!r}")
    _no_unknown_keys(raw, ("max_length", "time"), where)
    max_length = raw.get("max_length")
    if max_length is not None and (not isinstance(max_length, int)
                                   or isinstance(max_length, bool) or max_length < 1):
        raise SchemaError(f"{where}.max_length: {max_length!r} is not a positive integer "
                          "(the number of most recent behaviours kept)")
    time = raw.get("time")
    if time is not None and (not isinstance(time, str) or not _NAME.match(time)):
        raise SchemaError(f"{where}.time: {time!r} is not a column name")
    return Sequence(max_length=max_length, time=time)


def _check_times(features: tuple[Feature, ...], where: str) -> None:
    """A sequence's time column is an int64 ``ids`` feature of the same layer, and not a
    sequence itself."""
    by_name = {f.name: f for f in features}
    for i, f in enumerate(features):
        time = f.sequence.time if f.sequence is not None else None
        if time is None:
            continue
        at = f"{where}.features[{i}] ({f.name}).sequence.time"
        other = by_name.get(time)
        if other is None:
            raise SchemaError(f"{at}: {time!r} is not a feature of this layer; the time column "
                              f"is an ids feature beside {f.name!r} with one int64 time per "
                              f"item, e.g. `{{name: {time}, kind: ids}}`")
        if other is f:
            raise SchemaError(f"{at}: a sequence cannot be its own time column")
        if other.kind != "ids" or other.dtype != "int64":
            raise SchemaError(f"{at}: the time column {time!r} has kind {other.kind!r}"
                              f"{'' if other.kind == 'dense' else ', dtype ' + other.dtype}; "
                              "it must be an ids feature of dtype int64 (one time per item)")
        if other.sequence is not None:
            raise SchemaError(f"{at}: the time column {time!r} is itself declared a sequence; "
                              "a time column only orders other sequences")


def _no_unknown_keys(raw: Mapping, allowed: tuple[str, ...], where: str):
    for k in raw:
        if k not in allowed:
            raise SchemaError(f"{where}: unknown field {k!r}; expected {', '.join(allowed)}")
