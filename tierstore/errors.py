"""The exception hierarchy: every error the store raises subclasses ``StoreError``."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error raised by tierstore."""


class KeyNotFound(StoreError):
    """The key is not in the store (or not in the opened version)."""


class InvalidKey(StoreError, ValueError):
    """The key breaks the key rules (charset, segments, length)."""


class ReadOnlyError(StoreError):
    """A write was attempted on a store opened with mode="r"."""


class StoreLocked(StoreError):
    """Another process holds the writer lock of this store."""


class CorruptData(StoreError):
    """Stored bytes fail a check; the message names the key and the chunk."""

    def __init__(self, message: str, key: str | None = None, chunk: int | None = None):
        super().__init__(message)
        self.key = key
        self.chunk = chunk


class LoanWritten(StoreError):
    """Bytes the store holds changed after they were stored: a lent tensor was written into.

    Raised by the write (and so the ``commit``) that needed them, or by an update of the key,
    which would carry them into a new generation: a tensor lent by ``get(copy=False)``, or
    handed over by ``put(copy=False)``, is read-only. Nothing is
    written under the wrong checksum and the last commit is intact; a ``put`` or ``delete`` of
    the key replaces the changed bytes. ``key`` and ``chunk`` name them.
    """

    def __init__(self, message: str, key: str | None = None, chunk: int | None = None):
        super().__init__(message)
        self.key = key
        self.chunk = chunk


class FormatVersionError(StoreError):
    """The store was written by a newer format version than this code reads."""


class BudgetError(StoreError):
    """A budget is too small for the request (e.g. smaller than one chunk)."""


class CodecError(StoreError, ValueError):
    """A codec name, spec or parameter is unknown or invalid, or data cannot be coded."""


class StoreClosed(StoreError):
    """The store was used after close()."""


class DiskError(StoreError, OSError):
    """An I/O call failed (EIO, ENOSPC, ...); the last commit is untouched."""


class StoreNotFound(StoreError, FileNotFoundError):
    """No store exists at the path (mode="r"), or the requested version is not retained."""


class InvalidIndex(StoreError, IndexError):
    """A get index (slice or rows) does not fit the tensor's dim 0."""


class MalformedFile(StoreError, ValueError):
    """A foreign file (safetensors, index, config) breaks its format; the message names it."""
