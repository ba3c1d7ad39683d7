"""tierstore: an async tiered tensor database (NVMe chunks, RAM cache, VRAM window)."""

from tierstore import codecs
from tierstore.api import open, open_async
from tierstore.config import StoreConfig, parse_size
from tierstore.errors import (
    BudgetError,
    CodecError,
    CorruptData,
    DiskError,
    FormatVersionError,
    InvalidIndex,
    InvalidKey,
    KeyNotFound,
    LoanWritten,
    MalformedFile,
    ReadOnlyError,
    StoreClosed,
    StoreError,
    StoreLocked,
    StoreNotFound,
)
from tierstore.keys import validate_key
from tierstore.records import Commit, TensorInfo
from tierstore.store import AsyncStore
from tierstore.sync import Store

__all__ = [
    "AsyncStore",
    "Commit",
    "InvalidIndex",
    "MalformedFile",
    "Store",
    "StoreConfig",
    "StoreNotFound",
    "TensorInfo",
    "open",
    "open_async",
    "parse_size",
    "BudgetError",
    "CodecError",
    "CorruptData",
    "DiskError",
    "FormatVersionError",
    "InvalidKey",
    "KeyNotFound",
    "LoanWritten",
    "ReadOnlyError",
    "StoreClosed",
    "StoreError",
    "StoreLocked",
    "codecs",
    "validate_key",
]
