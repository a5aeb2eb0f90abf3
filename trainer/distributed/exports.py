"""Serving exports of a sharded run: the dense SavedModel built from worker 0's weights and
every shard's snapshot (and deltas) of every table, kept per shard."""

from __future__ import annotations

import os

import ray

from trainer import models as models_lib
from trainer.distributed.manifest import PLACEMENT


def serving_core(schema, model, config, dense_arrays: dict):
    """A :class:`~trainer.model_core.ModelCore` holding ``dense_arrays`` (a worker's
    ``dense.npz`` arrays) for ``model`` (a built-in DenseNet's spec or a function returning a
    fresh DenseNet): what :mod:`trainer.serving` builds the SavedModel from."""
    from trainer.model_core import ModelCore

    net = models_lib.from_spec(model) if isinstance(model, dict) else model()
    core = ModelCore(schema, net, config)
    core.set_dense_arrays(dense_arrays, optimizer=False)
    return core


def export(core, shards: list, directory, step: int) -> str:
    """A serving export of ``core`` (:func:`serving_core`) with every shard's snapshot of
    every table (``stores/<table>/shard-NNNN``), written from the shard actors' processes."""
    from trainer import serving

    def write_stores(tmp):
        ray.get([s.snapshot.remote(os.path.join(tmp, "stores")) for s in shards])
        return {"shards": len(shards), "placement": PLACEMENT}

    return serving.export(core, directory, step=step, write_stores=write_stores)


def export_delta(shards: list, directory) -> dict:
    """Every shard's delta of every table (``directory/<table>/shard-NNNN/delta-MMMMMM.bin``):
    ``{table: [path per shard]}``."""
    directory = os.path.abspath(os.fspath(directory))
    per_shard = ray.get([s.export_delta.remote(directory) for s in shards])
    return {table: [paths[table] for paths in per_shard] for table in per_shard[0]}
