"""In-place updates: what a writable loan of a key holds, and who may touch the key meanwhile.

``AsyncStore.update(key)`` lends the caller the key's value writable and makes what the caller
leaves in it the key's new head generation. Two ways, one contract:

- *in place* (a raw codec, not sharded, the tensor fits the RAM budget): the chunks' RAM-tier
  buffers are moved to the new generation's ids and lent as they are: no copy, no fresh page,
  no disk write. A buffer that a reader still reads (a loan from ``get(copy=False)``, a get in
  flight) is copied first (copy-on-write), so nobody sees bytes change under them. The old
  generation stays readable wherever else it lives (disk, when a commit named it).
- *through scratch* (coded or sharded tensors, or larger than the RAM budget): the value is
  decoded into a scratch buffer of the store's ``ScratchPool``, apart from the RAM budget (taken
  from it, the buffer pushed out chunks that were read again: ``tierstore.scratch``); the
  release encodes it as the new generation, whose chunks stay dirty in RAM like the in-place
  ones.

While a key is lent (between ``begin`` and ``end`` of its ``BorrowTable`` entry) every other get,
put, delete or update of that key waits for the release, and a commit waits for in-place loans
to end: a reader never sees half an update, and a commit never publishes one. The chunks of an
in-place loan are flagged ``updating`` in the RAM tier: neither evicted nor written back.
Everything here is owned by the store's event loop thread.

The update path itself (``begin_update``, ``end_update``, the plan and its look-ahead) is plain
functions of the store rather than a collaborator object: it uses most of the store's private
state (head, RAM tier, borrows, pins, write tasks, generation counter, commit lock) and its read
and put paths. ``AsyncStore.update``, ``begin_update(s)``, ``end_update(s)`` and ``plan`` call it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tierstore import callers
from tierstore.errors import LoanWritten
from tierstore.keys import validate_key
from tierstore.plan import AccessPlan
from tierstore.records import CRC_PENDING, GenRecord
from tierstore.retirement import forget_in_memory, retire_soon
from tierstore.settle import finish_despite_cancel, settle
from tierstore.tiers.disk import checksum
from tierstore.writes import start_write_back

if TYPE_CHECKING:
    from tierstore.store import AsyncStore

class BorrowTable:
    """Keys held by a writer (a put, a delete or an update) and events their waiters wait on.

    One writer per key at a time: a put, delete or update of a held key waits for its release.
    Gets wait only for updates (a get during a put returns the value before or after it). Loop
    thread only.
    """

    def __init__(self) -> None:
        #: held keys -> the event their waiters wait on (made by the first waiter: most holds
        #: have none, and an event a hold would cost microseconds a key of a training step)
        self._released: dict[str, asyncio.Event | None] = {}
        #: keys held by an update: gets of them wait
        self._updating: set[str] = set()
        #: keys whose in-place loan made the head (a commit waits for them) -> who holds the loan
        self.in_place: dict[str, object | None] = {}
        self._none_in_place = asyncio.Event()
        self._none_in_place.set()
        #: commits waiting for the in-place loans to end: no new update starts meanwhile
        self._commits_waiting = 0
        self._no_commit_waiting = asyncio.Event()
        self._no_commit_waiting.set()

    def __contains__(self, key: str) -> bool:
        return key in self._released

    def updating(self, key: str) -> bool:
        """Whether ``key`` is lent to an update now."""
        return key in self._updating

    def _event(self, key: str) -> asyncio.Event:
        """The event set when held ``key`` is released (made now if nobody waited yet)."""
        ev = self._released[key]
        if ev is None:
            ev = self._released[key] = asyncio.Event()
        return ev

    async def wait_free(self, key: str) -> None:
        """Return once no writer holds ``key`` (at once if none does)."""
        while key in self._released:
            await self._event(key).wait()

    async def wait_readable(self, key: str) -> None:
        """Return once no update holds ``key``."""
        while key in self._updating and key in self._released:
            await self._event(key).wait()

    async def acquire(self, key: str, update: bool = False) -> None:
        """Wait until ``key`` is free, then hold it (no await between the check and the hold)."""
        await self.wait_free(key)
        self.hold(key, update)

    def hold(self, key: str, update: bool = False) -> None:
        """Hold ``key``, which no writer holds (``update``: its gets wait too)."""
        assert key not in self._released
        self._released[key] = None
        if update:
            self._updating.add(key)

    def mark_in_place(self, key: str, holder: object | None) -> None:
        """``key``'s head is now the generation ``holder`` (``callers``) writes in place."""
        self.in_place[key] = holder
        self._none_in_place.clear()

    def release(self, key: str) -> None:
        """Give ``key`` back and wake its waiters."""
        self._updating.discard(key)
        self.in_place.pop(key, None)
        if not self.in_place:
            self._none_in_place.set()
        ev = self._released.pop(key, None)
        if ev is not None:
            ev.set()

    async def wait_no_in_place(self) -> None:
        """Return once no in-place loan is open (a commit must not publish one half-written)."""
        while self.in_place:
            await self._none_in_place.wait()

    async def lock_without_loans(self, lock: asyncio.Lock) -> None:
        """Acquire ``lock`` (the commit lock) at a moment no in-place loan is open.

        Lending in place takes the commit lock, and a batch (``begin_updates``) lends key after
        key: holding the lock while waiting for the loans to end would wait for a batch that
        waits for the lock. So the lock is let go while loans are open, and updates not yet
        started wait for this commit (``wait_no_commit``): it is not starved. Cancelled, it
        holds nothing.
        """
        self._commits_waiting += 1
        self._no_commit_waiting.clear()
        try:
            while True:
                await lock.acquire()
                if not self.in_place:
                    return
                lock.release()
                await self.wait_no_in_place()
        finally:
            self._commits_waiting -= 1
            if not self._commits_waiting:
                self._no_commit_waiting.set()

    def commit_waiting(self) -> bool:
        """Whether a commit waits for in-place loans to end (new updates wait for it)."""
        return self._commits_waiting > 0

    async def wait_no_commit(self) -> None:
        """Return once no commit waits for in-place loans to end (a new update starts after it)."""
        while self._commits_waiting:
            await self._no_commit_waiting.wait()


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
    #: host buffers backing ``scratch``, given back at release: to the RAM tier (in place, a
    #: shaped view of several chunks) or to the store's ``ScratchPool`` (through scratch)
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


