"""Exceptions of the native embedding store; each also subclasses the builtin a caller would catch."""


class StoreError(RuntimeError):
    """Base class of every error raised by native.EmbeddingStore."""


class InvalidInputError(StoreError, ValueError):
    """An argument has the wrong shape, value or option; the message names it."""


class InvalidDtypeError(InvalidInputError, TypeError):
    """An array argument has the wrong element type (e.g. float ids)."""


class CorruptFileError(StoreError, ValueError):
    """A snapshot or delta failed its magic, version, structure or checksum checks."""


class IncompatibleStoreError(StoreError, ValueError):
    """A well-formed snapshot or delta of a store with another dim or optimizer."""


class DeltaOrderError(StoreError, ValueError):
    """A delta whose sequence number is not the next one the store expects."""


class StoreIOError(StoreError, OSError):
    """The operating system refused a read, write, fsync or rename."""
