"""The device window: whole tensors on the compute device under a byte budget.

The window accounts for every tensor it has handed out while that tensor is alive (a weakref
finalizer returns its bytes), so its peak is the memory really held, not a guess. It keeps
strong references to recent tensors in LRU order and drops them to make room.

On CUDA, host-to-device copies run on the window's own stream and each tensor carries an event;
``wait_ready`` makes the consumer's current stream wait on it, so the host never blocks. Without
CUDA the device is the CPU, copies are synchronous, and the budget is enforced all the same.
Owned by the store's event loop thread, except the finalizers, which may run on any thread and
only touch ``_released`` under a lock.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch

from tierstore.errors import BudgetError


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
        self._events: weakref.WeakKeyDictionary[torch.Tensor, object] = weakref.WeakKeyDictionary()
        self.is_cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.is_cuda else None

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

    def admit(self, generation: int | None, host: torch.Tensor, owned: bool = False) -> torch.Tensor:
        """Move a host tensor into the window (room must have been made) and track it.

        ``owned`` says nobody else references ``host``, so on the CPU it is taken as it is.
        """
        nbytes = host.numel() * host.element_size()
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
