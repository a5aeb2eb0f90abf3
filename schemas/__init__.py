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

``schemas.load(path)`` validates it up front and returns a frozen :class:`Schema`.
"""

from schemas.hashing import stable_hash, stable_hash_strings
from schemas.schema import (
    Feature,
    KINDS,
    Layer,
    MAX_LAYERS,
    Schema,
    SchemaError,
    from_arrow_metadata,
    from_dict,
    load,
)

__all__ = [
    "Feature",
    "KINDS",
    "Layer",
    "MAX_LAYERS",
    "Schema",
    "SchemaError",
    "from_arrow_metadata",
    "from_dict",
    "load",
    "stable_hash",
    "stable_hash_strings",
]