def begin_now(store: AsyncStore, key: str, chunked: bool, joining: bool = False) -> Update | None:
    """``begin_update`` where nothing is to be waited for (``lend_now``), as a plain call; else None.

    None leaves nothing held, and ``begin_update`` then takes the waiting path from the start.
    """
    store._check_writable()
    validate_key(key)
    store._record(key)  # KeyNotFound
    if (not joining and store._borrows.commit_waiting()) or not can_lend_now(store, key, chunked):
        return None
    if store._plan is not None and store._plan.touch(key):
        plan_ahead(store)
        if not can_lend_now(store, key, chunked):  # the look-ahead may have started its write
            return None
    return lend_checked(store, key, chunked)


async def begin_update(store: AsyncStore, key: str, chunked: bool, joining: bool = False) -> Update:
    """Hold ``key`` for an update and lend its value: in place when it may be, else a scratch.

    ``joining``: the caller's batch holds loans already; it goes on past a waiting commit (which
    waits for those loans), where a new update waits for the commit first.
    """
    store._check_writable()
    validate_key(key)
    store._record(key)  # KeyNotFound before waiting
    if not joining:
        await store._borrows.wait_no_commit()
    if store._plan is not None and store._plan.touch(key):
        plan_ahead(store)
    u = lend_now(store, key, chunked)
    if u is not None:
        return u
    await store._borrows.acquire(key, update=True)
    try:
        rec = store._record(key)
        u = None
        if in_place_ok(store, rec):
            u = await begin_in_place(store, rec, chunked)
        if u is None:
            u = await begin_scratch(store, rec, chunked)
    except BaseException:
        store._borrows.release(key)
        raise
    store.stats_counters.updates += 1
    return u


