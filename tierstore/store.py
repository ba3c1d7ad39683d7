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

Generations are deleted by one path, ``_collect``: a generation nobody references any more is
deleted at once unless it is pinned (``PinTable``: a read or prefetch of this process) or, for a
generation a commit named, leased by a reader (``readers/*.lease``, any process); then it waits
in ``_deferred`` until the last user lets go. Every async method is cancellation-safe: a
cancelled call happened completely or not at all. A commit's catalog transaction and what
follows it run in a shielded task; a cancelled commit raises only after that task is done, so
when the cancellation arrives the version either exists (in memory and on disk) or does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from tierstore.catalog import Catalog
from tierstore.chunks import encode_chunk
from tierstore.codecs import Codec, resolve
from tierstore.config import StoreConfig
from tierstore.dtypes import as_bytes, dtype_name
from tierstore.errors import (
    BudgetError,
    CorruptData,
    DiskError,
    KeyNotFound,
    LoanWritten,
    ReadOnlyError,
    StoreClosed,
    StoreError,
    StoreNotFound,
)
from tierstore.faults import FaultPlan
from tierstore.keys import validate_key
from tierstore.layout import ChunkGrid, zarr_metadata
from tierstore.leases import LEASE_DIR, PinTable, ReaderLease, leased_generations
from tierstore.locks import HeldLock, writer_lock
from tierstore.mapped import MappedGather
from tierstore.plan import AccessPlan
from tierstore.prefetch import AccessPredictor
from tierstore.reads import ReadPath
from tierstore.records import Commit, GenRecord, TensorInfo
from tierstore.shards import (
    TRAILER,
    ShardMap,
    plan_sharded,
    shard_count,
    shard_index,
    shard_members,
    sharded_zarr_metadata,
)
from tierstore.stats import Counters, Tracer
from tierstore.tiers.device import DeviceWindow
from tierstore.tiers.disk import IOV_MAX, DiskTier, SyncLedger, checksum, crc_trailer
from tierstore.tiers.host import HostTier
from tierstore.updates import CRC_PENDING, BorrowTable, Update, split_flat

T = TypeVar("T")
#: a chunk a write must find unchanged: (key, chunk index, its payload, the crc32c it was stored with)
ChunkCheck = tuple[str, int, Any, int]
_INLINE_BYTES = 1 << 20  # smaller chunks are coded on the loop thread: a thread hop costs more
_SYNC_ON_WRITE_BYTES = 1 << 20  # larger files are fdatasync'd by the write-behind itself
_SHARD_GROUP_BYTES = 4 << 20  # inner chunks of a shard written with one pwritev
_STORE_ENTRIES = {"LOCK", "catalog", "data", LEASE_DIR}
_OPEN_RETRIES = 5  # a reader retries its open when retention drops its version meanwhile


async def _finish_despite_cancel(task: asyncio.Task[Any]) -> None:
    """Wait until ``task`` is done even if the caller is cancelled meanwhile (again and again)."""
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            continue
    if not task.cancelled():
        task.exception()  # retrieved: the caller's cancellation is what propagates


async def _settle(tasks: list[asyncio.Task[Any]]) -> list[BaseException]:
    """Wait for ``tasks`` without cancelling them if the caller is cancelled (unlike ``gather``);
    return their failures (a cancellation counts), each retrieved so that asyncio logs none."""
    if tasks:
        await asyncio.wait(tasks)
    return [asyncio.CancelledError() if t.cancelled() else t.exception() for t in tasks
            if t.cancelled() or t.exception() is not None]  # type: ignore[misc]


def _write_checked(disk: DiskTier, path: str, at: int | None, parts: list[Any], sync: bool,
                   checks: Sequence[ChunkCheck]) -> None:
    """``disk.write_at``, then each checked chunk's crc32c again: LoanWritten if its bytes changed."""
    disk.write_at(path, at, parts, sync)
    for key, i, data, crc in checks:
        if checksum([data]) != crc:
            raise LoanWritten(
                f"chunk {i} of {key!r} changed after it was stored: a tensor lent by get(copy=False) "
                f"(or given to put(copy=False)) was written into. The changed bytes are not "
                f"committed and the last commit is intact; put or delete {key!r} to go on",
                key=key, chunk=i)


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
        self._io = ThreadPoolExecutor(config.io_threads, thread_name_prefix="tierstore-io")
        self._cpu = ThreadPoolExecutor(max(1, os.cpu_count() or 1), thread_name_prefix="tierstore-cpu")
        self._head: dict[str, GenRecord] = {}
        self._records: dict[int, GenRecord] = {}  # every generation with a catalog record
        self._committed: set[int] = set()  # generations referenced by retained commits
        self._commits: list[Commit] = []
        self._next_gen = 1
        self._writes: dict[int, list[asyncio.Task[None]]] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._reads: dict[tuple[int, int], asyncio.Task[torch.Tensor]] = {}
        self._shard_maps: dict[int, ShardMap] = {}  # offsets of sharded generations, built on use
        self._device_loads: dict[int, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._ledger = SyncLedger()  # files and folders the next commit must fsync
        self._pins = PinTable()
        self._pins.on_release = self._on_unpinned
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
            self._cpu.shutdown(wait=False)

        try:
            await asyncio.shield(opening)
            self._load_head(version)
        except BaseException:
            if opening.done():
                give_up()
            else:  # cancelled while the io thread opens: release what it takes once it is done
                opening.add_done_callback(give_up)
            raise
        return self

    def _open_files(self) -> None:
        root = self.path
        is_store = True
        if self.readonly:
            if not os.path.isdir(os.path.join(root, "catalog")):
                raise StoreNotFound(f"no tierstore at {root}")
        else:
            if not os.path.isdir(root):
                os.makedirs(root)
                self._ledger.created(root)
            self._writer_lock = writer_lock(root)  # a forked child closes its copy (tierstore.locks)
            is_store = os.path.exists(os.path.join(root, "catalog", "data.mdb"))
            if not is_store:
                self._refuse_foreign(root)
            if self.mode == "w":
                for sub in ("catalog", "data", LEASE_DIR):
                    shutil.rmtree(os.path.join(root, sub), ignore_errors=True)
            for sub in ("data", "catalog"):
                if not os.path.isdir(os.path.join(root, sub)):
                    os.makedirs(os.path.join(root, sub))
                    self._ledger.created(os.path.join(root, sub))
            os.makedirs(os.path.join(root, LEASE_DIR), exist_ok=True)  # readers need not create it
        self._catalog = Catalog(os.path.join(root, "catalog"), create=not self.readonly,
                                readonly=self.readonly)
        if not self.readonly and (self.mode == "w" or not is_store):
            self._ledger.written(os.path.join(root, "catalog"))  # the entries of the new LMDB files

    def _refuse_foreign(self, root: str) -> None:
        """Refuse to create a store over a folder holding things no store wrote (mode "w" or "a")."""
        foreign = sorted(set(os.listdir(root)) - _STORE_ENTRIES) if self.mode == "w" else []
        for sub in ("data", "catalog"):
            p = os.path.join(root, sub)
            if os.path.exists(p) and (not os.path.isdir(p) or os.listdir(p)):
                foreign.append(f"{sub}/")  # an empty data/ is what a crash during creation leaves
        if foreign:
            what = "wipe" if self.mode == "w" else "create a store in"
            raise StoreError(f"mode={self.mode!r} refuses to {what} {root}: it is not a tierstore "
                             f"(no catalog) but holds {foreign[:5]}; pick an empty folder")

    def _load_head(self, version: int | None) -> None:
        assert self._catalog is not None
        if self.readonly:
            self._load_leased_head(version)
            return
        self._commits = self._catalog.commits()
        head = self._commits[-1] if self._commits else None
        gens = head.generations if head is not None else {}
        recs = self._catalog.records(self._catalog.generation_ids())
        self._records = dict(recs)
        self._gen_keys = {g: r.key for g, r in recs.items()}
        self._delete_orphans()
        self._head = {k: recs[g] for k, g in gens.items()}
        self._committed = {g for c in self._commits for g in c.generations.values()}
        known = [*recs, *(g for _, g in self._disk.scan_generations())]
        self._next_gen = max(known, default=0) + 1

    def _load_leased_head(self, version: int | None) -> None:
        """A reader's open: load a version, lease its generations, check they were not dropped.

        The writer drops a version's records in its catalog transaction and reads the leases
        after it: a lease written before that transaction is honoured, and a version dropped
        before our check is seen as missing records here, and the open retries. After this the
        reader needs nothing from the catalog and lets go of it.
        """
        assert self._catalog is not None
        for attempt in range(_OPEN_RETRIES):
            lease = None
            try:
                commits = self._catalog.commits()
                head = self._catalog.commit(version) if version is not None else (
                    commits[-1] if commits else None)
                gens = dict(head.generations) if head is not None else {}
                recs = self._catalog.records(gens.values())
                if head is not None:
                    lease = ReaderLease.acquire(self.path, head.version, list(gens.values()))
                self._catalog.records(gens.values())  # still there: our lease came in time
                if version is not None:
                    self._catalog.commit(version)
            except (CorruptData, StoreNotFound):
                # dropped by the writer between our reads (or really missing: the last try says)
                if lease is not None:
                    lease.release()
                if version is not None or attempt == _OPEN_RETRIES - 1:
                    raise
                continue
            self._lease = lease
            self._commits = commits
            self._head = {k: recs[g] for k, g in gens.items()}
            self._committed = {g for c in commits for g in c.generations.values()} | set(gens.values())
            self._catalog.close()
            self._catalog = None
            return
        raise StoreError(f"the store at {self.path} changes faster than a reader can open it")

    def _delete_orphans(self) -> None:
        """Delete generation folders no catalog record names (writes after the last commit).

        A folder a live reader lease names (a version dropped while it was read) is kept and
        collected later, like any other deferred generation.
        """
        orphans = [(k, g) for k, g in self._disk.scan_generations() if g not in self._records]
        if not orphans:
            return
        leased = leased_generations(self.path)
        for key, gen in orphans:
            if leased is None or gen in leased:
                self._deferred[gen] = (key, 0, True)
            else:
                self._disk.delete_generation(key, gen)

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
                    await self._collect({})
                except (StoreError, OSError):
                    pass  # left behind as orphans: the next writer open deletes them
            self._closing = True
            background = list(self._background)
            for t in background:
                t.cancel()
            # let them (and the disk reads they started) unwind: a task still pending when the
            # sync facade stops its loop is destroyed mid-await (found by tools.harness.modelcheck)
            await _settle([*background, *self._reads.values()])
            self._closed = True
            self._window.clear()
            self._mapped.close()
            self._release_files()
            self._io.shutdown(wait=True)
            self._cpu.shutdown(wait=True)

    def _has_changes(self) -> bool:
        last = self._commits[-1].generations if self._commits else {}
        return {k: r.generation for k, r in self._head.items()} != last

    # ---------------------------------------------------------------- helpers

    async def _run_io(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def _run_cpu(self, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        if nbytes < _INLINE_BYTES:
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
            return None
        failed = [t.exception() for ts in self._writes.values() for t in ts
                  if t.done() and not t.cancelled() and t.exception() is not None]
        if failed:
            return f"{len(failed)} chunk writes failed; last error: {failed[-1]}"
        if self._start_write_back():
            return None
        if self._finishing:
            return None  # an update's encoded chunks become a head, and writable, once it lands
        if self._host.dirty_count():
            return (f"{self._host.dirty_count()} chunks wait to be written (chunks lent to an "
                    "open update() are written once it ends)")
        return None

    def _start_write_back(self) -> bool:
        """Start writing dirty head chunks nobody writes yet, least recently used first; True if any.

        Write-behind: a dirty chunk is written when the RAM budget needs its room or a commit
        needs it durable, not when it is made, so state that fits the budget costs no disk
        traffic between commits. About 1/16 of the budget is queued at once, so that room
        frees while more is written.
        """
        heads = {r.generation: r for r in self._head.values()}
        target = max(1, (self._host.budget or 0) // 16)
        queued = 0
        for gen, _ in self._host.dirty_lru():
            rec = heads.get(gen)
            if rec is None or gen in self._writes:
                continue  # written already or now, or not a head any more (its retirement drops it)
            self._writes[gen] = [self._spawn(self._write_dirty(rec))]
            queued += rec.stored_nbytes
            if queued >= target:
                break
        return queued > 0

    async def _write_dirty(self, rec: GenRecord) -> None:
        """Write every dirty chunk of ``rec`` (with its folders and metadata); raise the first failure."""
        failures = await _settle([self._spawn(c) for c in await self._rewrite(rec)])
        if failures:
            raise failures[0]

    def _chunk_crc(self, rec: GenRecord, i: int) -> int:
        """The crc32c of chunk ``i`` of ``rec``: in the record, or computed when it was written."""
        crc = rec.chunks[i][1]
        if crc != CRC_PENDING:
            return crc
        late = self._late_crcs.get((rec.generation, i))
        if late is None:  # never written and no longer in RAM: the generation was dropped
            raise StoreError(f"generation {rec.generation} of {rec.key!r} was replaced before this "
                             "read reached it; read the key again")
        return late

    def _resolve_crcs(self, rec: GenRecord) -> GenRecord:
        """``rec`` with the crcs its chunks got when they were written (a commit publishes this)."""
        if all(c != CRC_PENDING for _, c in rec.chunks):
            return rec
        return dataclasses.replace(rec, chunks=tuple(
            (n, self._chunk_crc(rec, i)) for i, (n, _) in enumerate(rec.chunks)))

    # ---------------------------------------------------------------- put

    async def put(self, key: str, tensor: torch.Tensor, codec: str | dict[str, Any] | Codec = "raw",
                  *, chunk_rows: int | None = None, shard_rows: int | None = None,
                  copy: bool = True) -> None:
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
        """
        self._check_writable()
        validate_key(key)
        if not isinstance(tensor, torch.Tensor):
            raise StoreError(f"put({key!r}) needs a torch.Tensor, got {type(tensor).__name__}")
        self._check_sharding(key, tensor, chunk_rows, shard_rows)
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
            rec = await self._put_generation(key, t, codec_obj, grid, shard, adopt=adopt)
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
            rec = await self._write_generation(key, gen, t, codec_obj, grid, shard, adopt=adopt,
                                               lazy=lazy)
            async with self._commit_lock:  # a commit in progress owns the head
                # no await from here on: the put lands whole, or (cancelled above) not at all
                old = self._head.get(key)
                self._head[key] = rec
                if old is not None and old.generation not in self._committed:
                    self._retire_soon(old.key, old.generation, old.grid.n_chunks)
        except BaseException:
            if self._head.get(key) is None or self._head[key].generation != gen:
                self._retire_soon(key, gen, grid.n_chunks)
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
        self._check_writable()
        validate_key(key)
        self._record(key)  # KeyNotFound before waiting
        if self._plan is not None and self._plan.touch(key):
            self._plan_ahead()
        await self._borrows.acquire(key, update=True)
        try:
            rec = self._record(key)
            u = None
            if self._in_place_ok(rec):
                u = await self._begin_in_place(rec, chunked)
            if u is None:
                u = await self._begin_scratch(rec, chunked)
        except BaseException:
            self._borrows.release(key)
            raise
        self.stats_counters.updates += 1
        return u

    def plan(self, keys: Sequence[str] | None) -> None:
        """Declare the order in which the workload updates ``keys``, cycle after cycle (None: forget it).

        The RAM tier then evicts and writes back what the plan needs last, and reads ahead
        what it needs next, so that a cycle over state larger than the budget moves the
        minimum of bytes (``tierstore.plan``). Keys need not exist yet.
        """
        self._check_open()
        if keys is None:
            self._plan = None
            self._host.rank = None
            return
        plan = AccessPlan(keys)
        gen_keys = self._gen_keys

        def rank(cid: tuple[int, int]) -> float:
            return plan.distance(gen_keys.get(cid[0]))

        self._plan = plan
        self._host.rank = rank

    def _plan_ahead(self) -> None:
        """Along the plan: start writing back what is needed last, and read ahead what comes next."""
        plan, budget = self._plan, self._host.budget
        if plan is None or budget is None or self._closing:
            return
        # one key ahead (at least a chunk): enough to overlap its read with this update, and
        # every byte read ahead is a byte of state that cannot stay (more reads a cycle)
        nxt = self._head.get(next(plan.upcoming()))
        ahead = min(budget // 8, max(nxt.stored_nbytes if nxt is not None else 0,
                                     self.config.chunk_bytes or 0, 1))
        if self._host.used + ahead > budget and self._host.reclaimable() < ahead:
            self._start_write_back()
        want: list[str] = []
        seen = 0
        for key in plan.upcoming():
            rec = self._head.get(key)
            if rec is None or key in self._borrows:
                continue
            seen += rec.stored_nbytes
            if seen > ahead and want:
                break
            if not all(self._host.holds((rec.generation, i)) for i in range(rec.grid.n_chunks)):
                want.append(key)
        if want:
            self._prefetch_keys(want, "host")

    def _in_place_ok(self, rec: GenRecord) -> bool:
        budget = self._host.budget
        return (rec.codec_obj.raw_layout and not rec.shard and rec.nbytes > 0
                and (budget is None or rec.stored_nbytes <= budget // 2))

    async def _begin_in_place(self, rec: GenRecord, chunked: bool) -> Update | None:
        """Lend ``rec``'s RAM-tier buffers as a new head generation; None if they will not stay in RAM."""
        g, n = rec.generation, rec.grid.n_chunks
        assert self._commit_lock is not None
        # a write in flight reads the buffers about to change: let it end (put's write-behind)
        await _settle(list(self._writes.get(g, [])))
        dtype = rec.decoded_dtype
        for _attempt in range(3):
            missing = [i for i in range(n) if not self._host.holds((g, i))]
            if missing:  # loaded holding nothing of ours: a wait for room here cannot be for us
                self._pins.pin(g)
                try:
                    await asyncio.gather(*(self._load_chunk(rec, i, cache="yes") for i in missing))
                finally:
                    self._pins.unpin(g)
            # copy on write where someone reads the old bytes: a loan, or a read in flight (new
            # readers of this key wait for us, so this set only shrinks from here)
            readers = self._pins.pinned(g)
            need = {i: rec.chunks[i][0] for i in range(n) if readers or self._host.lent((g, i))}
            if not chunked and n > 1:
                need[-1] = rec.nbytes  # the scratch one tensor of several chunks is lent in
            bufs: dict[int, torch.Tensor] = {}
            try:
                for i, nbytes in need.items():
                    # never waited for: memory held here while waiting could be what the wait needs
                    buf = self._host.try_alloc(nbytes)
                    if buf is None:
                        return None  # no room beside the chunks: through a scratch instead
                    bufs[i] = buf
                async with self._commit_lock:  # the head is a commit's while it runs
                    # no await from here on: the loan starts whole or not at all
                    if all(self._host.holds((g, i)) for i in range(n)):
                        scratch_buf = bufs.pop(-1, None)
                        u = self._lend_in_place(rec, bufs, scratch_buf, chunked, dtype)
                        bufs = {}
                        return u
            finally:
                for buf in bufs.values():
                    self._host.recycle(buf)
            # chunks evicted meanwhile (a full budget): load them again
        return None

    def _lend_in_place(self, rec: GenRecord, cow: dict[int, torch.Tensor],
                       scratch_buf: torch.Tensor | None, chunked: bool, dtype: torch.dtype) -> Update:
        """The no-await part of ``_begin_in_place``: move (or copy) the chunks, swap the head."""
        g, n = rec.generation, rec.grid.n_chunks
        new_gen = self._next_gen
        self._next_gen += 1
        parts = []
        for i in range(n):
            if i in cow:
                buf = cow[i]
                src = self._host.lookup((g, i))
                assert src is not None
                buf.copy_(src)
                self._host.insert_for_update((new_gen, i), buf)
                self.stats_counters.bytes_copied_on_write += buf.numel()
            else:
                buf = self._host.take_for_update((g, i), (new_gen, i))
            parts.append(buf[: rec.grid.span(i)[1] * dtype.itemsize].view(dtype))
        new = dataclasses.replace(rec, generation=new_gen,
                                  chunks=tuple((nb, CRC_PENDING) for nb, _ in rec.chunks))
        self._gen_keys[new_gen] = rec.key
        self._head[rec.key] = new
        self._borrows.mark_in_place(rec.key)
        if g not in self._committed:
            if g not in self._writes and not self._pins.pinned(g) and g not in self._deferred:
                # never written (an earlier update's, still dirty in RAM), now moved on: nothing
                # on disk to delete, so no task and no io thread for it
                self._forget_in_memory(g, n)
            else:
                self._retire_soon(rec.key, g, n)
        u = Update(rec.key, rec, new, parts, chunked=chunked)
        if scratch_buf is not None:
            u.scratch_buf = scratch_buf
            u.scratch = scratch_buf.view(dtype)
            for piece, part in zip(split_flat(u.scratch, [p.numel() for p in parts]), parts, strict=True):
                piece.copy_(part)
        return u

    async def _begin_scratch(self, rec: GenRecord, chunked: bool) -> Update:
        """Decode ``rec`` into a scratch buffer counted in the RAM budget (coded, sharded or large)."""
        dtype = rec.decoded_dtype
        nbytes = max(1, rec.nbytes)
        # in the budget only where it leaves room for the encoded chunks it is turned into
        budget = self._host.budget
        buf = await self._host.alloc(nbytes) if budget is None or nbytes <= budget // 4 else None
        scratch = (buf if buf is not None else torch.empty(nbytes, dtype=torch.uint8))[: rec.nbytes].view(dtype)
        self._pins.pin(rec.generation)
        try:
            await self._fill(rec, [(0, scratch.numel(), 0)], scratch)
        except BaseException:
            if buf is not None:
                self._host.recycle(buf)
            raise
        finally:
            self._pins.unpin(rec.generation)
        sizes = [rec.grid.span(i)[1] for i in range(rec.grid.n_chunks)]
        return Update(rec.key, rec, None, split_flat(scratch, sizes), scratch=scratch,
                      scratch_buf=buf, chunked=chunked)

    async def begin_updates(self, keys: Sequence[str], *, chunked: bool = False) -> list[Update]:
        """``begin_update`` of several keys (in sorted order: two callers never wait on each other
        in a cycle), returned in the order of ``keys``; all of them or, on an error, none."""
        if len(set(keys)) != len(keys):
            raise StoreError(f"update of {list(keys)}: a key appears twice")
        begun: dict[str, Update] = {}
        try:
            for key in sorted(keys):
                begun[key] = await self.begin_update(key, chunked=chunked)
        except BaseException:
            await self.end_updates(list(begun.values()))
            raise
        return [begun[k] for k in keys]

    async def end_updates(self, us: Sequence[Update]) -> None:
        """``end_update`` of each of ``us`` (every one, even if an earlier one fails)."""
        failure: BaseException | None = None
        for u in us:
            try:
                await self.end_update(u)
            except BaseException as e:  # the others are still given back
                failure = failure or e
        if failure is not None:
            raise failure

    async def end_update(self, u: Update) -> None:
        """End an update: its value becomes the head (at once, or encoded from the scratch)."""
        if u.done:
            return
        u.done = True
        if u.new is not None and u.scratch is None:
            await self._finish_update(u)  # no await inside: it cannot be cancelled halfway
            return
        task = self._spawn(self._finish_update(u))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await _finish_despite_cancel(task)  # the key is never left lent
            raise

    async def _finish_update(self, u: Update) -> None:
        rec = u.old
        try:
            if u.new is not None:  # in place: the head is already the new generation
                if u.scratch is not None:
                    for piece, part in zip(split_flat(u.scratch, [p.numel() for p in u.parts]),
                                           u.parts, strict=True):
                        part.copy_(piece)
                for i in range(rec.grid.n_chunks):
                    self._host.end_update((u.new.generation, i))
            else:
                assert u.scratch is not None
                self._finishing += 1
                try:
                    await self._put_generation(rec.key, u.scratch.view(rec.shape), rec.codec_obj,
                                               rec.grid, rec.shard, lazy=not rec.shard)
                finally:
                    self._finishing -= 1
        finally:
            if u.scratch_buf is not None:
                self._host.recycle(u.scratch_buf)
            u.parts, u.scratch, u.scratch_buf = [], None, None
            self._borrows.release(rec.key)

    def _check_sharding(self, key: str, t: torch.Tensor, chunk_rows: Any, shard_rows: Any) -> None:
        """Reject bad ``chunk_rows``/``shard_rows`` naming the rule, before anything is written."""
        if chunk_rows is None:
            if shard_rows is not None:
                raise StoreError(f"put({key!r}): shard_rows= needs chunk_rows= (rows per inner chunk)")
            return
        for name, v in (("chunk_rows", chunk_rows), ("shard_rows", shard_rows)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise StoreError(f"put({key!r}): {name} must be a positive int, got {v!r}")
        if t.dim() == 0:
            raise StoreError(f"put({key!r}, chunk_rows=...): a 0-d tensor has no rows to chunk")
        if shard_rows is not None and shard_rows % chunk_rows:
            raise StoreError(f"put({key!r}): shard_rows={shard_rows} must be a multiple of "
                             f"chunk_rows={chunk_rows} (a shard holds whole inner chunks)")
        inner = min(chunk_rows, max(1, t.shape[0])) * (t.numel() // max(1, t.shape[0])) * t.element_size()
        if not self._host.fits(inner):
            raise BudgetError(f"put({key!r}): an inner chunk of {chunk_rows} rows is {inner} B, more "
                              f"than the RAM budget ({self._host.budget} B); lower chunk_rows")

    async def _write_generation(self, key: str, gen: int, t: torch.Tensor, codec: Codec,
                                grid: ChunkGrid, shard: int = 0, adopt: bool = False,
                                lazy: bool = False) -> GenRecord:
        # nothing on the put's own path touches the disk: folders and files are write-behind,
        # started now, or (``lazy``, not sharded) when the budget or a commit needs them
        assert not (lazy and (shard or adopt))
        self._gen_keys[gen] = key
        tasks: list[asyncio.Task[None]] = [] if lazy else self._writes.setdefault(gen, [])
        dirs: asyncio.Task[None] | None = None

        def start_writes() -> asyncio.Task[None]:
            task = self._spawn(self._make_dirs(key, gen, grid, shard))
            tasks.append(task)
            tasks.append(self._spawn(self._write_meta(key, gen, grid, t.dtype, codec, after=task,
                                                      shard=shard)))
            return task

        if not lazy:
            dirs = start_writes()

        async def alloc(nbytes: int) -> torch.Tensor:
            # a lazy generation is not a head yet, so the write-behind cannot free its room: once
            # the budget is full it is written as it is made, like a put's
            nonlocal lazy, dirs
            if lazy:
                buf = self._host.try_alloc(nbytes)
                if buf is not None:
                    return buf
                lazy = False
                self._writes[gen] = tasks
                dirs = start_writes()
                for j, (_, crc) in enumerate(chunks):
                    payload = self._host.dirty_payload((gen, j))
                    if payload is not None:
                        tasks.append(self._spawn(self._write_chunk(key, gen, grid, j, payload, crc,
                                                                   after=dirs)))
            return await self._host.alloc(nbytes)
        flat = t.reshape(-1)
        chunks: list[tuple[int, int]] = []
        at = 0  # offset of the next inner chunk in its shard file
        group_parts: list[Any] = []
        group_cids: list[tuple[int, int]] = []
        group_checks: list[ChunkCheck] = []
        group_bytes = group_at = 0
        flush_bytes = min(_SHARD_GROUP_BYTES, (self._host.budget or _SHARD_GROUP_BYTES) // 4)
        raw_bytes = grid.chunk_numel * t.element_size()
        for i in range(grid.n_chunks):
            start, valid = grid.span(i)
            adopted = adopt and valid == grid.chunk_numel  # an edge chunk is padded: copied
            if adopted:
                await self._host.reserve(raw_bytes)
                payload = as_bytes(flat[start : start + valid])
                try:
                    crc = await self._run_cpu(raw_bytes, checksum, [payload.numpy()])
                except BaseException:
                    self._host.release(payload)
                    raise
            elif codec.raw_layout:
                buf = await alloc(raw_bytes)
                try:
                    payload, crc = await self._run_cpu(raw_bytes, encode_chunk, codec, flat, grid, i, buf)
                except BaseException:
                    self._host.release(buf)
                    raise
            else:
                encoded, crc = await self._run_cpu(raw_bytes, encode_chunk, codec, flat, grid, i, None)
                payload = await alloc(encoded.numel())
                payload.copy_(encoded)  # into a buffer the RAM tier accounts for
            self._host.insert((gen, i), payload, dirty=True, adopted=adopted)
            chunks.append((payload.numel(), crc))
            if not shard:
                if not lazy:
                    tasks.append(self._spawn(self._write_chunk(key, gen, grid, i, payload, crc,
                                                               after=dirs)))
                continue
            # a shard is written in groups of adjacent inner chunks, one pwritev each (a task
            # per 4 KiB row cost more than the write); a group stays well under the budget,
            # as its chunks are dirty until it is written
            if not group_parts:
                group_at = at
            group_parts += [payload.numpy(), crc_trailer(crc)]
            group_cids.append((gen, i))
            group_checks.append((key, i, payload.numpy(), crc))
            group_bytes += payload.numel() + TRAILER
            at += payload.numel() + TRAILER
            last = i % shard == shard - 1 or i == grid.n_chunks - 1  # the shard's last inner chunk
            if last:  # the index follows the last inner chunk: same write
                group_parts.append(shard_index([n for n, _ in chunks[i - i % shard :]], shard))
            if last or group_bytes >= flush_bytes or len(group_parts) >= IOV_MAX - 2:
                path = self._disk.shard_path(key, gen, grid, i // shard)
                tasks.append(self._spawn(self._write_file(
                    path, group_parts, group_cids, after=dirs, at=group_at, checks=group_checks)))
                group_parts, group_cids, group_checks, group_bytes = [], [], [], 0
            if last:
                at = 0
        rec = GenRecord.new(key, gen, t.dtype, codec, grid, chunks, shard)
        return rec

    async def _write_meta(self, key: str, gen: int, grid: ChunkGrid, dtype: torch.dtype,
                          codec: Codec, after: asyncio.Task[None] | None = None,
                          shard: int = 0) -> None:
        """Write the generation's zarr.json."""
        attrs = {"key": key, "generation": gen}
        if shard:
            meta = sharded_zarr_metadata(grid, shard, dtype, codec, attrs)
        else:
            meta = zarr_metadata(grid, dtype, codec, attrs)
        path = os.path.join(self._disk.generation_dir(key, gen), "zarr.json")
        await self._write_file(path, [meta], None, after=after)

    async def _write_chunk(self, key: str, gen: int, grid: ChunkGrid, i: int, payload: torch.Tensor,
                           crc: int, after: asyncio.Task[None] | None = None, check: bool = True) -> None:
        """Write chunk ``i``'s file (payload + crc32c trailer); the RAM copy turns clean.

        ``check``: the payload must still match ``crc`` (``_write_file``); False only where the
        crc was just taken from these very bytes.
        """
        path = self._disk.chunk_path(key, gen, grid, i)
        data = payload.numpy()
        await self._write_file(path, [data, crc_trailer(crc)], (gen, i), after=after,
                               checks=[(key, i, data, crc)] if check else ())

    async def _make_dirs(self, key: str, gen: int, grid: ChunkGrid, shard: int = 0) -> None:
        # each new folder (and the one holding it) enters the ledger as it is made
        await self._run_io(self._disk.make_dirs, key, gen, grid, range(grid.n_chunks), self._ledger,
                           shard)

    async def _write_file(self, path: str, parts: list[Any],
                          cid: tuple[int, int] | list[tuple[int, int]] | None,
                          after: asyncio.Task[None] | None = None, at: int | None = None,
                          checks: Sequence[ChunkCheck] = ()) -> None:
        """Write ``parts`` as the file ``path`` (``at``: at that offset of a shard file).

        ``checks``: chunks among ``parts`` whose crc32c was taken when they were stored. Each
        is checked once written, on the same io thread: bytes changed since (a tensor lent by
        ``get(copy=False)`` or given to ``put(copy=False)`` written into) fail the write with
        ``LoanWritten``, so the chunk stays dirty and no commit publishes the file. Checked
        after the write, not before, so a change made while ``pwritev`` ran is caught too.
        """
        if after is not None:
            await after  # the generation's folders; their failure fails this write too
        assert self._write_sem is not None
        n = sum(memoryview(p).nbytes for p in parts)
        sync = n >= _SYNC_ON_WRITE_BYTES
        async with self._write_sem:
            t0 = time.perf_counter()
            await self._run_io(_write_checked, self._disk, path, at, parts, sync, checks)
        if not sync:
            self._ledger.written(path)
        self.stats_counters.bytes_written_disk += n
        for c in ([cid] if isinstance(cid, tuple) else cid or []):
            self._host.mark_clean(c)  # the RAM copies turn clean
        self.tracer.span("write", "disk", t0, time.perf_counter(), bytes=n)

    def _retire_soon(self, key: str, gen: int, n_chunks: int) -> None:
        """Forget an uncommitted generation: once its writes settle, drop its RAM and files."""
        self._spawn_retiring(self._retire(key, gen, n_chunks))

    def _spawn_retiring(self, coro: Any) -> None:
        # a deletion in the background: commits and close wait for every one (``_retiring``)
        task = self._spawn(coro)
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, key: str, gen: int, n_chunks: int) -> None:
        # the writes stay listed until they settle: a reservation waiting for RAM room must see
        # them pending, not dirty chunks with no write (a false BudgetError, found by the fuzz)
        await _settle(list(self._writes.get(gen, [])))
        self._writes.pop(gen, None)
        await self._collect({gen: (key, n_chunks, False)})  # never committed: no reader leases it

    async def _collect(self, gens: dict[int, tuple[str, int, bool]]) -> None:
        """Delete unreferenced generations nothing uses; defer the rest (pinned or leased).

        The only path that deletes a generation (RAM chunks, window copy, folder).
        """
        self._deferred.update(gens)
        candidates = list(self._deferred)  # before the lease scan: later entries wait for the next
        leased: set[int] | None = set()
        if any(self._deferred[g][2] for g in candidates):
            leased = await self._run_io(leased_generations, self.path)
        for g in candidates:
            entry = self._deferred.get(g)
            if entry is None or self._pins.pinned(g):
                continue  # taken by a concurrent collection, or still read here
            key, n_chunks, shared = entry
            if shared and (leased is None or g in leased):
                continue  # a reader (maybe in another process) reads it
            del self._deferred[g]
            self._forget_in_memory(g, n_chunks)
            await self._run_io(self._disk.delete_generation, key, g)

    def _forget_in_memory(self, g: int, n_chunks: int) -> None:
        """Drop everything this process keeps of generation ``g`` (its RAM chunks, window copy, maps)."""
        for i in range(n_chunks):
            self._late_crcs.pop((g, i), None)
        self._gen_keys.pop(g, None)
        self._host.drop_generation(g, n_chunks)
        self._window.forget(g)
        self._shard_maps.pop(g, None)
        self._mapped.forget(g)

    def _on_unpinned(self, gen: int) -> None:
        """The last in-process user of ``gen`` let go: collect it if it waited for that."""
        if gen in self._deferred and not (self._closed or self._closing):
            # while closing, the io pool is going away: a deferred generation stays an orphan
            # for the next writer open to delete (or keep, while a lease names it)
            self._spawn_retiring(self._collect({}))

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
                    self._retire_soon(rec.key, rec.generation, rec.grid.n_chunks)
        finally:
            self._borrows.release(key)

    # ---------------------------------------------------------------- restore

    async def restore(self, key: str, version: int) -> None:
        """Make ``key``'s head the generation that retained commit ``version`` holds for it.

        No byte moves and nothing is re-encoded: the head points at the stored generation
        again, with its codec, chunk grid and sharded layout (a get then put would re-encode,
        and the lossy codecs are not idempotent). Invariant: a generation the head references
        is never deleted. It holds because the generation is in ``_committed`` (a retained
        commit names it): ``_collect`` deletes only generations a commit dropped from
        ``_records`` or that ``_retire_soon`` retired as never committed, and the next commit,
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
                    self._retire_soon(old.key, old.generation, old.grid.n_chunks)
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
            "bytes_copied_on_write": c.bytes_copied_on_write,
            "mapped_gathers": self._mapped.served, "mapped_declined": self._mapped.declined,
            "predictor_dropped_reads": self._predictor.dropped, "trace_dropped_events": self.tracer.dropped,
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

    async def _drain_writes(self) -> None:
        """Wait for every pending chunk write; retry failed ones once (e.g. after ENOSPC).

        ``asyncio.wait`` on a snapshot, never ``gather``: cancelling a commit must not cancel
        the write-behind (or retirements) it waits for (found by tools.harness.modelcheck).
        """
        if self._retiring:
            await _settle(list(self._retiring))
        for gen in list(self._writes):
            tasks = list(self._writes.get(gen, []))
            if not await _settle(tasks):
                continue
            rec = next((r for r in self._head.values() if r.generation == gen), None)
            if rec is None:
                continue  # superseded meanwhile: nothing to save
            retry = self._writes[gen] = [self._spawn(t) for t in await self._rewrite(rec)]
            failures = await _settle(retry)
            if failures:
                raise failures[0]  # the first failure of the retry fails the commit

    async def _rewrite(self, rec: GenRecord) -> list[Any]:
        """Write coroutines for every file of ``rec`` whose data is still dirty in RAM.

        A sharded generation rewrites its dirty inner chunks in place and every shard index
        (small, and a failed index write leaves no dirty chunk to say so).
        """
        await self._make_dirs(rec.key, rec.generation, rec.grid, rec.shard)
        coros = [self._write_meta(rec.key, rec.generation, rec.grid, rec.torch_dtype, rec.codec_obj,
                                  shard=rec.shard)]
        smap = self._shard_map(rec) if rec.shard else None
        for i, (_, crc) in enumerate(rec.chunks):
            payload = self._host.dirty_payload((rec.generation, i))
            if payload is None:
                continue
            check = True
            if crc == CRC_PENDING:  # changed in place: its crc is taken now, once (no update can
                # change it any more: a new update moves it to a new generation, after this write)
                cid = (rec.generation, i)
                if cid not in self._late_crcs:
                    self._late_crcs[cid] = await self._run_cpu(payload.numel(), checksum,
                                                               [payload.numpy()])
                    check = False  # just taken from these bytes: a second pass would find them equal
                crc = self._late_crcs[cid]
            if smap is None:
                coros.append(self._write_chunk(rec.key, rec.generation, rec.grid, i, payload, crc,
                                               check=check))
            else:
                s, at = smap.location(i)
                path = self._disk.shard_path(rec.key, rec.generation, rec.grid, s)
                data = payload.numpy()
                coros.append(self._write_file(path, [data, crc_trailer(crc)], (rec.generation, i), at=at,
                                              checks=[(rec.key, i, data, crc)] if check else ()))
        if smap is not None:
            for s in range(shard_count(rec.grid, rec.shard)):
                members = shard_members(rec.grid, rec.shard, s)
                index = shard_index([rec.chunks[i][0] for i in members], rec.shard)
                path = self._disk.shard_path(rec.key, rec.generation, rec.grid, s)
                coros.append(self._write_file(path, [index], None, at=int(smap.data_end[s])))
        return coros

    async def commit(self, step: int | None = None, message: str = "") -> int:
        """Make the head a durable, atomic version (fsync + one LMDB transaction); return its id."""
        self._check_writable()
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise StoreError(f"step must be an int or None, got {step!r}")
        assert self._commit_lock is not None and self._catalog is not None
        lock = self._commit_lock
        await lock.acquire()
        try:
            t0 = time.perf_counter()
            await self._borrows.wait_no_in_place()  # never publish half an update
            # write-behind: what the budget has not made write yet is written now
            for rec in list(self._head.values()):
                if rec.generation not in self._records and rec.generation not in self._writes:
                    self._writes[rec.generation] = [self._spawn(self._write_dirty(rec))]
            # cancelled up to the transaction, nothing happened: drained writes and fsyncs
            # change nothing a reopen sees, and the ledger keeps what was not surely synced
            await self._drain_writes()
            for k, rec in list(self._head.items()):
                self._head[k] = self._resolve_crcs(rec)
            head = dict(self._head)
            await self._fsync_all()
            version = (self._commits[-1].version + 1) if self._commits else 1
            commit = Commit(version, step, time.time(), str(message),
                            {k: r.generation for k, r in sorted(head.items())})
            task = self._spawn(self._publish_and_apply(commit, head, t0))
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                # the transaction may have run: the cancellation is delivered once memory matches
                # the disk, so a caller never sees a version still landing (found by modelcheck)
                await _finish_despite_cancel(task)
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
            await self._collect(gone)  # after the transaction: see its docstring on leases
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

    async def _fsync_all(self) -> None:
        """Sync every ledger path; they leave the ledger only once the sync succeeded."""
        paths = self._ledger.pending()
        if not paths:
            return
        await self._run_io(self._disk.sync_paths, paths)
        self._ledger.synced(paths)
