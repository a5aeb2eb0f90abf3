"""The sample schema: layers of a multi-prefix tree, their features, and the labels.

A schema is a YAML file (see ``schemas/examples/taobao_like.yaml``)::

    name: taobao_like
    layers:                         # root first, leaves last; 1 to 4 layers
      - name: user
        key: [user_id]
        features:
          - {name: user_id, kind: id}
          - {name: clicked_cats, kind: ids}
      - name: ad
        key: [ad_id]
        features:
          - {name: ad_id, kind: id, dtype: string}
          - {name: price, kind: dense, dim: 1}
    labels: [click]

An ``ids`` feature may be an ordered behaviour sequence, oldest first (``sequence: true``), keep
only its most recent items (``sequence: {max_length: 50}``) or be ordered by a time column of
the same layer (``sequence: {time: clicked_times}``); sequence models (DIEN) read its order.

The leaf layer may also list ``carried: [{name: request_id, dtype: string}]``: columns that
travel with every sample (row ids, timestamps) but are never trained.

``schemas.load(path)`` validates it up front and returns a frozen :class:`Schema`.
"""

from schemas.hashing import stable_hash, stable_hash_strings
from schemas.schema import (
    CARRIED_DTYPES,
    Carried,
    Feature,
    KINDS,
    Layer,
    MAX_LAYERS,
    Schema,
    SchemaError,
    Sequence,
    from_arrow_metadata,
    from_dict,
    load,
)

__all__ = [
    "CARRIED_DTYPES",
    "Carried",
    "Feature",
    "KINDS",
    "Layer",
    "MAX_LAYERS",
    "Schema",
    "SchemaError",
    "Sequence",
    "from_arrow_metadata",
    "from_dict",
    "load",
    "stable_hash",
    "stable_hash_strings",
]
