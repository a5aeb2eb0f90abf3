"""Lossless multi-prefix-tree compression of flat samples, and the batches the trainer reads.

    trees = compression.build_trees(table, schema)        # flat samples -> nested tree table
    flat = compression.flatten(trees, schema)             # and back (same multiset of rows)
    for batch in compression.iter_batches(trees, schema, batch_size=5000):
        batch.layers[1].parent                            # indicator: ad node -> user node

Pure pyarrow/numpy (and ``native``'s JSON decoder, for Kafka messages): importable anywhere
(Beam workers, the trainer, notebooks). Kafka clients live in ``compression.kafka``, imported
only by the code that talks to a broker.
"""

from compression.batches import LayerBatch, TreeBatch, iter_batches
from compression.io import (
    RawChunk,
    TreeMessageDecoder,
    decode_trees,
    encode_trees,
    expand_paths,
    iter_raw_chunks,
    iter_trees,
    raw_format,
    read_raw,
    read_trees,
    write_trees,
)
from compression.messages import DeadLetter, dead_letter_topic, decode_json_samples
from compression.stats import TreeStats
from compression.trees import (
    ROOT_NODE,
    LayerNodes,
    build_trees,
    concat_roots,
    flat_layers,
    flatten,
    split_roots,
)
from compression.validate import (RawDataError, conform_columns, split_bad_rows, validate_features,
                                  validate_raw)

__all__ = [
    "ROOT_NODE",
    "LayerBatch",
    "LayerNodes",
    "RawChunk",
    "TreeBatch",
    "TreeStats",
    "DeadLetter",
    "dead_letter_topic",
    "decode_json_samples",
    "TreeMessageDecoder",
    "decode_trees",
    "encode_trees",
    "expand_paths",
    "iter_batches",
    "iter_raw_chunks",
    "iter_trees",
    "raw_format",
    "read_raw",
    "read_trees",
    "write_trees",
    "RawDataError",
    "build_trees",
    "concat_roots",
    "conform_columns",
    "flat_layers",
    "flatten",
    "split_bad_rows",
    "split_roots",
    "validate_features",
    "validate_raw",
]
