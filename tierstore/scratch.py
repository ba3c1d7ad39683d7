"""The decode buffers of updates through a scratch: apart from the RAM tier, kept for reuse.

An update of a coded (or sharded, or large) key decodes the whole value into a scratch buffer,
lends it, and encodes it back as the new head at release. Allocated from the RAM tier, such a
buffer pushed out the chunks it had to make room for: in a training step whose budget holds
part of the weights, the moments' scratch (the decoded ``m`` and ``v`` of each parameter, 8
bytes a parameter) evicted weights that forward, backward or the next update then read again
(docs/benchmarks.md, "where the reads of a training step go"). The pool keeps them apart:

- in use: one buffer per update through a scratch in flight, of the key's decoded size (so
  bounded by the updates the caller runs at once: the trainer's AdamW, one parameter);
- kept: buffers given back are kept, by exact size, for the next update of that size (no fresh
  pages a step), up to ``limit`` bytes; the least recently given back go first.

``stats()`` reports both (``scratch_bytes``, ``scratch_kept_bytes``, ``peak_scratch_bytes``).
Owned by the store's event loop thread.
"""

from __future__ import annotations

import sys
from collections import OrderedDict

import torch


class ScratchPool:
    """Scratch buffers handed out and kept for reuse, the kept ones bounded by ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"ScratchPool limit must be >= 0, got {limit}")
        self.limit = limit
        #: (size, serial) -> kept buffer, least recently given back first
        self._kept: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self._serial = 0
        self.kept_bytes = 0
        self.in_use = 0
        self.peak = 0
        #: buffers allocated fresh (the rest were reused)
        self.fresh = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes``: a kept one of that size, else a new one."""
        buf = None
        for k in [k for k in self._kept if k[0] == nbytes]:
            cand = self._kept.pop(k)
            self.kept_bytes -= nbytes
            # one still referenced elsewhere is let go, never handed out twice (as the RAM
            # tier's spares: the refs are this local name and getrefcount's argument)
            if sys.getrefcount(cand) <= 2:
                buf = cand
                break
            del cand
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            self.fresh += 1
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use + self.kept_bytes)
        return buf

    def give(self, buf: torch.Tensor) -> None:
        """Take back a buffer from ``take``: kept for reuse while the kept ones fit ``limit``."""
        n = buf.numel()
        self.in_use -= n
        if n > self.limit:
            return
        while self._kept and self.kept_bytes + n > self.limit:
            (size, _), _old = self._kept.popitem(last=False)
            self.kept_bytes -= size
        self._serial += 1
        self._kept[(n, self._serial)] = buf
        self.kept_bytes += n
