"""Byte sizes: human-readable output, and size arguments parsed into usage errors."""

from __future__ import annotations

import tierstore
from tools.cli.errors import UsageError

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """A byte count in binary units, e.g. ``1.50 GiB`` (bytes shown exactly)."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def size_arg(value: str, flag: str) -> int:
    """Bytes from a size flag such as ``500MB`` or ``4GiB``; UsageError (exit 2) if malformed."""
    try:
        n = tierstore.parse_size(value, flag)
    except tierstore.StoreError as e:
        raise UsageError(str(e)) from None
    assert n is not None
    return n
