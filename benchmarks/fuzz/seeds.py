"""The seeds of the kept corpus (``python -m benchmarks.fuzz --make-seeds``): valid inputs from
the project's own writers plus hand-made nasty ones, a few per target.

Seeds are written as ``seed-<what>`` files into ``tests/fuzz_corpus/<target>/`` (existing
``seed-*`` files are replaced; findings, kept as ``finding-*`` files, are left alone). The
whole corpus stays small: the largest seeds are the 100,000 nested ``[`` of the two JSON
targets (100 KB each).
"""

from __future__ import annotations

import io
import json
import os

from benchmarks.fuzz import targets as T

NESTED = 100_000


def _rows():
    """Five raw samples of the fuzz schema: two users, three ads, nulls in carried columns."""
    import datetime

    ts = datetime.datetime(2024, 5, 1, 12, 0, tzinfo=datetime.timezone.utc)
    return [
        {"uid": 1, "hist": [3, 4], "tags": ["a", "é"], "aid": "ad1", "price": [1.5, 2.0],
         "pos": 0, "click": 1.0, "conv": 0.0, "row_id": 10, "score": 0.5, "req": "r1", "ts": ts},
        {"uid": 1, "hist": [3, 4], "tags": ["a", "é"], "aid": "ad1", "price": [1.5, 2.0],
         "pos": 1, "click": 0.0, "conv": 0.0, "row_id": 11, "score": None, "req": None,
         "ts": None},
        {"uid": 1, "hist": [3, 4], "tags": ["a", "é"], "aid": "ad2", "price": [0.0, -1.0],
         "pos": 0, "click": 1.0, "conv": 1.0, "row_id": 12, "score": float("nan"), "req": "",
         "ts": ts},
        {"uid": -9, "hist": [], "tags": [], "aid": "", "price": [3.0, 4.0], "pos": 2,
         "click": 0.0, "conv": 0.0, "row_id": None, "score": -0.0, "req": "x\u0000y", "ts": ts},
        {"uid": 2**63 - 1, "hist": [-(2**63)], "tags": ["t"], "aid": "ad3",
         "price": [1e30, 1e-30], "pos": 5, "click": 0.5, "conv": 0.0, "row_id": 13,
         "score": 1e308, "req": "r5", "ts": ts},
    ]


def _raw_table():
    import pyarrow as pa

    return pa.Table.from_pylist(_rows(), schema=T.fuzz_schema().raw_arrow_schema())


def _trees():
    import compression

    return compression.build_trees(_raw_table(), T.fuzz_schema())


def _parquet_bytes(table) -> bytes:
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def _json_lines() -> list[bytes]:
    from pipelines.replay import json_lines

    return [v.as_py().encode() if isinstance(v.as_py(), str) else v.as_py()
            for v in json_lines(_raw_table(), T.fuzz_schema())]


def _csv_bytes() -> bytes:
    """The documented CSV form: lists as ``|``-separated cells, timestamps as ISO-8601."""
    import csv

    schema = T.fuzz_schema()
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(schema.raw_arrow_schema().names)
    for row in _rows():
        cells = []
        for name in schema.raw_arrow_schema().names:
            value = row[name]
            if isinstance(value, list):
                value = "|".join(str(v) for v in value)
            elif value is None:
                value = ""
            elif hasattr(value, "isoformat"):
                value = value.isoformat()
            cells.append(value)
        writer.writerow(cells)
    return out.getvalue().encode()


def _common() -> dict[str, bytes]:
    """Nasty inputs that every parser meets."""
    return {
        "empty": b"",
        "nul-bytes": b"\x00" * 64,
        "binary-junk": bytes(range(256)),
        "latin1": "café;naïve,ünïcode\n".encode("latin-1"),
    }


