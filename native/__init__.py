"""The native embedding store: a C++ dynamic hash-map embedding table behind a typed facade.

Also the native JSON sample decoder (native.json_samples) used by online learning and the scanner
of the prediction service's request envelopes (native.json_envelope)."""
from native.config import (FTRL, SGD, Adagrad, Adam, CounterFilter, CountingBloomFilter,
                           EntryFilter, Initializer, Normal, Optimizer, ProbabilityFilter,
                           StoreConfig, Uniform, Zeros)
from native.errors import (CorruptFileError, DeltaOrderError, IncompatibleStoreError,
                           InvalidDtypeError, InvalidInputError, StoreError, StoreIOError)
from native.json_envelope import Envelope, MalformedJsonError, MemberSpans, scan_envelope
from native.json_samples import DecodedChunk, DecodedSamples, JsonColumn, JsonSampleDecoder
from native.quantized import QuantizedStore
from native.store import EmbeddingStore, StoreStats, scatter_add_rows

__all__ = [
    "EmbeddingStore", "StoreConfig", "StoreStats", "scatter_add_rows", "QuantizedStore",
    "SGD", "Adagrad", "Adam", "FTRL", "Optimizer",
    "Zeros", "Uniform", "Normal", "Initializer",
    "ProbabilityFilter", "CountingBloomFilter", "CounterFilter", "EntryFilter",
    "StoreError", "InvalidInputError", "InvalidDtypeError", "CorruptFileError",
    "IncompatibleStoreError", "DeltaOrderError", "StoreIOError",
    "JsonSampleDecoder", "JsonColumn", "DecodedChunk", "DecodedSamples",
    "scan_envelope", "Envelope", "MemberSpans", "MalformedJsonError",
]
