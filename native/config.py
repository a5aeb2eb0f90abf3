"""Configuration of the native embedding store: optimizers, initializers, entry filters, StoreConfig."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Union

import numpy as np

from native.errors import InvalidInputError

# Kind numbers shared with native/include/prefixrec/embedding_store.h.
_SGD, _ADAGRAD, _ADAM, _FTRL = 0, 1, 2, 3
_ZEROS, _UNIFORM, _NORMAL = 0, 1, 2
_NO_FILTER, _PROBABILITY, _BLOOM, _COUNTER = 0, 1, 2, 3


def _check_number(owner: str, name: str, value, low: float, high: float = math.inf,
                  low_open: bool = False, high_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidInputError(f"{owner}.{name} must be a number, got {value!r}")
    ok = math.isfinite(value) and (value > low if low_open else value >= low) and (
        value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise InvalidInputError(f"{owner}.{name} must be in {interval}, got {value!r}")


def _check_int(owner: str, name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidInputError(f"{owner}.{name} must be an int, got {value!r}")
    if not low <= value <= high:
        raise InvalidInputError(f"{owner}.{name} must be in [{low}, {high}], got {value!r}")


@dataclasses.dataclass(frozen=True)
class SGD:
    """Plain SGD, ``w -= lr * g``; no state."""

    lr: float = 0.01

    def __post_init__(self):
        _check_number("SGD", "lr", self.lr, 0, low_open=True)


@dataclasses.dataclass(frozen=True)
class Adagrad:
    """Adagrad as in TensorFlow: ``acc += g*g; w -= lr * g / sqrt(acc)``; acc starts at
    ``initial_accumulator``."""

    lr: float = 0.05
    initial_accumulator: float = 0.1

    def __post_init__(self):
        _check_number("Adagrad", "lr", self.lr, 0, low_open=True)
        _check_number("Adagrad", "initial_accumulator", self.initial_accumulator, 0, low_open=True)


@dataclasses.dataclass(frozen=True)
class Adam:
    """Adam with bias correction; ``t`` is the row's own update count (lazy Adam)."""

    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8

    def __post_init__(self):
        _check_number("Adam", "lr", self.lr, 0, low_open=True)
        _check_number("Adam", "beta1", self.beta1, 0, 1, high_open=True)
        _check_number("Adam", "beta2", self.beta2, 0, 1, high_open=True)
        _check_number("Adam", "epsilon", self.epsilon, 0, low_open=True)


@dataclasses.dataclass(frozen=True)
class FTRL:
    """FTRL-Proximal (McMahan et al. 2013) with per-coordinate z and n:
    ``w = -(z - sign(z) l1) / ((beta + sqrt(n)) / alpha + l2)`` if ``|z| > l1`` else 0."""

    alpha: float = 0.05
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0

    def __post_init__(self):
        _check_number("FTRL", "alpha", self.alpha, 0, low_open=True)
        for name in ("beta", "l1", "l2"):
            _check_number("FTRL", name, getattr(self, name), 0)


@dataclasses.dataclass(frozen=True)
class Zeros:
    """New rows start at zero."""


@dataclasses.dataclass(frozen=True)
class Uniform:
    """New rows start uniform in ``[-scale, scale)``."""

    scale: float = 0.01

    def __post_init__(self):
        _check_number("Uniform", "scale", self.scale, 0)


@dataclasses.dataclass(frozen=True)
class Normal:
    """New rows start normal with ``stddev``, truncated (redrawn) beyond 2 stddev."""

    stddev: float = 0.01

    def __post_init__(self):
        _check_number("Normal", "stddev", self.stddev, 0)


@dataclasses.dataclass(frozen=True)
class ProbabilityFilter:
    """XDL's feature_add_probability: each sighting of an unseen id admits it with probability p."""

    p: float

    def __post_init__(self):
        _check_number("ProbabilityFilter", "p", self.p, 0, 1)


