"""Fault injection at the disk tier's I/O call sites, for tests of crash and error paths.

A ``FaultPlan`` is given to the disk tier (``AsyncStore.inject_faults``). Each I/O call site asks
``plan.check(site, path)`` first; the plan counts calls and raises the chosen ``OSError`` at the
chosen ones. Sites: ``mkdir``, ``write``, ``fsync``, ``read``, ``delete``, ``catalog``.
``short_writes`` makes every ``pwritev`` write at most that many bytes, to exercise the resume loop.
Called from the I/O threads: the counter is guarded by a lock.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import threading

SITES = ("mkdir", "write", "fsync", "read", "delete", "catalog")


@dataclasses.dataclass
class FaultPlan:
    """Which I/O calls fail, and how."""

    #: fail the calls whose running number (0-based, over all sites in ``sites``) is listed
    fail_calls: set[int] = dataclasses.field(default_factory=set)
    #: fail every call at these sites (e.g. {"write"} for a full disk)
    fail_sites: set[str] = dataclasses.field(default_factory=set)
    #: fail the first call at each of these (site, path) pairs: independent of thread timing
    fail_at: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    #: the errno raised
    error: int = errno.EIO
    #: count and fail only these sites
    sites: tuple[str, ...] = SITES
    #: cap on the bytes one pwritev may write (None = no cap)
    short_writes: int | None = None
    calls: int = 0
    log: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def check(self, site: str, path: str) -> None:
        """Count a call at ``site``; raise the planned OSError if this call must fail."""
        if site not in self.sites:
            return
        with self._lock:
            n = self.calls
            self.calls += 1
            self.log.append((n, site, path))
            hit = (site, path) in self.fail_at
            self.fail_at.discard((site, path))
        if hit or n in self.fail_calls or site in self.fail_sites:
            raise OSError(self.error, f"{os.strerror(self.error)} (injected at {site} call {n})", path)

    def limit(self, nbytes: int) -> int:
        """How many of ``nbytes`` one write call may write."""
        return nbytes if self.short_writes is None else min(nbytes, self.short_writes)


def pwritev_limited(fd: int, views: list[memoryview], offset: int, limit: int) -> int:
    """``os.pwritev`` of at most ``limit`` bytes (fault injection of short writes)."""
    out: list[memoryview] = []
    left = limit
    for v in views:
        if left <= 0:
            break
        out.append(v[:left])
        left -= len(out[-1])
    return os.pwritev(fd, out, offset)
