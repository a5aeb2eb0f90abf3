"""Random schemas and raw sample tables for property-based tests (hypothesis strategies)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import strategies as st

import schemas

# Small value domains, so that nodes are shared, features change between samples of one key,
# and duplicate rows occur often.
_INTS = [0, 1, 2, -(1 << 62)]
_STRINGS = ["", "a", "b", "héllo"]
_FLOATS = [0.0, -0.0, 1.5, -2.25]


@st.composite
def random_schemas(draw, max_layers: int = 4) -> schemas.Schema:
    levels = draw(st.integers(1, max_layers))
    layers = []
    counter = 0
    for level in range(levels):
        features = [{"name": f"k{level}", "kind": "id",
                     "dtype": draw(st.sampled_from(["int64", "string"]))}]
        for _ in range(draw(st.integers(0, 3))):
            counter += 1
            kind = draw(st.sampled_from(["id", "ids", "dense"]))
            feature = {"name": f"f{counter}", "kind": kind}
            if kind == "dense":
                feature["dim"] = draw(st.integers(1, 3))
            else:
                feature["dtype"] = draw(st.sampled_from(["int64", "string"]))
            features.append(feature)
        layers.append({"name": f"layer{level}", "key": [f"k{level}"], "features": features})
    labels = ["click", "conversion"][:draw(st.integers(1, 2))]
    return schemas.from_dict({"name": "random", "layers": layers, "labels": labels})


def _value(draw, feature: schemas.Feature):
    if feature.kind == "dense":
        return [draw(st.sampled_from(_FLOATS)) for _ in range(feature.dim)]
    pool = _INTS if feature.dtype == "int64" else _STRINGS
    if feature.kind == "id":
        return draw(st.sampled_from(pool))
    return draw(st.lists(st.sampled_from(pool), max_size=3))


@st.composite
def raw_tables(draw, schema: schemas.Schema, max_rows: int = 40) -> pa.Table:
    """Rows whose upper-layer nodes are drawn from small pools (so trees share nodes), with some
    features redrawn per row (so a key's features change), duplicates and no particular order."""
    n = draw(st.integers(0, max_rows))
    pools = []
    for layer in schema.layers[:-1]:
        pools.append([{f.name: _value(draw, f) for f in layer.features}
                      for _ in range(draw(st.integers(1, 4)))])
    rows = []
    for _ in range(n):
        if rows and draw(st.integers(0, 9)) == 0:
            rows.append(dict(rows[draw(st.integers(0, len(rows) - 1))]))  # exact duplicate
            continue
        row = {}
        for layer, pool in zip(schema.layers[:-1], pools):
            node = dict(draw(st.sampled_from(pool)))
            if draw(st.integers(0, 5)) == 0:  # this sample sees changed features
                f = draw(st.sampled_from(layer.features))
                node[f.name] = _value(draw, f)
            row.update(node)
        row.update({f.name: _value(draw, f) for f in schema.leaf.features})
        row.update({label: draw(st.sampled_from([0.0, 1.0, 0.5])) for label in schema.labels})
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=schema.raw_arrow_schema())


def row_multiset(table: pa.Table) -> list[str]:
    """Rows as a sorted list of reprs: equal for tables equal as multisets of rows
    (repr keeps -0.0 apart from 0.0)."""
    return sorted(repr(tuple(row.values())) for row in table.to_pylist())


def taobao_table(n: int = 300, seed: int = 0) -> pa.Table:
    """A small hand-made table of the taobao_like example schema (users share ads)."""
    schema = schemas.load("schemas/examples/taobao_like.yaml")
    rng = np.random.default_rng(seed)
    users = rng.integers(0, max(n // 20, 1), n)
    ads = rng.integers(0, 8, n)
    cols = {}
    for f in schema.features:
        level = schema.layer_index(f.name)
        base = users if level == 0 else ads if level == 1 else rng.integers(0, 1000, n)
        if f.kind == "id":
            values = (base * 7 + schemas.stable_hash(f.name) % 5
                      if f.name not in ("user_id", "ad_id") else base)
            cols[f.name] = (pa.array([f"{v}_x" for v in values]) if f.dtype == "string"
                            else pa.array(values.astype(np.int64)))
        elif f.kind == "ids":
            cols[f.name] = pa.array([[int(u), int(u) + 1][: int(u) % 3] for u in base],
                                    pa.list_(pa.int64()))
        else:
            cols[f.name] = pa.array([[float(b % 4)] * f.dim for b in base],
                                    pa.list_(pa.float32()))
    for label in schema.labels:
        cols[label] = pa.array((rng.random(n) < 0.1).astype(np.float32))
    return pa.table(cols).cast(schema.raw_arrow_schema())


def carried_samples(n: int = 500, seed: int = 0) -> pa.Table:
    """Raw samples of schemas/examples/with_row_ids.yaml: ~n/10 users sharing ads, row ids unique
    across seeds, every seventh request id null."""
    rng = np.random.default_rng(seed)
    users = rng.integers(0, max(n // 10, 1), n)
    return pa.table({
        "user_id": pa.array(users, pa.int64()),
        "clicked_cats": pa.array([[int(u) % 5, 3] for u in users], pa.list_(pa.int64())),
        "ad_id": pa.array(rng.integers(0, 6, n), pa.int64()),
        "price": pa.array([[float(a)] for a in rng.integers(0, 6, n)], pa.list_(pa.float32())),
        "click": pa.array(rng.integers(0, 2, n).astype(np.float32)),
        "request_id": pa.array([f"req-{seed}-{i}" if i % 7 else None for i in range(n)]),
        "row_id": pa.array(np.arange(n, dtype=np.int64) + seed * 1_000_000),
        "event_time": pa.array(1_714_564_800_000_000 + np.arange(n, dtype=np.int64) * 1001,
                               pa.int64()).cast(pa.timestamp("us", tz="UTC")),
    })
