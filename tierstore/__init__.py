"""tierstore: an async tiered tensor database (NVMe chunks, RAM cache, VRAM window)."""

from tierstore import codecs
from tierstore.errors import (
    BudgetError,
    CodecError,
    CorruptData,
    DiskError,
    FormatVersionError,
    InvalidKey,
    KeyNotFound,
    ReadOnlyError,
    StoreClosed,
    StoreError,
    StoreLocked,
)

__all__ = [
    "BudgetError",
    "CodecError",
    "CorruptData",
    "DiskError",
    "FormatVersionError",
    "InvalidKey",
    "KeyNotFound",
    "ReadOnlyError",
    "StoreClosed",
    "StoreError",
    "StoreLocked",
    "codecs",
]
