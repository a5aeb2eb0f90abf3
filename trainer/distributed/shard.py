"""The store shard actor: one native store per table holding the ids the shard owns.

A module-level class that Ray pickles by reference: a shard process imports numpy, ``native``,
``schemas`` and this package's TensorFlow-free modules only, never TensorFlow
(``tests/test_layering.py`` checks it).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import math
import os
import shutil
import tempfile
import time

import numpy as np

import native
from trainer import tiers
from trainer.config import row_l2
from trainer.distributed.placement import id_shards

RESTARTED = "prefixrec: actor restarted"


def reconstructed() -> bool:
    """Whether this process is a Ray actor that Ray restarted after its process died."""
    try:
        import ray

        context = ray.get_runtime_context()
        return context.get_actor_id() is not None and bool(context.was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - not in a Ray actor (tests use the classes directly)
        return False


def held_key(table: str) -> str:
    """The key of a lookup's answer that says which of ``table``'s ids have a row (a table
    with a cold table); no table name has a colon."""
    return f"{table}:held"


def table_specs(config, tables, shards: int, tier_dir: str | None = None) -> dict:
    """What a :class:`Shard` of ``shards`` takes for every table of ``config`` (a
    TrainConfig): its store config (a table's ``max_rows`` and memory budget split over the
    shards; the disk tier under ``tier_dir/<table>``, each shard in its own ``shard-NNNN``
    there), row L2 and expiry."""
    specs = {}
    stores = config.store_configs(tables, tier_dir, shards)
    for table in tables:
        tc = config.table(table)
        store = stores[table]
        if tc.max_rows is not None and shards > 1:
            store = dataclasses.replace(store, max_rows=math.ceil(tc.max_rows / shards))
        expire = tc.expire
        specs[table] = {"store": store,
                        # a table with a cold table: its lookups also say which ids have a row
                        # (trainer/compact.py), the worker routes the others to their buckets
                        "cold": tc.cold_buckets is not None,
                        "l2": tc.l2,
                        "expire": None if expire is None else {
                            "every_steps": expire.every_steps,
                            "max_idle_steps": expire.max_idle_steps,
                            "max_idle_seconds": expire.max_idle_seconds,
                            "function": expire.function}}
    return specs


class Shard:
    """One shard of every table: ``stores[table]`` holds the ids ``i`` with
    ``id_shards(i, shards) == index``."""

    def __init__(self, index: int, shards: int, tables: dict, restore=None):
        """``restore``: None (empty stores), ``(snapshot dir,)`` (this shard's own
        snapshots) or a list of several: the snapshots of a checkpoint with another
        number of shards, of which this shard keeps its own ids (resharding)."""
        self.index, self.shards = index, shards
        self.tables = tables = {t: self._own_tier(spec) for t, spec in tables.items()}
        self.expiry = {t: spec["expire"] for t, spec in tables.items()}
        self.expired = 0
        self.timings = {"lookup": 0.0, "apply": 0.0}
        self._frozen = False  # gc.freeze() done (after the first step)
        # Ray re-runs this constructor when it restarts the actor after its process died:
        # the stores are then empty, so step calls are refused until the driver has
        # loaded a checkpoint (``load``) instead of silently training on empty tables.
        self.load(restore)
        self.restarted = reconstructed()

    def _own_tier(self, spec: dict) -> dict:
        """``spec`` with a budgeted store's disk tier in this shard's own directory."""
        store = spec["store"]
        if store.memory_budget_bytes is None:
            return spec
        return {**spec, "store": dataclasses.replace(
            store, disk_dir=os.path.join(store.disk_dir, f"shard-{self.index:04d}"))}

    def load(self, restore=None, expired: int | None = None):
        """Replace every store: ``restore`` as the constructor takes it."""
        tables = self.tables
        if restore is None:
            stores = {t: tiers.new_store(spec["store"]) for t, spec in tables.items()}
        elif isinstance(restore, tuple):
            stores = {t: tiers.load_store(os.path.join(restore[0], t), spec["store"])
                      for t, spec in tables.items()}
        else:
            stores = {t: self._reshard(t, spec["store"], restore)
                      for t, spec in tables.items()}
        self.stores = stores
        if expired is not None:
            self.expired = expired
        self.restarted = False
        return self.index

    def _check(self):
        if self.restarted:
            raise RuntimeError(f"{RESTARTED}: store shard {self.index} was restarted "
                               "and holds no rows until a checkpoint is loaded")

    def pid(self):
        return os.getpid()

    def _owned(self, ids):
        return id_shards(ids, self.shards) == self.index

    def _reshard(self, table, config, directories):
        """A store of this shard's ids of ``table`` from the snapshots of another
        sharding, through the store's own delta format: each old snapshot is loaded, its
        other ids removed and the rest saved, and a store without rows writes the delta
        that rebases it onto that part (``write_rebase_delta``: every row, whatever deltas
        the old store exported before, and no tombstone), numbered next in the new store's
        sequence (with empty deltas). Rows, optimizer state, update counts, last steps and
        times, and the global step move exactly; so a store resharded or exported from
        before reshards again.

        The entry filter's state moves too (``EmbeddingStore.filter_state``):

        - a counter filter's pending sightings of ids without a row go to the shard that
          owns each id, exactly, so admission after resharding is what it would have been
          without it (and what one store does);
        - a counting Bloom filter cannot be split: its counters are shared by every id
          that hashes to them, whatever shard owns the id. Every new shard starts from
          the old shards' counters added up (each old shard counted its own ids'
          sightings in the same layout), i.e. every sighting counted so far, as one
          store counts them. No id is admitted later than before resharding; ids may be
          admitted earlier than in a never-resharded run (the other shards' ids' counts
          are false positives here), which is what a Bloom filter trades anyway;
        - a probability filter's random streams start anew (each sighting is an
          independent draw either way).

        The admitted/rejected counters start over."""
        store = tiers.new_store(config)
        tmp = tempfile.mkdtemp(prefix=f"reshard-{table}-")
        try:
            for i, directory in enumerate(directories):
                old = tiers.load_store(os.path.join(directory, table), config)
                old.expire_where(lambda ids, *rows: ~self._owned(ids))
                part = os.path.join(tmp, f"part-{i}")
                os.makedirs(part)
                old.save(part)
                blank = tiers.new_store(config)  # at the new store's delta sequence
                while blank.stats().delta_sequence < store.stats().delta_sequence:
                    empty = os.path.join(tmp, f"empty-{i}-{blank.stats().delta_sequence}")
                    os.makedirs(empty)
                    blank.export_delta(empty)
                rebase = os.path.join(tmp, f"rebase-{i}.bin")
                blank.write_rebase_delta(part, rebase)
                store.apply_delta(rebase)
                state = old.filter_state()
                own = self._owned(state["ids"])
                try:
                    store.merge_filter_state(state["ids"][own], state["counts"][own],
                                             state["bloom"])
                except native.StoreError as e:
                    raise ValueError(f"{directory}/{table}: its entry filter's state does "
                                     f"not fit this run's filter ({e})") from None
                del old
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return store

    def ping(self):
        return self.index

    def get_timings(self):
        return dict(self.timings)

    def lookup(self, train: bool, *requests):
        """``requests[w]``: ``{table: int64 ids}`` of worker ``w`` (distinct per worker).
        One ``lookup_unique`` per table over all workers; returns one ``{table: rows}``
        per worker (a list when there are several)."""
        self._check()
        t0 = time.perf_counter()
        # a worker's step message (n, gradients, request) or its request alone
        requests = [r[2] if isinstance(r, tuple) else r for r in requests]
        out = [{} for _ in requests]
        empty = np.zeros(0, np.int64)
        for table, store in self.stores.items():
            parts = [r.get(table, empty) for r in requests]
            ids = parts[0] if len(parts) == 1 else np.concatenate(parts)
            unique, inverse, rows = store.lookup_unique(ids, train)
            held = store.contains(unique) if self.tables[table].get("cold") else None
            if len(unique) == len(ids):
                # distinct ids (one worker's: it sent each once): the rows are in their order
                inverse = None
            at = 0
            for w, part in enumerate(parts):
                out[w][table] = (rows[at:at + len(part)] if inverse is None
                                 else rows[inverse[at:at + len(part)]])
                if held is not None:
                    out[w][held_key(table)] = (held[at:at + len(part)] if inverse is None
                                               else held[inverse[at:at + len(part)]])
                at += len(part)
        self.timings["lookup"] += time.perf_counter() - t0
        return out if len(out) > 1 else out[0]

    def apply(self, step: int, mean: bool, l2_scale: float, *messages):
        """``messages[w] = (leaves, {table: (ids, per-sample-summed row gradients)})``.
        One ``apply_gradients`` per table (every table, every step; the rows' L2 of
        ``row_l2(table l2, the step's leaves, l2_scale)``, as in process), then the
        expiry due at ``step``; returns the rows expired."""
        self._check()
        t0 = time.perf_counter()
        total = sum(n for n, _ in messages)
        if not total:  # a step past the end of the data: nothing happened
            return 0
        removed = 0
        for table, store in self.stores.items():
            parts = [m[table] for _, m in messages if table in m]
            if len(parts) == 1:
                ids, grads = parts[0]
            elif parts:
                ids = np.concatenate([p[0] for p in parts])
                grads = np.concatenate([p[1] for p in parts])
            else:
                ids, grads = np.zeros(0, np.int64), np.zeros((0, store.dim), np.float32)
            if mean and total:
                grads = grads / np.float32(total)
            store.apply_gradients(ids, grads, step,
                                  l2=row_l2(self.tables[table]["l2"], total, l2_scale))
            expiry = self.expiry[table]
            if expiry is not None and step % expiry["every_steps"] == 0:
                removed += self._expire(table, step)
        self.expired += removed
        self.timings["apply"] += time.perf_counter() - t0
        return removed

    def step(self, step: int, mean: bool, l2_scale: float, workers: int, lookup: bool,
             *messages):
        """:meth:`apply` of step ``step``, then, with ``lookup``, the training
        :meth:`lookup` of the next step. ``messages[w]``: worker ``w``'s ``(leaves,
        gradients, next request)`` for this shard (one object per worker and shard: each
        object costs a hop its own store and lookup). Returns ``(rows expired, rows for
        worker 0, ..., worker W-1)``, or the rows expired without ``lookup``."""
        removed = self.apply(step, mean, l2_scale,
                             *[(n, grads) for n, grads, _ in messages])
        if not self._frozen:
            # Ray's objects and the stores' alive after the first step live as long as the
            # process: out of the cyclic collector's full passes (as the workers do)
            self._frozen = True
            gc.freeze()
        if not lookup:
            return removed
        rows = self.lookup(True, *messages)
        return (removed,) + (tuple(rows) if workers > 1 else (rows,))

    def _expire(self, table: str, step: int) -> int:
        expiry, store = self.expiry[table], self.stores[table]
        removed = 0
        if expiry["max_idle_steps"] is not None or expiry["max_idle_seconds"] is not None:
            removed += store.expire(expiry["max_idle_steps"], expiry["max_idle_seconds"])
        if expiry["function"] is not None:
            module, name = expiry["function"].split(":")
            fn = getattr(importlib.import_module(module), name)
            removed += store.expire_where(lambda *rows: fn(*rows, step=step))
        return removed

    def stats(self) -> dict:
        return {t: s.stats().as_dict() for t, s in self.stores.items()}

    def tier_stats(self) -> dict:
        """Per table: where this shard's rows are (:func:`trainer.tiers.tier_stats`)."""
        return {t: tiers.tier_stats(s) for t, s in self.stores.items()}

    def rows(self) -> dict:
        return {t: s.to_numpy() for t, s in self.stores.items()}

    def snapshot(self, root: str) -> dict:
        """Every table's snapshot to ``root/<table>/shard-NNNN`` (a serving export)."""
        self._check()
        paths = {}
        for table, store in self.stores.items():
            path = os.path.join(root, table, f"shard-{self.index:04d}")
            os.makedirs(path, exist_ok=True)
            paths[table] = store.save(path)
        return paths

    def save(self, directory: str) -> dict:
        self._check()
        paths = {}
        for table, store in self.stores.items():
            os.makedirs(os.path.join(directory, table), exist_ok=True)
            paths[table] = store.save(os.path.join(directory, table))
        return {"expired": self.expired, "paths": paths,
                "rows": {t: len(s) for t, s in self.stores.items()}}

    def export_delta(self, directory: str) -> dict:
        """Every table's rows changed since this shard's previous delta (and tombstones)
        to ``directory/<table>/shard-NNNN/delta-MMMMMM.bin``; returns table -> path."""
        self._check()
        paths = {}
        for table, store in self.stores.items():
            path = os.path.join(directory, table, f"shard-{self.index:04d}")
            os.makedirs(path, exist_ok=True)
            paths[table] = store.export_delta(path)
        return paths
