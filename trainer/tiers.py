"""Memory budgets of the embedding stores: sizes, the split of a budget over tables and
shards, the disk tier's directories and the tier statistics (docs/tiered-store.md).

A budgeted store keeps about ``memory_budget_bytes`` of rows in memory and the rest on local
disk (``native.StoreConfig(memory_budget_bytes=..., disk_dir=...)``). Every store instance
gets a directory of its own under its table's tier directory (:func:`new_store`,
:func:`load_store`): two stores never share one (a store opening a tier discards what the
directory held), and the directory goes when the store does. TensorFlow-free: the store
shards on Ray use it too.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import os
import re
import shutil
import tempfile
import warnings
import weakref

import native

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2,
          "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
# file systems whose files are not on this machine's disk (the tier would be a network hop
# per miss), and those whose files are in memory (the tier would not save any)
NETWORK_FILE_SYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre",
                        "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone",
                        "fuse.juicefs", "fuse.goofys")
MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")
_STATE_WIDTH = {native.SGD: 0, native.Adagrad: 1, native.Adam: 2, native.FTRL: 2}


class BudgetError(ValueError):
    """A memory budget or tier directory that cannot work; the message names the setting."""


def parse_size(value, key: str) -> int:
    """Bytes of ``value``: an integer, or a string like ``512MiB``, ``2GiB``, ``1.5GB``,
    ``800k`` (KiB/MiB/GiB/TiB: powers of 1024; k/KB, M/MB, G/GB, T/TB: of 1000)."""
    if isinstance(value, bool):
        raise BudgetError(f"{key}: expected a size like 512MiB or a number of bytes, got "
                          f"{value!r}")
    if isinstance(value, int):
        if value < 1:
            raise BudgetError(f"{key}: expected a size > 0, got {value!r}")
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise BudgetError(f"{key}: expected a size like 512MiB, 2GiB, 1.5GB or a number of "
                          f"bytes, got {value!r}")
    size = int(float(match.group(1)) * unit)
    if size < 1:
        raise BudgetError(f"{key}: expected a size > 0, got {value!r}")
    return size


def format_size(size: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def memory_row_bytes(dim: int, optimizer) -> int:
    """A memory row's share of a budget: the 20-byte header, the values and optimizer state
    (float32) and its hash-table slot (5 bytes), as the native store counts it."""
    return 20 + 4 * dim * (1 + _STATE_WIDTH[type(optimizer)]) + 5


def min_budget(dim: int, optimizer, num_shards: int = 16) -> int:
    """The smallest budget a store takes: one memory row per (native) shard."""
    return num_shards * memory_row_bytes(dim, optimizer)


def split_budget(total: int, row_bytes: dict[str, int]) -> dict[str, int]:
    """``total`` bytes over the tables of ``row_bytes`` (table -> bytes of a memory row) in
    proportion to their row bytes: every table gets the same number of memory rows."""
    weight = sum(row_bytes.values())
    return {t: total * b // weight for t, b in row_bytes.items()}


def split_over_shards(budget: int | None, shards: int) -> int | None:
    return None if budget is None else math.ceil(budget / shards)


def check_tier_dir(path, key: str) -> str:
    """``path`` as an absolute directory for disk tiers, created if missing; BudgetError
    naming ``key`` when it is not a local directory this process can write (an object store
    URI, a network file system, a file, no permission). A file system in memory (tmpfs)
    works but saves no memory: a warning says so."""
    if not isinstance(path, str) or not path:
        raise BudgetError(f"{key}: expected a local directory, got {path!r}")
    if "://" in path:
        raise BudgetError(f"{key}: {path} is not a local directory; the disk tier must be on "
                          "this machine's disk (an object store is far too slow for it)")
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise BudgetError(f"{key}: cannot create {path} ({e.strerror}); give a writable "
                          "directory on local disk") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise BudgetError(f"{key}: {path} is not writable; give a writable directory on "
                          "local disk")
    fs_type = file_system_type(path)
    if fs_type in NETWORK_FILE_SYSTEMS:
        raise BudgetError(f"{key}: {path} is on a network file system ({fs_type}); the disk "
                          "tier must be on local disk")
    if fs_type in MEMORY_FILE_SYSTEMS:
        warnings.warn(f"{key}: {path} is on {fs_type}, which keeps its files in memory: the "
                      "rows beyond the memory budget stay in memory; give a directory on "
                      "local disk", stacklevel=2)
    return path


def file_system_type(path: str) -> str | None:
    """The type of the file system holding ``path`` (the longest mount point of
    /proc/mounts that contains it), or None where that is not known."""
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    real = os.path.realpath(path)
    best, kind = "", None
    for point, fs_type in mounts:
        point = point.replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fs_type
    return kind


def temporary_tier_dir(parent: str | None = None, prefix: str = "prefixrec-tiers-") -> str:
    """A new directory for disk tiers (under ``parent``, else the system's temporary
    directory), removed with everything in it when this process exits."""
    if parent is not None:
        os.makedirs(parent, exist_ok=True)
    path = check_tier_dir(tempfile.mkdtemp(prefix=prefix, dir=parent), "the tier directory")
    atexit.register(shutil.rmtree, path, True)
    return path


def _own_directory(config: native.StoreConfig) -> native.StoreConfig:
    """``config`` with its ``disk_dir`` (the table's tier directory) replaced by a new empty
    directory inside it, for one store."""
    if config.memory_budget_bytes is None:
        return config
    os.makedirs(config.disk_dir, exist_ok=True)
    own = tempfile.mkdtemp(prefix="store-", dir=config.disk_dir)
    return dataclasses.replace(config, disk_dir=own)


def _release_with(store: native.EmbeddingStore) -> native.EmbeddingStore:
    directory = store.config.disk_dir if store.config.memory_budget_bytes else None
    if directory:
        weakref.finalize(store, shutil.rmtree, directory, True)
    return store


def new_store(config: native.StoreConfig) -> native.EmbeddingStore:
    """A new store of ``config``; with a memory budget its tier is in a directory of its own
    under ``config.disk_dir``, removed when the store is."""
    own = _own_directory(config)
    try:
        return _release_with(native.EmbeddingStore(own))
    except BaseException:
        if own is not config:
            shutil.rmtree(own.disk_dir, ignore_errors=True)
        raise


def load_store(directory: str, config: native.StoreConfig | None) -> native.EmbeddingStore:
    """The store saved in ``directory`` (``EmbeddingStore.load``), into ``config``'s memory
    budget when it has one (its tier in a directory of its own, as :func:`new_store`)."""
    own = None if config is None else _own_directory(config)
    try:
        return _release_with(native.EmbeddingStore.load(directory, own))
    except BaseException:
        if own is not None and own is not config:
            shutil.rmtree(own.disk_dir, ignore_errors=True)
        raise


def budgeted(config: native.StoreConfig | None, budget: int | None, disk_dir: str | None,
             eviction: str = "lru") -> native.StoreConfig | None:
    """``config`` (None: only the budget, for ``EmbeddingStore.load`` of a snapshot whose
    options it keeps) with a memory budget, or as it is without one."""
    if budget is None:
        return config
    return dataclasses.replace(config, memory_budget_bytes=int(budget), disk_dir=disk_dir,
                               eviction=eviction)


# -- statistics ----------------------------------------------------------------------------

TIER_KEYS = ("memory_rows", "disk_rows", "memory_bytes", "disk_bytes", "faults",
             "prefetched", "evicted_to_disk", "lookups", "disk_reads", "disk_writes")


def tier_stats(store) -> dict:
    """Where ``store``'s rows are (an EmbeddingStore, or anything with ``shards``: their
    sums): ``memory_rows``, ``disk_rows``, ``memory_bytes`` (the store's heap bytes),
    ``disk_bytes`` (the tier's files on disk), ``faults`` (rows a lookup or update read back
    from disk), ``prefetched`` (rows the trainer's pipeline read back ahead of their
    lookup), ``evicted_to_disk``, ``lookups``, ``disk_reads`` and ``disk_writes`` (rows read
    from / written to the disk tier by any call), ``budget_bytes`` (None: unbounded) and
    ``hit_rate``: the share of looked-up ids found in memory without a read from disk,
    1 - (faults + prefetched) / lookups (None before any lookup)."""
    parts = getattr(store, "shards", None) or [store]
    out = dict.fromkeys(TIER_KEYS, 0)
    budget = 0
    for part in parts:
        stats = part.stats()
        tiers = _native_tier_stats(part)
        out["memory_rows"] += tiers.get("memory_rows", stats.rows)
        out["memory_bytes"] += stats.bytes
        out["lookups"] += stats.lookups
        for key in ("disk_rows", "disk_bytes", "faults", "prefetched", "evicted_to_disk"):
            out[key] += int(tiers.get(key, 0))
        for key in ("disk_reads", "disk_writes"):  # None for a store that does not count them
            out[key] = _add(out[key], tiers.get(key))
        budget = None if budget is None or part.config.memory_budget_bytes is None else (
            budget + part.config.memory_budget_bytes)
    out["budget_bytes"] = budget
    out["hit_rate"] = hit_rate(out)
    return out


def hit_rate(stats: dict) -> float | None:
    """1 - (faults + prefetched) / lookups: the share of looked-up ids that needed no read
    from disk (None before any lookup)."""
    if not stats["lookups"]:
        return None
    return max(0.0, 1.0 - (stats["faults"] + stats["prefetched"]) / stats["lookups"])


def _add(total, value):
    """Sum of counters where one that is not counted (None) makes the total None."""
    return None if total is None or value is None else total + int(value)


def _native_tier_stats(store) -> dict:
    tier = getattr(store, "tier_stats", None)  # a facade method, once the store has one
    if tier is None:
        tier = getattr(getattr(store, "_native", None), "tier_stats", None)
    return dict(tier()) if tier is not None else {}


def sum_tier_stats(parts: list[dict]) -> dict:
    """:func:`tier_stats` of several stores of one table (e.g. its shards) as one."""
    out = dict.fromkeys(TIER_KEYS, 0)
    budget = 0
    for part in parts:
        for key in TIER_KEYS:
            out[key] = _add(out[key], part.get(key))
        budget = None if budget is None or part.get("budget_bytes") is None else (
            budget + part["budget_bytes"])
    out["budget_bytes"] = budget
    out["hit_rate"] = hit_rate(out)
    return out


# (key, metric suffix, kind, help) of the per-table tier metrics of /metrics
TIER_METRICS = (
    ("memory_rows", "tier_memory_rows", "gauge", "embedding rows in memory"),
    ("disk_rows", "tier_disk_rows", "gauge", "embedding rows on disk (beyond the memory budget)"),
    ("memory_bytes", "tier_memory_bytes", "gauge", "heap bytes of the store in memory"),
    ("disk_bytes", "tier_disk_bytes", "gauge", "bytes of the disk tier's files"),
    ("budget_bytes", "tier_budget_bytes", "gauge", "memory budget (NaN: unbounded)"),
    ("hit_rate", "tier_hit_ratio", "gauge",
     "1 - rows read back from disk (faults + prefetched) / ids looked up"),
    ("lookups", "tier_lookups", "counter", "ids looked up"),
    ("faults", "tier_faults", "counter", "rows a lookup or update read back from disk"),
    ("prefetched", "tier_prefetched", "counter",
     "rows the training pipeline read back from disk ahead of their lookup"),
    ("evicted_to_disk", "tier_evicted_to_disk", "counter", "rows moved from memory to disk"),
    ("disk_reads", "tier_disk_reads", "counter", "rows read from the disk tier"),
    ("disk_writes", "tier_disk_writes", "counter", "rows written to the disk tier"),
)


def tier_metric_families(prefix: str, per_table: dict):
    """Prometheus families ``<prefix>_tier_*{table=...}`` of :func:`tier_stats` per table
    (disk reads and writes per second: ``rate()`` of their counters)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for key, name, kind, text in TIER_METRICS:
        family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
            f"{prefix}_{name}", text, labels=["table"])
        for table, stats in sorted(per_table.items()):
            value = stats.get(key)
            family.add_metric([table], float("nan") if value is None else float(value))
        yield family
