"""How a store runs (budgets, threads, chunking): a runtime config, never stored in the catalog."""

from __future__ import annotations

import dataclasses
import os
import re

import torch

from tierstore.errors import BudgetError, StoreError
from tierstore.stats import DEFAULT_TRACE_EVENTS

#: the chunk size of a store opened without ``chunk_bytes`` (and a RAM budget of at least 4x it)
DEFAULT_CHUNK_BYTES = 16 * 2**20

#: idle update scratch kept for reuse (``tierstore.scratch``): this fraction of the RAM budget,
#: beside it, or ``SCRATCH_KEEP_UNBUDGETED`` bytes without a budget
SCRATCH_KEEP_DIVISOR = 8
SCRATCH_KEEP_UNBUDGETED = 256 * 2**20


def scratch_keep_bytes(ram_budget: int | None) -> int:
    """Bytes of idle update scratch a store keeps for reuse, apart from its RAM budget."""
    return SCRATCH_KEEP_UNBUDGETED if ram_budget is None else ram_budget // SCRATCH_KEEP_DIVISOR

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_size(value: int | float | str | None, what: str = "size") -> int | None:
    """Bytes from an int, or from a size string like ``"4GiB"`` / ``"512MB"``; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise StoreError(f"{what} must be a byte count or a size string, got {value!r}")
    if isinstance(value, (int, float)):
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE.fullmatch(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise StoreError(f"{what}: cannot parse {value!r}; use bytes or e.g. '4GiB', '512MB'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise StoreError(f"{what} must be a byte count or a size string, got {type(value).__name__}")
    if n <= 0:
        raise BudgetError(f"{what} must be positive, got {value!r}")
    return n


def human_bytes(n: float) -> str:
    """A byte count as a short human string (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def default_device() -> torch.device:
    """CUDA when available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclasses.dataclass(kw_only=True, slots=True)
class StoreConfig:
    """Runtime settings of an open store."""

    #: bytes of chunk data the RAM tier may hold (stored form); None = unlimited
    ram_budget: int | None = None
    #: bytes of tensors the device window may hold at once; None = unlimited
    device_budget: int | None = None
    #: the compute device of the window; None = cuda if available, else cpu
    device: torch.device | None = None
    #: target logical bytes per chunk; None = ``DEFAULT_CHUNK_BYTES``, shrunk to a quarter of a
    #: small RAM budget
    chunk_bytes: int | None = None
    #: threads of the store's own I/O pool (pread/pwrite/fsync)
    io_threads: int = 4
    #: chunk writes in flight at once (write-behind queue depth)
    io_depth: int = 8
    #: commits kept; older ones and the generations only they reference are deleted
    keep_last: int = 2
    #: keys of the last step's access order kept by the predictor to prefetch after each read
    prefetch_ahead: int = 4
    #: serve row gathers of committed raw sharded tables whose pages are in the page cache on
    #: the calling thread, from read-only mmaps (``tierstore.mapped``); False: always via the loop
    mapped_gathers: bool = True
    #: OpenMP threads of each torch CPU kernel the store's own threads run (codecs, copies; the
    #: caller's loop of ``open_async`` is not the store's); None = torch's default. 1 where the
    #: caller computes on the same cores: a second OpenMP team makes the caller's team sleep
    #: between its kernels (``tierstore.kernel_threads``)
    kernel_threads: int | None = None
    #: chunks smaller than this are coded and checksummed on the loop thread itself (a hop to
    #: the cpu pool costs more); 0 sends every one to the pool
    inline_bytes: int = 1 << 20
    #: spans of the I/O trace kept (``Store.chrome_trace``): the first ones, about 450 B each;
    #: 0 turns tracing off
    trace_events: int = DEFAULT_TRACE_EVENTS

    def __post_init__(self) -> None:
        self.ram_budget = parse_size(self.ram_budget, "ram_budget")
        self.device_budget = parse_size(self.device_budget, "device_budget")
        self.chunk_bytes = parse_size(self.chunk_bytes, "chunk_bytes")
        if self.device is None:
            self.device = default_device()
        else:
            self.device = torch.device(self.device)
        if self.chunk_bytes is None:
            self.chunk_bytes = DEFAULT_CHUNK_BYTES
            if self.ram_budget is not None:
                self.chunk_bytes = max(4096, min(self.chunk_bytes, self.ram_budget // 4))
        if self.ram_budget is not None and self.ram_budget < self.chunk_bytes:
            raise BudgetError(
                f"ram_budget ({self.ram_budget} B) is smaller than one chunk "
                f"({self.chunk_bytes} B); raise ram_budget or lower chunk_bytes"
            )
        if self.io_threads < 1 or self.io_depth < 1:
            raise StoreError("io_threads and io_depth must be >= 1")
        if self.keep_last < 1:
            raise StoreError("keep_last must be >= 1: the last commit is what a reopen reads")
        if self.prefetch_ahead < 0:
            raise StoreError("prefetch_ahead must be >= 0")
        if isinstance(self.trace_events, bool) or not isinstance(self.trace_events, int) or self.trace_events < 0:
            raise StoreError(f"trace_events must be an int >= 0 (0: no trace), got {self.trace_events!r}")
        if isinstance(self.inline_bytes, bool) or not isinstance(self.inline_bytes, int) or self.inline_bytes < 0:
            raise StoreError(f"inline_bytes must be an int >= 0, got {self.inline_bytes!r}")
        if self.kernel_threads is not None and (isinstance(self.kernel_threads, bool) or not isinstance(
                self.kernel_threads, int) or self.kernel_threads < 1):
            raise StoreError(f"kernel_threads must be None or an int >= 1, got {self.kernel_threads!r}")
        self.io_threads = min(self.io_threads, max(4, (os.cpu_count() or 2) * 2))
