"""The RAM tier: chunks in stored form under a byte budget, with write-back and backpressure.

Owned by the store's event loop thread: every method is called from that thread only, so the
tier needs no lock. Buffers are allocated through the tier before a chunk is built, so the budget
bounds the memory actually allocated, not just what has been inserted.

Lent buffers (``lend``; ``get(..., copy=False)`` on a CPU window): a chunk's buffer handed to a
caller as it is, read-only by contract. Who owns what:

- the tier owns the buffer and keeps counting its bytes in ``used`` for as long as any borrower
  holds it, whether the chunk is still cached or was dropped or evicted meanwhile (the window
  counts nothing for it: every lent byte is counted once, here);
- every lent tensor is (a view of) ``torch.from_numpy(entry.root)``: its storage holds a reference
  to ``root``, a numpy view of the buffer made for lending. So ``sys.getrefcount(root)`` counts
  the borrowers, views, ``detach()`` and ``.numpy()`` of lent tensors included, and only ``lend``
  (on the loop thread) can raise it: once it is down to the tier's own reference the buffer is
  free for good, whichever thread dropped the last tensor;
- a borrowed chunk is not evicted (that frees nothing); a dropped one (its generation superseded
  by a put, which writes new buffers: copy-on-write) waits in ``_held``, counted, and becomes a
  spare (or is given back) once its borrowers are gone. A spare is never borrowed, so no
  allocation can hand out memory a borrower still reads;
- a wait for room that could not succeed even with everything but the loans freed raises
  ``BudgetError`` at once: only the borrowers can give loans back, and the waiter may be one.

Writable loans (``AsyncStore.update``): the store moves a chunk's entry to the new generation's
id (``take_for_update``, no copy) and flags it ``updating`` until the caller releases it
(``end_update``). An updating chunk is dirty and is neither evicted nor written back: its bytes
are changing. Dirty chunks are written when the store asks (``dirty_lru``: a full budget, a
commit), not when they are made.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tierstore.errors import BudgetError

#: seconds a wait for RAM room waits for other callers' open in-place updates to end (their
#: chunks become writable, then reclaimable) before it raises ``BudgetError``: far longer than an
#: optimizer's update of a layer, short enough to surface a holder that waits on the waiter
UPDATE_WAIT_S = 30.0

ChunkId = tuple[int, int]  # (generation, chunk index)


@dataclasses.dataclass(slots=True)
class HostEntry:
    """One chunk's stored payload in RAM."""

    data: torch.Tensor  # uint8, the payload without the crc trailer
    dirty: bool
    #: memory of a caller's tensor (a put with ``copy=False``): never recycled as a spare
    adopted: bool = False
    #: a numpy view of ``data`` that every lent tensor's storage references (``lend``), else None
    root: np.ndarray | None = None
    #: lent writable to an in-place update: not evicted, not written, until ``end_update``
    updating: bool = False
    #: landed from the disk and not used since (a read ahead, or a read whose reader has yet
    #: to take it): evicted only after the other clean chunks (``_evict_one``)
    fresh: bool = False
    #: times the buffer was lent writable under its id: a crc32c taken while it stood still
    #: is good only if this has not moved since (``tierstore.updates.crc_ahead``)
    rewrites: int = 0

    def plain_victim(self) -> bool:
        """Whether an eviction may take it before any ``fresh`` chunk: clean, used, not lent."""
        return not (self.dirty or self.fresh or self.updating) and not self.borrowed()

    def borrowed(self) -> bool:
        """Whether a tensor lent from this buffer is still alive somewhere (any thread)."""
        # each lent tensor's storage (shared by its views) holds one reference to ``root``
        return self.root is not None and self._root_refs() > _UNLENT_ROOT_REFS

    def _root_refs(self) -> int:
        return sys.getrefcount(self.root)


def _unlent_root_refs() -> int:
    """``_root_refs`` of a root nobody borrowed: 2 on CPython 3.11 (the field, getrefcount's
    argument), measured rather than assumed since newer interpreters count stack references
    differently."""
    probe = HostEntry(torch.empty(1, dtype=torch.uint8), dirty=False)
    probe.root = probe.data.numpy()
    return probe._root_refs()


