"""A request of the prediction service, decoded from its body by the project's native JSON decoders.

    request = scan_request(body, max_samples=10_000)   # the JSON, schema-free: 400 / 413
    decoded = decode_request(request, schema)           # pa.Table (samples) or TreeRequest

Two forms (``trainer.serve``): ``{"samples": [{...}, ...]}``, raw samples, each scored as its
own tree, and ``{"root": {...}, "candidates": [{...}, ...]}``, a ranking request: the root
layer's features once, each candidate the features of the layers below.

:func:`scan_request` validates the whole body in C++ (:func:`native.scan_envelope`: no
recursion, at most :data:`MAX_DEPTH` nested arrays and objects, valid UTF-8, no lone surrogate
escapes) and finds the byte spans of the root and of every sample or candidate. Then
:func:`decode_request` hands those spans to the JSON sample decoder that reads files and Kafka
messages (``native.JsonSampleDecoder``, over the schema's feature columns: the root's layer for
the root, the layers below for the candidates), which builds the Arrow columns without a Python
loop over the samples. So a sample is refused in the words a JSON-lines file or a Kafka message
holding it would get (unknown fields, a value of the wrong type, an integer beyond int64, a
string with invalid UTF-8 or a lone surrogate: each names its field), prefixed by its place in
the request: ``sample 3: not a valid sample: field 'uid': expected an integer ...``. Labels may
be given and are ignored (a number in [0, 1] or null); so are the schema's carried columns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from compression import LayerBatch, TreeBatch
from compression.batches import feature_array
from compression.messages import MESSAGE_INDEX, decoded_table, json_columns
from native.json_envelope import DEFAULT_MAX_DEPTH, MalformedJsonError, scan_envelope
from native.json_samples import MAX_MESSAGE_BYTES_LIMIT, JsonColumn, JsonSampleDecoder

MAX_SAMPLES = 10_000
MAX_DEPTH = DEFAULT_MAX_DEPTH  # a valid request nests 4 deep: body, samples, sample, list
MEMBERS = ("samples", "root", "candidates")
FORMS = '{"samples": [...]} or {"root": {...}, "candidates": [...]}'


class BadRequest(ValueError):
    """A request the service refuses: HTTP ``status`` and a message naming what to fix."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RequestBody:
    """A request body whose JSON is valid: its form (``"samples"`` or ``"tree"``) and the byte
    spans of its samples (the candidates of a tree request) and of its root."""

    body: bytes
    kind: str
    starts: np.ndarray  # int64: body[starts[i]:ends[i]] is sample (candidate) i
    ends: np.ndarray
    root: tuple[int, int] | None = None  # a tree request's root object

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def item(self) -> str:
        """What one of its samples is called in messages."""
        return "sample" if self.kind == "samples" else "candidate"


def scan_request(body: bytes, max_samples: int = MAX_SAMPLES) -> RequestBody:
    """The body's form and spans; :class:`BadRequest` (400, or 413 above ``max_samples``
    samples) for malformed JSON or a body of neither form. A syntax error inside a sample is
    named as :func:`decode_request` names a sample's other problems."""
    body = body if isinstance(body, bytes) else bytes(body)
    try:
        envelope = scan_envelope(body, MEMBERS, max_depth=MAX_DEPTH, max_elements=max_samples)
    except MalformedJsonError as e:
        raise BadRequest(malformed_message(e)) from None
    if not envelope.is_object:
        raise BadRequest(f"the body must be a JSON object: {FORMS}")
    members = envelope.members
    if "samples" in members and ("root" in members or "candidates" in members):
        raise BadRequest('give either "samples" or "root" + "candidates", not both')
    if "samples" in members:
        kind, name = "samples", "samples"
    elif "candidates" in members:
        kind, name = "tree", "candidates"
        root = members.get("root")
        if root is None or body[root.start:root.start + 1] != b"{":
            raise BadRequest('"root" must be an object holding the root layer\'s features')
    else:
        raise BadRequest('no "samples" (or "root" + "candidates") in the request')
    items = members[name]
    if not items.is_array:
        raise BadRequest(f'"{name}" must be a list of objects')
    if items.count == 0:
        raise BadRequest(f'"{name}" is empty: nothing to score')
    if items.count > max_samples:
        raise BadRequest(f"{items.count} {name} in one request; the limit is {max_samples} "
                         "(--max-samples): split the request", status=413)
    root = members.get("root") if kind == "tree" else None
    return RequestBody(body, kind, items.starts, items.ends,
                       None if root is None else (root.start, root.end))


