"""Counters of an open store, and trace events exportable as Chrome trace JSON (Perfetto).

The tracer keeps the first ``StoreConfig.trace_events`` spans of a store's life (default
``DEFAULT_TRACE_EVENTS``; 0 turns tracing off) and counts the rest in ``dropped``. A span is
about 450 bytes, so the default costs at most about 4.5 MiB, outside the RAM budget.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

#: spans kept by default: the first steps of a training run, a few MiB
DEFAULT_TRACE_EVENTS = 10_000


@dataclasses.dataclass(slots=True)
class Counters:
    """Counters since open; ``Store.stats()`` reports them with the tiers' peaks."""

    hits_device: int = 0
    hits_host: int = 0
    reads_disk: int = 0
    bytes_read_disk: int = 0
    bytes_written_disk: int = 0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    stall_s: float = 0.0
    puts: int = 0
    gets: int = 0
    commits: int = 0
    prefetched_chunks: int = 0
    prefetch_errors: int = 0
    lent: int = 0  # tensors lent from the RAM tier (get(copy=False)) instead of copied
    bytes_lent: int = 0
    updates: int = 0  # update() loans
    bytes_copied_on_write: int = 0  # chunk bytes an update copied because a reader held them
    folders_recycled: int = 0  # generation folders renamed for a new generation, not remade


class Tracer:
    """Collects complete-span events (``ph: X``) from any thread, the first ``max_events``."""

    def __init__(self, max_events: int = DEFAULT_TRACE_EVENTS):
        self.max_events = max_events
        self.enabled = max_events > 0
        #: spans not kept because the cap was reached
        self.dropped = 0
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    def span(self, name: str, cat: str, start: float, end: float, **args: Any) -> None:
        """Record a span that ran from ``start`` to ``end`` (perf_counter seconds)."""
        if not self.enabled:
            return
        if len(self._events) >= self.max_events:  # racy read: the locked check below decides
            with self._lock:
                self.dropped += 1
            return
        ev = {"name": name, "cat": cat, "ph": "X", "ts": (start - self._t0) * 1e6,
              "dur": (end - start) * 1e6, "pid": 0, "tid": threading.current_thread().name,
              "args": args}
        with self._lock:
            if len(self._events) < self.max_events:
                self._events.append(ev)
            else:
                self.dropped += 1

    def events(self) -> list[dict[str, Any]]:
        """A copy of the recorded events."""
        with self._lock:
            return list(self._events)

    def chrome_trace(self) -> str:
        """The events as Chrome trace JSON (open in Perfetto or chrome://tracing)."""
        return json.dumps({"traceEvents": self.events(), "displayTimeUnit": "ms"})
