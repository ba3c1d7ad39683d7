"""In-place updates: what a writable loan of a key holds, and who may touch the key meanwhile.

``AsyncStore.update(key)`` lends the caller the key's value writable and makes what the caller
leaves in it the key's new head generation. Two ways, one contract:

- *in place* (a raw codec, not sharded, the tensor fits the RAM budget): the chunks' RAM-tier
  buffers are moved to the new generation's ids and lent as they are: no copy, no fresh page,
  no disk write. A buffer that a reader still reads (a loan from ``get(copy=False)``, a get in
  flight) is copied first (copy-on-write), so nobody sees bytes change under them. The old
  generation stays readable wherever else it lives (disk, when a commit named it).
- *through scratch* (coded or sharded tensors, or larger than the RAM budget): the value is
  decoded into a scratch buffer counted in the RAM budget; the release encodes it as the new
  generation, whose chunks stay dirty in RAM like the in-place ones.

While a key is lent (between ``begin`` and ``end`` of its ``BorrowTable`` entry) every other get,
put, delete or update of that key waits for the release, and a commit waits for in-place loans
to end: a reader never sees half an update, and a commit never publishes one. The chunks of an
in-place loan are flagged ``updating`` in the RAM tier: neither evicted nor written back.
Everything here is owned by the store's event loop thread.
"""

from __future__ import annotations

import asyncio
import dataclasses

import torch

from tierstore.records import GenRecord

#: crc32c of a chunk an in-place update changed, until it is written (computed there, once)
CRC_PENDING = -1


class BorrowTable:
    """Keys held by a writer (a put, a delete or an update) and events their waiters wait on.

    One writer per key at a time: a put, delete or update of a held key waits for its release.
    Gets wait only for updates (a get during a put returns the value before or after it). Loop
    thread only.
    """

    def __init__(self) -> None:
        self._released: dict[str, asyncio.Event] = {}
        #: keys held by an update: gets of them wait
        self._updating: set[str] = set()
        #: keys whose in-place loan made the head: a commit waits for them
        self.in_place: set[str] = set()
        self._none_in_place = asyncio.Event()
        self._none_in_place.set()

    def __contains__(self, key: str) -> bool:
        return key in self._released

    def updating(self, key: str) -> bool:
        """Whether ``key`` is lent to an update now."""
        return key in self._updating

    async def wait_free(self, key: str) -> None:
        """Return once no writer holds ``key`` (at once if none does)."""
        while (ev := self._released.get(key)) is not None:
            await ev.wait()

    async def wait_readable(self, key: str) -> None:
        """Return once no update holds ``key``."""
        while key in self._updating and (ev := self._released.get(key)) is not None:
            await ev.wait()

    async def acquire(self, key: str, update: bool = False) -> None:
        """Wait until ``key`` is free, then hold it (no await between the check and the hold)."""
        await self.wait_free(key)
        self._released[key] = asyncio.Event()
        if update:
            self._updating.add(key)

    def mark_in_place(self, key: str) -> None:
        """``key``'s head is now the generation being written in place."""
        self.in_place.add(key)
        self._none_in_place.clear()

    def release(self, key: str) -> None:
        """Give ``key`` back and wake its waiters."""
        self._updating.discard(key)
        self.in_place.discard(key)
        if not self.in_place:
            self._none_in_place.set()
        ev = self._released.pop(key, None)
        if ev is not None:
            ev.set()

    async def wait_no_in_place(self) -> None:
        """Return once no in-place loan is open (a commit must not publish one half-written)."""
        while self.in_place:
            await self._none_in_place.wait()


@dataclasses.dataclass(slots=True, eq=False)
class Update:
    """One writable loan: the record it replaces, the one it makes, and the tensors lent."""

    key: str
    old: GenRecord
    #: the new head's record (in place) or None (through scratch: made at release)
    new: GenRecord | None
    #: flat views of the valid part of each chunk, in order (in place) or of the scratch
    parts: list[torch.Tensor]
    #: the scratch holding the whole value (through scratch, or a shaped view of several chunks)
    scratch: torch.Tensor | None = None
    #: host buffers backing ``scratch``, given back to the RAM tier at release
    scratch_buf: torch.Tensor | None = None
    codec: object = None
    chunked: bool = False
    done: bool = False

    def value(self) -> torch.Tensor | list[torch.Tensor]:
        """What the caller is lent: the chunk views (``chunked``) or the shaped tensor."""
        shape = self.old.shape
        if self.chunked:
            return self.parts
        if self.scratch is not None:
            return self.scratch.view(shape)
        return self.parts[0].view(shape)  # in place, not chunked: one chunk (else a scratch)


def split_flat(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Views of ``flat`` cut into consecutive pieces of ``sizes`` elements."""
    out, at = [], 0
    for n in sizes:
        out.append(flat[at : at + n])
        at += n
    return out
