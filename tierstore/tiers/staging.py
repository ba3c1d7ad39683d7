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

Thread safety: ``release`` may be called from any thread (the store's loop thread, the
trainer's thread, the gradient drain thread); one condition variable guards the free list.
An event loop thread takes buffers only with ``await acquire_async()``, never the blocking
``acquire``: its own coroutines hold buffers across awaits (a load fills one from the disk),
so a loop thread that blocked on an exhausted pool would wait for releases that only it can run.
Invariant: a thread running an event loop never blocks on the pool. A pool made with
``loop_owned=True`` (the device window's) refuses ``acquire`` outright, so no caller can break
the rule by accident; a waiting coroutine is woken by ``release`` from any thread through
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any

import torch

from tierstore.errors import BudgetError, StoreError

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


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class StagingPool:
    """``count`` host buffers of ``buffer_bytes`` each, recycled; events gate their reuse."""

    def __init__(self, buffer_bytes: int, count: int, pin: bool = False, host: Any = None,
                 loop_owned: bool = False) -> None:
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
        #: coroutines waiting in ``acquire_async``, each with its loop; woken by every release
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.loop_owned = loop_owned
        """Buffers are taken only on an event loop (``acquire_async``); ``acquire`` is refused."""
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
    def from_host_tier(cls, host: Any, device_budget: int | None = None, count: int = 4,
                       loop_owned: bool = False) -> StagingPool:
        """A pool whose buffers come from (and are counted in) a ``HostTier``'s RAM budget."""
        size, n = staging_plan(host.budget, device_budget, count)
        return cls(size, n, pin=bool(getattr(host, "pin", False)), host=host, loop_owned=loop_owned)

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

    def _check_size(self, nbytes: int | None) -> None:
        if nbytes is not None and nbytes > self.buffer_bytes:
            raise BudgetError(f"{nbytes} B do not fit a staging buffer of {self.buffer_bytes} B; "
                              "copy in pieces")

    def acquire(self, nbytes: int | None = None, timeout: float | None = None) -> torch.Tensor:
        """A free buffer (uint8, ``buffer_bytes`` long), waiting for an in-flight copy if none is.

        Blocks the calling thread: never call it on an event loop thread (see the module
        docstring); a ``loop_owned`` pool refuses it.
        """
        self._check_size(nbytes)
        if self.loop_owned:
            raise StoreError("this staging pool belongs to an event loop: take its buffers with "
                             "'await acquire_async()', which never blocks the loop")
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

    def _take(self) -> torch.Tensor | None:
        """A free buffer, or the oldest in-flight one once its copy is done; None if all are held (lock held)."""
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

    def try_acquire(self) -> torch.Tensor | None:
        """A free buffer, or the oldest in-flight one once its copy is done; None if all are held."""
        with self._cond:
            return self._take()

    async def acquire_async(self, nbytes: int | None = None) -> torch.Tensor:
        """A free buffer for a coroutine: awaits a release (from any thread) instead of blocking the loop."""
        self._check_size(nbytes)
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                buf = self._take()
                if buf is not None:
                    return buf
                # registered under the lock that release takes: no release can slip between
                # the failed take and the registration
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, fut))
            try:
                await fut
            finally:
                with self._cond:
                    if (loop, fut) in self._waiters:
                        self._waiters.remove((loop, fut))

    def _wake_waiters(self) -> None:
        """Wake every coroutine in ``acquire_async`` to retry (lock held); each retries on its loop."""
        waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:
                pass  # its loop is closed: nobody is left to wake

    def release(self, buf: torch.Tensor, after: Any = None) -> None:
        """Give a buffer back; with ``after`` (a CUDA event) it is reused once the event is done."""
        with self._cond:
            if after is None:
                self._free.append(buf)
            else:
                self._in_flight.append((buf, after))
            self._cond.notify()
            self._wake_waiters()

    def close(self) -> None:
        """Wait for copies in flight and give the buffers back to the RAM budget."""
        with self._cond:
            for _buf, event in self._in_flight:
                event.synchronize()
            self._in_flight.clear()
            self._free.clear()
            self._closed = True
            self._wake_waiters()  # they retry and find the pool closed
            if self._host is not None:
                for buf in self._bufs:
                    self._host.release(buf)
            self._bufs = []