@dataclasses.dataclass(frozen=True)
class CountingBloomFilter:
    """Admit an id on its ``min_count``-th sighting, counted approximately in a counting Bloom
    filter of 8-bit saturating counters sized for ``capacity`` distinct ids at
    ``false_positive_rate`` (a false positive admits an id early). Memory is reported as
    ``stats().filter_bytes``; about ``1.44 * log2(1/rate)`` bytes per id of capacity."""

    min_count: int
    capacity: int
    false_positive_rate: float = 0.01

    def __post_init__(self):
        _check_int("CountingBloomFilter", "min_count", self.min_count, 1, 255)
        _check_int("CountingBloomFilter", "capacity", self.capacity, 1, 2**36)
        _check_number("CountingBloomFilter", "false_positive_rate", self.false_positive_rate, 0, 1,
                      low_open=True, high_open=True)


@dataclasses.dataclass(frozen=True)
class CounterFilter:
    """Admit an id on its ``min_count``-th sighting, counted exactly (a hash map entry per
    unadmitted id, dropped on admission)."""

    min_count: int

    def __post_init__(self):
        _check_int("CounterFilter", "min_count", self.min_count, 1, 2**32 - 1)


# StoreConfig.eviction -> the core's EvictionKind.
_EVICTIONS = {"lru": 0, "lfu": 1}

