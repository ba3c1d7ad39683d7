"""Counters of an open store, and trace events exportable as Chrome trace JSON (Perfetto).

The tracer keeps the first ``StoreConfig.trace_events`` spans of a store's life (default
``DEFAULT_TRACE_EVENTS``; 0 turns tracing off) and counts the rest in ``dropped``. A span is kept
as a tuple (``_Span``) of about 200 bytes with its arguments, and becomes a Chrome trace event
(a dict of twice that) only when exported, so the default costs at most about 2 MiB, outside
the RAM budget. A long-running process sees that much growth over its first few thousand store
calls (a training run's first hundred or so steps), then none.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

#: spans kept by default: the first steps of a training run, about 2 MiB
DEFAULT_TRACE_EVENTS = 10_000

_Span = tuple[str, str, float, float, str, tuple[tuple[str, Any], ...]]


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
    updates_reused: int = 0  # of those, lent in the generation an earlier update made (no new one)
    bytes_copied_on_write: int = 0  # chunk bytes an update copied because a reader held them
    folders_recycled: int = 0  # generation folders renamed for a new generation, not remade
    crcs_ahead: int = 0  # crc32cs of hot chunks changed in place, taken after the update ended


class Tracer:
    """Collects complete-span events (``ph: X``) from any thread, the first ``max_events``."""

    def __init__(self, max_events: int = DEFAULT_TRACE_EVENTS):
        self.max_events = max_events
        self.enabled = max_events > 0
        #: spans not kept because the cap was reached
        self.dropped = 0
        #: (name, cat, start, end, thread name, args as (name, value) pairs): a dict per span
        #: would cost twice the memory for as long as the store is open
        self._events: list[_Span] = []
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
        ev = (name, cat, start, end, threading.current_thread().name, tuple(args.items()) if args else ())
        with self._lock:
            if len(self._events) < self.max_events:
                self._events.append(ev)
            else:
                self.dropped += 1

    def events(self) -> list[dict[str, Any]]:
        """The recorded spans as Chrome trace events (``ph: X``, microseconds since the tracer began)."""
        with self._lock:
            spans = list(self._events)
        return [{"name": name, "cat": cat, "ph": "X", "ts": (start - self._t0) * 1e6,
                 "dur": (end - start) * 1e6, "pid": 0, "tid": tid, "args": dict(args)}
                for name, cat, start, end, tid, args in spans]

    def chrome_trace(self) -> str:
        """The events as Chrome trace JSON (open in Perfetto or chrome://tracing)."""
        return json.dumps({"traceEvents": self.events(), "displayTimeUnit": "ms"})
