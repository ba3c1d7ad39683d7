"""The read path of ``AsyncStore``: get, dim-0 slices and gathers, chunk loads, prefetch.

A base class of ``AsyncStore`` (``store.py`` keeps the lifecycle, puts and commits;
``tierstore.writes`` the write path); it uses the store's tiers, counters and helpers, declared
below, and holds no state of its own. Sharded tensors are read by ``tierstore.shard_reads``.
Every read pins the generation it reads (``PinTable``) for as long as anything of it runs,
including disk reads and cache fills that outlive a cancelled caller: a put, delete or commit
that supersedes the generation meanwhile defers its deletion until the pin goes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from tierstore.checksums import checksum
from tierstore.chunks import decode_into, pieces_by_chunk
from tierstore.codecs.base import Codec
from tierstore.config import StoreConfig
from tierstore.errors import BudgetError, InvalidIndex, StoreError
from tierstore.leases import PinTable
from tierstore.plan import AccessPlan
from tierstore.prefetch import AccessPredictor
from tierstore.records import CRC_PENDING, GenRecord
from tierstore.settle import mark_retrieved
from tierstore.shard_reads import fill_sharded, gather_sharded
from tierstore.shards import ShardMap
from tierstore.stats import Counters, Tracer
from tierstore.tiers.device import DeviceWindow
from tierstore.tiers.disk import DiskTier
from tierstore.tiers.host import HostTier
from tierstore.updates import BorrowTable
from tierstore.writes import chunk_crc

T = TypeVar("T")

Index = slice | int | torch.Tensor | Sequence[int] | None


class ReadPath:
    """Reads of ``AsyncStore``: from RAM, disk or the device window, with prefetching."""

    # the store's state this mixin uses (set by AsyncStore.__init__ / open)
    stats_counters: Counters
    tracer: Tracer
    _disk: DiskTier
    _host: HostTier
    _window: DeviceWindow
    _predictor: AccessPredictor
    _cpu: ThreadPoolExecutor
    _io: ThreadPoolExecutor
    _pins: PinTable
    _head: dict[str, GenRecord]
    _reads: dict[tuple[int, int], asyncio.Task[torch.Tensor]]
    _device_loads: dict[int, asyncio.Task[None]]
    _read_sem: asyncio.Semaphore | None
    _shard_maps: dict[int, ShardMap]
    _borrows: BorrowTable
    _late_crcs: dict[tuple[int, int], int]
    _plan: AccessPlan | None
    config: StoreConfig

    if TYPE_CHECKING:  # helpers AsyncStore defines
        def _record(self, key: str) -> GenRecord: ...
        def _check_open(self) -> None: ...
        def _spawn(self, coro: Any) -> asyncio.Task[Any]: ...
        async def _run_io(self, fn: Callable[..., T], *args: Any) -> T: ...
        async def _run_cpu(self, nbytes: int, fn: Callable[..., T], *args: Any) -> T: ...

    async def get(self, key: str, device: str | torch.device | None = None, index: Index = None,
                  copy: bool = True) -> torch.Tensor:
        """The newest value of ``key``: on the host, or in the device window with ``device=``.

        ``copy=False`` with a CPU window (``device="cpu"`` on a store opened with the CPU as its
        device): lend the RAM tier's own buffer instead of copying it into the window, for a
        whole tensor of a raw codec held in one chunk (read into the RAM tier first if it is
        not there). The tensor is read-only by contract and stays valid, unchanged, for as long
        as the caller holds it: a later put of the key writes new buffers, and the tier neither
        evicts nor reuses the buffer meanwhile. Its bytes stay counted in the RAM budget (not
        the window's). Anything else (a compressed codec, several chunks, a sharded tensor, an
        ``index``, a CUDA window, a host read) is read the usual way, a copy; ``stats()["lent"]``
        counts the tensors lent.

        Writing into a lent tensor is not prevented, but it never reaches the disk: the write of
        a chunk checks its crc32c, so if the chunk was not yet on disk, the ``commit()`` that
        needs it raises ``LoanWritten`` naming the key (the last commit stays intact; a ``put``
        or ``delete`` of the key clears it); if it was, the disk keeps the stored bytes, and gets
        may return the changed ones only until the RAM copy is evicted.
        """
        rec = self._record(key)
        if self._borrows.updating(key):  # a reader never sees half an update
            await self._borrows.wait_readable(key)
            rec = self._record(key)
        target = self._target_device(device)
        self.stats_counters.gets += 1
        upcoming = self._predictor.record(key)
        lend = not copy and target is not None and target.type == "cpu" and index is None
        if upcoming:
            # a borrower reads from the RAM tier: warm that, not the window
            self._prefetch_keys(upcoming, "host" if lend or target is None else "device", hint=True)
        t0 = time.perf_counter()
        self._pins.pin(rec.generation)
        try:
            lent = await self._lend(rec) if lend else None
            if lent is not None:
                out = lent
            elif target is None:
                out = await self._read(rec, index)
            elif index is None:
                out = await self._load_to_device(rec, wait=True)
            else:
                part = await self._read(rec, index)
                out = await self._admit(None, part, wait=True)
        finally:
            self._pins.unpin(rec.generation)
        self.tracer.span("get", "store", t0, time.perf_counter(), key=key)
        return out

    def lendable(self, rec: GenRecord, codec: Codec | None = None) -> bool:
        """Whether ``get(copy=False)`` lends ``rec``'s RAM-tier buffer rather than copying it:
        raw, unsharded, one chunk, in a store whose device is the CPU and whose RAM tier is not pinned."""
        codec = rec.codec_obj if codec is None else codec
        return (codec.raw_layout and not rec.shard and rec.grid.n_chunks == 1
                and self._window.device.type == "cpu" and not self._host.pin)

    async def _lend(self, rec: GenRecord) -> torch.Tensor | None:
        """The tensor as a loan of its RAM-tier buffer (``get(copy=False)``); None where it cannot be lent.

        A copy already in the window is returned instead (no copy either). No await between the
        ``lend`` and the return: a cancelled call lends nothing, or drops what it was lent, which
        the RAM tier then sees as given back.
        """
        codec = rec.codec_obj  # built from its spec at each use: once here (a loan costs ~15 us)
        if not self.lendable(rec, codec):
            return None
        dtype = codec.decoded_dtype(rec.torch_dtype)
        shape = rec.shape
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        if not nbytes:
            return None
        hit = self._window.lookup(rec.generation)
        if hit is not None:
            self.stats_counters.hits_device += 1
            return hit
        cid = (rec.generation, 0)
        if self._host.holds(cid):
            self.stats_counters.hits_host += 1
        elif self._host.fits(rec.chunks[0][0]):
            for _attempt in range(3):
                await self._load_chunk(rec, 0, cache="yes", use=False)  # cached unless the RAM tier cannot
                if self._host.holds(cid):
                    break
                # read, then evicted before this task ran again (a budget full of dirty and
                # lent chunks leaves only this one to evict): read it again, not copy it
        if rec.chunks[0][1] == CRC_PENDING and cid not in self._late_crcs:
            # changed in place and not yet written: its crc is taken before the first loan, so
            # that the write-back finds a write into a loan as it does for a put's chunk
            data = self._host.lookup(cid)
            if data is not None:
                crc = await self._run_cpu(data.numel(), checksum, [data.numpy()])
                if self._host.holds(cid):  # not dropped meanwhile (its generation replaced)
                    self._late_crcs.setdefault(cid, crc)
        raw = self._host.lend(cid)
        if raw is None:
            return None  # not cached (the RAM tier could not take it): the caller copies
        self.stats_counters.lent += 1
        self.stats_counters.bytes_lent += nbytes
        return raw[:nbytes].view(dtype).view(shape)

    def _target_device(self, device: str | torch.device | None) -> torch.device | None:
        if device is None:
            return None
        dev = torch.device(device)
        win = self._window.device
        if dev.type == "cpu" and win.type != "cpu":
            return None  # a host read
        if dev.type != win.type or (dev.index is not None and win.index is not None and dev.index != win.index):
            raise StoreError(f"device {dev} is not this store's device window ({win}); "
                             "open the store with device=...")
        return dev

    async def _load_to_device(self, rec: GenRecord, wait: bool) -> torch.Tensor:
        gen = rec.generation
        hit = self._window.lookup(gen)
        if hit is not None:
            self.stats_counters.hits_device += 1
            return hit
        pending = self._device_loads.get(gen)
        if pending is not None:
            t0 = time.perf_counter()
            await asyncio.shield(pending)
            self.stats_counters.stall_s += time.perf_counter() - t0
            hit = self._window.lookup(gen)
            if hit is not None:
                self.stats_counters.hits_device += 1
                return hit
        if self._window.staging is not None and rec.nbytes:
            return await self._load_staged(rec, wait)
        host = await self._read(rec, None)
        return await self._admit(gen, host, wait)

    async def _load_staged(self, rec: GenRecord, wait: bool) -> torch.Tensor:
        """Fill the staging buffers straight from the RAM tier (or disk) and copy each one up.

        No host tensor of the whole size is allocated (fresh pages fault in at a fraction of
        copy speed), and each piece's DMA overlaps the decoding of the next one.
        """
        pool = self._window.staging
        assert pool is not None
        await self._wait_room(rec.nbytes, wait)
        t = self._window.start_upload(tuple(rec.shape), rec.decoded_dtype)
        item = t.element_size()
        step = max(1, pool.buffer_bytes // item)
        n = t.numel()
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            buf = await pool.acquire_async()  # another load may hold every buffer while it fills one
            try:
                view = buf[: (hi - lo) * item].view(rec.decoded_dtype)
                await self._fill(rec, [(lo, hi, 0)], view)
            except BaseException:
                pool.release(buf)
                raise
            self._window.upload_piece(t, lo, hi, buf)
        self.stats_counters.bytes_h2d += rec.nbytes
        return self._window.finish_upload(rec.generation, t)

    async def _wait_room(self, nbytes: int, wait: bool) -> None:
        while not self._window.make_room(nbytes):
            if not wait or not self._device_loads:
                raise BudgetError(
                    f"device window full: {self._window.live_bytes} of {self._window.budget} B are "
                    f"held by tensors still referenced; {nbytes} B more do not fit. Drop "
                    "references to window tensors you no longer need.")
            await asyncio.sleep(0.001)  # a prefetch in flight may be waiting on the same room

    async def _admit(self, gen: int | None, host: torch.Tensor, wait: bool) -> torch.Tensor:
        nbytes = host.numel() * host.element_size()
        await self._wait_room(nbytes, wait)
        out = await self._window.admit(gen, host, owned=True)
        self.stats_counters.bytes_h2d += nbytes
        return out

    async def _read(self, rec: GenRecord, index: Index) -> torch.Tensor:
        """Read a whole tensor, a dim-0 slice or a dim-0 gather into a new host tensor."""
        shape = rec.shape
        if index is None:
            if self._window.device.type == "cpu":
                # a CPU window holds host memory: copying its tensor beats reading the disk
                # again (the trainer's optimizer reads the weights backward has just used).
                # A peek: a host read must not keep the tensor in the window, or the weights
                # already updated would push out those the optimizer has yet to read
                hit = self._window.peek(rec.generation)
                if hit is not None:
                    self.stats_counters.hits_device += 1
                    return hit.clone()
            out = torch.empty(shape, dtype=rec.decoded_dtype)
            await self._fill(rec, [(0, out.numel(), 0)], out.reshape(-1))
            return out
        if not shape:
            raise InvalidIndex(f"{rec.key!r} is 0-d: it has no dim 0 to index")
        rows = shape[0]
        row_numel = 1
        for s in shape[1:]:
            row_numel *= s
        if isinstance(index, slice):
            start, stop, step = index.indices(rows)
            if step != 1:
                raise InvalidIndex(f"slices of {rec.key!r} need step 1, got {index.step}")
            stop = max(start, stop)
            out = torch.empty((stop - start, *shape[1:]), dtype=rec.decoded_dtype)
            await self._fill(rec, [(start * row_numel, stop * row_numel, 0)], out.reshape(-1))
            return out
        idx = self._row_index(rec, index, rows)
        flat = idx.reshape(-1)
        if rec.shard:
            return await gather_sharded(self, rec, idx)
        uniq, inverse = torch.unique(flat, return_inverse=True)
        tmp = torch.empty((len(uniq), *shape[1:]), dtype=rec.decoded_dtype)
        ranges = [(r * row_numel, (r + 1) * row_numel, j * row_numel) for j, r in enumerate(uniq.tolist())]
        await self._fill(rec, ranges, tmp.reshape(-1), gather=True)
        out = tmp if len(uniq) == len(flat) and torch.equal(uniq, flat) else tmp[inverse]
        # torch semantics: rows of index shape S give S + shape[1:]; an integer (0-d) drops dim 0
        return out.reshape((*idx.shape, *shape[1:]))

    @staticmethod
    def _row_index(rec: GenRecord, index: Any, rows: int) -> torch.Tensor:
        """The rows ``index`` names, as int64 in the index's own shape, negatives resolved."""
        if isinstance(index, bool):
            raise InvalidIndex(f"a bool is not a row index of {rec.key!r}")
        try:
            idx = torch.as_tensor(index)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InvalidIndex(f"index of {rec.key!r} must be a slice, an int or int rows: {e}") from None
        if idx.numel() == 0 and not isinstance(index, torch.Tensor):
            idx = idx.to(torch.int64)  # [] is float to torch.as_tensor, and selects no rows
        if idx.dtype in (torch.bool,) or idx.dtype.is_floating_point or idx.dtype.is_complex:
            raise InvalidIndex(f"row indices of {rec.key!r} must be integers, got {idx.dtype}")
        if idx.dtype == torch.uint64 and idx.numel() and int(idx.cpu().numpy().max()) >= rows:
            # checked before the cast below, which wraps 2**64 - 1 to -1 (the last row)
            raise InvalidIndex(f"row index out of range for {rec.key!r} with {rows} rows")
        idx = idx.to(torch.int64)
        if idx.numel() and (int(idx.min()) < -rows or int(idx.max()) >= rows):
            raise InvalidIndex(f"row index out of range for {rec.key!r} with {rows} rows")
        return torch.where(idx < 0, idx + rows, idx)

    async def _fill(self, rec: GenRecord, ranges: list[tuple[int, int, int]], dest: torch.Tensor,
                    gather: bool = False) -> None:
        """Copy flat source ranges of ``rec`` into ``dest``, chunk by chunk, in parallel.

        A raw chunk that is not in RAM and feeds one run of ``dest`` is read straight into it:
        caching it as well would cost a second copy on the read path (measured: 20-30% of a
        cold read here). The RAM tier is filled by puts and prefetches (hinted or predicted),
        and by chunks that must be decoded or gathered from, unless the tensor is larger than
        half the budget (scan resistance). Sharded tensors go through ``tierstore.shard_reads``.
        """
        by_chunk = pieces_by_chunk(rec.grid, ranges)
        if not by_chunk:
            return
        if rec.shard:
            await fill_sharded(self, rec, by_chunk, dest, gather)
            return
        codec = rec.codec_obj
        budget = self._host.budget
        cache = "no" if budget is not None and rec.stored_nbytes > budget // 2 else "yes"
        t0 = time.perf_counter()
        missed = [False]

        async def one(i: int, pieces: list[tuple[int, int, int]]) -> None:
            cid = (rec.generation, i)
            payload = self._host.lookup(cid)
            if payload is not None:
                self.stats_counters.hits_host += 1
            else:
                missed[0] = True
                if codec.raw_layout and len(pieces) == 1 and self._reads.get(cid) is None:
                    await self._read_direct(rec, i, pieces[0], dest)
                    return
                payload = await self._load_chunk(rec, i, cache=cache)
            await self._run_cpu(payload.numel(), decode_into, codec, rec.grid, rec.torch_dtype,
                                payload, pieces, dest)

        await asyncio.gather(*(one(i, p) for i, p in by_chunk.items()))
        if missed[0]:
            self.stats_counters.stall_s += time.perf_counter() - t0

    def _shard_map(self, rec: GenRecord) -> ShardMap:
        """Offsets of a sharded generation's inner chunks (built once per generation)."""
        smap = self._shard_maps.get(rec.generation)
        if smap is None:
            smap = self._shard_maps[rec.generation] = ShardMap.build(rec.chunks, rec.shard)
        return smap

    def _chunk_location(self, rec: GenRecord, i: int) -> tuple[str, int | None]:
        """(file, offset) of chunk ``i``: its own file (offset None) or its place in a shard."""
        if not rec.shard:
            return self._disk.chunk_path(rec.key, rec.generation, rec.grid, i), None
        s, at = self._shard_map(rec).location(i)
        return self._disk.shard_path(rec.key, rec.generation, rec.grid, s), at

    async def _read_direct(self, rec: GenRecord, i: int, piece: tuple[int, int, int],
                           dest: torch.Tensor) -> None:
        """Read a raw chunk straight into the destination (no RAM-tier copy)."""
        lo, hi, off = piece
        n, crc = rec.chunks[i][0], chunk_crc(rec, i, self._late_crcs)
        item = dest.element_size()
        dest_bytes = dest.view(torch.uint8) if dest.dtype != torch.uint8 else dest
        head = np.empty(lo * item, np.uint8)
        body = dest_bytes[off * item : (off + hi - lo) * item].numpy()
        tail = np.empty(n - hi * item, np.uint8)
        path, at = self._chunk_location(rec, i)
        assert self._read_sem is not None
        async with self._read_sem:
            t0 = time.perf_counter()
            await self._io_pinned(rec.generation, self._disk.read_chunk, path, rec.key, i, n, crc,
                                  [head, body, tail], at)
        self.stats_counters.reads_disk += 1
        self.stats_counters.bytes_read_disk += n + 4
        self.tracer.span("read", "disk", t0, time.perf_counter(), bytes=n)

    async def _load_chunk(self, rec: GenRecord, i: int, cache: str, use: bool = True) -> torch.Tensor:
        """A chunk's payload from RAM or disk; ``cache`` is "yes", "try" (no waiting) or "no".

        ``use``: the caller uses the payload now (a read ahead does not: its chunk stays
        ``fresh`` in the RAM tier until a reader takes it)."""
        cid = (rec.generation, i)
        payload = self._host.lookup(cid)
        if payload is not None:
            return payload
        task = self._reads.get(cid)
        if task is None:
            # shielded: a cancelled reader leaves the fill to finish (and to keep its pin)
            task = asyncio.get_running_loop().create_task(self._disk_read(rec, i, cache))
            self._reads[cid] = task
            self._pins.pin(rec.generation)
            task.add_done_callback(lambda t: self._read_done(cid, t))
        payload = await asyncio.shield(task)
        if use:
            self._host.mark_used(cid)
        return payload

    def _read_done(self, cid: tuple[int, int], task: asyncio.Task[torch.Tensor]) -> None:
        self._reads.pop(cid, None)
        mark_retrieved(task)  # every reader may have been cancelled
        self._pins.unpin(cid[0])

    async def _io_pinned(self, gen: int, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on an io thread with ``gen`` pinned until the call ends, cancelled or not.

        A cancelled ``await`` does not stop the thread: without the pin, a superseded
        generation's folder could be deleted under a read that is still running.
        """
        fut = asyncio.get_running_loop().run_in_executor(self._io, fn, *args)
        self._pins.pin(gen)

        def done(f: asyncio.Future[T]) -> None:
            mark_retrieved(f)
            self._pins.unpin(gen)

        fut.add_done_callback(done)
        return await asyncio.shield(fut)

    async def _disk_read(self, rec: GenRecord, i: int, cache: str) -> torch.Tensor:
        cid = (rec.generation, i)
        n, crc = rec.chunks[i][0], chunk_crc(rec, i, self._late_crcs)
        buf: torch.Tensor | None = None
        if cache == "yes":
            try:
                buf = await self._host.alloc(n, optional=True)
            except BudgetError:
                buf = None  # RAM full of chunks that cannot be written (ENOSPC): read uncached
        elif cache == "try":
            # a read ahead along the plan pushes out only what is needed later than it
            plan = self._plan
            buf = self._host.try_alloc(n, above=-1.0 if plan is None else plan.distance(rec.key))
        reserved = buf is not None
        if buf is None:
            buf = torch.empty(n, dtype=torch.uint8)
        else:
            self._host.loading += n
        try:
            path, at = self._chunk_location(rec, i)
            assert self._read_sem is not None
            async with self._read_sem:
                t0 = time.perf_counter()
                await self._run_io(self._disk.read_chunk, path, rec.key, i, n, crc, [buf.numpy()], at)
        except BaseException:
            if reserved:
                self._host.release(buf)
            raise
        finally:
            if reserved:
                self._host.loading -= n
        self.stats_counters.reads_disk += 1
        self.stats_counters.bytes_read_disk += n + 4
        self.tracer.span("read", "disk", t0, time.perf_counter(), bytes=n)
        if reserved:
            self._host.insert(cid, buf, dirty=False, fresh=True)
        return buf

    # ---------------------------------------------------------------- prefetch

    async def prefetch(self, keys: Sequence[str], to: str = "host", wait: bool = False) -> None:
        """Start loading ``keys`` into the RAM tier (``to="host"``) or the device window.

        With ``wait=True`` return once the loads are done (warming a cache on purpose).
        """
        self._check_open()
        if to not in ("host", "device"):
            raise StoreError(f"prefetch to= must be 'host' or 'device', got {to!r}")
        if isinstance(keys, str):
            keys = [keys]
        for k in keys:
            self._record(k)
        tasks = self._prefetch_keys(list(keys), to)
        if wait:
            # shielded: cancelling this wait must not cancel loads a concurrent get also awaits
            loads = asyncio.gather(*tasks)
            loads.add_done_callback(mark_retrieved)  # nobody may await it once this wait is cancelled
            await asyncio.shield(loads)

    def _prefetch_keys(self, keys: list[str], to: str, hint: bool = False) -> list[asyncio.Task[Any]]:
        """Start loading ``keys``; the tasks to await. ``hint``: nobody awaits them, so a key
        already held or on its way to the RAM tier gets no task."""
        tasks: list[asyncio.Task[Any]] = []
        for k in keys:
            rec = self._head.get(k)
            if rec is None or self._borrows.updating(k):
                continue  # a key lent to an update is read once it ends, never half-written
            if to == "device":
                gen = rec.generation
                if gen in self._device_loads:
                    tasks.append(self._device_loads[gen])
                    continue
                if self._window.lookup(gen) is not None:
                    continue
                task = self._spawn(self._prefetch_device(rec))
                self._device_loads[gen] = task
                task.add_done_callback(lambda _t, g=gen: self._device_loads.pop(g, None))
            else:
                if hint and self._host_loaded(rec):
                    continue  # a task that would find every chunk held or on its way
                task = self._spawn(self._prefetch_host(rec))
            tasks.append(task)
        return tasks

    def _host_loaded(self, rec: GenRecord) -> bool:
        """Whether every chunk of ``rec`` is in the RAM tier or being read into it."""
        g, host, reads = rec.generation, self._host, self._reads
        return all(host.holds((g, i)) or (g, i) in reads for i in range(rec.grid.n_chunks))

    async def _prefetch_host(self, rec: GenRecord) -> None:
        if self._borrows.updating(rec.key):
            return  # lent to an update since the hint: its bytes are changing (an update seen
            # to start after this check finds the generation pinned, and copies on write)
        self._pins.pin(rec.generation)
        try:
            plan = self._plan
            above = -1.0 if plan is None else plan.distance(rec.key)
            for i in range(rec.grid.n_chunks):
                cid = (rec.generation, i)
                if self._host.holds(cid):
                    continue
                if cid not in self._reads:
                    # a hint reads only into room it has: never a read the RAM tier drops again
                    room = self._host.try_alloc(rec.chunks[i][0], above=above)
                    if room is None:
                        return
                    self._host.recycle(room)  # the read below takes it as a spare
                    del room  # a spare still referenced is not reused
                await self._load_chunk(rec, i, cache="try", use=False)
                self.stats_counters.prefetched_chunks += 1
        except StoreError:
            self.stats_counters.prefetch_errors += 1  # a hint failed; the real read reports it
        finally:
            self._pins.unpin(rec.generation)

    async def _prefetch_device(self, rec: GenRecord) -> None:
        if self._borrows.updating(rec.key):
            return  # as in _prefetch_host: never a copy of half an update in the window
        self._pins.pin(rec.generation)
        try:
            if self._window.budget is not None and rec.nbytes > self._window.budget:
                return
            if not self._window.make_room(rec.nbytes):
                await self._prefetch_host(rec)  # no room on the device yet: stage in RAM
                return
            if self._window.lookup(rec.generation) is None:
                if self._window.staging is not None and rec.nbytes:
                    await self._load_staged(rec, wait=False)
                else:
                    await self._admit(rec.generation, await self._read(rec, None), wait=False)
        except StoreError:
            self.stats_counters.prefetch_errors += 1
        finally:
            self._pins.unpin(rec.generation)
