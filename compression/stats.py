"""Compression statistics of tree tables: samples, trees, nodes per layer, ids flat vs in trees."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from compression.trees import flat_layers
from schemas import Schema


class TreeStats:
    """Accumulates statistics over tree tables (one file or shard at a time) and summarises.

    ``ids_flat`` counts the ids a flat copy of the samples holds (every feature of every layer
    repeated on every sample); ``ids_in_trees`` counts the ids the trees hold (each node's own
    features once). Their ratio is how much the trees save on sparse features, the thing the
    trainer's embedding lookups scale with.
    """

    def __init__(self, schema: Schema):
        self.schema = schema
        self.nodes = [0] * len(schema.layers)
        self.ids_flat = 0
        self.ids_in_trees = 0
        self.values_flat = 0
        self.values_in_trees = 0
        self.bytes_on_disk = 0
        self._per_root: list[np.ndarray] = []

    def add(self, trees: pa.Table) -> "TreeStats":
        if trees.num_rows == 0:
            return self
        layers = flat_layers(trees, self.schema)
        # leaves under every node, from the leaves up
        under = np.ones(len(layers[-1]), np.int64)
        counts = [None] * len(layers)
        counts[-1] = under
        for level in range(len(layers) - 1, 0, -1):
            under = np.bincount(layers[level].parent, weights=under,
                                minlength=len(layers[level - 1])).astype(np.int64)
            counts[level - 1] = under
        for level, (layer, nodes) in enumerate(zip(self.schema.layers, layers)):
            self.nodes[level] += len(nodes)
            for f in layer.features:
                column = nodes.columns[f.name]
                if f.kind == "id":
                    own_ids = np.ones(len(nodes), np.int64)
                    own_values = own_ids
                else:
                    offsets = column.offsets.to_numpy()
                    own_values = np.diff(offsets).astype(np.int64)
                    own_ids = own_values if f.kind == "ids" else np.zeros(len(nodes), np.int64)
                self.ids_in_trees += int(own_ids.sum())
                self.ids_flat += int(own_ids @ counts[level])
                self.values_in_trees += int(own_values.sum())
                self.values_flat += int(own_values @ counts[level])
        self._per_root.append(counts[0])
        return self

    def merge(self, other: "TreeStats") -> "TreeStats":
        self.nodes = [a + b for a, b in zip(self.nodes, other.nodes)]
        for name in ("ids_flat", "ids_in_trees", "values_flat", "values_in_trees",
                     "bytes_on_disk"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._per_root.extend(other._per_root)
        return self

    def summary(self) -> dict:
        per_root = (np.concatenate(self._per_root) if self._per_root
                    else np.zeros(0, np.int64))
        samples = int(per_root.sum())

        def pct(q):
            return float(np.percentile(per_root, q)) if len(per_root) else 0.0

        out = {
            "schema": self.schema.name,
            "samples": samples,
            "trees": int(len(per_root)),
            "nodes": {layer.name: int(n) for layer, n in zip(self.schema.layers, self.nodes)},
            "samples_per_root": {
                "mean": float(per_root.mean()) if len(per_root) else 0.0,
                "p50": pct(50), "p99": pct(99), "max": int(per_root.max()) if len(per_root) else 0,
            },
            "ids_flat": self.ids_flat,
            "ids_in_trees": self.ids_in_trees,
            "id_compression_ratio": (self.ids_flat / self.ids_in_trees
                                     if self.ids_in_trees else 1.0),
            "values_flat": self.values_flat,
            "values_in_trees": self.values_in_trees,
        }
        if self.bytes_on_disk:
            out["bytes_on_disk"] = self.bytes_on_disk
        return out


def format_summary(summary: dict) -> str:
    """The human-readable table ``python -m compression.inspect`` prints."""
    spr = summary["samples_per_root"]
    lines = [
        f"schema                {summary['schema']}",
        f"samples               {summary['samples']:,}",
        f"trees (root nodes)    {summary['trees']:,}",
    ]
    for name, count in summary["nodes"].items():
        lines.append(f"  {name + ' nodes':<20}{count:,}")
    lines += [
        f"samples per root      mean {spr['mean']:.1f}  p50 {spr['p50']:.0f}  "
        f"p99 {spr['p99']:.0f}  max {spr['max']:,}",
        f"ids stored flat       {summary['ids_flat']:,}",
        f"ids stored in trees   {summary['ids_in_trees']:,}",
        f"compression ratio     {summary['id_compression_ratio']:.2f}x fewer ids",
    ]
    if "bytes_on_disk" in summary:
        lines.append(f"bytes on disk         {summary['bytes_on_disk']:,} "
                     f"({summary['bytes_on_disk'] / max(summary['samples'], 1):.1f} per sample)")
    return "\n".join(lines)