def malformed_message(e: MalformedJsonError, items: dict | None = None) -> str:
    """A scan refusal's message: inside a sample (candidate, the root), the sample decoder's
    reason for it, named by its place; elsewhere, where the body's JSON breaks. ``items``:
    the members that list samples and what one is called (default: samples and candidates)."""
    items = items or {"samples": "sample", "candidates": "candidate"}
    if e.message is not None and not e.at_end and (
            (e.member in items and e.element >= 0) or
            (e.member == "root" and e.element < 0)):
        place = "root" if e.member == "root" else f"{items[e.member]} {e.element}"
        if e.too_deep:
            return f"{place}: {e.what} at byte {e.offset - e.message}; the service reads at " \
                   f"most {MAX_DEPTH} levels"
        return f"{place}: {e.reason}"
    return f"malformed JSON: {e}"


@dataclass
class TreeRequest:
    """A ranking request, validated: the root layer's features once, the layers below one row
    per candidate."""

    root: pa.Table        # one row: the root layer's columns
    candidates: pa.Table  # the lower layers' columns

    def __len__(self) -> int:
        return self.candidates.num_rows

    def batch(self, schema, start: int, stop: int) -> TreeBatch:
        """Candidates ``start:stop`` as one tree: the root once, every candidate a node under
        it (and one node per candidate in each layer further down)."""
        n = max(0, min(stop, len(self)) - start)
        rows = self.candidates.slice(start, n)
        identity = np.arange(n, dtype=np.int32)
        layers = []
        for level, layer in enumerate(schema.layers):
            source = self.root if level == 0 else rows
            size = 1 if level == 0 else n
            parent = None if level == 0 else np.zeros(n, np.int32) if level == 1 else identity
            layers.append(LayerBatch(layer.name, size, parent, {
                f.name: feature_array(source.column(f.name), f) for f in layer.features}))
        return TreeBatch(layers, {label: np.zeros(n, np.float32) for label in schema.labels})


def decode_request(request: RequestBody, schema) -> pa.Table | TreeRequest:
    """The request's samples in ``schema``'s raw types: a Table of every feature plus zero
    labels (the samples form), or a :class:`TreeRequest`. :class:`BadRequest` names the first
    refused sample (candidate, the root) and its field, in the sample decoder's words."""
    parts = _parts(schema)
    if request.kind == "samples":
        table = _decode(request, parts.samples, request.starts, request.ends)
        features = [table.column(f.name) for f in schema.features]
        zeros = pa.array(np.zeros(table.num_rows, np.float32))
        return pa.Table.from_arrays(features + [zeros] * len(schema.labels),
                                    schema=_flat_schema(schema))
    if parts.root is None:
        raise BadRequest(f"the schema {schema.name!r} has one layer: there is nothing to rank "
                         'under a root; send {"samples": [...]}')
    start, end = request.root
    root = _decode(request, parts.root, np.array([start]), np.array([end]), root=True)
    candidates = _decode(request, parts.candidates, request.starts, request.ends)
    return TreeRequest(root.select(parts.root.names), candidates.select(parts.candidates.names))


@dataclass(frozen=True)
class _Part:
    """The decoder of one part of a request and what its columns are."""

    decoder: JsonSampleDecoder
    arrow: pa.Schema
    names: list[str]             # its feature columns
    labels: list[str]            # labels read (and ignored) with it
    elsewhere: dict[str, str]    # fields that belong to the other part -> what to say


@dataclass(frozen=True)
class _Parts:
    """The decoders of a schema's requests (a one-layer schema has no tree form)."""

    samples: _Part
    root: _Part | None
    candidates: _Part | None


def _flat_schema(schema) -> pa.Schema:
    """Every feature in its raw type, then the labels as float32."""
    raw = schema.raw_arrow_schema()
    return pa.schema([raw.field(f.name) for f in schema.features] +
                     [pa.field(label, pa.float32()) for label in schema.labels])