Optimizer = Union[SGD, Adagrad, Adam, FTRL]
Initializer = Union[Zeros, Uniform, Normal]
EntryFilter = Union[ProbabilityFilter, CountingBloomFilter, CounterFilter]


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """Everything that defines an EmbeddingStore; saved in its snapshots.

    ``StoreConfig(dim=8, optimizer=Adagrad(0.05), entry_filter=CounterFilter(3), max_rows=10**7)``
    """

    dim: int
    optimizer: Optimizer = Adagrad()
    initializer: Initializer = Normal(0.01)
    seed: int = 0
    num_shards: int = 16
    entry_filter: EntryFilter | None = None
    max_rows: int | None = None
    num_threads: int = 0  # threads per batch call; 0 = all cores
    # Two tiers (docs/tiered-store.md): at most about memory_budget_bytes of rows in memory
    # (split evenly over the shards; rows of the current batch excepted), the rest on local
    # disk under disk_dir/shard-NNNN (started empty: after a crash the store restores from its
    # snapshot). Lookups and updates are the same as without a budget. eviction: which rows go
    # to disk first, "lru" (least recently updated) or "lfu" (fewest updates). Run-time
    # settings: not saved in snapshots.
    memory_budget_bytes: int | None = None
    disk_dir: str | None = None
    eviction: str = "lru"

    # max_rows: when a training lookup takes the store above it, the least recently updated rows
    # (oldest last step, then last time, then id) are evicted down to max_rows - max_rows // 100
    # (the scan is O(rows), so a store at its cap pays it once per ~1% of new rows).

    def __post_init__(self):
        _check_int("StoreConfig", "dim", self.dim, 1, 4096)
        if not isinstance(self.optimizer, (SGD, Adagrad, Adam, FTRL)):
            raise InvalidInputError(
                f"StoreConfig.optimizer must be SGD, Adagrad, Adam or FTRL, got {self.optimizer!r}")
        if not isinstance(self.initializer, (Zeros, Uniform, Normal)):
            raise InvalidInputError(
                f"StoreConfig.initializer must be Zeros, Uniform or Normal, got {self.initializer!r}")
        _check_int("StoreConfig", "seed", self.seed, 0, 2**64 - 1)
        _check_int("StoreConfig", "num_shards", self.num_shards, 1, 4096)
        if self.entry_filter is not None and not isinstance(
                self.entry_filter, (ProbabilityFilter, CountingBloomFilter, CounterFilter)):
            raise InvalidInputError(
                "StoreConfig.entry_filter must be None, ProbabilityFilter, CountingBloomFilter or "
                f"CounterFilter, got {self.entry_filter!r}")
        if self.max_rows is not None:
            _check_int("StoreConfig", "max_rows", self.max_rows, 1, 2**63 - 1)
        _check_int("StoreConfig", "num_threads", self.num_threads, 0, 256)
        if self.eviction not in _EVICTIONS:
            raise InvalidInputError(
                f"StoreConfig.eviction must be 'lru' or 'lfu', got {self.eviction!r}")
        if self.memory_budget_bytes is None:
            if self.disk_dir is not None:
                raise InvalidInputError(
                    "StoreConfig.disk_dir is set but memory_budget_bytes is not (a disk tier "
                    "holds the rows beyond a memory budget)")
            return
        _check_int("StoreConfig", "memory_budget_bytes", self.memory_budget_bytes, 1, 2**63 - 1)
        if not isinstance(self.disk_dir, str) or not self.disk_dir:
            raise InvalidInputError(
                "StoreConfig.memory_budget_bytes needs disk_dir, a directory for the rows beyond "
                f"it, got {self.disk_dir!r}")
        if self.max_rows is not None:
            raise InvalidInputError(
                "StoreConfig.max_rows is not supported yet with memory_budget_bytes")

    def _native_kwargs(self) -> dict:
        opt = self.optimizer
        params = {"lr": 0.01, "initial_accumulator": 0.1, "beta1": 0.9, "beta2": 0.999,
                  "epsilon": 1e-8, "alpha": 0.05, "beta": 1.0, "l1": 0.0, "l2": 0.0}
        params.update(dataclasses.asdict(opt))
        kind = {SGD: _SGD, Adagrad: _ADAGRAD, Adam: _ADAM, FTRL: _FTRL}[type(opt)]
        init = self.initializer
        init_kind, scale = {Zeros: (_ZEROS, 0.0), Uniform: (_UNIFORM, getattr(init, "scale", 0.0)),
                            Normal: (_NORMAL, getattr(init, "stddev", 0.0))}[type(init)]
        f = self.entry_filter
        filter_kwargs = {"filter": _NO_FILTER, "probability": 1.0, "min_count": 1, "capacity": 0,
                         "false_positive_rate": 0.01}
        if isinstance(f, ProbabilityFilter):
            filter_kwargs.update(filter=_PROBABILITY, probability=float(f.p))
        elif isinstance(f, CountingBloomFilter):
            filter_kwargs.update(filter=_BLOOM, min_count=f.min_count, capacity=f.capacity,
                                 false_positive_rate=float(f.false_positive_rate))
        elif isinstance(f, CounterFilter):
            filter_kwargs.update(filter=_COUNTER, min_count=f.min_count)
        return dict(
            dim=self.dim, optimizer=kind,
            optimizer_params=[float(params[k]) for k in (
                "lr", "initial_accumulator", "beta1", "beta2", "epsilon", "alpha", "beta", "l1", "l2")],
            initializer=init_kind, initializer_scale=float(scale), seed=self.seed,
            num_shards=self.num_shards, max_rows=self.max_rows or 0, num_threads=self.num_threads,
            memory_budget_bytes=self.memory_budget_bytes or 0, disk_dir=self.disk_dir or "",
            eviction=_EVICTIONS[self.eviction], **filter_kwargs)

    @classmethod
    def _from_native(cls, o: dict) -> "StoreConfig":
        def f32(x: float) -> float:
            # The core keeps hyper-parameters as float32; the shortest float32 repr gives back
            # the value the user typed (0.01, not 0.009999999776).
            return float(str(np.float32(x)))

        lr, acc, b1, b2, eps, alpha, beta, l1, l2 = (f32(x) for x in o["optimizer_params"])
        optimizer = {_SGD: lambda: SGD(lr), _ADAGRAD: lambda: Adagrad(lr, acc),
                     _ADAM: lambda: Adam(lr, b1, b2, eps),
                     _FTRL: lambda: FTRL(alpha, beta, l1, l2)}[o["optimizer"]]()
        scale = f32(o["initializer_scale"])
        initializer = {_ZEROS: Zeros, _UNIFORM: lambda: Uniform(scale),
                       _NORMAL: lambda: Normal(scale)}[o["initializer"]]()
        entry_filter = {_NO_FILTER: lambda: None,
                        _PROBABILITY: lambda: ProbabilityFilter(o["probability"]),
                        _BLOOM: lambda: CountingBloomFilter(o["min_count"], o["capacity"],
                                                            o["false_positive_rate"]),
                        _COUNTER: lambda: CounterFilter(o["min_count"])}[o["filter"]]()
        return cls(dim=o["dim"], optimizer=optimizer, initializer=initializer, seed=o["seed"],
                   num_shards=o["num_shards"], entry_filter=entry_filter,
                   max_rows=o["max_rows"] or None, num_threads=o["num_threads"],
                   memory_budget_bytes=o["memory_budget_bytes"] or None,
                   disk_dir=o["disk_dir"] or None,
                   eviction={v: k for k, v in _EVICTIONS.items()}[o["eviction"]])
