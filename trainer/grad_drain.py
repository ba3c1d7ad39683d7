"""Gradients leave the GPU as each layer's backward ends, without making the host wait for it.

The streaming engine used to call ``grad.to("cpu")`` after each layer's backward: a synchronous
copy from device memory into fresh pageable memory, so the host stopped queueing the next layer's
kernels until the GPU had finished this one, and then copied at pageable speed. ``GradDrain``
instead has its own D2H stream wait on the compute stream and copy the layer's gradients into one
pinned staging buffer (``tierstore.tiers.staging.StagingPool``), records an event, and returns at
once. A named drain thread waits on each copy's event, moves the bytes into the fp32 host tensors
the sink keeps (the staging buffer goes straight back to the pool) and calls the sink, in the order
the groups were submitted. ``flush`` waits for every submitted group and re-raises a sink error.

Without CUDA (or with ``threaded=False``) ``submit`` is the old synchronous path: the same
tensors reach the sink in the same order, so the numbers never depend on the drain.
Threads: the caller's thread owns the D2H stream and submits; the drain thread only waits on
events, copies host memory and runs the sink (which takes the trainer's store lock itself).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from tierstore.errors import BudgetError
from tierstore.tiers.staging import StagingPool

Sink = Callable[[int, dict[str, torch.Tensor]], None]

# one item: (group, sink, [(name, shape, dtype, payload)], staging buffer, event) where a payload
# is a finished host tensor or (buffer, offset, nbytes) that the D2H stream fills before ``event``
_Item = tuple[int, Sink, list[tuple[str, torch.Size, torch.dtype, Any]], Any, Any]


def host_fp32(t: torch.Tensor) -> torch.Tensor:
    """A host fp32 copy of a gradient (the synchronous path)."""
    return t.detach().to("cpu", torch.float32)


class GradDrain:
    """Moves each group's gradients to fp32 host tensors and hands them to a sink, in order."""

    def __init__(self, device: torch.device, pool: StagingPool | None = None, threaded: bool | None = None) -> None:
        self.device = device
        cuda = device.type == "cuda" and torch.cuda.is_available()
        self.threaded = cuda if threaded is None else threaded
        self._stream = torch.cuda.Stream(device) if cuda else None
        self.pool = pool
        self._q: queue.Queue[_Item | None] = queue.Queue()
        self._pending = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self.staged_bytes = 0
        """Bytes copied down through the staging pool (the rest took the direct path)."""
        self._thread: threading.Thread | None = None
        if self.threaded:
            self._thread = threading.Thread(target=self._loop, name="trainer-grad-drain", daemon=True)
            self._thread.start()

    @classmethod
    def for_groups(cls, device: torch.device, group_bytes: list[int], threaded: bool | None = None,
                   store: Any = None) -> GradDrain:
        """A drain with (up to) three pinned buffers of one layer group's fp32 gradients each (CUDA only).

        One buffer fills on the D2H stream while the drain thread empties another; a group's
        gradients share one buffer, so small tensors (norms, biases) waste nothing. The prelude
        and head gradients (embeddings, larger than a layer) go down directly. With ``store`` the
        buffers are reserved from its RAM budget (fewer if it is tight; none: direct copies).
        """
        cuda = device.type == "cuda" and torch.cuda.is_available()
        pool = None
        if cuda:
            layers = group_bytes[1:-1] or group_bytes
            buf = -(-(max(layers) + 64 * 64) // 4096) * 4096  # room for the 64-byte alignment of each piece
            # at most 1/8 of the RAM budget, so the RAM tier keeps room for its chunks
            budget = store.stats().get("ram_budget") if hasattr(store, "stats") else None
            count = 3 if budget is None else min(3, budget // 8 // buf)
            try:
                if count < 1:
                    pool = None
                elif hasattr(store, "staging_pool"):
                    pool = store.staging_pool(buf, count)
                else:
                    pool = StagingPool(buf, count, pin=True)
            except BudgetError:
                pool = None  # no room in the RAM budget: the synchronous copies
        return cls(device, pool, threaded)

    def submit(self, g: int, grads: dict[str, torch.Tensor], sink: Sink) -> None:
        """Start moving group ``g``'s gradients down; ``sink(g, host_fp32_grads)`` runs later."""
        self._raise()
        if not self.threaded:
            sink(g, {n: host_fp32(t) for n, t in grads.items()})
            return
        items: list[tuple[str, torch.Size, torch.dtype, Any]] = []
        staged = self._stream is not None and self.pool is not None and all(
            t.device.type == "cuda" for t in grads.values())
        offsets, off = [], 0
        for t in grads.values():
            offsets.append(off)
            off += -(-(t.numel() * t.element_size()) // 64) * 64
        buf, event = None, None
        if staged and 0 < off <= self.pool.buffer_bytes:  # type: ignore[union-attr]
            assert self._stream is not None and self.pool is not None
            buf = self.pool.acquire()
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # this layer's backward
            with torch.cuda.stream(self._stream):
                for (name, t), o in zip(grads.items(), offsets, strict=True):
                    n = t.numel() * t.element_size()
                    buf[o:o + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
                    t.record_stream(self._stream)  # its memory is not reused before the copy ends
                    items.append((name, t.shape, t.dtype, (buf, o, n)))
                event = torch.cuda.Event()
                event.record(self._stream)
            self.staged_bytes += off
        else:  # on the CPU, or a group too large to stage: the synchronous copy
            items = [(name, t.shape, t.dtype, host_fp32(t)) for name, t in grads.items()]
        with self._cond:
            self._pending += 1
        self._q.put((g, sink, items, buf, event))

    @staticmethod
    def _finish(shape: torch.Size, dtype: torch.dtype, payload: Any) -> torch.Tensor:
        """The fp32 host tensor the sink keeps: a host payload as it is, a staged one copied out."""
        if isinstance(payload, torch.Tensor):
            return payload
        buf, off, nbytes = payload
        out = torch.empty(shape, dtype=torch.float32)
        out.copy_(buf[off:off + nbytes].view(dtype).reshape(shape))  # converts a bf16 gradient too
        return out

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._free_pool()
                return
            g, sink, items, buf, event = item
            try:
                if event is not None:
                    event.synchronize()  # this group's copy only: the GPU runs on meanwhile
                try:
                    grads = {name: self._finish(shape, dtype, p) for name, shape, dtype, p in items}
                finally:
                    if buf is not None:
                        assert self.pool is not None
                        self.pool.release(buf)  # emptied: the next layer may fill it
                if self._error is None:
                    sink(g, grads)
            except BaseException as e:  # handed to the training thread at its next call
                if self._error is None:
                    self._error = e
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("the gradient drain failed") from err

    def flush(self) -> None:
        """Wait until every submitted group has reached its sink; re-raise a sink's error."""
        with self._cond:
            while self._pending:
                self._cond.wait()
        self._raise()

    def close(self) -> None:
        """Finish queued work, stop the thread and free the pool (an unreported error is dropped)."""
        if self._thread is not None and self._thread is not threading.current_thread():
            with self._cond:
                while self._pending:
                    self._cond.wait()
            self._q.put(None)
            self._thread.join()
            self._thread = None
        self.close_soon()

    def close_soon(self) -> None:
        """Stop once the queued work is done, without waiting: safe in a finalizer on any thread.

        (A blocking close run by a garbage collection on the store's loop thread would wait for
        sinks that need that very thread.)
        """
        if self._thread is not None:
            self._q.put(None)  # the drain thread frees the pool on its way out
            return
        self._free_pool()

    def _free_pool(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            try:
                pool.close()
            except Exception:  # a closed store has no budget left to give the bytes back to
                pass
