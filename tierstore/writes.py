"""The write path of ``AsyncStore``: a generation's chunks into the RAM tier, then to disk.

Plain functions of the store rather than a collaborator object: they use most of its private
state (the RAM tier, the disk tier, the head, the write tasks, the sync ledger, the io and cpu
pools), all owned by the store's event loop thread, where every function here runs; only the
blocking calls they hand to ``store._run_io``/``_run_cpu`` run on the ``tierstore-io`` and
``tierstore-cpu`` threads.

A put encodes its chunks into RAM-tier buffers (``write_generation``) and returns; the files are
written behind it. ``store._writes`` lists, per generation, the write tasks in flight or done
and not yet committed. Invariant: a dirty RAM chunk of a head generation is either being written
by a task in ``store._writes`` or waits for ``start_write_back`` (the budget needs its room) or
a commit (``drain_writes``) to write it; a chunk changed in place gets its crc32c when it is
written or first lent (``CRC_PENDING``, ``store._late_crcs``). A generation written for room
alone has no ``zarr.json`` until a commit publishes it (``store._meta_owed``,
``write_owed_meta``): most such state is superseded a step later, and its metadata would be a
file written, and written over, for nobody. A generation written back for room (most of a
training step's state) goes to disk in one io job a chunk, crc32c and file together, its
folders in the first (``write_back``).

Every chunk write checks the crc32c of the bytes it wrote against the one taken when they were
stored (``write_file``'s ``checks``): a write into a tensor lent by ``get(copy=False)`` (or
given to ``put(copy=False)``) fails that write with ``LoanWritten``, so the chunk stays dirty
and no commit publishes it. One crc32c pass per chunk written, several times faster than the
write it follows. Every write of a chunk that was ever lent, or is a caller's memory, checks,
with no exception for a crc32c just taken: taking it and writing are two moments, and a loan
may be lent and written into between them. A chunk found never lent once the write is done
(``HostTier.untouched``, asked on the loop thread after the write) is not checked: nobody but
the store had its bytes while they were written, and a loan lent after that point changes only
the RAM copy, which the write has already left behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from tierstore.chunks import encode_chunk
from tierstore.codecs import Codec
from tierstore.dtypes import as_bytes
from tierstore.errors import BudgetError, DiskError, LoanWritten, StoreError
from tierstore.layout import ChunkGrid, zarr_metadata
from tierstore.records import CRC_PENDING, GenRecord
from tierstore.retirement import delete_folder, spawn_retiring
from tierstore.settle import mark_retrieved, settle
from tierstore.shards import (
    TRAILER,
    shard_count,
    shard_index,
    shard_members,
    sharded_zarr_metadata,
)
from tierstore.tiers.disk import IOV_MAX, DiskTier, SyncLedger, checksum, crc_trailer
from tierstore.tiers.host import HostTier

if TYPE_CHECKING:
    from tierstore.store import AsyncStore

_SYNC_ON_WRITE_BYTES = 1 << 20  # larger files are fdatasync'd by the write-behind itself
_SHARD_GROUP_BYTES = 4 << 20  # inner chunks of a shard written with one pwritev
#: a chunk a write must find unchanged: (key, chunk index, its payload, the crc32c it was stored
#: with, its RAM-tier id: looked up once the write is done, it says whether anyone but the store
#: could have written the payload meanwhile)
ChunkCheck = tuple[str, int, Any, int, tuple[int, int]]


def start_write_back(store: AsyncStore) -> bool:
    """Start writing dirty head chunks nobody writes yet, needed last first; True if any started.

    Write-behind: a dirty chunk is written when the RAM budget needs its room or a commit
    needs it durable, not when it is made, so state that fits the budget costs no disk
    traffic between commits. About 1/16 of the budget is kept in flight, so that room frees
    while more is written; a call while that much is in flight starts nothing (each waiter
    for room calls this, and a write started for nobody's room is a write too many).
    """
    target = max(1, (store._host.budget or 0) // 16)
    # counted from the tasks themselves, not by callbacks: a done task's callback runs a loop
    # turn later, and a waiter between the two would find room neither made nor coming
    flight = store._write_backs
    for t in [t for t in flight if t.done()]:
        del flight[t]
    in_flight = sum(flight.values())
    if in_flight >= target:
        return False  # before ranking the dirty chunks: each waiter for room asks
    heads = {r.generation: r for r in store._head.values()}
    started = False
    for gen, _ in store._host.dirty_lru():
        if in_flight >= target:
            break
        rec = heads.get(gen)
        if rec is None or gen in store._writes:
            continue  # written already or now, or not a head any more (its retirement drops it)
        task = store._spawn(write_dirty(store, rec, meta=False))
        flight[task] = rec.stored_nbytes
        in_flight += rec.stored_nbytes
        store._writes[gen] = [task]
        started = True
    return started


async def write_dirty(store: AsyncStore, rec: GenRecord, meta: bool = True) -> None:
    """Write every dirty chunk of ``rec`` (with its folders; ``meta``: and its zarr.json); raise the first failure."""
    if not meta and await write_back(store, rec):
        return
    # made room for, not made durable: a commit syncs what is still the head by then, and
    # state superseded first (most of a training step's) is deleted before any device write
    failures = await settle([store._spawn(c) for c in await rewrite(store, rec, sync=False, meta=meta)])
    if failures:
        raise failures[0]


@dataclasses.dataclass(slots=True)
class _WriteBack:
    """What ``_write_back_job`` did, for the loop thread to record."""

    recycled: bool = False  # the retired folder was renamed to this generation's
    spare_failed: bool = False  # its rename failed: the retired folder is to be deleted
    folders: bool = False  # the generation's folders exist
    crc: int = 0  # the crc32c written after the payload
    error: Exception | None = None


def _write_back_job(disk: DiskTier, key: str, gen: int, grid: ChunkGrid, spare: int | None,
                    ledger: SyncLedger, folder: bool, path: str | None, data: Any, crc: int | None,
                    overwrite: bool) -> _WriteBack:
    """A write-back's io job: the generation's folders (``folder``: renamed from ``spare`` or
    made), then the file at ``path`` (None: none) with its crc32c (None: taken here).

    A failure is returned, not raised: the folders made before it must still be recorded.
    """
    out = _WriteBack(recycled=overwrite)
    try:
        if folder:
            if spare is not None:
                try:
                    disk.adopt_folder(key, spare, gen, grid, ledger)
                    out.recycled = True
                except DiskError:
                    out.spare_failed = True
            if not out.recycled:
                disk.make_dirs(key, gen, grid, range(grid.n_chunks), ledger)
            out.folders = True
        if path is not None:
            out.crc = checksum([data]) if crc is None else crc
            disk.write_at(path, None, [data, crc_trailer(out.crc)], False, overwrite=out.recycled)
    except Exception as e:  # noqa: BLE001 - handed to the loop thread, which raises it
        out.error = e
    return out


async def write_back(store: AsyncStore, rec: GenRecord) -> bool:
    """``write_dirty(meta=False)`` of an unsharded generation in one io job a chunk; False if
    ``rec`` is not one this path writes (then nothing was done).

    The general path takes a hop for the folders, one after another for each pending crc32c
    and a task and a hop for each file. Here each chunk's crc32c (if still pending) is taken
    in its file's job, and the chunks go to the io threads together; a one-chunk generation's
    folder goes in its file's job too, a larger one's folders in a job before them. Same
    checks: a chunk lent meanwhile is checked after its write (``_check_written``), and a crc
    a loan took meanwhile must equal the one written.
    """
    g, key, grid = rec.generation, rec.key, rec.grid
    n = grid.n_chunks
    dirty = [(i, p) for i, p in enumerate(store._host.dirty_payload((g, j)) for j in range(n)) if p is not None]
    memory_only = g in store._memory_only
    if rec.shard or not dirty or (memory_only and len(dirty) != n):
        return False
    store._meta_owed.add(g)  # owed to the commit, as ``rewrite(meta=False)``
    # no folder yet: a retired one of the key may become its
    spare = take_retired_folder(store, key, grid) if memory_only else None
    store._memory_only.discard(g)  # before: a cancelled job may still make the folder
    folder = memory_only or g not in store._folder_grids
    recycled = False
    if folder and n > 1:  # every file needs the folders first
        assert store._write_sem is not None
        async with store._write_sem:
            out = await store._run_io(_write_back_job, store._disk, key, g, grid, spare, store._ledger,
                                      True, None, None, None, False)
        _record_folders(store, key, g, grid, spare, out)
        if out.error is not None:
            raise out.error
        folder, spare, recycled = False, None, out.recycled
    if len(dirty) == 1:
        await _write_back_chunk(store, rec, *dirty[0], folder, spare, recycled)
        return True
    tasks = [store._spawn(_write_back_chunk(store, rec, i, p, folder, spare, recycled)) for i, p in dirty]
    # a chunk written and evicted before the last one ends gives its buffer back at once: no
    # name here may hold a payload while the tasks run
    del dirty
    failures = await settle(tasks)
    if failures:
        raise failures[0]
    return True


async def _write_back_chunk(store: AsyncStore, rec: GenRecord, i: int, payload: torch.Tensor,
                            folder: bool, spare: int | None, recycled: bool) -> None:
    """Chunk ``i`` of a write-back (``write_back``) in one io job, and what the loop records after it."""
    g, key = rec.generation, rec.key
    cid = (g, i)
    crc: int | None = rec.chunks[i][1]
    if crc == CRC_PENDING:
        crc = store._late_crcs.get(cid)
    path = store._disk.chunk_path(key, g, rec.grid, i)
    data = payload.numpy()  # ``payload`` stays referenced: its buffer is not reused meanwhile
    assert store._write_sem is not None
    async with store._write_sem:
        t0 = time.perf_counter()
        out = await store._run_io(_write_back_job, store._disk, key, g, rec.grid, spare, store._ledger,
                                  folder, path, data, crc, recycled)
        _record_folders(store, key, g, rec.grid, spare, out)
        if out.error is not None:
            raise out.error
        if crc is None and store._host.holds(cid):
            # the first crc taken wins (``rewrite``): one a loan took meanwhile must be this one
            if store._late_crcs.setdefault(cid, out.crc) != out.crc:
                raise loan_written(key, i)
        if not store._host.untouched(cid):
            await store._run_io(_check_written, [(key, i, data, out.crc, cid)])
    _written(store, path, payload.numel() + TRAILER, [cid], t0, sync=False)


def _record_folders(store: AsyncStore, key: str, g: int, grid: ChunkGrid, spare: int | None,
                    out: _WriteBack) -> None:
    """Record the folders a write-back's job made or renamed; a retired folder it failed to rename goes."""
    if out.spare_failed:
        spawn_retiring(store, store._run_delete(delete_folder, store, key, spare))
    if out.folders:
        store._folder_grids[g] = grid
        store.stats_counters.folders_recycled += out.recycled


async def recycle_folder(store: AsyncStore, key: str, gen: int, grid: ChunkGrid, shard: int) -> bool:
    """Give ``gen`` (no folder yet) a retired generation's folder of ``key``; True if it took one.

    Training state written back for room is superseded a step later: its folder becomes the
    next generation's instead of being deleted while a new one is made (``adopt_folder``).
    The caller writes every file of ``gen`` over the old ones (``write_at(overwrite=True)``),
    so only the grid (the folders it needs) has to match.
    """
    spare = None if shard else take_retired_folder(store, key, grid)
    if spare is None:
        return False
    store._memory_only.discard(gen)  # before: a cancelled rename may still land
    try:
        await store._run_io(store._disk.adopt_folder, key, spare, gen, grid, store._ledger)
    except DiskError:
        spawn_retiring(store, store._run_delete(delete_folder, store, key, spare))
        return False
    store._folder_grids[gen] = grid
    store.stats_counters.folders_recycled += 1
    return True


def take_retired_folder(store: AsyncStore, key: str, grid: ChunkGrid) -> int | None:
    """The generation of a retired folder of ``key`` with the same grid, now the caller's; None if none."""
    spare = store._spare_folders.get(key)
    if spare is None or spare[1] != grid:
        return None
    del store._spare_folders[key]
    return spare[0]


async def folders(store: AsyncStore, key: str, gen: int, grid: ChunkGrid, shard: int) -> bool:
    """A new generation's folders: a recycled one (True: write its files over) or new ones."""
    if await recycle_folder(store, key, gen, grid, shard):
        return True
    await make_dirs(store, key, gen, grid, shard)
    return False


def chunk_crc(rec: GenRecord, i: int, late_crcs: dict[tuple[int, int], int]) -> int:
    """The crc32c of chunk ``i`` of ``rec``: in the record, or computed when it was written."""
    crc = rec.chunks[i][1]
    if crc != CRC_PENDING:
        return crc
    late = late_crcs.get((rec.generation, i))
    if late is None:  # never written and no longer in RAM: the generation was dropped
        raise StoreError(f"generation {rec.generation} of {rec.key!r} was replaced before this "
                         "read reached it; read the key again")
    return late


def resolve_crcs(store: AsyncStore, rec: GenRecord) -> GenRecord:
    """``rec`` with the crcs its chunks got when they were written (a commit publishes this)."""
    if all(c != CRC_PENDING for _, c in rec.chunks):
        return rec
    return dataclasses.replace(rec, chunks=tuple(
        (n, chunk_crc(rec, i, store._late_crcs)) for i, (n, _) in enumerate(rec.chunks)))


def check_sharding(host: HostTier, key: str, t: torch.Tensor, chunk_rows: Any,
                   shard_rows: Any) -> None:
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
    if not host.fits(inner):
        raise BudgetError(f"put({key!r}): an inner chunk of {chunk_rows} rows is {inner} B, more "
                          f"than the RAM budget ({host.budget} B); lower chunk_rows")


async def write_generation(store: AsyncStore, key: str, gen: int, t: torch.Tensor, codec: Codec,
                           grid: ChunkGrid, shard: int = 0, adopt: bool = False,
                           lazy: bool = False) -> GenRecord:
    """Encode ``t`` into RAM-tier chunks of generation ``gen`` and start writing them; its record."""
    # nothing on the put's own path touches the disk: folders and files are write-behind,
    # started now, or (``lazy``, not sharded) when the budget or a commit needs them
    assert not (lazy and shard)
    store._gen_keys[gen] = key
    tasks: list[asyncio.Task[Any]] = [] if lazy else store._writes.setdefault(gen, [])
    dirs: asyncio.Task[bool] | None = None

    def start_writes() -> asyncio.Task[bool]:
        store._memory_only.discard(gen)  # now, not when the task starts: a collection may come first
        task = store._spawn(folders(store, key, gen, grid, shard))
        tasks.append(task)
        tasks.append(store._spawn(write_meta(store, key, gen, grid, t.dtype, codec, after=task,
                                             shard=shard)))
        return task

    if lazy:
        store._memory_only.add(gen)
    else:
        dirs = start_writes()

    def go_eager() -> None:
        # a lazy generation is not a head yet, so the write-behind cannot free its room: once
        # the budget is full it is written as it is made, like a put's
        nonlocal lazy, dirs
        lazy = False
        store._writes[gen] = tasks
        dirs = start_writes()
        for j, (_, crc) in enumerate(chunks):
            payload = store._host.dirty_payload((gen, j))
            if payload is not None:
                tasks.append(store._spawn(write_chunk(store, key, gen, grid, j, payload, crc,
                                                      after=dirs)))

    async def alloc(nbytes: int) -> torch.Tensor:
        if lazy:
            buf = store._host.try_alloc(nbytes)
            if buf is not None:
                return buf
            go_eager()
        return await store._host.alloc(nbytes)

    async def reserve(nbytes: int) -> None:
        if lazy:
            if store._host.try_reserve(nbytes):
                return
            go_eager()
        await store._host.reserve(nbytes)
    flat = t.reshape(-1)
    chunks: list[tuple[int, int]] = []
    at = 0  # offset of the next inner chunk in its shard file
    group_parts: list[Any] = []
    group_cids: list[tuple[int, int]] = []
    group_checks: list[ChunkCheck] = []
    group_bytes = group_at = 0
    flush_bytes = min(_SHARD_GROUP_BYTES, (store._host.budget or _SHARD_GROUP_BYTES) // 4)
    raw_bytes = grid.chunk_numel * t.element_size()
    for i in range(grid.n_chunks):
        start, valid = grid.span(i)
        adopted = adopt and valid == grid.chunk_numel  # an edge chunk is padded: copied
        if adopted:
            await reserve(raw_bytes)
            payload = as_bytes(flat[start : start + valid])
            try:
                crc = await store._run_cpu(raw_bytes, checksum, [payload.numpy()])
            except BaseException:
                store._host.release(payload)
                raise
        elif codec.raw_layout:
            buf = await alloc(raw_bytes)
            try:
                payload, crc = await store._run_cpu(raw_bytes, encode_chunk, codec, flat, grid, i, buf)
            except BaseException:
                store._host.release(buf)
                raise
        else:
            encoded, crc = await store._run_cpu(raw_bytes, encode_chunk, codec, flat, grid, i, None)
            payload = await alloc(encoded.numel())
            payload.copy_(encoded)  # into a buffer the RAM tier accounts for
        store._host.insert((gen, i), payload, dirty=True, adopted=adopted)
        chunks.append((payload.numel(), crc))
        if not shard:
            if not lazy:
                tasks.append(store._spawn(write_chunk(store, key, gen, grid, i, payload, crc,
                                                      after=dirs)))
            continue
        # a shard is written in groups of adjacent inner chunks, one pwritev each (a task
        # per 4 KiB row cost more than the write); a group stays well under the budget,
        # as its chunks are dirty until it is written
        if not group_parts:
            group_at = at
        group_parts += [payload.numpy(), crc_trailer(crc)]
        group_cids.append((gen, i))
        group_checks.append((key, i, payload.numpy(), crc, (gen, i)))
        group_bytes += payload.numel() + TRAILER
        at += payload.numel() + TRAILER
        last = i % shard == shard - 1 or i == grid.n_chunks - 1  # the shard's last inner chunk
        if last:  # the index follows the last inner chunk: same write
            group_parts.append(shard_index([n for n, _ in chunks[i - i % shard :]], shard))
        if last or group_bytes >= flush_bytes or len(group_parts) >= IOV_MAX - 2:
            path = store._disk.shard_path(key, gen, grid, i // shard)
            tasks.append(store._spawn(write_file(store, path, group_parts, group_cids,
                                                 after=dirs, at=group_at, checks=group_checks)))
            group_parts, group_cids, group_checks, group_bytes = [], [], [], 0
        if last:
            at = 0
    rec = GenRecord.new(key, gen, t.dtype, codec, grid, chunks, shard)
    return rec


async def write_meta(store: AsyncStore, key: str, gen: int, grid: ChunkGrid, dtype: torch.dtype,
                     codec: Codec, after: asyncio.Task[bool] | None = None,
                     shard: int = 0, overwrite: bool = False) -> None:
    """Write the generation's zarr.json (``overwrite``: over a recycled folder's, ``write_at``)."""
    attrs = {"key": key, "generation": gen}
    if shard:
        meta = sharded_zarr_metadata(grid, shard, dtype, codec, attrs)
    else:
        meta = zarr_metadata(grid, dtype, codec, attrs)
    path = os.path.join(store._disk.generation_dir(key, gen), "zarr.json")
    await write_file(store, path, [meta], None, after=after, overwrite=overwrite)


async def write_chunk(store: AsyncStore, key: str, gen: int, grid: ChunkGrid, i: int,
                      payload: torch.Tensor, crc: int,
                      after: asyncio.Task[bool] | None = None, sync: bool = True,
                      overwrite: bool = False) -> None:
    """Write chunk ``i``'s file (payload + crc32c trailer); the RAM copy turns clean.

    The payload must still match ``crc`` once written (``write_file``) if the chunk was lent
    by then: even a crc just taken from these bytes was taken before the write, and a loan
    may be written in between.
    ``overwrite``: over a recycled folder's file.
    """
    path = store._disk.chunk_path(key, gen, grid, i)
    data = payload.numpy()
    await write_file(store, path, [data, crc_trailer(crc)], (gen, i), after=after, sync=sync,
                     checks=[(key, i, data, crc, (gen, i))], overwrite=overwrite)


async def make_dirs(store: AsyncStore, key: str, gen: int, grid: ChunkGrid, shard: int = 0) -> None:
    """Make the generation's folders; each new one (and the one holding it) enters the ledger."""
    store._memory_only.discard(gen)  # before: a failure midway may leave folders behind
    await store._run_io(store._disk.make_dirs, key, gen, grid, range(grid.n_chunks), store._ledger,
                        shard)
    if not shard:  # every folder its grid needs exists: a later generation may take them over
        store._folder_grids[gen] = grid


def _check_written(checks: Sequence[ChunkCheck]) -> None:
    """Each chunk's crc32c again: LoanWritten if its bytes changed since it was stored (io thread)."""
    for key, i, data, crc, _ in checks:
        if checksum([data]) != crc:
            raise loan_written(key, i)


def loan_written(key: str, i: int) -> LoanWritten:
    """The error of a chunk whose bytes changed after they were stored."""
    return LoanWritten(
        f"chunk {i} of {key!r} changed after it was stored: a tensor lent by get(copy=False) "
        f"(or given to put(copy=False)) was written into. The changed bytes are not "
        f"committed and the last commit is intact; put or delete {key!r} to go on",
        key=key, chunk=i)


async def write_file(store: AsyncStore, path: str, parts: list[Any],
                     cid: tuple[int, int] | list[tuple[int, int]] | None,
                     after: asyncio.Task[bool] | None = None, at: int | None = None,
                     sync: bool = True, checks: Sequence[ChunkCheck] = (),
                     overwrite: bool = False) -> None:
    """Write ``parts`` as the file ``path`` (``at``: at that offset of a shard file).

    ``sync``: a large file is synced by the write itself (so a commit has less left to sync);
    False leaves it to the commit's sync (the ledger).

    ``checks``: chunks among ``parts`` whose crc32c was taken when they were stored; each is
    checked once written, on the same io thread. Bytes changed since fail the write with
    ``LoanWritten``, and the chunk stays dirty. Checked after the write, not before, so that a
    change made while ``pwritev`` ran is caught too (the file is not published either way).
    """
    if after is not None:
        # the generation's folders; their failure fails this write too. True: a recycled
        # folder, whose old files are written over
        overwrite = await after is True or overwrite
    assert store._write_sem is not None
    n = sum(memoryview(p).nbytes for p in parts)
    sync = sync and n >= _SYNC_ON_WRITE_BYTES
    async with store._write_sem:
        t0 = time.perf_counter()
        await store._run_io(store._disk.write_at, path, at, parts, sync, overwrite)
        # only chunks that left the store's hands by now: never lent nor a caller's memory,
        # nobody but the store had the bytes while they were written
        lent = [c for c in checks if not store._host.untouched(c[4])]
        if lent:
            await store._run_io(_check_written, lent)
    _written(store, path, n, [cid] if isinstance(cid, tuple) else cid or [], t0, sync)


def _written(store: AsyncStore, path: str, n: int, cids: Sequence[tuple[int, int]], t0: float,
             sync: bool) -> None:
    """Record a finished write of ``n`` bytes: its file owed to the commit's sync (unless synced),
    its chunks' RAM copies clean, its counter and span."""
    if not sync:
        store._ledger.written(path)
    store.stats_counters.bytes_written_disk += n
    for c in cids:
        store._host.mark_clean(c)
    store.tracer.span("write", "disk", t0, time.perf_counter(), bytes=n)


async def write_owed_meta(store: AsyncStore) -> None:
    """Write the zarr.json of every head generation written for room only; raise the first failure.

    Runs in a commit after ``drain_writes``, so every folder exists. A generation stays owed
    until its write succeeds: a failed or cancelled commit leaves it to the next one. The
    file is written over (``overwrite``): a recycled folder may hold an older generation's.
    """
    async def one(rec: GenRecord) -> None:
        await write_meta(store, rec.key, rec.generation, rec.grid, rec.torch_dtype, rec.codec_obj,
                         shard=rec.shard, overwrite=True)
        store._meta_owed.discard(rec.generation)

    owed = [r for r in store._head.values() if r.generation in store._meta_owed]
    tasks = [store._spawn(one(r)) for r in owed]
    for t in tasks:
        # a cancelled commit leaves them running, and nobody else waits for them: a failure
        # is seen here or by the next commit, which finds the generation still owed
        t.add_done_callback(mark_retrieved)
    failures = await settle(tasks)
    if failures:
        raise failures[0]


async def drain_writes(store: AsyncStore) -> None:
    """Wait for every pending chunk write; retry failed ones once (e.g. after ENOSPC).

    ``asyncio.wait`` on a snapshot, never ``gather``: cancelling a commit must not cancel
    the write-behind (or retirements) it waits for (found by tools.harness.modelcheck).
    """
    if store._retiring:
        await settle(list(store._retiring))
    for gen in list(store._writes):
        tasks = list(store._writes.get(gen, []))
        if not await settle(tasks):
            continue
        rec = next((r for r in store._head.values() if r.generation == gen), None)
        if rec is None:
            continue  # superseded meanwhile: nothing to save
        retry = store._writes[gen] = [store._spawn(t) for t in await rewrite(store, rec)]
        failures = await settle(retry)
        if failures:
            raise failures[0]  # the first failure of the retry fails the commit


async def rewrite(store: AsyncStore, rec: GenRecord, sync: bool = True, meta: bool = True) -> list[Any]:
    """Write coroutines for every file of ``rec`` whose data is still dirty in RAM (``sync``: as ``write_file``).

    ``meta=False`` (a write-back for room): the zarr.json is owed to the commit instead
    (``write_owed_meta``); owed before the first await, so a commit that drains this write
    finds it owed.

    A sharded generation rewrites its dirty inner chunks in place and every shard index
    (small, and a failed index write leaves no dirty chunk to say so).
    """
    g = rec.generation
    if meta:
        store._meta_owed.discard(g)
    else:
        store._meta_owed.add(g)
    if g in store._memory_only and all(store._host.dirty_payload((g, i)) is not None
                                       for i in range(rec.grid.n_chunks)):
        recycled = await folders(store, rec.key, g, rec.grid, rec.shard)  # every file is written
    else:
        recycled = False
        await make_dirs(store, rec.key, g, rec.grid, rec.shard)
    coros: list[Any] = []
    if meta:
        coros.append(write_meta(store, rec.key, rec.generation, rec.grid, rec.torch_dtype, rec.codec_obj,
                                shard=rec.shard, overwrite=recycled))
    smap = store._shard_map(rec) if rec.shard else None
    for i, (_, crc) in enumerate(rec.chunks):
        payload = store._host.dirty_payload((rec.generation, i))
        if payload is None:
            continue
        if crc == CRC_PENDING:  # changed in place: its crc is taken now, once (no update can
            # change it any more: a new update moves it to a new generation, after this write).
            # Its write still checks it, as any write does: the write runs later (behind the
            # io threads and other writes), and a get(copy=False) may lend the chunk and have
            # it written into meanwhile, which a crc taken here cannot see
            cid = (rec.generation, i)
            if cid not in store._late_crcs:
                late = await store._run_cpu(payload.numel(), checksum, [payload.numpy()])
                # the first crc taken wins: a get(copy=False) may have taken one meanwhile and
                # lent the chunk, and this one may have read bytes written through that loan
                store._late_crcs.setdefault(cid, late)
            crc = store._late_crcs[cid]
        if smap is None:
            coros.append(write_chunk(store, rec.key, rec.generation, rec.grid, i, payload, crc,
                                     sync=sync, overwrite=recycled))
        else:
            s, at = smap.location(i)
            path = store._disk.shard_path(rec.key, rec.generation, rec.grid, s)
            data = payload.numpy()
            coros.append(write_file(store, path, [data, crc_trailer(crc)], (rec.generation, i), at=at,
                                    sync=sync, checks=[(rec.key, i, data, crc, (rec.generation, i))]))
    if smap is not None:
        for s in range(shard_count(rec.grid, rec.shard)):
            members = shard_members(rec.grid, rec.shard, s)
            index = shard_index([rec.chunks[i][0] for i in members], rec.shard)
            path = store._disk.shard_path(rec.key, rec.generation, rec.grid, s)
            coros.append(write_file(store, path, [index], None, at=int(smap.data_end[s])))
    return coros


async def fsync_all(store: AsyncStore) -> None:
    """Sync every ledger path; they leave the ledger only once the sync succeeded."""
    paths = store._ledger.pending()
    if not paths:
        return
    await store._run_io(store._disk.sync_paths, paths)
    store._ledger.synced(paths)