@functools.lru_cache(maxsize=16)
def _parts(schema) -> _Parts:
    raw = schema.raw_arrow_schema()
    columns = {c.name: c for c in json_columns(schema)}

    def part(features, extras=True, elsewhere=None) -> _Part:
        names = [f.name for f in features]
        cols = [columns[n] for n in names]
        fields = [raw.field(n) for n in names]
        labels = list(schema.labels) if extras else []
        # labels and carried columns may come with a sample: read (labels checked) and ignored
        cols += [JsonColumn(label, "carried", dtype="float64") for label in labels]
        fields += [pa.field(label, pa.float64()) for label in labels]
        if extras:
            cols += [columns[c.name] for c in schema.carried]
            fields += [raw.field(c.name) for c in schema.carried]
        # a sample is as big as the body lets it be (the body's limit is the service's)
        return _Part(JsonSampleDecoder(cols, MAX_MESSAGE_BYTES_LIMIT), pa.schema(fields), names,
                     labels, elsewhere or {})

    samples = part(schema.features)
    if len(schema.layers) < 2:
        return _Parts(samples, None, None)
    top = schema.layers[0]
    below = [f for layer in schema.layers[1:] for f in layer.features]
    root_names = ", ".join(f.name for f in top.features)
    root = part(top.features, extras=False, elsewhere={
        **{f.name: f"{f.name!r} is not a feature of the root layer {top.name!r} "
                   f"({root_names}); give the other layers' features in each candidate"
           for f in below},
        **{n: f"{n!r} is not a feature of the root layer {top.name!r} ({root_names}); give it "
              "with each candidate" for n in (*schema.labels, *schema.carried_names)}})
    candidates = part(below, elsewhere={
        f.name: f"{f.name!r} is a feature of the root layer {top.name!r}; give it once, in "
                "the request's root" for f in top.features})
    return _Parts(samples, root, candidates)


def _decode(request: RequestBody, part: _Part, starts, ends, root: bool = False) -> pa.Table:
    """The part's samples at ``starts``/``ends`` decoded; refusals raise :class:`BadRequest`."""
    out = part.decoder.decode_spans(request.body, starts, ends)
    table = decoded_table(out, part.decoder.columns, part.arrow)
    rejected = out.rejected_index.tolist()
    refused = [(rejected[0], out.rejected_reason[0])] if rejected else []
    refused = sorted(refused + _label_refusals(table, part))  # the first sample's problem
    if refused:
        i, reason = refused[0]
        if rejected and i == rejected[0]:
            reason = _elsewhere(request.body, int(starts[i]), int(ends[i]), part) or reason
        more = f" ({len(rejected) - 1} more {request.item}s refused)" if len(rejected) > 1 \
            else ""
        raise BadRequest(f"{'root' if root else f'{request.item} {i}'}: {reason}{more}")
    return table.drop_columns([MESSAGE_INDEX])


def _label_refusals(table: pa.Table, part: _Part) -> list[tuple[int, str]]:
    """The first sample with a label outside [0, 1] (a null one is no label), as the sample
    decoder's row check words it, for each label."""
    found = []
    for label in part.labels:
        column = table.column(label)
        if column.null_count == len(column):  # no label given (what a request sends)
            continue
        values = column.to_numpy(zero_copy_only=False)  # nulls read as NaN
        given = ~column.is_null().to_numpy(zero_copy_only=False)
        with np.errstate(invalid="ignore"):
            bad = np.flatnonzero(given & ~((values >= 0) & (values <= 1)))
        if len(bad):
            message = int(table.column(MESSAGE_INDEX)[int(bad[0])].as_py())
            found.append((message, f"label {label!r}: value out of range, labels must be in "
                                   "[0, 1]"))
    return found


def _elsewhere(body: bytes, start: int, end: int, part: _Part) -> str | None:
    """For a refused sample holding a feature of the request's other part: the message that
    says where to give it (else None: the decoder's reason stands)."""
    if not part.elsewhere:
        return None
    try:
        found = scan_envelope(body[start:end], list(part.elsewhere)).members
    except MalformedJsonError:  # one of those fields given twice: the decoder's reason stands
        return None
    name = next((n for n in part.elsewhere if n in found), None)
    return None if name is None else part.elsewhere[name]
