"""Reads of sharded tensors: gathers and fills that read only the inner chunks they need.

A sharded generation (``tierstore.shards``) keeps many small inner chunks per file, so its reads
differ from whole-chunk reads: rows are grouped by inner chunk with numpy, RAM hits are served
first, and every missing inner chunk is read in one batch of ``preadv`` calls per shard file
spread over the ``tierstore-io`` threads (``read_jobs``). Plain functions of the store's read
path (``tierstore.reads.ReadPath``), run on the event loop thread like the rest of it; only
``DiskTier.read_many`` runs on the io threads, into buffers reserved in the RAM budget that stay
out of the tier, and the generation stays pinned, until every thread has returned.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tierstore.chunks import decode_into
from tierstore.records import GenRecord
from tierstore.shards import TRAILER
from tierstore.tiers.disk import Inner

if TYPE_CHECKING:
    from tierstore.reads import ReadPath


async def gather_sharded(store: ReadPath, rec: GenRecord, idx: torch.Tensor) -> torch.Tensor:
    """A gather of a sharded tensor: ``fill_sharded``'s rules, vectorized over rows.

    Rows are grouped by inner chunk with numpy (no per-row Python on the hot path); each
    touched inner chunk costs one RAM-tier lookup, and each missing one a place in a
    coalesced ``preadv`` and a cache insert.
    """
    shape = rec.shape
    gen, grid = rec.generation, rec.grid
    rows_u, inverse = np.unique(idx.reshape(-1).numpy(), return_inverse=True)
    out = torch.empty((len(rows_u), *shape[1:]), dtype=rec.decoded_dtype)
    if len(rows_u):
        item = out.element_size()
        row_bytes = grid.inner * item
        dest = (out.view(torch.uint8) if out.dtype != torch.uint8 else out).numpy()
        dest = dest.reshape(len(rows_u), row_bytes)
        cr = grid.rows
        chunk = rows_u // cr
        local = rows_u - chunk * cr
        cut = np.flatnonzero(chunk[1:] != chunk[:-1]) + 1
        starts = [0, *cut.tolist()]
        ends = [*cut.tolist(), len(rows_u)]
        cids = chunk[starts].tolist()
        codec = rec.codec_obj

        def copy_rows(k: int, payload: np.ndarray) -> None:
            if not codec.raw_layout:
                decoded = codec.decode(memoryview(payload), grid.chunk_shape, rec.torch_dtype)
                payload = decoded.reshape(-1).view(torch.uint8).numpy()
            a, b = starts[k], ends[k]
            if b - a == 1:
                r = int(local[a])
                dest[a] = payload[r * row_bytes : (r + 1) * row_bytes]
            else:
                dest[a:b] = payload[: cr * row_bytes].reshape(cr, row_bytes)[local[a:b]]

        lookup = store._host.lookup
        payloads = [lookup((gen, c)) for c in cids]
        misses = [k for k, p in enumerate(payloads) if p is None]
        hit = [k for k, p in enumerate(payloads) if p is not None] if misses else range(len(cids))
        rows_of_hits = [payloads[k] for k in hit] if misses else payloads
        if hit and cr == 1 and codec.raw_layout and \
                all(p.numel() == row_bytes for p in rows_of_hits):  # type: ignore[union-attr]
            # one row per inner chunk: the hits' payloads are the rows, copied by one
            # torch call instead of a Python copy a row (1,024 hits through the sync facade:
            # 5.2-5.5 -> 2.3-3.1 ms; the hop and the lookups are the rest)
            dest_t = torch.from_numpy(dest)
            if misses:
                dest_t[list(hit)] = torch.stack(rows_of_hits)  # type: ignore[arg-type]
            else:
                torch.cat(rows_of_hits, out=dest_t.reshape(-1))  # type: ignore[arg-type]
        else:
            for k in hit:
                copy_rows(k, payloads[k].numpy())  # type: ignore[union-attr]
        store.stats_counters.hits_host += len(cids) - len(misses)
        if misses:
            await read_inner_chunks(store, rec, [cids[k] for k in misses],
                                          lambda j, p: copy_rows(misses[j], p))
    if len(rows_u) == len(inverse) and bool((np.diff(rows_u) > 0).all()) and \
            np.array_equal(rows_u, idx.reshape(-1).numpy()):
        res = out
    else:
        res = out[torch.from_numpy(inverse.reshape(-1))]
    # torch semantics: rows of index shape S give S + shape[1:]; an integer (0-d) drops dim 0
    return res.reshape((*idx.shape, *shape[1:]))


async def read_inner_chunks(store: ReadPath, rec: GenRecord, chunks: list[int],
                            use: Callable[[int, np.ndarray], None]) -> None:
    """Read inner chunks (sorted) from their shards, cache them, hand each to ``use(j, payload)``.

    Every one is cached (``try_alloc``: evicting the least recently used, never waiting);
    when the tier cannot give a buffer the chunk is read into scratch memory instead.
    """
    gen = rec.generation
    smap = store._shard_map(rec)
    reserved: dict[int, torch.Tensor] = {}
    bufs: list[np.ndarray] = []
    by_shard: dict[int, list[Inner]] = {}
    offsets = smap.offsets
    for j, c in enumerate(chunks):
        n, crc = rec.chunks[c]
        buf = store._host.try_alloc(n)
        if buf is not None:
            reserved[j] = buf
            b = buf.numpy()
        else:
            b = np.empty(n, np.uint8)
        bufs.append(b)
        by_shard.setdefault(c // rec.shard, []).append((c, int(offsets[c]), crc, [b]))
    await read_shards(store, rec, gen, by_shard, reserved, chunks)
    # no await from here on: the buffers land in the tier together
    for j, buf in reserved.items():
        cid = (gen, chunks[j])
        if store._host.holds(cid):
            store._host.release(buf)  # a concurrent read cached it first
        else:
            store._host.insert(cid, buf, dirty=False)
    for j, b in enumerate(bufs):
        use(j, b)


async def fill_sharded(store: ReadPath, rec: GenRecord,
                       by_chunk: dict[int, list[tuple[int, int, int]]], dest: torch.Tensor,
                       gather: bool) -> None:
    """``_fill`` for a sharded tensor: RAM hits, then every missing inner chunk in one batch.

    The missing inner chunks are grouped by shard file and runs of adjacent ones are read
    with one ``preadv`` each, split over the io threads. A gather caches every inner chunk
    it reads (``try_alloc``: evicting the least recently used, never waiting), so hot rows
    stay in RAM whatever the table's size; a slice or whole read caches them only when the
    tensor is at most half the budget (scan resistance) and reads raw single-piece chunks
    straight into ``dest``. Cache buffers are reserved before the reads and inserted (or
    released) only once every read thread is done, cancelled caller or not.
    """
    codec = rec.codec_obj
    gen = rec.generation
    item = dest.element_size()
    dest_np = (dest.view(torch.uint8) if dest.dtype != torch.uint8 else dest).numpy()

    def copy_out(i: int, payload: Any) -> None:
        pieces = by_chunk[i]
        if codec.raw_layout:
            src = payload if isinstance(payload, np.ndarray) else payload.numpy()
            for lo, hi, off in pieces:
                dest_np[off * item : (off + hi - lo) * item] = src[lo * item : hi * item]
        else:
            decode_into(codec, rec.grid, rec.torch_dtype,
                        payload if isinstance(payload, torch.Tensor) else torch.from_numpy(payload),
                        pieces, dest)

    misses: list[int] = []
    for i in by_chunk:
        payload = store._host.lookup((gen, i))
        if payload is None:
            misses.append(i)
        else:
            store.stats_counters.hits_host += 1
            copy_out(i, payload)
    if not misses:
        return
    budget = store._host.budget
    cache = gather or budget is None or rec.stored_nbytes <= budget // 2
    smap = store._shard_map(rec)
    reserved: dict[int, torch.Tensor] = {}
    scratch: dict[int, np.ndarray] = {}
    by_shard: dict[int, list[Inner]] = {}
    for i in sorted(misses):
        n, crc = rec.chunks[i]
        pieces = by_chunk[i]
        buf = store._host.try_alloc(n) if cache else None
        if buf is not None:
            reserved[i] = buf
            bufs: list[Any] = [buf.numpy()]
        elif codec.raw_layout and len(pieces) == 1:
            lo, hi, off = pieces[0]  # straight into dest, like ``ReadPath._read_direct``
            bufs = [np.empty(lo * item, np.uint8),
                    dest_np[off * item : (off + hi - lo) * item],
                    np.empty(n - hi * item, np.uint8)]
        else:
            scratch[i] = np.empty(n, np.uint8)
            bufs = [scratch[i]]
        s, at = smap.location(i)
        by_shard.setdefault(s, []).append((i, at, crc, bufs))
    await read_shards(store, rec, gen, by_shard, reserved, misses)
    # no await from here to the inserts: the buffers land in the tier together
    for i, buf in reserved.items():
        if store._host.holds((gen, i)):
            store._host.release(buf)  # a concurrent read cached it first; ours is a copy
        else:
            store._host.insert((gen, i), buf, dirty=False)
    for i in misses:
        if i in reserved:
            copy_out(i, reserved[i])
        elif i in scratch:
            copy_out(i, scratch[i])


async def read_shards(store: ReadPath, rec: GenRecord, gen: int, by_shard: dict[int, list[Any]],
                      reserved: dict[int, torch.Tensor], chunks: Sequence[int]) -> None:
    """Read the inner chunks ``by_shard`` lists (per shard file), counted as ``chunks``."""
    jobs = [(store._disk.shard_path(rec.key, gen, rec.grid, s), entries)
            for s, entries in by_shard.items()]
    t0 = time.perf_counter()
    await read_jobs(store, rec, jobs, reserved)
    store.stats_counters.stall_s += time.perf_counter() - t0
    store.stats_counters.reads_disk += len(chunks)
    store.stats_counters.bytes_read_disk += sum(rec.chunks[c][0] + TRAILER for c in chunks)
    store.tracer.span("read", "disk", t0, time.perf_counter(), chunks=len(chunks))


async def read_jobs(store: ReadPath, rec: GenRecord, jobs: list[tuple[str, list[Inner]]],
                    reserved: dict[int, torch.Tensor]) -> None:
    """Run the shard reads on up to ``io_threads`` threads; settle ``reserved`` on failure.

    The generation stays pinned, and the reserved buffers stay out of the tier, until every
    thread has returned: a cancelled caller must not free memory a thread still writes.
    """
    n_threads = max(1, min(len(jobs), store.config.io_threads,
                           sum(len(r) for _, r in jobs) // 16 + 1))
    groups: list[list[tuple[str, list[Inner]]]] = [[] for _ in range(n_threads)]
    for k, job in enumerate(sorted(jobs, key=lambda j: -len(j[1]))):
        groups[k % n_threads].append(job)
    loop = asyncio.get_running_loop()
    futs = [loop.run_in_executor(store._io, store._disk.read_many, rec.key, g) for g in groups]
    allf = asyncio.gather(*futs, return_exceptions=True)  # done only once every thread is
    gen = rec.generation
    store._pins.pin(gen)
    state = {"abandoned": False, "released": False}

    def release() -> None:
        if not state["released"]:
            state["released"] = True
            for buf in reserved.values():
                store._host.release(buf)
            reserved.clear()

    def done(f: asyncio.Future[Any]) -> None:
        store._pins.unpin(gen)
        if (f.cancelled() or state["abandoned"]
                or any(isinstance(r, BaseException) for r in f.result())):
            release()

    allf.add_done_callback(done)
    assert store._read_sem is not None
    try:
        async with store._read_sem:
            results = await asyncio.shield(allf)
    except BaseException:
        state["abandoned"] = True
        if allf.done():
            release()  # the reads had ended: ``done`` may already have run
        raise
    for r in results:
        if isinstance(r, BaseException):
            raise r
