"""EmbeddingStore: the typed Python facade over the native (C++) dynamic embedding table."""
from __future__ import annotations

import dataclasses
import math
import operator
import os
import time
from typing import Callable

import numpy as np

from native import _store
from native.config import StoreConfig
from native.errors import (CorruptFileError, IncompatibleStoreError, InvalidDtypeError,
                           InvalidInputError)

_INT64_MAX = np.iinfo(np.int64).max


@dataclasses.dataclass(frozen=True)
class StoreStats:
    """Counters of a store since it was created (they survive save/load)."""

    rows: int            # rows held now
    bytes: int           # heap bytes of rows, hash tables, filter and pending tombstones
    filter_bytes: int    # of which the entry filter
    admitted: int        # ids given a row by a training lookup
    rejected: int        # sightings the entry filter turned down (once per id per lookup call)
    expired: int         # rows removed by expire/expire_where
    evicted: int         # rows removed to respect max_rows
    lookups: int         # ids looked up, duplicates included
    updates: int         # row updates (one per distinct id with a row per apply_gradients)
    global_step: int     # largest step given to apply_gradients (or received in a delta)
    delta_sequence: int  # sequence number of the last delta exported or applied

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _as_ids(ids, name: str = "ids") -> np.ndarray:
    if isinstance(ids, (list, tuple)) and len(ids) == 0:
        return np.zeros(0, dtype=np.int64)
    array = np.asarray(ids)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise InvalidDtypeError(
            f"{name} must be integers (e.g. an int64 numpy array), got dtype {array.dtype}")
    if array.ndim != 1:
        raise InvalidInputError(f"{name} must be 1-D, got shape {array.shape}")
    if array.dtype == np.uint64 and array.size and int(array.max()) > _INT64_MAX:
        raise InvalidInputError(
            f"{name} must fit in int64, got {int(array.max())} at position {int(array.argmax())}")
    return np.ascontiguousarray(array, dtype=np.int64)


def _as_step(step) -> int:
    if isinstance(step, (bool, np.bool_)):
        raise InvalidInputError(f"step must be a non-negative int, got {step!r}")
    try:
        value = operator.index(step)
    except TypeError:
        raise InvalidInputError(f"step must be a non-negative int, got {step!r}") from None
    if not 0 <= value <= _INT64_MAX:
        raise InvalidInputError(f"step must be a non-negative int64, got {value}")
    return value


def _now(now: float | None) -> float:
    if now is None:
        return time.time()
    try:
        value = float(now)
    except (TypeError, ValueError):
        raise InvalidInputError(f"now must be a number of seconds, got {now!r}") from None
    if not np.isfinite(value):
        raise InvalidInputError(f"now must be a finite number of seconds, got {now!r}")
    return value


def scatter_add_rows(values, index, num_rows: int) -> np.ndarray:
    """``out[num_rows, d]`` with ``out[index[i]] += values[i]`` for every i, from zeros: the per-row
    gradient of a gather from a ``[num_rows, d]`` table, e.g. a TensorFlow ``IndexedSlices``'
    ``values`` and ``indices``, summed per row in one pass without the GIL (TensorFlow's own
    ``unsorted_segment_sum`` takes milliseconds for a training batch of ids here)."""
    values = np.asarray(values)
    if values.dtype != np.float32:
        raise InvalidDtypeError(f"values must be float32, got dtype {values.dtype}")
    if values.ndim != 2:
        raise InvalidInputError(f"values must be 2-D [n, dim], got shape {values.shape}")
    index = np.asarray(index)
    if index.dtype not in (np.int32, np.int64):
        raise InvalidDtypeError(f"index must be int32 or int64, got dtype {index.dtype}")
    if index.shape != values.shape[:1]:
        raise InvalidInputError(f"index must have shape ({values.shape[0]},) like values' rows, "
                                f"got {index.shape}")
    try:
        num_rows = operator.index(num_rows)
    except TypeError:
        raise InvalidInputError(f"num_rows must be an int, got {num_rows!r}") from None
    if num_rows < 0:
        raise InvalidInputError(f"num_rows must be >= 0, got {num_rows}")
    return _store.scatter_add_rows(np.ascontiguousarray(values), np.ascontiguousarray(index),
                                   num_rows)