def end_now(store: AsyncStore, u: Update) -> bool:
    """``end_update`` of an in-place loan (nothing to wait for) as a plain call; False for others."""
    if u.done:
        return True
    if u.new is None or u.scratch is not None:
        return False
    u.done = True
    try:
        for i in range(u.old.grid.n_chunks):
            store._host.end_update((u.new.generation, i))
    finally:
        u.parts = []
        store._borrows.release(u.key)
    crc_ahead(store, u.new)
    return True


def crc_ahead(store: AsyncStore, rec: GenRecord) -> None:
    """Start taking the crc32c of ``rec``'s chunks (just changed in place) if its key is hot.

    A hot key (weights: read in forward and backward, then updated) is lent by ``get(copy=False)``
    soon after its update, and its first loan takes the crc a write through it is checked
    against: taken then, on the reader's path (a training step's forward waited about 3 ms a
    layer for it). Taken here instead, on the cpu pool while nobody waits; the first crc taken
    of a chunk wins, as before. It is kept only if the bytes stood still meanwhile: the same
    entry, not lent writable now, and not lent writable again since (``HostEntry.rewrites``):
    an update that lends the same generation again (``lend_again``) drops the crcs taken.
    """
    plan = store._plan
    if plan is None or rec.key not in plan.hot or store._closing:
        return
    # only what a get(copy=False) can lend: a value that is copied, or goes to a GPU, needs its
    # crc only once written, and a commit every N steps writes it once where this would take it
    # every step
    if not store.lendable(rec):
        return
    if all(crc != CRC_PENDING for _, crc in rec.chunks):
        return
    store._spawn(_take_crcs(store, rec))


async def _take_crcs(store: AsyncStore, rec: GenRecord) -> None:
    """``crc_ahead``'s task: each pending chunk's crc32c into ``store._late_crcs``, if still good."""
    host, late = store._host, store._late_crcs
    for i, (_, crc) in enumerate(rec.chunks):
        cid = (rec.generation, i)
        e = host.entry(cid)
        if crc != CRC_PENDING or e is None or e.updating or cid in late:
            continue
        seen = e.rewrites
        taken = await store._run_cpu(e.data.numel(), checksum, [e.data.numpy()])
        if host.entry(cid) is e and not e.updating and e.rewrites == seen and cid not in late:
            late[cid] = taken
            store.stats_counters.crcs_ahead += 1


async def end_update(store: AsyncStore, u: Update) -> None:
    """End ``u``: its value becomes the head (at once, or encoded from the scratch in a task)."""
    if end_now(store, u):
        return
    u.done = True
    task = store._spawn(finish_update(store, u))
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await finish_despite_cancel(task)  # the key is never left lent
        raise


def set_plan(store: AsyncStore, keys: Sequence[str] | None, hot: Sequence[str] = ()) -> None:
    """Make ``keys`` the store's update order (``None``: forget it); the RAM tier ranks by it."""
    if keys is None:
        store._plan = None
        store._host.rank = None
        return
    plan = AccessPlan(keys, hot)
    gen_keys = store._gen_keys

    def rank(cid: tuple[int, int]) -> float:
        return plan.rank(gen_keys.get(cid[0]))

    store._plan = plan
    store._host.rank = rank


def plan_ahead(store: AsyncStore) -> None:
    """Along the plan: start writing back what is needed last, and read ahead what comes next."""
    plan, budget = store._plan, store._host.budget
    if plan is None or budget is None or store._closing:
        return
    # one key ahead (at least a chunk): enough to overlap its read with this update, and
    # every byte read ahead is a byte of state that cannot stay (more reads a cycle)
    host = store._host
    nxt = store._head.get(plan.next_key())
    ahead = min(budget // 8, max(nxt.stored_nbytes if nxt is not None else 0,
                                 store.config.chunk_bytes or 0, 1))
    if host.used + ahead > budget:
        if not host.reclaimable_at_least(ahead):
            start_write_back(store)
    elif nxt is None or host.holds_all(nxt.generation, nxt.grid.n_chunks):
        # room to spare and the next key in RAM: nothing is urgent, the next update looks again
        # (with state that fits, a walk on every update would only confirm what is held)
        return
    want: list[str] = []
    seen = 0
    # only the keys within ``ahead`` bytes: a walk further, on every update, would cost the
    # whole plan each time its next keys are all held (a state that fits: quadratic a cycle)
    for key in plan.upcoming():
        rec = store._head.get(key)
        if rec is None or key in store._borrows:
            continue
        if not store._host_loaded(rec):
            want.append(key)
        seen += rec.stored_nbytes
        if seen >= ahead:
            break
    if want:
        store._prefetch_keys(want, "host", hint=True)