_UNLENT_ROOT_REFS = _unlent_root_refs()


class HostTier:
    """A cache of chunk payloads (least recently used, or by plan: ``rank``) that never exceeds ``budget``."""

    def __init__(self, budget: int | None, pin: bool = False):
        self.budget = budget
        self.pin = pin
        self.used = 0
        self.peak = 0
        self._entries: OrderedDict[ChunkId, HostEntry] = OrderedDict()
        #: buffers of dropped chunks by size, kept (and counted in ``used``) for reuse: a put
        #: that replaces a tensor then fills the old buffers instead of faulting in new pages
        #: (fresh pages fault in at a fraction of the speed of a copy into reused memory)
        self._spare: dict[int, list[torch.Tensor]] = {}
        #: buffers allocated fresh from the OS since open (the rest were recycled)
        self.fresh_buffers = 0
        #: dropped or evicted chunks whose buffers are still lent: counted until given back
        self._held: list[HostEntry] = []
        #: bytes allocated for disk reads still running: each lands as a clean (evictable) chunk
        #: or is released, so a wait for room while it is above 0 is not stuck
        self.loading = 0
        #: set by ``explain_stuck`` when only reads in flight can make room (no write-back runs):
        #: then the next clean landing wakes the waiters. Otherwise they wait for the write-back,
        #: whose chunk is the one a plan needs last, not the read just landed (needed next)
        self.wake_on_landing = False
        self._freed = asyncio.Event()
        #: waiters for room that give up first when nothing can be freed (``alloc(optional=)``)
        self._optional_waiters = 0
        #: called when a reservation cannot wait any longer; returns a reason or None to wait
        self.explain_stuck: Callable[[], str | None] = lambda: None
        #: who waits now (``tierstore.callers``), and the callers waiting for room: a waiter
        #: stuck behind open in-place updates waits while ``updates_may_free`` says one of
        #: them is held by a caller who is not waiting too (it can end and free the room)
        self.caller: Callable[[], object | None] = lambda: None
        self.waiting: dict[object | None, int] = {}
        self.updates_may_free: Callable[[object | None], bool] = lambda me: False
        #: how long a waiter waits for such updates to end before it gives up (a holder that
        #: waits on this waiter in some other way, a key it holds, would never end its update)
        self.update_wait_s = UPDATE_WAIT_S
        #: how late a chunk is needed again (an access plan); the highest goes first, when set:
        #: evicted first, written back first. None: least recently used first
        self.rank: Callable[[ChunkId], float] | None = None
        #: False while a waiter for room that nothing else can free evicts ``fresh`` chunks too
        self.keep_fresh = True

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        self.fresh_buffers += 1
        if self.pin:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return torch.empty(nbytes, dtype=torch.uint8)

    def fits(self, nbytes: int) -> bool:
        """Whether a chunk of ``nbytes`` can ever be held."""
        return self.budget is None or nbytes <= self.budget

    def try_alloc(self, nbytes: int, above: float = -1.0) -> torch.Tensor | None:
        """A buffer of ``nbytes`` counted in the budget, evicting clean chunks; None if full.

        Buffers of dropped and evicted chunks become spares, and a spare of the same size is
        handed over as it is: in steady state the tier recycles its buffers instead of
        faulting in fresh pages for every chunk. ``above``: evict only chunks ranked higher
        (needed later than what the buffer is for: a read ahead never pushes out what comes first).
        """
        if self._held:
            self._reclaim()
        victims: list[ChunkId] | None = None
        while (spare := self._take_spare(nbytes)) is None:
            if self.budget is None or self.used + nbytes <= self.budget:
                self.used += nbytes
                self.peak = max(self.peak, self.used)
                return self._new_buffer(nbytes)
            if self._free_one_spare():
                continue
            if victims is None:
                victims = self._ranked_victims(above)
            if not self._evict_next(victims, above):
                return None
        return spare  # its bytes stay counted: they move to the new owner

    def try_reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` of memory the caller brings (an adopted buffer), evicting as needed."""
        if self._held:
            self._reclaim()
        victims: list[ChunkId] | None = None
        while self.budget is not None and self.used + nbytes > self.budget:
            if self._free_one_spare():
                continue
            if victims is None:
                victims = self._ranked_victims(-1.0)
            if not self._evict_next(victims, -1.0):
                return False
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return True

    async def alloc(self, nbytes: int, optional: bool = False) -> torch.Tensor:
        """A buffer of ``nbytes``, waiting for write-backs to free room (backpressure).

        ``optional``: the caller can do without (a read that goes uncached on ``BudgetError``);
        when nothing can be freed it gives up first, so that the others wait for it to go on.
        """
        return await self._wait_for(nbytes, self.try_alloc, optional)

    async def reserve(self, nbytes: int) -> None:
        """``try_reserve``, waiting for write-backs to free room (backpressure)."""
        await self._wait_for(nbytes, lambda n: True if self.try_reserve(n) else None)

    async def _wait_for(self, nbytes: int, attempt: Callable[[int], Any],
                        optional: bool = False) -> Any:
        if not self.fits(nbytes):
            raise BudgetError(f"a chunk of {nbytes} B is larger than the RAM budget ({self.budget} B)")
        if optional:
            self._optional_waiters += 1
        try:
            return await self._wait_loop(nbytes, attempt, optional)
        finally:
            if optional:
                self._optional_waiters -= 1

    async def _wait_loop(self, nbytes: int, attempt: Callable[[int], Any], optional: bool) -> Any:
        me = self.caller()
        self.waiting[me] = self.waiting.get(me, 0) + 1
        try:
            return await self._wait_as(me, nbytes, attempt, optional)
        finally:
            if self.waiting[me] == 1:
                del self.waiting[me]
            else:
                self.waiting[me] -= 1

    async def _wait_as(self, me: object | None, nbytes: int, attempt: Callable[[int], Any],
                       optional: bool) -> Any:
        behind_updates_since: float | None = None
        while (got := attempt(nbytes)) is None:
            lent = self.lent_bytes() if self.budget is not None else 0
            if lent and self.budget is not None and self.budget - lent < nbytes:
                # only their borrowers can give them back, and this wait may be one of them
                raise BudgetError(
                    f"RAM budget full: {lent} of its {self.budget} B are lent to tensors still "
                    f"referenced (get(..., copy=False)), {nbytes} B more do not fit beside them; "
                    "drop the lent tensors you no longer need")
            reason = self.explain_stuck()
            if reason is not None:
                # a write-back that cannot run frees nothing: the reads not yet used go first
                self.keep_fresh = False
                try:
                    got = attempt(nbytes)
                finally:
                    self.keep_fresh = True
                if got is not None:
                    return got
                waited = self._waited_behind_updates(me, behind_updates_since)
                if waited is None:  # their ends wake this wait
                    behind_updates_since = behind_updates_since or time.monotonic()
                else:
                    if optional or not self._optional_waiters:
                        if waited:
                            reason += f" (waited {waited:.1f} s for the open update()s to end)"
                        raise BudgetError(f"RAM budget full and nothing can be freed: {reason}")
                    # an optional waiter may be what holds the room up (the reads of an update
                    # that holds its loans): wake it to give up and go on uncached, then wait
                    self._freed.set()
                    await asyncio.sleep(0)
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
        return got

    def _waited_behind_updates(self, me: object | None, since: float | None) -> float | None:
        """None to wait on for open in-place updates to end; else the seconds already waited."""
        waited = 0.0 if since is None else time.monotonic() - since
        if waited < self.update_wait_s and self.updates_may_free(me):
            return None
        return waited

    def release(self, buf: torch.Tensor) -> None:
        """Return an allocated buffer that was not inserted."""
        self.used -= buf.numel()
        self._freed.set()

    def recycle(self, buf: torch.Tensor) -> None:
        """Return an allocated buffer that was not inserted, kept (counted) for reuse as a spare."""
        if self.budget is None:
            self.release(buf)
            return
        self._spare.setdefault(buf.numel(), []).append(buf)
        self._freed.set()

    def take_for_update(self, old: ChunkId, new: ChunkId) -> torch.Tensor:
        """Move a held chunk's buffer to ``new`` as a dirty chunk lent writable; returns the buffer.

        The caller checked that nobody reads the old chunk's buffer (no loan, no pinned reader):
        the move copies nothing, and the old id is no longer held.
        """
        e = self._entries.pop(old)
        assert not e.borrowed() and not e.updating
        e.root = None  # a later loan gets a root of its own
        e.dirty = True
        e.updating = True
        e.fresh = False
        e.rewrites += 1
        self._entries[new] = e
        return e.data

    def free_to_update(self, generation: int, n_chunks: int) -> bool:
        """Whether every chunk of ``generation`` is held and none is lent now (one call a key)."""
        entries = self._entries
        for i in range(n_chunks):
            e = entries.get((generation, i))
            if e is None or e.borrowed():
                return False
        return True

    def holds_all(self, generation: int, n_chunks: int) -> bool:
        """Whether every chunk of ``generation`` is held (recency untouched)."""
        entries = self._entries
        return all((generation, i) in entries for i in range(n_chunks))

    def all_dirty(self, generation: int, n_chunks: int) -> bool:
        """Whether every chunk of ``generation`` is held and not yet on disk."""
        entries = self._entries
        for i in range(n_chunks):
            e = entries.get((generation, i))
            if e is None or not e.dirty:
                return False
        return True

    def take_again(self, cid: ChunkId) -> torch.Tensor:
        """Lend a held dirty chunk's buffer writable under the same id; returns the buffer.

        The caller checked that nobody reads it (no loan, no pinned reader) and that it never
        reached the disk: ``take_for_update`` without the move.
        """
        e = self._entries[cid]
        assert e.dirty and not e.borrowed() and not e.updating
        e.root = None  # a later loan gets a root of its own
        e.updating = True
        e.rewrites += 1
        self._entries.move_to_end(cid)
        return e.data

    def insert_for_update(self, cid: ChunkId, data: torch.Tensor) -> None:
        """Insert a copied-on-write buffer (from ``alloc``) as a dirty chunk lent writable."""
        self.insert(cid, data, dirty=True)
        self._entries[cid].updating = True

    def entry(self, cid: ChunkId) -> HostEntry | None:
        """The chunk's entry if held, without marking it used."""
        return self._entries.get(cid)

    def end_update(self, cid: ChunkId) -> None:
        """The writable loan of ``cid`` ended: it may now be written back (and then evicted)."""
        e = self._entries.get(cid)
        if e is not None:
            e.updating = False
            self._freed.set()

    def dirty_lru(self) -> list[ChunkId]:
        """Dirty chunks that may be written now (not lent writable): needed last first (``rank``),
        else least recently used first."""
        out = [cid for cid, e in self._entries.items() if e.dirty and not e.updating]
        if self.rank is not None:
            out.sort(key=self.rank, reverse=True)  # stable: least recently used first among equals
        return out

    def reclaimable_at_least(self, nbytes: int) -> bool:
        """Whether an allocation could get ``nbytes`` now without a write: free, spare, or clean
        and unlent (counted only as far as needed)."""
        free = (self.budget - self.used) if self.budget is not None else 0
        free += sum(size * len(bufs) for size, bufs in self._spare.items())
        if free >= nbytes:
            return True
        for e in self._entries.values():
            if not e.dirty and not e.updating and not e.borrowed():
                free += e.data.numel()
                if free >= nbytes:
                    return True
        return False

    def insert(self, cid: ChunkId, data: torch.Tensor, dirty: bool, adopted: bool = False,
               fresh: bool = False) -> None:
        """Insert a chunk whose buffer came from ``alloc``/``try_alloc`` (``adopted``: ``reserve``;
        ``fresh``: read from the disk for a use still to come)."""
        old = self._entries.pop(cid, None)
        if old is not None:
            if old.borrowed():
                self._held.append(old)  # still read by a borrower: counted until it lets go
            else:
                self.used -= old.data.numel()
        self._entries[cid] = HostEntry(data, dirty, adopted, fresh=fresh and not dirty)
        if not dirty and self.wake_on_landing:
            self.wake_on_landing = False
            self._freed.set()  # a clean chunk can be evicted: waiters for room try again

    def untouched(self, cid: ChunkId) -> bool:
        """Whether only the store could have written the chunk's buffer: held, never lent since
        it got this id, not a caller's memory (``put(copy=False)``)."""
        e = self._entries.get(cid)
        return e is not None and e.root is None and not e.adopted

    def lookup(self, cid: ChunkId) -> torch.Tensor | None:
        """The chunk's payload if held (and mark it recently used)."""
        e = self._entries.get(cid)
        if e is None:
            return None
        self._entries.move_to_end(cid)
        e.fresh = False
        return e.data

    def mark_used(self, cid: ChunkId) -> None:
        """A chunk read for a caller reached it: no longer ``fresh``."""
        e = self._entries.get(cid)
        if e is not None:
            e.fresh = False

    def lend(self, cid: ChunkId) -> torch.Tensor | None:
        """The chunk's whole buffer as a new uint8 tensor to lend out (read-only by contract); None if not held.

        The tensor shares the buffer's memory (no copy) and its storage references the entry's
        ``root``, so the tier sees the loan for as long as the tensor, or anything made from it,
        is alive; its bytes stay counted in ``used`` all that time (see the module docstring).
        """
        e = self._entries.get(cid)
        if e is None:
            return None
        self._entries.move_to_end(cid)
        e.fresh = False
        if e.root is None:
            e.root = e.data.numpy()
        return torch.from_numpy(e.root)

    def was_lent(self, cid: ChunkId) -> bool:
        """Whether the chunk's buffer has been lent (``lend``) since it got this id, loan alive or not."""
        e = self._entries.get(cid)
        return e is not None and e.root is not None

    def lent(self, cid: ChunkId) -> bool:
        """Whether the chunk is held and a tensor lent from its buffer is still alive."""
        e = self._entries.get(cid)
        return e is not None and e.borrowed()

    def lent_bytes(self) -> int:
        """Bytes of buffers lent out now (cached chunks and dropped ones), all counted in ``used``."""
        return (sum(e.data.numel() for e in self._entries.values() if e.borrowed())
                + sum(e.data.numel() for e in self._held if e.borrowed()))

    def dirty_payload(self, cid: ChunkId) -> torch.Tensor | None:
        """The chunk's payload if it is held and not yet on disk (a write to retry)."""
        e = self._entries.get(cid)
        return e.data if e is not None and e.dirty else None

    def holds(self, cid: ChunkId) -> bool:
        """Whether the chunk is held, without touching its recency."""
        return cid in self._entries

    def mark_clean(self, cid: ChunkId) -> None:
        """The chunk's payload is on disk: it may now be evicted."""
        e = self._entries.get(cid)
        if e is not None and e.dirty:
            e.dirty = False
            self._freed.set()

    def drop(self, cid: ChunkId) -> None:
        """Forget a chunk, dirty or not (its generation is gone); keep its buffer for reuse."""
        e = self._entries.pop(cid, None)
        if e is not None:
            self._to_spare(e)
            self._freed.set()

    def _to_spare(self, e: HostEntry) -> None:
        """Keep a chunk's buffer (still counted) for the next allocation of its size."""
        if e.borrowed():
            self._held.append(e)  # lent: it becomes a spare once its borrowers are gone
            return
        e.root = None
        buf = e.data
        # without a budget nothing would ever bound the spares; an adopted buffer is a view of
        # a caller's tensor, which must never be handed out as another chunk's buffer
        if self.budget is None or e.adopted:
            self.used -= buf.numel()
        else:
            self._spare.setdefault(buf.numel(), []).append(buf)

    def _dirty_last(self, rank: Callable[[ChunkId], float]) -> float:
        """The highest rank of a dirty chunk that may be written now."""
        return max((rank(cid) for cid, e in self._entries.items() if e.dirty and not e.updating),
                   default=-math.inf)

    def _reclaim(self) -> bool:
        """Turn held buffers whose borrowers are gone into spares (or give them back); True if any."""
        back: list[HostEntry] = []
        still: list[HostEntry] = []
        for e in self._held:  # one look at each: a borrower on another thread may let go meanwhile
            (still if e.borrowed() else back).append(e)
        if not back:
            return False
        self._held = still
        for e in back:
            self._to_spare(e)
        self._freed.set()
        return True

    def _take_spare(self, nbytes: int) -> torch.Tensor | None:
        """A spare buffer of exactly ``nbytes`` that nobody references any more, or None."""
        bufs = self._spare.get(nbytes)
        while bufs:
            buf = bufs.pop()
            # a reader may still be copying out of a dropped chunk: reuse only a buffer whose
            # refs are this local name and getrefcount's argument
            if sys.getrefcount(buf) <= 2:
                return buf
            self.used -= nbytes  # still in use elsewhere: let it go, uncounted
        return None

    def _free_one_spare(self) -> bool:
        """Give one spare buffer back (uncount it); False when there is none."""
        for size, bufs in self._spare.items():
            if bufs:
                bufs.pop()
                self.used -= size
                return True
        return False

    def drop_generation(self, generation: int, n_chunks: int) -> None:
        """Forget every chunk of a generation."""
        for i in range(n_chunks):
            self.drop((generation, i))

    def dirty_count(self) -> int:
        """Chunks not yet on disk."""
        return sum(e.dirty for e in self._entries.values())

    def _ranked_victims(self, above: float) -> list[ChunkId]:
        """The clean chunks ``_evict_one`` would take while no ``fresh`` one is due, the next
        victim last: one walk for all the evictions of one allocation, not one walk each.

        Empty without a plan (least recently used first: ``_evict_one`` stops at the first)."""
        rank = self.rank
        if rank is None:
            return []
        ranked = [(r, cid) for cid, e in self._entries.items()
                  if e.plain_victim() and (r := rank(cid)) > above]
        # stable: among equal ranks the least recently used goes first, as in ``_evict_one``
        ranked.sort(key=lambda rc: rc[0], reverse=True)
        return [cid for _, cid in reversed(ranked)]

    def _evict_next(self, victims: list[ChunkId], above: float) -> bool:
        """Evict the next of ``victims`` (``_ranked_victims``) still evictable, else ``_evict_one``.

        Nothing else runs on the loop thread meanwhile, so ranks and recency hold still; a
        borrower on another thread can only let go, and the chunk it frees is ranked by the
        next allocation's walk."""
        while victims:
            cid = victims.pop()
            e = self._entries.get(cid)
            if e is not None and e.plain_victim():
                self._to_spare(self._entries.pop(cid))
                return True
        return self._evict_one(above)

    def _evict_one(self, above: float = -1.0) -> bool:
        """Make a clean chunk's buffer a spare: the one needed last (``rank``), else the least
        recently used; only one ranked over ``above``. False if there is none.

        A lent chunk is passed over: evicting it would free nothing while its borrower reads it.
        A ``fresh`` chunk (read, not yet used) goes only after every other clean one, and not
        at all while the write-back of a dirty chunk needed no sooner can make room instead
        and fresh chunks hold at most half the budget: evicting a read before its use costs
        the same read again.
        """
        rank = self.rank
        victim, best = None, above
        fresh_victim, fresh_best = None, above
        fresh_bytes, writable_dirty = 0, False
        for cid, e in self._entries.items():
            if e.dirty:
                writable_dirty = writable_dirty or not e.updating
                continue
            if e.fresh:
                fresh_bytes += e.data.numel()
            if e.updating or e.borrowed():
                continue
            if rank is None:  # least recently used first
                if not e.fresh:
                    victim = cid
                    break
                if fresh_victim is None:
                    fresh_victim = cid
                continue
            r = rank(cid)
            if e.fresh:
                if r > fresh_best:
                    fresh_victim, fresh_best = cid, r
            elif r > best:
                victim, best = cid, r
        if victim is None and fresh_victim is not None:
            # a write-back makes room instead where a dirty chunk is needed no sooner
            waits = (self.keep_fresh and writable_dirty
                     and (self.budget is None or 2 * fresh_bytes <= self.budget)
                     and (rank is None or self._dirty_last(rank) >= fresh_best))
            victim = None if waits else fresh_victim
        if victim is None:
            return False
        self._to_spare(self._entries.pop(victim))
        return True
