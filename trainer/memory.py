"""Process memory: RSS readings, the RAM tier's default budget, malloc tuning, the RSS plan.

Everything here reads ``/proc`` (no psutil). ``tracemalloc`` does not see torch's allocations,
so RSS is read from ``/proc/self/status`` (``VmRSS`` now, ``VmHWM`` the peak).

The plan (``rss_plan``) is what makes the peak RSS predictable from the budgets: the RAM tier
never holds more than its budget, the device window (RAM too when the device is the CPU) never
more than its budget, and every other allocation of the streaming trainer is bounded by the
largest piece of the model, not by its size:

- gradients in flight: the group being back-propagated plus ``UpdateWorker``'s bounded queue;
- the optimizer's working set: parameter, gradient, both moments and one temporary, each of the
  largest tensor (the update is per tensor);
- the store's idle update scratch, kept for reuse apart from the RAM budget
  (``tierstore.config.scratch_keep_bytes``: an eighth of it);
- uncached chunk reads in flight: the store's read semaphore times the chunk size;
- activations: the layer-boundary hidden states of one micro-batch plus one layer's autograd graph.

Left out of the plan, fixed and small: the store's memo of checked keys
(``tierstore.keys.VALID_KEYS_REMEMBERED`` keys, under 6 MiB) and one codec object per record.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Iterator
from dataclasses import dataclass

import tierstore.config

_MIB = 1 << 20
_GIB = 1 << 30

#: glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

#: what ``tune_malloc`` sets: allocations from 1 MiB up are mmap'd and go back to the OS on free
#: (glibc's dynamic threshold would rise to 32 MiB and keep freed tensors in the heap); two
#: arenas instead of 8 a core, so freed memory of the I/O and codec threads is reused
MMAP_THRESHOLD = 1 * _MIB
ARENA_MAX = 2
TRIM_THRESHOLD = 16 * _MIB

_libc: ctypes.CDLL | None = None
_tuned = False


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name or "libc.so.6")
            lib.mallopt  # noqa: B018  (absent on musl: no tuning there)
            lib.malloc_trim  # noqa: B018
        except (OSError, AttributeError):
            return None
        _libc = lib
    return _libc


def tune_malloc() -> bool:
    """Make freed large buffers go back to the OS (glibc only; idempotent); True if applied."""
    global _tuned
    if _tuned:
        return True
    lib = _glibc()
    if lib is None:
        return False
    ok = all(lib.mallopt(p, v) == 1 for p, v in ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                                                 (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                                                 (_M_ARENA_MAX, ARENA_MAX)))
    _tuned = ok
    return ok


@contextlib.contextmanager
def reuse_freed_buffers() -> Iterator[None]:
    """While inside, freed buffers under 32 MiB stay in the heap for the next allocation of their size.

    For loops that free and allocate the same sizes over and over (generation streams every
    layer's weights through the window for every token; a training step allocates the same
    activations and gradients every step): with ``tune_malloc``'s settings each one is a fresh
    mmap whose pages fault in at a fraction of copy speed (the dev VM: 0.25-0.5 GiB/s). The heap
    then holds at most the loop's own working set (the plan's activations and gradients in
    flight). On exit the settings are ``tune_malloc``'s again and the heap is trimmed. A no-op
    when ``tune_malloc`` was not applied (glibc's own dynamic threshold already reuses them).
    """
    lib = _glibc() if _tuned else None
    if lib is None:
        yield
        return
    lib.mallopt(_M_MMAP_THRESHOLD, 32 * _MIB)  # glibc's largest mmap threshold on 64-bit
    lib.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    try:
        yield
    finally:
        lib.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        lib.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        lib.malloc_trim(0)


def trim() -> None:
    """Give free heap memory back to the OS (``malloc_trim``); a no-op off glibc."""
    lib = _glibc()
    if lib is not None:
        lib.malloc_trim(0)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since it started (VmHWM)."""
    return _status_kib("VmHWM") * 1024


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (MemTotal, MemAvailable, ...)."""
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[name] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


#: what the default RAM budget leaves for the trainer's own working sets (see ``rss_plan``)
WORKING_SET_RESERVE = 1 * _GIB


def default_ram_budget(device_budget: int | None = None, cpu_window: bool = False) -> int:
    """The RAM tier's budget when ``max_ram_gb`` is None: from the memory available now.

    MemAvailable (free memory plus reclaimable page cache, what other processes leave) minus
    20% of the total kept free, minus the device window when it lives in RAM (CPU device),
    minus ``WORKING_SET_RESERVE`` for gradients, optimizer and activations, shared with the
    idle update scratch the store keeps beside its budget (an eighth of it); at least 64 MiB.
    """
    try:
        info = meminfo()
        total = info["MemTotal"]
        avail = info["MemAvailable"] if "MemAvailable" in info else info["MemFree"]  # kernels < 3.14
    except (OSError, KeyError, ValueError):
        return 8 * _GIB
    budget = avail - total // 5 - WORKING_SET_RESERVE
    if cpu_window and device_budget is not None:
        budget -= device_budget
    # the budget and the scratch kept beside it (budget / SCRATCH_KEEP_DIVISOR) share what is left
    div = tierstore.config.SCRATCH_KEEP_DIVISOR
    return max(64 * _MIB, int(budget * div // (div + 1)))


def layer_chunk_bytes(largest_layer_tensor_bytes: int, ram_budget: int | str | None) -> int | None:
    """The chunk size that keeps each decoder-layer weight in one chunk, or None for tierstore's default.

    A CPU window lends a weight stored in one chunk to the layer instead of copying it (at 1B
    parameters, 16 MiB chunks split the MLP's weights and the copies put peak RSS above the
    budgets). The size is the smallest power of two that holds the largest layer weight, never
    below tierstore's default; None where that is the default already, or where it would exceed
    a quarter of the RAM budget (tierstore's own bound on a chunk).
    """
    budget = tierstore.config.parse_size(ram_budget, "ram_budget")
    size = tierstore.config.DEFAULT_CHUNK_BYTES
    while size < largest_layer_tensor_bytes:
        size *= 2
    if size == tierstore.config.DEFAULT_CHUNK_BYTES:
        return None
    if budget is not None and size > budget // 4:
        return None
    return size


@dataclass(frozen=True, slots=True)
class RSSPlan:
    """The parts of the expected peak RSS, in bytes; ``total`` is their sum."""

    baseline: int
    """The interpreter with torch, transformers and the trainer imported."""
    ram_tier: int
    device_window: int
    """The window's budget when the device is the CPU; 0 on CUDA (the window is VRAM)."""
    grads_in_flight: int
    optimizer: int
    read_scratch: int
    activations: int
    update_scratch: int
    """Idle decode buffers the store keeps for the next update of a coded moment."""

    @property
    def total(self) -> int:
        """The expected peak RSS."""
        return (self.baseline + self.ram_tier + self.device_window + self.grads_in_flight + self.optimizer
                + self.read_scratch + self.activations + self.update_scratch)

    def lines(self) -> list[str]:
        """One line a part, in MiB."""
        return [f"{name:16s} {getattr(self, name) / _MIB:10.1f} MiB" for name in
                ("baseline", "ram_tier", "device_window", "grads_in_flight", "optimizer", "read_scratch",
                 "activations", "update_scratch")] + [f"{'total':16s} {self.total / _MIB:10.1f} MiB"]


def rss_plan(*, baseline: int, ram_budget: int, device_budget: int, cpu_window: bool, group_bytes: list[int],
             largest_tensor_bytes: int, chunk_bytes: int, read_slots: int, activation_bytes: int,
             queued_groups: int) -> RSSPlan:
    """The expected peak RSS of a streaming training run from its budgets and the model's pieces.

    ``group_bytes``: fp32 bytes of each parameter group (prelude, layers, head);
    ``queued_groups``: gradient groups the optimizer queue may hold (``UpdateWorker.max_queued``).
    """
    biggest = max(group_bytes) if group_bytes else 0
    # backward holds the group it computes while the queue holds up to queued_groups more and the
    # worker updates one (its gradients stay referenced until the group is done)
    grads = biggest * (queued_groups + 2)
    return RSSPlan(baseline=baseline, ram_tier=ram_budget, device_window=device_budget if cpu_window else 0,
                   grads_in_flight=grads, optimizer=5 * largest_tensor_bytes, read_scratch=read_slots * chunk_bytes,
                   activations=activation_bytes,
                   update_scratch=tierstore.config.scratch_keep_bytes(ram_budget))


def max_queued_default() -> int:
    """Gradient groups the optimizer queue may hold before backward waits (env override)."""
    return max(1, int(os.environ.get("TRAINER_MAX_QUEUED_GRADS", "1")))