def in_place_ok(store: AsyncStore, rec: GenRecord) -> bool:
    """Whether ``rec`` can be lent where it lives (raw, not sharded, half the budget at most)."""
    budget = store._host.budget
    return (rec.codec_obj.raw_layout and not rec.shard and rec.nbytes > 0
            and (budget is None or rec.stored_nbytes <= budget // 2))


def can_lend_now(store: AsyncStore, key: str, chunked: bool) -> bool:
    """Whether ``lend_now`` would lend ``key`` (it changes nothing)."""
    assert store._commit_lock is not None
    if key in store._borrows or store._commit_lock.locked():
        return False
    rec = store._head.get(key)
    if rec is None or not in_place_ok(store, rec):
        return False
    g, n = rec.generation, rec.grid.n_chunks
    # any write task of the generation, even a finished one, takes the waiting path: it settles
    # the tasks (a failed write's error is retrieved there, not left for asyncio to log)
    if (n > 1 and not chunked) or store._pins.pinned(g) or store._writes.get(g):
        return False
    return store._host.free_to_update(g, n)


def lend_now(store: AsyncStore, key: str, chunked: bool) -> Update | None:
    """``begin_update``'s common case with nothing to wait for, lent without an await; else None.

    Nothing to wait for: the key is free, its chunks are all in RAM and nobody reads them (no
    copy on write), no write task of them is listed, the commit lock is free, and no scratch is
    needed. The waiting path would then do the same without ever suspending, through half a
    dozen coroutine frames a key (a training step lends every parameter and moment).
    """
    return lend_checked(store, key, chunked) if can_lend_now(store, key, chunked) else None


def lend_checked(store: AsyncStore, key: str, chunked: bool) -> Update:
    """``lend_now`` once ``can_lend_now`` said yes (nothing awaited since)."""
    rec = store._head[key]
    store._borrows.hold(key, update=True)
    try:
        u = lend_in_place(store, rec, {}, None, chunked, rec.decoded_dtype)
    except BaseException:
        store._borrows.release(key)
        raise
    store.stats_counters.updates += 1
    return u


async def begin_in_place(store: AsyncStore, rec: GenRecord, chunked: bool) -> Update | None:
    """Lend ``rec``'s RAM-tier buffers as a new head generation; None if they will not stay in RAM."""
    g, n = rec.generation, rec.grid.n_chunks
    assert store._commit_lock is not None
    # a write in flight reads the buffers about to change: let it end (put's write-behind)
    await settle(list(store._writes.get(g, [])))
    dtype = rec.decoded_dtype
    for _attempt in range(3):
        missing = [i for i in range(n) if not store._host.holds((g, i))]
        if missing:  # loaded holding nothing of ours: a wait for room here cannot be for us
            store._pins.pin(g)
            try:
                await asyncio.gather(*(store._load_chunk(rec, i, cache="yes") for i in missing))
            finally:
                store._pins.unpin(g)
        # copy on write where someone reads the old bytes: a loan, or a read in flight (new
        # readers of this key wait for us, so this set only shrinks from here)
        readers = store._pins.pinned(g)
        need = {i: rec.chunks[i][0] for i in range(n) if readers or store._host.lent((g, i))}
        if not chunked and n > 1:
            need[-1] = rec.nbytes  # the scratch one tensor of several chunks is lent in
        bufs: dict[int, torch.Tensor] = {}
        try:
            for i, nbytes in need.items():
                # never waited for: memory held here while waiting could be what the wait needs
                buf = store._host.try_alloc(nbytes)
                if buf is None:
                    return None  # no room beside the chunks: through a scratch instead
                bufs[i] = buf
            async with store._commit_lock:  # the head is a commit's while it runs
                # no await from here on: the loan starts whole or not at all
                if store._host.holds_all(g, n):
                    u = lend_in_place(store, rec, {i: b for i, b in bufs.items() if i >= 0},
                                      bufs.get(-1), chunked, dtype)
                    bufs = {}  # the loan's now (a refused loan leaves them here: recycled)
                    return u
        finally:
            for buf in bufs.values():
                store._host.recycle(buf)
        # chunks evicted meanwhile (a full budget): load them again
    return None


def lend_in_place(store: AsyncStore, rec: GenRecord, cow: dict[int, torch.Tensor],
                   scratch_buf: torch.Tensor | None, chunked: bool, dtype: torch.dtype) -> Update:
    """The no-await part of ``begin_in_place``: move (or copy) the chunks, swap the head.

    A generation that only earlier updates have seen (``seen_only_by_updates``) is lent again
    as it is: its bytes were never written, committed or read since, so no new generation is
    needed to keep anyone's view (the common case of training state between two commits).
    """
    g, n = rec.generation, rec.grid.n_chunks
    host = store._host
    for i, buf in cow.items():  # copied first: the check below reads what the update will hold
        src = host.lookup((g, i))
        assert src is not None
        buf.copy_(src)
    for i in range(n):
        if host.was_lent((g, i)):
            held = cow.get(i)
            check_unchanged(store, rec, i, held if held is not None else host.lookup((g, i)))
    if not cow and scratch_buf is None and seen_only_by_updates(store, rec):
        return lend_again(store, rec, chunked, dtype)
    new_gen = store._next_gen
    store._next_gen += 1
    store._memory_only.add(new_gen)  # written, if ever, by the write-behind (``rewrite``)
    parts = []
    for i in range(n):
        if i in cow:
            buf = cow[i]
            host.insert_for_update((new_gen, i), buf)
            store.stats_counters.bytes_copied_on_write += buf.numel()
        else:
            buf = store._host.take_for_update((g, i), (new_gen, i))
        valid = rec.grid.span(i)[1] * dtype.itemsize
        # a raw chunk's buffer is its payload exactly: slicing a tensor costs microseconds a chunk
        parts.append((buf if buf.numel() == valid else buf[:valid]).view(dtype))
    new = rec.moved(new_gen, tuple((nb, CRC_PENDING) for nb, _ in rec.chunks))
    store._gen_keys[new_gen] = rec.key
    store._head[rec.key] = new
    store._borrows.mark_in_place(rec.key, callers.claim())
    if g not in store._committed:
        if g not in store._writes and not store._pins.pinned(g) and g not in store._deferred:
            # never written (an earlier update's, still dirty in RAM), now moved on: nothing
            # on disk to delete, so no task and no io thread for it
            forget_in_memory(store, g, n)
        else:
            retire_soon(store, rec.key, g, n)
    u = Update(rec.key, rec, new, parts, chunked=chunked)
    if scratch_buf is not None:
        u.scratch_buf = scratch_buf
        u.scratch = scratch_buf.view(dtype)
        for piece, part in zip(split_flat(u.scratch, [p.numel() for p in parts]), parts, strict=True):
            piece.copy_(part)
    return u


def seen_only_by_updates(store: AsyncStore, rec: GenRecord) -> bool:
    """Whether ``rec``'s bytes are an earlier in-place update's that only the RAM tier holds.

    Made by an update (every crc pending), never written or being written (memory-only, every
    chunk dirty, no write task listed), in no commit, and read by nobody now: no pin, no loan
    (the caller checked those two), no copy up to the device in flight.
    """
    g = rec.generation
    return (g in store._memory_only and g not in store._writes and g not in store._committed
            and g not in store._deferred and g not in store._device_loads
            and all(crc == CRC_PENDING for _, crc in rec.chunks)
            and store._host.all_dirty(g, rec.grid.n_chunks))


def lend_again(store: AsyncStore, rec: GenRecord, chunked: bool, dtype: torch.dtype) -> Update:
    """Lend ``rec``'s buffers writable as they are: the head stays ``rec``, its bytes change.

    What referred to the old bytes goes: crcs a loan took of them (checked by the caller) and
    the device window's copy.
    """
    g = rec.generation
    late, take, size = store._late_crcs, store._host.take_again, dtype.itemsize
    parts = []
    for i, valid in enumerate(rec.grid.valid_counts()):
        if late:
            late.pop((g, i), None)
        buf = take((g, i))
        parts.append((buf if buf.numel() == valid * size else buf[: valid * size]).view(dtype))
    store._window.forget(g)
    store._borrows.mark_in_place(rec.key, callers.claim())
    store.stats_counters.updates_reused += 1
    return Update(rec.key, rec, rec, parts, chunked=chunked)


def check_unchanged(store: AsyncStore, rec: GenRecord, i: int, data: torch.Tensor | None) -> None:
    """LoanWritten if chunk ``i`` of ``rec`` (``data``, its bytes) no longer matches its crc32c.

    For a chunk lent by ``get(copy=False)``: an in-place update gives its bytes a new generation
    whose crc is taken only when it is written, so a write into the loan would otherwise be
    carried into the update and the next commit unseen. Checked only for chunks that were
    lent, so the training step's own loans cost nothing.
    """
    crc = rec.chunks[i][1]
    if crc == CRC_PENDING:
        late = store._late_crcs.get((rec.generation, i))
        if late is None:
            return  # no crc was ever taken of these bytes: nothing to compare with
        crc = late
    if data is not None and checksum([data.numpy()]) != crc:
        raise LoanWritten(
            f"chunk {i} of {rec.key!r} changed after it was stored: a tensor lent by get(copy=False) "
            f"was written into. The update is refused and the last commit is intact; put or delete "
            f"{rec.key!r} to go on", key=rec.key, chunk=i)


async def begin_scratch(store: AsyncStore, rec: GenRecord, chunked: bool) -> Update:
    """Decode ``rec`` into a scratch buffer of the store's pool (coded, sharded or large)."""
    for i in range(rec.grid.n_chunks):  # a raw chunk over half the budget may have been lent too
        if store._host.was_lent((rec.generation, i)):
            check_unchanged(store, rec, i, store._host.lookup((rec.generation, i)))
    dtype = rec.decoded_dtype
    buf = store._scratch.take(max(1, rec.nbytes))
    scratch = buf[: rec.nbytes].view(dtype)
    store._pins.pin(rec.generation)
    try:
        await store._fill(rec, [(0, scratch.numel(), 0)], scratch)
    except BaseException:
        del scratch
        store._scratch.give(buf)
        raise
    finally:
        store._pins.unpin(rec.generation)
    sizes = [rec.grid.span(i)[1] for i in range(rec.grid.n_chunks)]
    return Update(rec.key, rec, None, split_flat(scratch, sizes), scratch=scratch,
                  scratch_buf=buf, chunked=chunked)


async def finish_update(store: AsyncStore, u: Update) -> None:
    """Make ``u``'s value the head (in place: it is already) and give the key back."""
    rec = u.old
    try:
        if u.new is not None:  # in place: the head is already the new generation
            if u.scratch is not None:
                for piece, part in zip(split_flat(u.scratch, [p.numel() for p in u.parts]),
                                       u.parts, strict=True):
                    part.copy_(piece)
            for i in range(rec.grid.n_chunks):
                store._host.end_update((u.new.generation, i))
        else:
            assert u.scratch is not None
            store._finishing += 1
            try:
                await store._put_generation(rec.key, u.scratch.view(rec.shape), rec.codec_obj,
                                            rec.grid, rec.shard, lazy=not rec.shard)
            finally:
                store._finishing -= 1
    finally:
        buf, u.parts, u.scratch, u.scratch_buf = u.scratch_buf, [], None, None
        if buf is not None:
            (store._host.recycle if u.new is not None else store._scratch.give)(buf)
        store._borrows.release(rec.key)
