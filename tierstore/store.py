"""AsyncStore: the tiered tensor store, as coroutines on one event loop.

Threads and ownership:
- the event loop thread owns the head map, the RAM tier, the device window's LRU and every
  asyncio primitive; all methods of this class run there;
- ``tierstore-io`` threads run blocking disk calls (pread/pwrite/fsync, the LMDB commit);
- ``tierstore-cpu`` threads run codec work and large copies (torch releases the GIL);
- tensors lent by ``get(..., copy=False)`` (a CPU window: the RAM tier's own buffers) belong to
  the caller's threads, which may drop them anywhere; the RAM tier only reads how many are alive,
  on the loop thread, and a count can rise only there (``HostTier.lend``).
A put is *copied* when it returns (the caller may reuse its tensor) and *committed* when a later
``commit`` returns.

Generations are deleted by one path, ``tierstore.retirement.collect``: a generation nobody
references any more is deleted at once unless it is pinned (``PinTable``: a read or prefetch of
this process) or, for a generation a commit named, leased by a reader (``readers/*.lease``, any
process); then it waits in ``_deferred`` until the last user lets go. Every async method is
cancellation-safe: a cancelled call happened completely or not at all. A commit's catalog
transaction and what follows it run in a shielded task; a cancelled commit raises only after that
task is done, so when the cancellation arrives the version either exists (in memory and on disk)
or does not.

This module keeps the lifecycle (open, close), puts, deletes, restores, metadata and commits; the
read path is ``tierstore.reads`` (a base class), and functions of the store, which run on its
loop thread and use its state, hold the rest: ``tierstore.opening`` (folders, lock, catalog,
head), ``tierstore.writes`` (the write path), ``tierstore.updates`` (in-place updates) and
``tierstore.retirement`` (deletion).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from tierstore import callers, updates
from tierstore.catalog import Catalog
from tierstore.codecs import Codec, resolve
from tierstore.config import StoreConfig, scratch_keep_bytes
from tierstore.dtypes import dtype_name
from tierstore.errors import (
    CorruptData,
    DiskError,
    KeyNotFound,
    ReadOnlyError,
    StoreClosed,
    StoreError,
    StoreNotFound,
)
from tierstore.faults import FaultPlan
from tierstore.kernel_threads import executor_options
from tierstore.keys import validate_key
from tierstore.layout import ChunkGrid
from tierstore.leases import PinTable, ReaderLease
from tierstore.locks import HeldLock
from tierstore.mapped import MappedGather
from tierstore.opening import load_head, open_files
from tierstore.plan import AccessPlan
from tierstore.prefetch import AccessPredictor
from tierstore.reads import ReadPath
from tierstore.records import Commit, GenRecord, TensorInfo
from tierstore.retirement import (
    collect,
    delete_folders,
    on_unpinned,
    retire_soon,
    take_spare_folders,
)
from tierstore.scratch import ScratchPool
from tierstore.settle import finish_despite_cancel, settle
from tierstore.shards import ShardMap, plan_sharded
from tierstore.stats import Counters, Tracer
from tierstore.tiers.device import DeviceWindow
from tierstore.tiers.disk import DiskTier, SyncLedger
from tierstore.tiers.host import HostTier
from tierstore.updates import BorrowTable, Update
from tierstore.writes import (
    check_sharding,
    drain_writes,
    fsync_all,
    resolve_crcs,
    start_write_back,
    write_dirty,
    write_generation,
    write_owed_meta,
)

T = TypeVar("T")


class AsyncStore(ReadPath):
    """A tiered tensor store; use ``tierstore.open_async`` to get one."""

    def __init__(self, path: str, mode: str, config: StoreConfig):
        self.path = os.path.realpath(path)
        self.mode = mode
        self.config = config
        self.readonly = mode == "r"
        self.stats_counters = Counters()
        self.tracer = Tracer(config.trace_events)
        self._catalog: Catalog | None = None
        self._writer_lock: HeldLock | None = None
        self._disk = DiskTier(self.path)
        #: caller-thread gathers from the page cache; see ``mapped_get`` for what it may read
        self._mapped = MappedGather(self._disk)
        self._mapped.enabled = self._mapped.enabled and config.mapped_gathers
        pin = torch.cuda.is_available() and config.device is not None and config.device.type == "cuda"
        self._host = HostTier(config.ram_budget, pin=pin)
        self._host.explain_stuck = self._explain_stuck
        self._host.caller = callers.current
        self._host.updates_may_free = self._updates_may_free
        #: decode buffers of updates through a scratch, apart from the RAM tier (``tierstore.scratch``)
        self._scratch = ScratchPool(scratch_keep_bytes(config.ram_budget))
        #: keys lent for update (or being put): who may touch them waits (``tierstore.updates``)
        self._borrows = BorrowTable()
        #: crc32c of chunks changed in place, computed when they are written (``CRC_PENDING``)
        self._late_crcs: dict[tuple[int, int], int] = {}
        self._finishing = 0  # updates through a scratch whose new generation is being made
        self._plan: AccessPlan | None = None  # the order of updates, when the caller gave it
        self._gen_keys: dict[int, str] = {}  # the key of every generation the RAM tier may hold
        assert config.device is not None
        self._window = DeviceWindow(config.device, config.device_budget)
        self._window.attach_staging(self._host)  # pinned copy buffers in the RAM budget (CUDA only)
        self._predictor = AccessPredictor(config.prefetch_ahead)
        pools = executor_options(config.kernel_threads)
        self._io = ThreadPoolExecutor(config.io_threads, thread_name_prefix="tierstore-io", **pools)
        #: folder deletions of collected generations: never urgent, and an unlink of a large
        #: file can block for milliseconds, so they never hold an io thread that a read waits for
        self._deleter = ThreadPoolExecutor(1, thread_name_prefix="tierstore-delete", **pools)
        self._cpu = ThreadPoolExecutor(max(1, os.cpu_count() or 1), thread_name_prefix="tierstore-cpu", **pools)
        self._head: dict[str, GenRecord] = {}
        self._records: dict[int, GenRecord] = {}  # every generation with a catalog record
        self._committed: set[int] = set()  # generations referenced by retained commits
        self._commits: list[Commit] = []
        self._next_gen = 1
        self._writes: dict[int, list[asyncio.Task[None]]] = {}
        #: generations made here whose folders were never made (lazy puts, in-place updates):
        #: collecting one deletes nothing on disk
        self._memory_only: set[int] = set()
        #: generations written for room whose zarr.json waits for a commit (``write_owed_meta``)
        self._meta_owed: set[int] = set()
        #: write-backs for room started (``writes.start_write_back``): task -> stored bytes
        self._write_backs: dict[asyncio.Task[None], int] = {}
        #: grids of generations whose write-back wrote every file: their folders may be recycled
        self._folder_grids: dict[int, ChunkGrid] = {}
        #: per key, a retired, never committed generation's folder kept for the next write-back
        self._spare_folders: dict[str, tuple[int, ChunkGrid]] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._reads: dict[tuple[int, int], asyncio.Task[torch.Tensor]] = {}
        self._shard_maps: dict[int, ShardMap] = {}  # offsets of sharded generations, built on use
        self._device_loads: dict[int, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._ledger = SyncLedger()  # files and folders the next commit must fsync
        self._pins = PinTable()
        self._pins.on_release = lambda gen: on_unpinned(self, gen)
        #: unreferenced generations still in use: gen -> (key, chunks, may a reader lease it)
        self._deferred: dict[int, tuple[str, int, bool]] = {}
        self._lease: ReaderLease | None = None
        self._write_sem: asyncio.Semaphore | None = None
        self._read_sem: asyncio.Semaphore | None = None
        self._commit_lock: asyncio.Lock | None = None
        self._closed = False
        self._closing = False  # close() is cancelling background work: start no more of it

    # ---------------------------------------------------------------- open / close

    @classmethod
    async def open(cls, path: str | os.PathLike[str], mode: str, config: StoreConfig,
                   version: int | None = None) -> AsyncStore:
        """Open or create the store at ``path``; see ``tierstore.open`` for the arguments."""
        if mode not in ("r", "a", "w"):
            raise StoreError(f"mode must be 'r', 'a' or 'w', got {mode!r}")
        if version is not None and mode != "r":
            raise StoreError("version= opens a past commit read-only: use mode='r'")
        self = cls(os.fspath(path), mode, config)
        self._write_sem = asyncio.Semaphore(config.io_depth)
        self._read_sem = asyncio.Semaphore(config.io_threads * 2)
        self._commit_lock = asyncio.Lock()
        opening = asyncio.get_running_loop().run_in_executor(self._io, self._open_files)

        def give_up(_f: Any = None) -> None:
            self._release_files()
            self._io.shutdown(wait=False)
            self._deleter.shutdown(wait=False)
            self._cpu.shutdown(wait=False)

        try:
            await asyncio.shield(opening)
            load_head(self, version)
        except BaseException:
            if opening.done():
                give_up()
            else:  # cancelled while the io thread opens: release what it takes once it is done
                opening.add_done_callback(give_up)
            raise
        return self

    def _open_files(self) -> None:
        # a method, so that a test can make the io thread's part of an open slow
        open_files(self)

    def _release_files(self) -> None:
        self._disk.open_files.close()
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._catalog is not None:
            self._catalog.close()
            self._catalog = None
        if self._writer_lock is not None:
            self._writer_lock.close()  # closing the descriptor releases the flock
            self._writer_lock = None

    async def close(self, commit: bool = True) -> None:
        """Commit pending changes (unless ``commit=False`` or read-only), then release everything."""
        if self._closed:
            return
        try:
            if commit and not self.readonly and self._has_changes():
                await self.commit(message="close")
        finally:
            if self._commit_lock is not None:
                async with self._commit_lock:  # a commit whose caller was cancelled ends first
                    pass
            # let in-flight I/O settle; failures no longer matter: nothing uncommitted survives
            pending = [t for ts in self._writes.values() for t in ts] + list(self._retiring)
            await asyncio.gather(*pending, return_exceptions=True)
            if self._deferred and not self.readonly:
                try:  # readers that closed meanwhile: their generations go now
                    await collect(self, {})
                except (StoreError, OSError):
                    pass  # left behind as orphans: the next writer open deletes them
            if self._spare_folders:
                try:
                    # on this thread: a store dropped without close is closed by its finalizer
                    # after the cyclic GC already stopped its executors' workers (weakref
                    # callbacks run first)
                    delete_folders(self, take_spare_folders(self))
                except (StoreError, OSError):
                    pass  # orphans likewise
            self._closing = True
            background = list(self._background)
            for t in background:
                t.cancel()
            # let them (and the disk reads they started) unwind: a task still pending when the
            # sync facade stops its loop is destroyed mid-await (found by tools.harness.modelcheck)
            await settle([*background, *self._reads.values()])
            self._closed = True
            self._window.clear()
            self._mapped.close()
            self._release_files()
            self._io.shutdown(wait=True)
            self._deleter.shutdown(wait=True)
            self._cpu.shutdown(wait=True)

    def _has_changes(self) -> bool:
        last = self._commits[-1].generations if self._commits else {}
        return {k: r.generation for k, r in self._head.items()} != last

    # ---------------------------------------------------------------- helpers

    async def _run_io(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def _run_delete(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._deleter, fn, *args)

    async def _run_cpu(self, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        if nbytes < self.config.inline_bytes:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"the store at {self.path} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.readonly:
            raise ReadOnlyError(f"the store at {self.path} is open read-only (mode='r')")

    def _record(self, key: str) -> GenRecord:
        self._check_open()
        validate_key(key)
        try:
            return self._head[key]
        except KeyError:
            raise KeyNotFound(f"no tensor under key {key!r}") from None

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _explain_stuck(self) -> str | None:
        # in-flight reads do not count: one waiting for room cannot make room (a get of a
        # compressed tensor used to wait forever on a full disk because of its own read)
        if any(not t.done() for ts in self._writes.values() for t in ts):
            # those may free nothing (a generation's folders, its zarr.json): dirty chunks
            # nobody writes yet are the room that comes soonest (tops up what is in flight)
            start_write_back(self)
            return None
        if self._host.loading:
            # reads in flight land as clean chunks, which an allocation can evict
            self._host.wake_on_landing = True
            return None
        failed = self._failed_writes()
        if failed:
            return f"{len(failed)} chunk writes failed; last error: {failed[-1]}"
        if start_write_back(self):
            return None
        if self._finishing:
            return None  # an update's encoded chunks become a head, and writable, once it lands
        if self._host.dirty_count():
            return (f"{self._host.dirty_count()} chunks wait to be written (chunks lent to an "
                    "open update() are written once it ends)")
        return None

    def _failed_writes(self) -> list[BaseException]:
        """The errors of write tasks that failed and are still listed (a commit retries them)."""
        return [e for ts in self._writes.values() for t in ts
                if t.done() and not t.cancelled() and (e := t.exception()) is not None]

    def _updates_may_free(self, me: object | None) -> bool:
        """Whether an open in-place update is held by a live caller other than ``me`` that waits
        for no room itself: its end can free room (see ``tierstore.callers``)."""
        if self._failed_writes():
            return False  # the disk refuses writes: an update's end frees nothing
        waiting = self._host.waiting
        return any(h is not me and h not in waiting and callers.alive(h)
                   for h in self._borrows.in_place.values())

    # ---------------------------------------------------------------- put

    async def put(self, key: str, tensor: torch.Tensor, codec: str | dict[str, Any] | Codec = "raw",
                  *, chunk_rows: int | None = None, shard_rows: int | None = None,
                  copy: bool = True, lazy: bool = False) -> None:
        """Store ``tensor`` under ``key`` as a new generation; returns once the bytes are copied.

        ``copy=False`` hands the tensor's memory over instead (raw codecs): its full chunks
        become RAM-tier buffers, counted in the budget, written from where they lie and served
        to reads until evicted. The caller must not modify the tensor afterwards (bytes changed
        before they are written make the commit raise ``LoanWritten``, see ``get``); it saves a
        copy into fresh pages, which costs more than the disk write on some machines. A view of
        a larger tensor, an edge chunk and a pinned RAM tier (CUDA) are copied all the same.

        ``chunk_rows``: store it sharded (``tierstore.shards``), in inner chunks of that many
        dim-0 rows, so that a gather reads (and the RAM tier caches) only the inner chunks
        holding its rows; ``shard_rows`` (a multiple of it) sets the rows per shard file
        (default: about 64 MiB a file). Without them the tensor has one file per chunk.

        ``lazy=True`` defers the write-behind: the chunks stay dirty in RAM until the budget
        needs their room or a commit needs them durable, as an in-place update's do. A value
        replaced or deleted before then (a gradient) never touches the disk: no folder, no
        file, no deletion. Sharded tensors are written as they are put all the same.
        """
        self._check_writable()
        validate_key(key)
        if not isinstance(tensor, torch.Tensor):
            raise StoreError(f"put({key!r}) needs a torch.Tensor, got {type(tensor).__name__}")
        check_sharding(self._host, key, tensor, chunk_rows, shard_rows)
        codec_obj = resolve(codec)
        dtype_name(tensor.dtype)
        codec_obj.check_dtype(tensor.dtype)
        t = tensor.detach()
        if t.device.type != "cpu":
            t = await self._window.to_host(t)  # on the D2H stream, through the staging buffers
            self.stats_counters.bytes_d2h += t.numel() * t.element_size()
        t = t.contiguous()
        assert self.config.chunk_bytes is not None
        shard = 0
        if chunk_rows is None:
            grid = ChunkGrid.plan(tuple(t.shape), t.element_size(), self.config.chunk_bytes)
        else:
            grid, shard = plan_sharded(tuple(t.shape), t.element_size(), chunk_rows, shard_rows)
        self._disk.generation_dir(key, self._next_gen)  # InvalidKey now if its folder name is too long
        t0 = time.perf_counter()
        # only a tensor that is its whole storage: adopting a view would keep the rest of
        # its base alive, uncounted; a pinned RAM tier (CUDA) copies, as its buffers must
        # stay pinned for asynchronous H2D loads
        adopt = (not copy and codec_obj.raw_layout and t.device.type == "cpu"
                 and not self._host.pin
                 and t.untyped_storage().nbytes() == t.numel() * t.element_size())
        await self._borrows.acquire(key)  # one writer per key: an update of it ends first
        try:
            rec = await self._put_generation(key, t, codec_obj, grid, shard, adopt=adopt,
                                             lazy=lazy and not shard)
        finally:
            self._borrows.release(key)
        self.stats_counters.puts += 1
        self.tracer.span("put", "store", t0, time.perf_counter(), key=key, bytes=rec.nbytes)

    async def _put_generation(self, key: str, t: torch.Tensor, codec_obj: Codec, grid: ChunkGrid,
                              shard: int, adopt: bool = False, lazy: bool = False) -> GenRecord:
        """Write ``t`` as a new generation of ``key`` and make it the head; the caller holds ``key``.

        ``lazy``: its chunks stay dirty in RAM until the budget or a commit needs them written.
        """
        gen = self._next_gen
        self._next_gen += 1
        assert self._commit_lock is not None
        try:
            rec = await write_generation(self, key, gen, t, codec_obj, grid, shard, adopt=adopt,
                                               lazy=lazy)
            async with self._commit_lock:  # a commit in progress owns the head
                # no await from here on: the put lands whole, or (cancelled above) not at all
                old = self._head.get(key)
                self._head[key] = rec
                if old is not None and old.generation not in self._committed:
                    retire_soon(self, old.key, old.generation, old.grid.n_chunks)
        except BaseException:
            if self._head.get(key) is None or self._head[key].generation != gen:
                retire_soon(self, key, gen, grid.n_chunks)
            raise
        return rec

    # ---------------------------------------------------------------- in-place updates

    @contextlib.asynccontextmanager
    async def update(self, key: str, *, chunked: bool = False) -> AsyncIterator[Any]:
        """Lend ``key``'s value writable; what the block leaves in it becomes the new head.

        ``async with store.update(key) as t: t.mul_(0.5)``. A raw tensor that is not sharded
        and fits the RAM budget is updated where it lives: its RAM-tier buffers are lent (no
        copy, no fresh page) and its chunks stay dirty in RAM until the budget or a commit needs
        them written. Anything else is decoded into a scratch buffer and encoded back at the
        end (``tierstore.updates``). ``chunked=True`` lends a list of flat views, one per chunk
        (a tensor of several chunks is lent in place only that way; as one tensor it goes
        through a scratch copy). Other gets, puts and updates of ``key`` wait for the end; a
        commit waits for in-place updates. If the block raises, the key keeps what the block
        left in the tensor, like an in-place torch op that failed midway.
        """
        u = await self.begin_update(key, chunked=chunked)
        try:
            yield u.value()
        finally:
            await self.end_update(u)

    async def begin_update(self, key: str, *, chunked: bool = False) -> Update:
        """Start an update of ``key`` (``update`` pairs it with ``end_update``); the loan in ``.value()``."""
        u = updates.begin_now(self, key, chunked)
        return u if u is not None else await updates.begin_update(self, key, chunked)

    def plan(self, keys: Sequence[str] | None, hot: Sequence[str] = ()) -> None:
        """Declare the order in which the workload updates ``keys``, cycle after cycle (None: forget it).

        The RAM tier then evicts and writes back what the plan needs last, and reads ahead
        what it needs next, so that a cycle over state larger than the budget moves the
        minimum of bytes (``tierstore.plan``). Keys need not exist yet. ``hot``: keys read more
        often than once a cycle (a model's weights), kept in RAM ahead of the others.
        """
        self._check_open()
        updates.set_plan(self, keys, hot)

    async def begin_updates(self, keys: Sequence[str], *, chunked: bool = False) -> list[Update]:
        """``begin_update`` of several keys (in sorted order: two callers never wait on each other
        in a cycle), returned in the order of ``keys``; all of them or, on an error, none."""
        if len(set(keys)) != len(keys):
            raise StoreError(f"update of {list(keys)}: a key appears twice")
        begun: dict[str, Update] = {}
        try:
            for key in sorted(keys):
                u = updates.begin_now(self, key, chunked, joining=bool(begun))
                if u is None:
                    u = await updates.begin_update(self, key, chunked, joining=bool(begun))
                begun[key] = u
        except BaseException:
            await self.end_updates(list(begun.values()))
            raise
        return [begun[k] for k in keys]

    async def end_updates(self, us: Sequence[Update]) -> None:
        """``end_update`` of each of ``us`` (every one, even if an earlier one fails).

        In-place loans end first: ending one needs no room, while an update through a scratch
        encodes new chunks, which may wait for room that only the in-place loans' chunks (not
        written while lent) can give.
        """
        failure: BaseException | None = None
        for u in sorted(us, key=lambda u: u.new is None):
            try:
                if not updates.end_now(self, u):
                    await self.end_update(u)
            except BaseException as e:  # the others are still given back
                failure = failure or e
        if failure is not None:
            raise failure

    async def end_update(self, u: Update) -> None:
        """End an update: its value becomes the head (at once, or encoded from the scratch)."""
        await updates.end_update(self, u)

    def mapped_get(self, key: str, index: Any) -> torch.Tensor | None:
        """A row gather served from the page cache on the calling thread, or None (use ``get``).

        Callable from any thread (the sync facade calls it before hopping to the loop). It reads
        the loop-owned head map and committed set with one ``dict.get`` and one ``in`` (atomic
        under the GIL) and touches nothing else the loop owns: no RAM tier, no pins, no
        predictor (these reads are not in the access trace). Only a generation a commit named
        is read, and it is read whole (``tierstore.mapped`` says why that is safe); a put not
        yet committed makes the head a generation this path refuses, so a gather after a put
        returns the put's values through the loop.
        """
        if self._closed or self._closing or not self._mapped.enabled or self._disk.faults is not None:
            return None

        def committed_head() -> GenRecord | None:  # read once the gather counts as in flight
            rec = self._head.get(key)
            if rec is None or not rec.shard or rec.generation not in self._committed:
                return None
            return rec

        return self._mapped.get(committed_head, index)

    def mark_step(self) -> None:
        """Close a step of the access trace; the predictor learns from it."""
        self._predictor.mark_step()

    # ---------------------------------------------------------------- metadata

    def info(self, key: str) -> TensorInfo:
        """Shape, dtype, codec, sizes and current tiers of ``key``."""
        rec = self._record(key)
        tiers = []
        if self._window.lookup(rec.generation) is not None:
            tiers.append("device")
        if any(self._host.holds((rec.generation, i)) for i in range(rec.grid.n_chunks)):
            tiers.append("host")
        writes = self._writes.get(rec.generation, [])
        if rec.generation in self._committed or (writes and all(
                t.done() and not t.cancelled() and t.exception() is None for t in writes)):
            tiers.append("disk")
        return TensorInfo(key=key, shape=rec.shape, dtype=rec.decoded_dtype, codec=rec.codec,
                          nbytes=rec.nbytes, stored_nbytes=rec.stored_nbytes, tiers=tuple(tiers),
                          generation=rec.generation, chunks=rec.grid.n_chunks,
                          uncommitted=rec.generation not in self._committed)

    def keys(self, prefix: str = "") -> list[str]:
        """Sorted keys that start with ``prefix``."""
        self._check_open()
        return sorted(k for k in self._head if k.startswith(prefix))

    def __contains__(self, key: str) -> bool:
        return key in self._head

    async def delete(self, key: str) -> None:
        """Remove ``key`` from the head (committed versions keep it until they are dropped)."""
        self._check_writable()
        rec = self._record(key)
        assert self._commit_lock is not None
        await self._borrows.acquire(key)  # an update of it ends first
        try:
            async with self._commit_lock:
                rec = self._head.get(key)  # a delete queued before us may have removed it
                if rec is None:
                    raise KeyNotFound(f"no tensor under key {key!r} (deleted meanwhile)")
                del self._head[key]
                if rec.generation not in self._committed:
                    retire_soon(self, rec.key, rec.generation, rec.grid.n_chunks)
        finally:
            self._borrows.release(key)

    # ---------------------------------------------------------------- restore

    async def restore(self, key: str, version: int) -> None:
        """Make ``key``'s head the generation that retained commit ``version`` holds for it.

        No byte moves and nothing is re-encoded: the head points at the stored generation
        again, with its codec, chunk grid and sharded layout (a get then put would re-encode,
        and the lossy codecs are not idempotent). Invariant: a generation the head references
        is never deleted. It holds because the generation is in ``_committed`` (a retained
        commit names it): ``collect`` deletes only generations a commit dropped from
        ``_records`` or that ``retire_soon`` retired as never committed, and the next commit,
        which names the head, keeps it. The head changes under the commit lock (a commit owns
        the head while it runs) and the key's borrow (an update or put of it ends first).
        ``StoreNotFound`` if ``version`` is not retained, ``KeyNotFound`` if it lacks ``key``.
        """
        self._check_writable()
        validate_key(key)
        assert self._commit_lock is not None
        await self._borrows.acquire(key)  # an update or put of it ends first
        try:
            async with self._commit_lock:
                # no await from here on: the head changes whole or not at all
                commit = next((c for c in self._commits if c.version == version), None)
                if commit is None:
                    raise StoreNotFound(f"restore({key!r}, {version}): version {version} is not retained "
                                        f"(retained: {[c.version for c in self._commits]})")
                gen = commit.generations.get(key)
                if gen is None:
                    raise KeyNotFound(f"restore({key!r}, {version}): version {version} has no key {key!r}")
                rec = self._records[gen]
                old = self._head.get(key)
                self._head[key] = rec
                if old is not None and old.generation != gen and old.generation not in self._committed:
                    retire_soon(self, old.key, old.generation, old.grid.n_chunks)
        finally:
            self._borrows.release(key)

    def versions(self) -> list[Commit]:
        """Retained commits, oldest first."""
        self._check_open()
        return list(self._commits)

    def zarr_path(self, key: str) -> str:
        """The folder of ``key``'s current generation, readable with ``zarr.open_array``."""
        rec = self._record(key)
        return self._disk.generation_dir(rec.key, rec.generation)

    def stats(self) -> dict[str, Any]:
        """Counters since open, tier occupancy and peaks, and the predictor's accuracy."""
        c = self.stats_counters
        return {
            "hits_device": c.hits_device, "hits_host": c.hits_host, "reads_disk": c.reads_disk,
            "bytes_read_disk": c.bytes_read_disk, "bytes_written_disk": c.bytes_written_disk,
            "bytes_h2d": c.bytes_h2d, "bytes_d2h": c.bytes_d2h, "stall_s": c.stall_s,
            "peak_host_bytes": self._host.peak, "peak_device_bytes": self._window.peak,
            "host_bytes": self._host.used, "device_bytes": self._window.live_bytes,
            "ram_budget": self._host.budget, "device_budget": self._window.budget,
            "prediction_accuracy": self._predictor.accuracy, "puts": c.puts, "gets": c.gets,
            "commits": c.commits, "prefetched_chunks": c.prefetched_chunks,
            "prefetch_errors": c.prefetch_errors, "dirty_chunks": self._host.dirty_count(),
            "host_fresh_buffers": self._host.fresh_buffers, "lent": c.lent, "bytes_lent": c.bytes_lent,
            "host_lent_bytes": self._host.lent_bytes(), "updates": c.updates,
            "updates_reused": c.updates_reused, "bytes_copied_on_write": c.bytes_copied_on_write, "folders_recycled": c.folders_recycled,
            "crcs_ahead": c.crcs_ahead,
            "mapped_gathers": self._mapped.served, "mapped_declined": self._mapped.declined,
            "predictor_dropped_reads": self._predictor.dropped, "trace_dropped_events": self.tracer.dropped,
            "scratch_bytes": self._scratch.in_use, "scratch_kept_bytes": self._scratch.kept_bytes,
            "peak_scratch_bytes": self._scratch.peak, "scratch_fresh_buffers": self._scratch.fresh,
        }

    async def verify(self, keys: Sequence[str] | None = None) -> list[CorruptData]:
        """Re-read every chunk of the opened version (or of ``keys``) from disk; return the faults.

        ``keys`` lets a caller verify in steps (a progress bar); uncommitted keys are skipped.
        """
        self._check_open()
        faults: list[CorruptData] = []
        committed = {k: r for k, r in self._head.items() if r.generation in self._committed}
        if keys is not None:
            wanted = {k: self._record(k) for k in keys}  # KeyNotFound for an unknown key
            committed = {k: r for k, r in wanted.items() if k in committed}
        for rec in committed.values():
            self._pins.pin(rec.generation)  # a commit meanwhile must not delete what we check
        try:
            for key, rec in sorted(committed.items()):
                for i, (n, crc) in enumerate(rec.chunks):
                    path, at = self._chunk_location(rec, i)
                    buf = np.empty(n, np.uint8)
                    try:
                        await self._io_pinned(rec.generation, self._disk.read_chunk, path, key, i,
                                              n, crc, [buf], at)
                    except CorruptData as e:
                        faults.append(e)
        finally:
            for rec in committed.values():
                self._pins.unpin(rec.generation)
        return faults

    # ---------------------------------------------------------------- commit

    async def commit(self, step: int | None = None, message: str = "") -> int:
        """Make the head a durable, atomic version (fsync + one LMDB transaction); return its id."""
        self._check_writable()
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise StoreError(f"step must be an int or None, got {step!r}")
        assert self._commit_lock is not None and self._catalog is not None
        lock = self._commit_lock
        await self._borrows.lock_without_loans(lock)  # never publish half an update
        try:
            t0 = time.perf_counter()
            # write-behind: what the budget has not made write yet is written now
            for rec in list(self._head.values()):
                if rec.generation not in self._records and rec.generation not in self._writes:
                    self._writes[rec.generation] = [self._spawn(write_dirty(self, rec))]
            # cancelled up to the transaction, nothing happened: drained writes and fsyncs
            # change nothing a reopen sees, and the ledger keeps what was not surely synced
            await drain_writes(self)
            await write_owed_meta(self)
            for k, rec in list(self._head.items()):
                self._head[k] = resolve_crcs(self, rec)
            head = dict(self._head)
            await fsync_all(self)
            version = (self._commits[-1].version + 1) if self._commits else 1
            commit = Commit(version, step, time.time(), str(message),
                            {k: r.generation for k, r in sorted(head.items())})
            task = self._spawn(self._publish_and_apply(commit, head, t0))
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                # the transaction may have run: the cancellation is delivered once memory matches
                # the disk, so a caller never sees a version still landing (found by modelcheck)
                await finish_despite_cancel(task)
                raise
        finally:
            lock.release()

    async def _publish_and_apply(self, commit: Commit, head: dict[str, GenRecord], t0: float) -> int:
        """The catalog transaction, then its effects in memory and the collection of old data.

        Runs as its own task under the commit lock, shielded from the caller's cancellation:
        once the transaction may have run, memory must match the disk.
        """
        kept = (self._commits + [commit])[-self.config.keep_last :]
        dropped = [c.version for c in self._commits if c not in kept]
        referenced = {g for c in kept for g in c.generations.values()}
        new_records = [r for r in head.values() if r.generation not in self._records]
        drop_gens = [g for g in self._records if g not in referenced]
        await self._run_io(self._publish, commit, new_records, dropped, drop_gens)
        for r in new_records:
            self._records[r.generation] = r
            self._writes.pop(r.generation, None)
        self._commits = kept
        self._committed = referenced
        gone = {}
        for g in drop_gens:
            rec = self._records.pop(g)
            gone[g] = (rec.key, rec.grid.n_chunks, True)
        self.stats_counters.commits += 1
        try:
            await collect(self, gone)  # after the transaction: see its docstring on leases
            # folders kept for recycling never outlive a commit: disk use after one is its
            # retained versions' (``keep_last``) and the head's
            await self._run_delete(delete_folders, self, take_spare_folders(self))
        except (StoreError, OSError):
            pass  # left-over folders are orphans a later collection or reopen deletes
        self.tracer.span("commit", "store", t0, time.perf_counter(), version=commit.version)
        return commit.version

    def _publish(self, commit: Commit, new_records: list[GenRecord], dropped: list[int],
                 drop_gens: list[int]) -> None:
        assert self._catalog is not None
        try:
            self._disk.check_faults("catalog", self._catalog.path)
        except OSError as e:
            raise DiskError(f"catalog commit failed: {e}") from e
        self._catalog.publish(commit, new_records, dropped, drop_gens)

    def inject_faults(self, plan: FaultPlan | None) -> None:
        """Make the disk tier fail chosen I/O calls (tests of error paths); None stops it."""
        self._disk.faults = plan
