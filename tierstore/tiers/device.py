"""The device window: whole tensors on the compute device under a byte budget.

The window accounts for every tensor it has handed out while that tensor is alive (a weakref
finalizer returns its bytes), so its peak is the memory really held, not a guess. It keeps
strong references to recent tensors in LRU order and drops them to make room.

On CUDA, host-to-device copies run on the window's own H2D stream and each tensor carries an
event; ``wait_ready`` makes the consumer's current stream wait on it, so the host never blocks.
With a staging pool attached (``attach_staging``; the store does it on CUDA) an upload goes
through the pool's pinned buffers in pieces, so the DMA is truly asynchronous, and device-to-host
copies (``to_host``) run on a second, D2H stream into the same buffers. Without CUDA the device
is the CPU, copies are synchronous, the pool is not used, and the budget is enforced all the same.
Owned by the store's event loop thread, except the finalizers, which may run on any thread and
only touch ``_released`` under a lock; both CUDA streams belong to the window. The pool is
``loop_owned``: its buffers are taken only by ``await acquire_async()``, since coroutines of the
same loop hold buffers across awaits and a blocked loop would never see them released; so the
copies that need one (``admit`` of a pageable tensor, ``to_host``) are coroutines.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch
from torch.utils.weak import WeakIdKeyDictionary

from tierstore.errors import BudgetError
from tierstore.tiers.staging import StagingPool


class DeviceWindow:
    """Tensors on ``device`` whose live bytes never exceed ``budget``."""

    def __init__(self, device: torch.device, budget: int | None):
        self.device = device
        self.budget = budget
        self.peak = 0
        self._live = 0
        self._released = 0
        self._lock = threading.Lock()
        self._strong: OrderedDict[int, torch.Tensor] = OrderedDict()  # generation -> tensor
        self._weak: dict[int, weakref.ref[torch.Tensor]] = {}
        # keyed by identity: a WeakKeyDictionary compares tensor keys with ==, which is elementwise
        self._events: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.is_cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.is_cuda else None
        self._d2h_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.staging: StagingPool | None = None

    def attach_staging(self, host: object, on_cpu: bool = False) -> None:
        """Stage copies through pinned buffers reserved from ``host`` (a HostTier); CUDA only.

        Without room in the RAM budget for even one buffer the window keeps direct copies.
        ``on_cpu`` attaches a (pageable) pool to a CPU window too: the tests of the staged read
        path, whose copies are then plain and synchronous.
        """
        if (not self.is_cuda and not on_cpu) or self.staging is not None:
            return
        try:
            self.staging = StagingPool.from_host_tier(host, self.budget, loop_owned=True)
        except BudgetError:
            self.staging = None

    @property
    def live_bytes(self) -> int:
        """Bytes of window tensors alive now."""
        with self._lock:
            self._live -= self._released
            self._released = 0
            return self._live

    def _on_free(self, nbytes: int) -> None:
        with self._lock:
            self._released += nbytes

    def lookup(self, generation: int) -> torch.Tensor | None:
        """The generation's tensor if it is still alive on the device."""
        ref = self._weak.get(generation)
        t = ref() if ref is not None else None
        if t is None:
            self._weak.pop(generation, None)
            return None
        self._strong[generation] = t
        self._strong.move_to_end(generation)
        return t

    def peek(self, generation: int) -> torch.Tensor | None:
        """The generation's tensor if it is still alive, without making it recently used."""
        ref = self._weak.get(generation)
        return ref() if ref is not None else None

    def make_room(self, nbytes: int) -> bool:
        """Drop LRU strong references until ``nbytes`` more fit; False if they cannot yet."""
        if self.budget is None:
            return True
        if nbytes > self.budget:
            raise BudgetError(
                f"a tensor of {nbytes} B is larger than the device window ({self.budget} B); "
                "read it to the host or in slices"
            )
        while self.live_bytes + nbytes > self.budget and self._strong:
            self._strong.popitem(last=False)
        return self.live_bytes + nbytes <= self.budget

    async def admit(self, generation: int | None, host: torch.Tensor, owned: bool = False) -> torch.Tensor:
        """Move a host tensor into the window (room must have been made) and track it.

        ``owned`` says nobody else references ``host``, so on the CPU it is taken as it is.
        """
        nbytes = host.numel() * host.element_size()
        if self.is_cuda and self.staging is not None and not host.is_pinned():
            return self.finish_upload(generation, await self._upload_staged(host))
        if self.is_cuda:
            assert self._stream is not None
            with torch.cuda.stream(self._stream):
                t = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
            self._events[t] = event
        else:
            t = host if owned else host.clone()
        with self._lock:
            self._live += nbytes
        self.peak = max(self.peak, self.live_bytes)
        weakref.finalize(t, self._on_free, nbytes)
        if generation is not None:
            self._weak[generation] = weakref.ref(t)
            self._strong[generation] = t
        return t

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor for the caller's own data, counted while alive; BudgetError without room.

        Made on the device's current stream (the caller computes into it), not the H2D stream.
        """
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if not self.make_room(nbytes):
            raise BudgetError(
                f"a buffer of {nbytes} B does not fit the device window ({self.budget} B) beside the "
                f"{self.live_bytes} B of tensors held now"
            )
        t = torch.empty(shape, dtype=dtype, device=self.device)
        with self._lock:
            self._live += nbytes
        self.peak = max(self.peak, self.live_bytes)
        weakref.finalize(t, self._on_free, nbytes)
        return t

    # -- uploads filled piece by piece from the RAM tier (reads.py), without a host tensor --------
    def start_upload(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised window tensor, counted at once (room must have been made)."""
        nbytes = 1
        for s in shape:
            nbytes *= s
        nbytes *= torch.empty((), dtype=dtype).element_size()
        if self.is_cuda:
            assert self._stream is not None
            with torch.cuda.stream(self._stream):  # its memory belongs to the H2D stream
                t = torch.empty(shape, dtype=dtype, device=self.device)
        else:
            t = torch.empty(shape, dtype=dtype)
        with self._lock:
            self._live += nbytes
        self.peak = max(self.peak, self.live_bytes)
        weakref.finalize(t, self._on_free, nbytes)  # a failed fill drops it: its bytes come back
        return t

    def upload_piece(self, t: torch.Tensor, lo: int, hi: int, buf: torch.Tensor) -> None:
        """Copy a staging buffer's first ``hi - lo`` elements into flat ``t[lo:hi]``; ``buf`` goes back to the pool.

        On CUDA the copy is queued on the H2D stream and the buffer is reused once it has run.
        """
        assert self.staging is not None
        n = (hi - lo) * t.element_size()
        dst = t.reshape(-1)[lo:hi].view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)[lo:hi]
        if self.is_cuda:
            assert self._stream is not None
            with torch.cuda.stream(self._stream):
                dst.copy_(buf[:n], non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            self.staging.release(buf, after=done)
        else:
            dst.copy_(buf[:n])
            self.staging.release(buf)

    def finish_upload(self, generation: int | None, t: torch.Tensor) -> torch.Tensor:
        """Mark a filled upload ready (an event consumers wait on) and track it."""
        if self.is_cuda:
            assert self._stream is not None
            event = torch.cuda.Event()
            event.record(self._stream)
            self._events[t] = event
        if generation is not None:
            self._weak[generation] = weakref.ref(t)
            self._strong[generation] = t
        return t

    async def _upload_staged(self, host: torch.Tensor) -> torch.Tensor:
        """Copy a pageable host tensor up through pinned buffers, piece by piece, on the H2D stream.

        The tensor is counted from the start (``start_upload``): a coroutine that makes room
        while this one awaits a buffer sees its bytes.
        """
        pool = self.staging
        assert pool is not None and self._stream is not None
        src = host.contiguous().reshape(-1).view(torch.uint8) if host.numel() else host.reshape(-1)
        t = self.start_upload(tuple(host.shape), host.dtype)
        dst = t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)
        n, step = src.numel(), pool.buffer_bytes
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            buf = await pool.acquire_async()
            with torch.cuda.stream(self._stream):
                buf[: hi - lo].copy_(src[lo:hi])  # host memcpy into page-locked memory
                dst[lo:hi].copy_(buf[: hi - lo], non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            pool.release(buf, after=done)  # reused once this piece's DMA has run
        return t

    async def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of a device tensor, copied on the D2H stream through the staging pool.

        The D2H stream first waits on the caller's current stream (the kernels that produced
        ``t``); the host then waits for the copy itself, piece by piece, since the caller needs the
        bytes. A CPU tensor, or a window without a pool, takes the plain ``.to("cpu")``.
        """
        pool = self.staging
        if t.device.type != "cuda" or pool is None or self._d2h_stream is None or t.numel() == 0:
            return t.to("cpu")
        out = torch.empty(t.shape, dtype=t.dtype)
        src = t.contiguous().reshape(-1).view(torch.uint8)
        dst = out.reshape(-1).view(torch.uint8)
        produced = torch.cuda.current_stream(t.device)
        self._d2h_stream.wait_stream(produced)
        n, step = src.numel(), pool.buffer_bytes
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            buf = await pool.acquire_async()
            try:
                with torch.cuda.stream(self._d2h_stream):
                    buf[: hi - lo].copy_(src[lo:hi], non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self._d2h_stream)
                done.synchronize()
                dst[lo:hi].copy_(buf[: hi - lo])
            finally:
                pool.release(buf)
        return out

    def wait_ready(self, t: torch.Tensor) -> None:
        """Make the caller's current CUDA stream wait for ``t``'s copy; no-op on the CPU."""
        event = self._events.get(t) if self.is_cuda else None
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]
            t.record_stream(torch.cuda.current_stream(self.device))

    def forget(self, generation: int) -> None:
        """Drop the window's own reference to a superseded generation."""
        self._strong.pop(generation, None)
        self._weak.pop(generation, None)

    def clear(self) -> None:
        """Drop every strong reference (on close)."""
        self._strong.clear()
        self._weak.clear()
        if self.staging is not None:
            self.staging.close()
            self.staging = None
