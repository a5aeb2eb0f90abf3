"""A face's request as the service's own: tensors or columns of per-sample values turned into
the ``{"samples": [...]}`` body that :mod:`trainer.requests` scans and decodes.

    tags   = [7, 8, 9]   (values of all samples, one after another)   sample 0: [7, 8]
    tags/row_lengths = [2, 0, 1]                                     sample 1: []
                                                                     sample 2: [9]
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from json.encoder import encode_basestring

import numpy as np

from trainer.faces import ROW_LENGTHS
from trainer.requests import BadRequest, scan_request


def samples_request(columns: dict[str, list], n: int, max_samples: int):
    """Columns of per-sample JSON values (a value, or a list for a list feature) as the
    service's ``{"samples": [...]}`` body, scanned: :meth:`trainer.live.LiveModel.decode`
    decodes it as it decodes ``/v1/predict``'s bodies."""
    if n > max_samples:
        raise BadRequest(f"{n} samples in one request; the limit is {max_samples} "
                         "(--max-samples): split the request", status=413)
    if not columns:
        return scan_request(('{"samples":[' + ",".join(["{}"] * n) + "]}").encode(),
                            max_samples)
    formats, texts = [], []
    for name, values in columns.items():
        form, value_texts = _json_texts(values)
        formats.append(_DUMP(str(name)).replace("%", "%%") + ":" + form)
        texts.append(value_texts)
    template = "{" + ",".join(formats) + "}"  # a sample's object: one format, no dict
    rows = ",".join(map(template.__mod__, zip(*texts)))
    return scan_request(('{"samples":[' + rows + "]}").encode(), max_samples)


# the JSON text json.dumps writes for a value the fast forms below do not cover
_DUMP = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False,
                          separators=(",", ":"))


def _json_texts(values: list) -> tuple[str, list]:
    """A column's values as a ``%`` format and its arguments, whose text is JSON of the same
    values: at C speed (no Python call per value) for integers, finite floats and lists of
    them (``repr`` writes them as JSON does, lists with a space after each comma) and for
    strings (``json``'s own string encoder); anything else value by value, as
    ``json.dumps`` writes it."""
    kinds = set(map(type, values))
    if kinds <= {int, float} and (float not in kinds or all(map(math.isfinite, values))):
        return "%r", values
    if kinds == {str}:
        return "%s", list(map(encode_basestring, values))
    if kinds == {list}:
        inner = set(map(type, itertools.chain.from_iterable(values)))
        if inner <= {int, float} and (float not in inner or all(map(
                math.isfinite, itertools.chain.from_iterable(values)))):
            return "%r", values
    return "%s", list(map(_DUMP, values))