class EmbeddingStore:
    """A dynamic id -> float32[dim] table with optimizer state per row, entry filters, expiry,
    snapshots and deltas. Thread-safe; batch calls release the GIL and use several cores.

    The trainer's round trip, with duplicates looked up once::

        ids = np.array([7, 3, 7, 9])
        unique, inverse, rows = store.lookup_unique(ids)   # unique=[7, 3, 9], inverse=[0, 1, 0, 2]
        # rows[inverse] are the per-position embeddings; d(loss)/d(rows) is summed per unique id
        store.apply_gradients(unique, grads_for_unique_rows, step)

    Unseen ids in a training lookup go through the entry filter once per call: an admitted id
    gets a row initialised from (seed, id) alone, a rejected one reads as zeros and updates to it
    are ignored. ``train=False`` changes no row and no filter state (only the ``lookups``
    counter) and reads unseen ids as zeros.

    ``now`` arguments (seconds since the epoch, default ``time.time()``) stamp rows and drive
    ``max_idle_seconds``; pass them to replay a run exactly.

    Row metadata is packed (20 bytes a row): a row's last time is kept to the whole second
    (rounded to nearest, within the years 1970-2106), so idle-seconds expiry is exact to
    +-0.5 s; last steps are exact while a row is less than 2**31 steps from the largest step
    seen; update counts stop at 2**31 - 1.
    """

    def __init__(self, config: StoreConfig):
        if not isinstance(config, StoreConfig):
            raise InvalidInputError(f"config must be a native.StoreConfig, got {type(config).__name__}")
        self._config = config
        self._native = _store.Store(**config._native_kwargs())

    @classmethod
    def _wrap(cls, native_store) -> "EmbeddingStore":
        store = cls.__new__(cls)
        store._native = native_store
        store._config = StoreConfig._from_native(native_store.options())
        return store

    @property
    def config(self) -> StoreConfig:
        return self._config

    @property
    def dim(self) -> int:
        return self._config.dim

    def __len__(self) -> int:
        return len(self._native)

    def __repr__(self) -> str:
        return f"EmbeddingStore(rows={len(self)}, config={self._config})"

    # -- batch work ------------------------------------------------------------------------

    def lookup(self, ids, train: bool = True, *, now: float | None = None) -> np.ndarray:
        """Rows of ``ids`` as float32[n, dim] (zeros for ids without a row)."""
        return self._native.lookup(_as_ids(ids), bool(train), _now(now))

    def prefetch(self, ids) -> int:
        """Two tiers: brings the rows of ``ids`` that are on disk back into memory ahead of their
        lookup, and keeps them there until the next ``prefetch`` (docs/tiered-store.md). Changes
        no row, so results are the same with or without it. Returns rows read from disk; 0
        without a memory budget. Runs without the GIL: call it from another thread while the
        current batch trains."""
        return self._native.prefetch(_as_ids(ids))

    def contains(self, ids) -> np.ndarray:
        """bool[n]: whether each id has a row (in memory or on the disk tier). Reads only: no
        entry-filter sighting, no counter changes, no row moves. Runs without the GIL."""
        return self._native.contains(_as_ids(ids))

    def lookup_unique(self, ids, train: bool = True, *, now: float | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(unique_ids, inverse, rows)``: distinct ids in order of first appearance,
        ``ids == unique_ids[inverse]``, and float32[len(unique_ids), dim] rows."""
        return tuple(self._native.lookup_unique(_as_ids(ids), bool(train), _now(now)))

    def apply_gradients(self, ids, grads, step: int, *, now: float | None = None,
                        l2: float = 0.0) -> None:
        """One optimizer update per distinct id (rows of equal ids summed first, in order).

        ``grads`` is float[n, dim] (cast to float32) and must be finite. Ids without a row are
        ignored. Each updated row records update_count + 1, ``step`` and ``now``. Bad input
        raises before anything changes.

        ``l2`` > 0: lazy L2 regularization, as if every step's loss held ``l2 / 2 * |w|^2`` for
        every row: a row's gradient gets ``l2 * idle * w`` added, ``idle`` the steps since its
        last update (at least 1), so a row used once in k steps is decayed for all k in its
        next update; rows not updated keep their values.
        """
        ids = _as_ids(ids)
        step = _as_step(step)
        grads = np.asarray(grads)
        if not np.issubdtype(grads.dtype, np.floating):
            raise InvalidDtypeError(f"grads must be floating point, got dtype {grads.dtype}")
        if grads.ndim != 2:
            raise InvalidInputError(f"grads must be 2-D [n, {self.dim}], got shape {grads.shape}")
        if grads.shape[0] != ids.shape[0]:
            raise InvalidInputError(f"grads has {grads.shape[0]} rows but ids has {ids.shape[0]}")
        if grads.shape[1] != self.dim:
            raise InvalidInputError(
                f"grads has {grads.shape[1]} columns but the store's dim is {self.dim}")
        with np.errstate(over="ignore"):  # float64 beyond float32 range becomes inf: refused below
            grads = np.ascontiguousarray(grads, dtype=np.float32)
        if isinstance(l2, bool) or not isinstance(l2, (int, float, np.integer, np.floating)) \
                or not math.isfinite(l2) or l2 < 0:
            raise InvalidInputError(f"l2 must be a finite number >= 0, got {l2!r}")
        self._native.apply_gradients(ids, grads, step, _now(now), float(l2))

    # -- expiry ----------------------------------------------------------------------------

    def expire(self, max_idle_steps: int | None = None, max_idle_seconds: float | None = None,
               *, now: float | None = None) -> int:
        """Removes rows not updated for more than ``max_idle_steps`` steps (counted from the
        largest step seen) or more than ``max_idle_seconds`` seconds; either condition suffices.
        New rows count as updated when admitted. Returns the number of rows removed."""
        if max_idle_steps is None and max_idle_seconds is None:
            raise InvalidInputError("expire needs max_idle_steps or max_idle_seconds")
        steps = -1 if max_idle_steps is None else _as_step(max_idle_steps)
        seconds = -1.0
        if max_idle_seconds is not None:
            seconds = float(max_idle_seconds)
            if not (np.isfinite(seconds) and seconds >= 0):
                raise InvalidInputError(
                    f"max_idle_seconds must be a finite number >= 0, got {max_idle_seconds!r}")
        return self._native.expire(steps, seconds, _now(now))

    def expire_where(self, fn: Callable[..., np.ndarray]) -> int:
        """Removes the rows for which ``fn(ids, update_counts, last_steps, last_times, l2_norms)``
        (numpy arrays, one entry per row) returns True in a boolean mask. Returns rows removed.

        Runs on a copy of the statistics: a row updated while ``fn`` runs is still removed.
        """
        rows = self._native.rows(False)
        ids = rows["ids"]
        mask = np.asarray(fn(ids, rows["update_counts"], rows["last_steps"], rows["last_times"],
                             rows["l2_norms"]))
        if mask.dtype != np.bool_ or mask.shape != ids.shape:
            raise InvalidInputError(
                f"expire_where's function must return a bool array of shape {ids.shape}, "
                f"got dtype {mask.dtype} and shape {mask.shape}")
        return self._native.remove(np.ascontiguousarray(ids[mask]))

    # -- persistence -----------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> str:
        """Writes a full snapshot to ``directory/store.snapshot`` atomically; returns its path.

        A crash at any moment leaves the previous snapshot or the complete new one (crash
        points ``store.snapshot.written``, ``.synced``, ``.renamed``: see
        :mod:`native.crash_points`). ``load`` refuses any damaged or cut-short file with
        CorruptFileError naming it."""
        directory = os.fspath(directory)
        self._native.save(directory)
        return os.path.join(directory, "store.snapshot")

    @classmethod
    def load(cls, directory: str | os.PathLike, config: StoreConfig | None = None) -> "EmbeddingStore":
        """The store saved in ``directory``, equal bit for bit to the one saved. With ``config``,
        refuses a snapshot whose dim or optimizer differ from it, and takes its memory budget
        (``memory_budget_bytes``, ``disk_dir``, ``eviction``: run-time settings, not saved)."""
        tiers = {}
        if config is not None and config.memory_budget_bytes is not None:
            native = config._native_kwargs()
            tiers = {k: native[k] for k in ("memory_budget_bytes", "disk_dir", "eviction")}
        native_store = _store.Store.load(os.fspath(directory), **tiers)
        try:
            store = cls._wrap(native_store)
        except InvalidInputError as e:  # options the C++ side reads but the facade refuses
            path = os.path.join(os.fspath(directory), "store.snapshot")
            raise CorruptFileError(f"corrupt store file {path}: its options are not a valid "
                                   f"StoreConfig ({e})") from None
        if config is not None:
            found = store.config
            if found.dim != config.dim or type(found.optimizer) is not type(config.optimizer):
                raise IncompatibleStoreError(
                    f"snapshot in {os.fspath(directory)} has dim {found.dim} and optimizer "
                    f"{type(found.optimizer).__name__}, expected dim {config.dim} and optimizer "
                    f"{type(config.optimizer).__name__}")
        return store

    def export_delta(self, directory: str | os.PathLike) -> str:
        """Writes ``directory/delta-NNNNNN.bin`` with the rows admitted or changed since the
        previous delta and tombstones for rows removed since then; returns its path.

        Written like a snapshot (crash points ``store.delta.written``, ``.synced``,
        ``.renamed``); the delta sequence advances only once the file is in place."""
        path, _ = self._native.export_delta(os.fspath(directory))
        return path

    def apply_delta(self, path: str | os.PathLike) -> int:
        """Applies a delta written by a store of the same dim and optimizer; deltas must come in
        sequence (the first after a fresh store is 1, after ``load`` the snapshot's + 1).
        Returns the delta's sequence number. A refused delta changes nothing."""
        return self._native.apply_delta(os.fspath(path))

    def read_delta(self, path: str | os.PathLike, ahead: int = 0) -> dict:
        """What the delta at ``path`` would change, without applying it: refused as
        :meth:`apply_delta` refuses it (damage, another dim or optimizer, a sequence other than
        this store's ``delta_sequence + 1 + ahead``). Its net effect: ``ids`` (int64[n]) with
        their embeddings ``rows`` (float32[n, dim]; no optimizer state) and ``tombstones``
        (int64, ids it removes), each id in one of the two; plus ``sequence`` and
        ``global_step``. A serving copy answers on "this store + the delta" while it applies it.
        """
        if ahead < 0:
            raise InvalidInputError(f"read_delta: ahead must be >= 0, got {ahead}")
        return dict(self._native.read_delta(os.fspath(path), int(ahead)))

    def write_rebase_delta(self, snapshot_dir: str | os.PathLike, path: str | os.PathLike) -> dict:
        """Writes at ``path`` a delta (the next in this store's sequence) that turns this
        store's rows into those of the snapshot in ``snapshot_dir`` (a store of the same dim and
        optimizer, e.g. a new full export of the same model): the snapshot rows that differ or
        that this store lacks, and tombstones for the ids the snapshot lacks. Applied or read
        like any delta; applying it also sets the delta sequence and global step to the
        snapshot's, so the snapshot's own deltas apply next (:meth:`read_delta` gives its
        ``rebase``: that sequence; None for other deltas). Filter state and counters stay this
        store's. Streams the snapshot (checked as :meth:`load` checks it; a damaged one writes
        nothing): it costs a block of rows and a byte per row, not a second store. Returns
        ``rows``, ``tombstones``, ``unchanged`` (snapshot rows equal to this store's) and
        ``bytes``. Safe beside lookups, not beside writers of this store."""
        return dict(self._native.write_rebase_delta(os.fspath(snapshot_dir), os.fspath(path)))

    # -- entry-filter state ----------------------------------------------------------------

    def filter_state(self) -> dict[str, np.ndarray]:
        """The entry filter's state (what a snapshot keeps of it), to carry it to another
        store, e.g. when a sharded table is split anew: ``ids`` (int64, sorted) and
        ``counts`` (uint32) are a :class:`CounterFilter`'s pending sightings of ids without a
        row; ``bloom`` (uint8, flat) is every counter of a :class:`CountingBloomFilter`
        (``num_shards`` blocks, one layout for every store of equal filter options and
        ``num_shards``). Arrays the filter does not keep are empty. A probability filter's
        state is its random streams' positions, not kept here."""
        return dict(self._native.filter_state())

    def merge_filter_state(self, ids=(), counts=(), bloom=None) -> int:
        """Adds a filter state (as :meth:`filter_state` gives it) to this store's filter.

        CounterFilter: each id's count is added to its pending sightings, capped at
        ``min_count - 1`` (its next sighting then admits it); ids that hold a row here are
        left out. CountingBloomFilter: ``bloom`` is added counter by counter (saturating at
        255), so the stores' states add up to that of one store that saw every sighting when
        their options are equal. Returns the counts and counters changed. Raises
        InvalidInputError, changing nothing, for a state this filter cannot take (counts for
        another kind of filter, a Bloom filter of another size, a count < 1, an id twice)."""
        ids = _as_ids(ids)
        counts = np.asarray(counts)
        if counts.size == 0:
            counts = np.zeros(0, np.uint32)
        if counts.dtype == np.bool_ or not np.issubdtype(counts.dtype, np.integer):
            raise InvalidDtypeError(f"counts must be integers, got dtype {counts.dtype}")
        if counts.shape != ids.shape:
            raise InvalidInputError(f"counts must have the shape of ids {ids.shape}, got "
                                    f"{counts.shape}")
        if counts.size and (int(counts.min()) < 1 or int(counts.max()) > 2**32 - 1):
            raise InvalidInputError("counts must be in 1 .. 2**32 - 1, got "
                                    f"{int(counts.min())} .. {int(counts.max())}")
        bloom = np.zeros(0, np.uint8) if bloom is None else np.asarray(bloom)
        if bloom.size == 0:
            bloom = np.zeros(0, np.uint8)
        if bloom.dtype != np.uint8:
            raise InvalidDtypeError(f"bloom must be uint8 counters, got dtype {bloom.dtype}")
        return self._native.merge_filter_state(
            ids, np.ascontiguousarray(counts, dtype=np.uint32),
            np.ascontiguousarray(bloom.reshape(-1)))

    # -- inspection ------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        return StoreStats(**self._native.stats())

    def initial_rows(self, ids) -> np.ndarray:
        """The values a newly admitted id starts with: a function of (seed, id) only."""
        return self._native.initial_rows(_as_ids(ids))

    def to_numpy(self) -> dict[str, np.ndarray]:
        """Copies of all rows: ids, values [n, dim], state [n, k], update_counts, last_steps,
        last_times, l2_norms (row order is the store's, not sorted)."""
        return dict(self._native.rows(True))

    def to_arrow(self):
        """All rows as a ``pyarrow.Table`` (id, values, optimizer_state, update_count, last_step,
        last_time). Needs pyarrow, imported only here."""
        import pyarrow as pa

        rows = self._native.rows(True)
        columns = {
            "id": pa.array(rows["ids"]),
            "values": pa.FixedSizeListArray.from_arrays(pa.array(rows["values"].reshape(-1)), self.dim),
        }
        width = rows["state"].shape[1]
        if width:
            columns["optimizer_state"] = pa.FixedSizeListArray.from_arrays(
                pa.array(rows["state"].reshape(-1)), width)
        columns["update_count"] = pa.array(rows["update_counts"])
        columns["last_step"] = pa.array(rows["last_steps"])
        columns["last_time"] = pa.array(rows["last_times"])
        table = pa.table(columns)
        return table.replace_schema_metadata({
            "dim": str(self.dim), "optimizer": type(self._config.optimizer).__name__})