def seeds() -> dict[str, dict[str, bytes]]:
    """target -> {seed name -> bytes}."""
    import compression

    schema = T.fuzz_schema()
    out: dict[str, dict[str, bytes]] = {name: _common() for name in T.TARGETS}
    deep = b"[" * NESTED

    lines = _json_lines()
    out["json_decoder"].update({
        "valid": b"\n".join(lines),
        "null-lines": b"null\nnull\nnull",
        "nested-brackets": deep,
        "nested-objects": b'{"uid":' * 2000,
        "huge-numbers": lines[0].replace(b'"uid":1', b'"uid":1' + b"0" * 400)
        + b"\n" + lines[0].replace(b'"score":0.5', b'"score":1e400'),
        "types-swapped": b'{"uid":"1","hist":{},"tags":[1],"aid":2,"price":[1],"pos":[],'
                         b'"click":"1","conv":true,"row_id":1.5,"score":"x","req":3,"ts":"2024"}',
        "bad-utf8": lines[0].replace(b'"r1"', b'"r\xff\xfe"'),
        "unknown-and-repeated": lines[0][:-1] + b',"uid":2,"zzz":1}',
        "bom-and-escapes": b"\xef\xbb\xbf" + lines[0].replace(b'"aid"', b'"a\\u0069d"'),
    })

    # the prediction service's bodies: both forms, and the three of issue 39 (nested brackets,
    # a nested sample, a lone surrogate) at 10,000 levels (any depth above 64 is refused alike)
    samples = b'{"samples": [' + b", ".join(lines) + b"]}"
    user = b'{"uid": 1, "hist": [3, 4], "tags": ["a", "\\u00e9"]}'
    ranking = (b'{"root": ' + user + b', "candidates": [{"aid": "ad1", "price": [1.5, 2], '
               b'"pos": 0}, {"aid": "ad2", "price": [0, -1], "pos": 1, "click": 1}], '
               b'"trace": {"id": [1, null, true]}}')
    out["request_envelope"].update({
        "valid-samples": samples,
        "valid-ranking": ranking,
        "nested-brackets": b"[" * 10_000,
        "nested-sample": b'{"samples": [' + b"[" * 10_000 + b"]" * 10_000 + b"]}",
        "lone-surrogate": samples.replace(b'"r1"', b'"\\ud800"'),
        "int64-overflow": ranking.replace(b'"pos": 1', b'"pos": 1' + b"0" * 30),
        "bad-utf8": samples.replace(b'"r1"', b'"r\xff"'),
        "cut-short": samples[:-40],
    })

    csv_text = _csv_bytes()
    header = csv_text.split(b"\n", 1)[0] + b"\n"
    out["csv_file"].update({
        "valid": csv_text,
        "header-only": header,
        "bad-int": csv_text.replace(b"\n1,3|4", b"\nten,3|4", 1),
        "quoted-newlines": header + b'"1\n2",3,"a|b"\n',
        "latin1-cells": csv_text.replace("é".encode(), "é".encode("latin-1")),
        "ragged-rows": header + b"1,2\n1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16\n",
    })

    raw_parquet = _parquet_bytes(_raw_table())
    out["parquet_file"].update({
        "valid": raw_parquet,
        "truncated": raw_parquet[: len(raw_parquet) // 2],
        "footer-only": raw_parquet[-64:],
        "zero-rows": _parquet_bytes(_raw_table().slice(0, 0)),
        "tree-file": _parquet_bytes(_trees()),
    })

    out["jsonl_file"].update({
        "valid": b"\n".join(lines) + b"\n",
        "null-lines": b"null\nnull\n",
        "nested-brackets": deep,
        "arrays": b"[1,2]\n[]\n",
        "huge-numbers": b'{"uid": 1' + b"0" * 400 + b"}\n",
        "crlf-and-blank": b"\r\n\r\n" + lines[0] + b"\r\n",
    })

    trees = _trees()
    tree_file = _parquet_bytes(trees)
    out["tree_parquet"].update({
        "valid": tree_file,
        "truncated": tree_file[: len(tree_file) // 2],
        "raw-samples": raw_parquet,
        "zero-roots": _parquet_bytes(trees.slice(0, 0)),
        "wrong-leaf-type": _parquet_bytes(_retyped_trees(trees)),
    })

    message = compression.encode_trees(trees)
    out["tree_ipc"].update({
        "valid": message,
        "truncated": message[: len(message) * 2 // 3],
        "raw-samples": compression.encode_trees(_raw_table()),
        "schema-only": compression.encode_trees(trees.slice(0, 0)),
        "wrong-leaf-type": compression.encode_trees(_retyped_trees(trees)),
    })

    _, snapshot, delta = T.store_base()
    for name, blob in (("store_snapshot", snapshot), ("store_rebase", snapshot),
                       ("store_delta", delta)):
        body = blob[:-T.TRAILER_BYTES]
        out[name].update({
            "valid-as-is": b"\x00" + blob,
            "valid-sealed": b"\x01" + body,
            "truncated-sealed": b"\x01" + body[: len(body) // 2],
            "header-only-sealed": b"\x01" + body[:12],
        })
    qdir, qsnapshot, qdelta = T.quantized_base()
    for name, blob in (("quantized_snapshot", qsnapshot), ("quantized_delta", qdelta)):
        body = blob[:-T.TRAILER_BYTES]
        out[name].update({
            "valid-as-is": b"\x00" + blob,
            "valid-sealed": b"\x01" + body,
            "truncated-sealed": b"\x01" + body[: len(body) // 2],
            "header-only-sealed": b"\x01" + body[:20],
        })
    out["quantized_snapshot"].update(_quantized_snapshots())
    out["store_snapshot"]["bloom-filter-sealed"] = b"\x01" + _bloom_snapshot()[:-T.TRAILER_BYTES]
    out["store_rebase"]["bloom-filter-sealed"] = out["store_snapshot"]["bloom-filter-sealed"]

    _, _, files, _ = T.checkpoint_base()
    state = files["trainer.json"]
    out["checkpoint"].update({
        "valid-trainer-json": b"\x00" + state,
        "valid-trainer-json-sealed": b"\x01" + state,
        "valid-dense-npz": b"\x02" + files["dense.npz"],
        "valid-state-json": b"\x03" + files["state.json"],
        "sealed-null": b"\x01null",
        "sealed-empty-object": b"\x01{}",
        "sealed-nested": b"\x01" + b"[" * 10_000,
        "dense-truncated": b"\x02" + files["dense.npz"][:200],
    })
    sealed_state = json.loads(state)
    sealed_state["variables"] = 5
    out["checkpoint"]["sealed-variables-not-a-list"] = b"\x01" + json.dumps(sealed_state).encode()

    with open(os.path.join(T.ROOT, "schemas", "examples", "with_row_ids.yaml"), "rb") as f:
        example = f.read()
    out["schema_yaml"].update({
        "valid-example": example,
        "valid-fuzz": schema.to_yaml().encode(),
        "nested-flow": b"[" * 10_000,
        "anchors": b"a: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\n",
        "wrong-types": b"name: 3\nlayers: {a: 1}\nlabels: [[1]]\n",
        "feature-dim-huge": example.replace(b"kind: dense, dim: 1", b"kind: dense, dim: 1e999"),
        "tabs-and-bom": b"\xef\xbb\xbf\tname: x\n",
    })
    with open(os.path.join(T.ROOT, "trainer", "examples", "mlp.yaml"), "rb") as f:
        mlp = f.read()
    out["config_yaml"].update({
        "mlp-example": mlp,  # names taobao_like's features: refused against the fuzz schema
        "valid-fuzz": b"batch_size: 64\nembedding: {dim: 4, optimizer: {name: adam, lr: 0.01},"
                      b" filter: {name: counter, min_count: 2}}\nfeatures:\n"
                      b"  hist: {table: uid, pooling: sum}\n  tags: {pooling: mean}\n"
                      b"tables: {uid: {dim: 8}}\ndense: {price: {transform: log1p}}\n",
        "nested-flow": b"{a: " * 5_000,
        "wrong-types": b"batch_size: [1]\nembedding: 3\nfeatures: [a]\ntables: x\n",
        "numbers": b"batch_size: 1e999\nseed: -0x10\nembedding: {dim: .inf, l2: .nan}\n",
        "function-spec": b"embedding: {expire: {every_steps: 1, function: 'no_module:fn'}}\n",
    })
    out["serve_request"].update(_serve_seeds())
    return out


def _serve_seeds() -> dict[str, bytes]:
    """Requests to the prediction service, encoded as ``targets.serve_request_bytes`` reads
    them (the first byte picks raw HTTP bytes, a body, a generated body or extra headers
    plus a body, and the framing); valid flat and ranking requests of ``SERVE_SCHEMA``."""
    body, repeat, headers = 1, 2, 3  # what the rest is
    chunked, cut, half_close, no_type, text, latin1, expect = 4, 8, 16, 32, 64, 96, 128
    flat = json.dumps({"samples": [
        {"uid": 1, "city": "paris", "aid": 3, "tags": ["a", "é"], "price": [1.5]},
        {"uid": 9, "city": "", "aid": 99, "tags": [], "price": [0.0]}]}).encode()
    ranking = json.dumps({"root": {"uid": 1, "city": "lyon"}, "candidates": [
        {"aid": 1, "tags": ["b"], "price": [2.0]}, {"aid": 4, "tags": [], "price": [1.0]},
        {"aid": 5, "tags": ["a", "b"], "price": [-3.0]}]}).encode()

    def raw(*requests: bytes) -> bytes:
        return b"\x00" + b"".join(requests)

    def generated(n: int, *parts: bytes) -> bytes:
        return bytes([repeat]) + n.to_bytes(3, "big") + b"\0".join(parts)

    def post(head: bytes, payload: bytes = b"") -> bytes:
        return b"POST /v1/predict HTTP/1.1\r\nHost: fuzz\r\n" + head + b"\r\n" + payload

    def get(path: bytes, head: bytes = b"") -> bytes:
        return b"GET " + path + b" HTTP/1.1\r\nHost: fuzz\r\n" + head + b"\r\n"

    length = b"Content-Length: %d\r\n" % len(flat)
    return {
        "valid-flat": bytes([body]) + flat,
        "valid-ranking": bytes([body]) + ranking,
        "valid-ranking-chunked": bytes([body | chunked]) + ranking,
        "valid-expect-continue": bytes([body | expect]) + ranking,
        "valid-pipelined": raw(get(b"/livez"), post(length, flat),
                               b"HEAD /readyz HTTP/1.1\r\nHost: fuzz\r\n\r\n",
                               get(b"/v1/model"), get(b"/metrics")),
        "valid-connection-close": bytes([headers]) + b"Connection: close\0" + ranking,
        "valid-http10": raw(b"POST /v1/predict HTTP/1.0\r\nContent-Length: %d\r\n\r\n"
                            % len(ranking) + ranking),
        "text-plain": bytes([body | text]) + flat,
        "no-content-type": bytes([body | no_type]) + ranking,
        "nested-brackets": generated(100_000, b"", b"["),
        "nested-samples": generated(50_000, b'{"samples": ', b"[", b"]", b"}"),
        "lone-surrogate": bytes([body]) + flat.replace(b'"paris"', b'"\\ud800"'),
        "lone-surrogate-root": bytes([body]) + ranking.replace(b'"lyon"', b'"\\udfff"'),
        "non-utf8": bytes([body]) + flat.replace(b'"paris"', b'"p\xe4ris"'),
        "latin1-declared": bytes([body | latin1]) + flat.replace(b'"paris"', b'"p\xe4ris"'),
        "utf16": bytes([body]) + flat.decode().encode("utf-16"),
        "too-many-samples": generated(10_000, b'{"samples": [', b'{"uid": 1},', b"",
                                      b'{"uid": 2}]}'),
        "truncated": bytes([body | cut]) + flat,
        "truncated-chunked": bytes([body | chunked | cut]) + ranking,
        "truncated-after-continue": bytes([body | expect | cut]) + ranking,
        "half-close": bytes([body | half_close]) + flat,
        "content-length-short": raw(post(b"Content-Length: 10\r\n", flat)),
        "content-length-long": raw(post(b"Content-Length: 1000\r\n", flat)),
        "content-length-negative": raw(post(b"Content-Length: -1\r\n", flat)),
        "content-length-huge": raw(post(b"Content-Length: 17000000\r\n", flat)),
        "content-length-twice": raw(post(length + b"Content-Length: 5\r\n", flat)),
        "content-length-and-chunked": raw(post(length + b"Transfer-Encoding: chunked\r\n",
                                               flat)),
        "chunk-size-bad": raw(post(b"Transfer-Encoding: chunked\r\n",
                                   b"zz\r\n{}\r\n0\r\n\r\n")),
        "chunk-size-huge": raw(post(b"Transfer-Encoding: chunked\r\n",
                                    b"fffffffffffffffff\r\n{}\r\n")),
        "get-predict": raw(get(b"/v1/predict")),
        "unknown-path": raw(get(b"/v1/model%ff/../x?q=%00")),
        "bad-request-line": raw(b"GET\r\n\r\n"),
        "header-obs-text": raw(get(b"/livez", b"X-Name: caf\xe9\r\n")),
        "forwarded-for": bytes([headers]) + b"X-Forwarded-For: \xff, 1.2.3.4\r\n"
                         b"X-Forwarded-Proto: gopher\0" + flat,
        "upgrade-websocket": raw(get(b"/livez", b"Connection: Upgrade\r\n"
                                               b"Upgrade: websocket\r\n")),
    }


def _retyped_trees(trees):
    """``trees`` with the leaves' label ``click`` as a string column: a tree table of another
    schema than the one it is read with."""
    import pyarrow as pa

    ads = trees.column("ad").combine_chunks()
    ad_nodes = ads.values
    samples = ad_nodes.field("sample")
    leaves = samples.values
    fields = [leaves.type.field(i) for i in range(leaves.type.num_fields)]
    arrays = [leaves.field(i) for i in range(leaves.type.num_fields)]
    index = [f.name for f in fields].index("click")
    arrays[index] = arrays[index].cast(pa.string())
    fields[index] = pa.field("click", pa.string())
    new_samples = pa.ListArray.from_arrays(samples.offsets, pa.StructArray.from_arrays(
        arrays, fields=fields))
    ad_fields = [ad_nodes.type.field(i) for i in range(ad_nodes.type.num_fields)]
    ad_arrays = [ad_nodes.field(i) for i in range(ad_nodes.type.num_fields)]
    ad_arrays[-1] = new_samples
    ad_fields[-1] = pa.field("sample", new_samples.type)
    new_ads = pa.ListArray.from_arrays(ads.offsets, pa.StructArray.from_arrays(
        ad_arrays, fields=ad_fields))
    return trees.set_column(trees.column_names.index("ad"), "ad", new_ads)


def _quantized_snapshots() -> dict[str, bytes]:
    """The base snapshot as float16 and int4 too, sealed bodies."""
    from native import quantized

    base, _, _ = T.store_base()
    out = {}
    for export_format in ("float16", "int4"):
        path = os.path.join(T.workdir(), f"seed-{export_format}", quantized.SNAPSHOT_FILE)
        quantized.quantize_snapshot(base, path, export_format)
        with open(path, "rb") as f:
            out[f"valid-{export_format}-sealed"] = b"\x01" + f.read()[:-T.TRAILER_BYTES]
    return out


def _bloom_snapshot() -> bytes:
    import native

    store = native.EmbeddingStore(T._store_config(1))
    T.train_store(store, range(1, 3))
    path = store.save(os.path.join(T.workdir(), "store-bloom"))
    with open(path, "rb") as f:
        return f.read()


def write_seeds(corpus_dir: str = T.CORPUS_DIR, only=None) -> dict[str, int]:
    """Write the seeds into ``corpus_dir/<target>/seed-<name>``; returns target -> count."""
    counts = {}
    for target, named in seeds().items():
        if only and target not in only:
            continue
        directory = os.path.join(corpus_dir, target)
        os.makedirs(directory, exist_ok=True)
        for old in os.listdir(directory):
            if old.startswith("seed-"):
                os.remove(os.path.join(directory, old))
        for name, blob in named.items():
            with open(os.path.join(directory, f"seed-{name}"), "wb") as f:
                f.write(blob)
        counts[target] = len(named)
    return counts
