"""The native embedding store: a C++ dynamic hash-map embedding table behind a typed facade."""
from native.config import (FTRL, SGD, Adagrad, Adam, CounterFilter, CountingBloomFilter,
                           EntryFilter, Initializer, Normal, Optimizer, ProbabilityFilter,
                           StoreConfig, Uniform, Zeros)
from native.errors import (CorruptFileError, DeltaOrderError, IncompatibleStoreError,
                           InvalidDtypeError, InvalidInputError, StoreError, StoreIOError)
from native.store import EmbeddingStore, StoreStats

__all__ = [
    "EmbeddingStore", "StoreConfig", "StoreStats",
    "SGD", "Adagrad", "Adam", "FTRL", "Optimizer",
    "Zeros", "Uniform", "Normal", "Initializer",
    "ProbabilityFilter", "CountingBloomFilter", "CounterFilter", "EntryFilter",
    "StoreError", "InvalidInputError", "InvalidDtypeError", "CorruptFileError",
    "IncompatibleStoreError", "DeltaOrderError", "StoreIOError",
]
