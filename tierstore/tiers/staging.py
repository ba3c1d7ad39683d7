"""Staging buffers: a fixed set of (pinned) host buffers that carry copies to and from the GPU.

A copy between pageable host memory and the GPU is synchronous for the host and runs at about
half the speed of one from page-locked memory; page-locking a fresh buffer per tensor costs more
than the copy. So every H2D and D2H copy of the store and the trainer goes through a small pool
of buffers allocated once, at open, and recycled:

- with CUDA the buffers are pinned (``HostTier(pin=True)`` allocates them), without it they are
  plain pageable tensors, so the same code paths run, and are tested, on the CPU;
- when the pool reserves its bytes from a ``HostTier`` they are counted in the RAM budget
  (``host_bytes``/``peak_host_bytes``) like any chunk buffer, and given back on ``close``;
- a buffer handed back with an event (``release(buf, after=event)``) is reused only once the
  event has completed, i.e. once the asynchronous copy that reads or fills it is done; the
  host waits on such an event only when every buffer is still in flight (backpressure).

Thread safety: ``acquire``/``release`` may be called from any thread (the store's loop thread,
the trainer's thread, the gradient drain thread); one condition variable guards the free list.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import torch

from tierstore.errors import BudgetError

_MIB = 1 << 20


def staging_plan(ram_budget: int | None, device_budget: int | None, count: int = 4,
                 cap: int = 64 * _MIB, floor: int = 1 * _MIB) -> tuple[int, int]:
    """(buffer bytes, count) for a pool sized by the budgets: at most 1/16 of RAM in all.

    Buffers larger than a quarter of the device window would never be filled by one copy, and
    more than ``cap`` bytes a buffer gains nothing (a copy of 64 MiB already runs at full speed).
    """
    size = cap
    if ram_budget is not None:
        size = min(size, ram_budget // (16 * count))
    if device_budget is not None:
        size = min(size, device_budget // 4)
    size = max(size, floor) // 4096 * 4096
    return max(size, 4096), count


class StagingPool:
    """``count`` host buffers of ``buffer_bytes`` each, recycled; events gate their reuse."""

    def __init__(self, buffer_bytes: int, count: int, pin: bool = False, host: Any = None) -> None:
        if buffer_bytes <= 0 or count <= 0:
            raise BudgetError(f"a staging pool needs buffer_bytes > 0 and count > 0, got "
                              f"{buffer_bytes} and {count}")
        self.buffer_bytes = buffer_bytes
        self.pinned = bool(pin and torch.cuda.is_available())
        self._host = host
        self._bufs: list[torch.Tensor] = []
        for _ in range(count):
            buf = self._allocate(buffer_bytes)
            if buf is None:
                break
            self._bufs.append(buf)
        if not self._bufs:
            raise BudgetError(f"no room for a staging buffer of {buffer_bytes} B in the RAM budget")
        self._free: deque[torch.Tensor] = deque(self._bufs)
        self._in_flight: deque[tuple[torch.Tensor, Any]] = deque()  # (buffer, event) in release order
        self._cond = threading.Condition()
        self.acquired = 0
        """Buffers handed out since open (each one a reuse: the pool never allocates again)."""
        self.waits = 0
        """Times an acquire found every buffer busy and waited for one."""
        self._closed = False

    def _allocate(self, nbytes: int) -> torch.Tensor | None:
        if self._host is not None:
            return self._host.try_alloc(nbytes)  # counted in the RAM budget, pinned with CUDA
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    @classmethod
    def from_host_tier(cls, host: Any, device_budget: int | None = None, count: int = 4) -> StagingPool:
        """A pool whose buffers come from (and are counted in) a ``HostTier``'s RAM budget."""
        size, n = staging_plan(host.budget, device_budget, count)
        return cls(size, n, pin=bool(getattr(host, "pin", False)), host=host)

    @property
    def count(self) -> int:
        """Buffers in the pool."""
        return len(self._bufs)

    @property
    def nbytes(self) -> int:
        """Host bytes the pool holds."""
        return self.buffer_bytes * len(self._bufs)

    def _reclaim(self) -> None:
        """Move buffers whose copies have completed back to the free list (lock held)."""
        while self._in_flight:
            buf, event = self._in_flight[0]
            if event is not None and not event.query():
                break  # release order is stream order on one stream: later ones are not done either
            self._in_flight.popleft()
            self._free.append(buf)

    def acquire(self, nbytes: int | None = None, timeout: float | None = None) -> torch.Tensor:
        """A free buffer (uint8, ``buffer_bytes`` long), waiting for an in-flight copy if none is."""
        if nbytes is not None and nbytes > self.buffer_bytes:
            raise BudgetError(f"{nbytes} B do not fit a staging buffer of {self.buffer_bytes} B; "
                              "copy in pieces")
        with self._cond:
            if self._closed:
                raise BudgetError("the staging pool is closed")
            self._reclaim()
            if not self._free:
                self.waits += 1
            while not self._free:
                if self._in_flight:
                    buf, event = self._in_flight.popleft()
                    event.synchronize()  # the oldest copy in flight: wait for the GPU, not a peer
                    self._free.append(buf)
                elif not self._cond.wait(timeout=timeout):
                    raise BudgetError(f"no staging buffer came back within {timeout} s")
            self.acquired += 1
            return self._free.popleft()

    def try_acquire(self) -> torch.Tensor | None:
        """A free buffer, or the oldest in-flight one once its copy is done; None if all are held.

        For the store's event loop thread, which must never block on a buffer that one of its own
        coroutines holds (it would never be released): the caller awaits and retries.
        """
        with self._cond:
            if self._closed:
                raise BudgetError("the staging pool is closed")
            self._reclaim()
            if not self._free and self._in_flight:
                buf, event = self._in_flight.popleft()
                event.synchronize()  # a DMA already queued: it ends without the loop's help
                self._free.append(buf)
            if not self._free:
                self.waits += 1
                return None
            self.acquired += 1
            return self._free.popleft()

    def release(self, buf: torch.Tensor, after: Any = None) -> None:
        """Give a buffer back; with ``after`` (a CUDA event) it is reused once the event is done."""
        with self._cond:
            if after is None:
                self._free.append(buf)
            else:
                self._in_flight.append((buf, after))
            self._cond.notify()

    def close(self) -> None:
        """Wait for copies in flight and give the buffers back to the RAM budget."""
        with self._cond:
            for _buf, event in self._in_flight:
                event.synchronize()
            self._in_flight.clear()
            self._free.clear()
            self._closed = True
            if self._host is not None:
                for buf in self._bufs:
                    self._host.release(buf)
            self._bufs = []