def tensor_columns(arrays: dict[str, np.ndarray], schema) -> tuple[dict[str, list], int]:
    """Tensors keyed by feature (the encoding of the module's doc) as columns of per-sample
    values and the number of samples; :class:`BadRequest` names the input (and the sample)."""
    features = {f.name: f for f in schema.features}
    lengths = {name[:-len(ROW_LENGTHS)]: a for name, a in arrays.items()
               if name.endswith(ROW_LENGTHS)}
    for name in lengths:
        if name not in arrays:
            raise BadRequest(f"input {name + ROW_LENGTHS!r} without the values it splits: give "
                             f"{name!r} too (all samples' values, one after another)")
    sizes = {}
    for name, a in arrays.items():
        if name.endswith(ROW_LENGTHS):
            continue
        if name in lengths:
            if lengths[name].ndim != 1:
                raise BadRequest(f"input {name + ROW_LENGTHS!r}: shape "
                                 f"{list(lengths[name].shape)}; row lengths are one count per "
                                 "sample (rank 1)")
            sizes[name] = len(lengths[name])
        elif a.ndim == 0:
            raise BadRequest(f"input {name!r}: a scalar; give one value per sample, the batch "
                             "dimension first")
        else:
            sizes[name] = a.shape[0]
    if not sizes:
        raise BadRequest("no inputs: give one tensor per feature, named by the feature")
    n = next(iter(sizes.values()))
    other = next((name for name, size in sizes.items() if size != n), None)
    if other is not None:
        first = next(iter(sizes))
        raise BadRequest(f"inputs disagree on the number of samples (their first dimension): "
                         f"{first!r} holds {n}, {other!r} holds {sizes[other]}")
    columns = {}
    for name, a in arrays.items():
        if name.endswith(ROW_LENGTHS):
            continue
        if name in lengths:
            columns[name] = _ragged(name, a, lengths[name])
            continue
        feature = features.get(name)
        if feature is not None and feature.kind == "id" and a.ndim == 2 and a.shape[1] == 1:
            a = a[:, 0]
        elif feature is not None and feature.kind == "dense" and feature.dim == 1 and \
                a.ndim == 1:
            a = a[:, None]
        if a.ndim > 2:
            raise BadRequest(f"input {name!r}: shape {list(a.shape)}; a feature is a tensor of "
                             "rank 1 (a value per sample) or 2 (a list per sample)")
        width = a.shape[1] if a.ndim == 2 else 1
        flat = _values(name, a.reshape(-1), lambda i: i // max(width, 1))
        columns[name] = flat if a.ndim == 1 else \
            [flat[i * width:(i + 1) * width] for i in range(a.shape[0])]
    return columns, n


def _ragged(name: str, values: np.ndarray, lengths: np.ndarray) -> list:
    """A ragged pair's per-sample lists."""
    label = name + ROW_LENGTHS
    if lengths.dtype.kind not in "iu":
        raise BadRequest(f"input {label!r}: integers expected (DT_INT64, INT64), got "
                         f"{lengths.dtype}")
    if values.ndim != 1:
        raise BadRequest(f"input {name!r} (with {label!r}): all samples' values one after "
                         f"another (rank 1), got shape {list(values.shape)}")
    negative = np.flatnonzero(lengths < 0) if lengths.dtype.kind == "i" else []
    if len(negative):
        raise BadRequest(f"sample {negative[0]}: input {label!r}: a negative length "
                         f"{lengths[negative[0]]}")
    if len(lengths) and lengths.max() > len(values):
        raise BadRequest(f"input {name!r}: {len(values)} values, fewer than {label!r} gives "
                         f"one sample ({lengths.max()})")
    offsets = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))])
    if offsets[-1] != len(values):
        raise BadRequest(f"input {name!r}: {len(values)} values, its {label!r} add up to "
                         f"{offsets[-1]}")
    flat = _values(name, values, lambda i: int(np.searchsorted(offsets, i, side="right")) - 1)
    bounds = offsets.tolist()
    return [flat[bounds[i]:bounds[i + 1]] for i in range(len(lengths))]


def _values(name: str, flat: np.ndarray, sample_of) -> list:
    """A rank-1 array as JSON values; ``sample_of(i)``: the sample of element i."""
    kind = flat.dtype.kind
    if kind in "iub":
        return flat.tolist()
    if kind == "f":
        bad = np.flatnonzero(~np.isfinite(flat))
        if len(bad):
            raise BadRequest(f"sample {sample_of(int(bad[0]))}: input {name!r}: "
                             f"{flat[bad[0]]} is not a finite number")
        return flat.tolist()
    if kind in "OSU":
        out = flat.tolist()
        if set(map(type, out)) <= {str}:  # JSON's strings (OIP): nothing to convert
            return out
        for i, v in enumerate(out):
            if isinstance(v, bytes):
                try:
                    out[i] = v.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise BadRequest(f"sample {sample_of(i)}: input {name!r}: not valid UTF-8 "
                                     f"({e.reason} at byte {e.start})") from None
            elif type(v) is int:  # beyond int64 (OIP JSON data): the decoder names it
                pass
            elif not isinstance(v, str):
                raise BadRequest(f"sample {sample_of(i)}: input {name!r}: expected a string, "
                                 f"got {type(v).__name__}")
        return out
    raise BadRequest(f"input {name!r}: values of type {flat.dtype} are no feature's; give "
                     "integers, floats or strings")


def input_tensors(schema) -> list[tuple[str, str, tuple]]:
    """``(tensor name, TF dtype, shape)`` of every input tensor of the schema's features."""
    out = []
    for f in schema.features:
        dtype = "DT_STRING" if f.dtype == "string" else "DT_INT64"
        if f.kind == "id":
            out.append((f.name, dtype, (-1,)))
        elif f.kind == "dense":
            out.append((f.name, "DT_FLOAT", (-1, f.dim)))
        else:
            out += [(f.name, dtype, (-1,)), (f.name + ROW_LENGTHS, "DT_INT64", (-1,))]
    return out
