"""Gathers served on the caller's thread from a read-only mapping of committed shard files.

A row gather of a sharded raw table (``put(chunk_rows=)``) through the sync facade used to hop
to the store's loop thread (about 0.1-0.5 ms) and then loop in Python over the inner chunks
(15-30 us each: a RAM-tier lookup or a ``preadv``, a crc32c, a copy). When the rows' pages are
in the page cache, ``MappedGather`` serves it without either: every shard file of a generation
is mapped into one reserved address range (shard ``s`` at ``s * slot``), 2 MiB-aligned so that the page
cache's large folios can be mapped whole, and one numpy fancy index over byte offsets copies all
the rows, in the caller's order; each inner chunk's crc32c is checked against the catalog (one call per inner chunk: the bytes come
from the page cache, i.e. from the files, not from the RAM tier, whose bytes were checked when
they were read). Anything else (pages not in the page cache, a generation not yet committed, a
codec that is not ``raw``-laid-out, a crc mismatch, a missing or short file, injected faults)
returns None and the caller takes the ordinary path through the loop, which reads with
``preadv``, fills the RAM tier and raises ``CorruptData`` naming the chunk.

Threads and ownership:
- the *store's loop thread* owns the head map and the set of committed generations; this module
  reads them only through ``AsyncStore.mapped_get``, with one ``dict.get`` and one ``in`` (atomic
  under the GIL, never an iteration); it never touches the RAM tier, the pin table, the
  predictor or the store's counters;
- *any thread* may call ``MappedGather.get``; the table of mapped generations and each
  mapping's count of users are guarded by ``_lock``; the copy and the crc32c run outside the
  lock, on a mapping whose user count the gather holds;
- the loop thread calls ``forget(gen)`` before it deletes a generation's folder: the mapping is
  unmapped at once, or by its last user, so that a deleted file's blocks are freed and no
  gather ever reads an unmapped range; a gather that read the head before the forget and maps
  the generation after it finds its tombstone (``MappedGather`` states the invariant).

Why reading without the loop's pin is safe: only generations a commit named are mapped (their
files are complete, fsynced and never written again: every put makes a new generation), so a
gather reads one generation's bytes whole or declines; a generation deleted while a gather
copies stays readable through the mapping it holds (an unlinked file's pages live until it is
unmapped); a folder deleted before it is mapped makes the mapping fail and the caller falls back
to the loop, which reads the head anew. A gather racing with a put of the same key therefore
returns the old or the new generation, never a mix. Read-your-writes holds: a put makes the head
a generation that no commit has named, which this path refuses until a commit publishes it.

Whether the pages are resident is sampled (``mincore`` on the pages of up to ``_SAMPLE`` rows,
2-5 us each; a whole-shard ``mincore`` costs about 10 ns a page not mapped in this process,
150 us per 64 MiB shard): a gather of partly resident rows may be served here and take page
faults for the rest (correct, slower than the loop's parallel reads). A cold gather samples
non-resident pages and goes through the loop, whose ``preadv`` reads 4 KiB where a page fault
reads a page (``MADV_RANDOM``) or a readahead window.

The one risk ``preadv`` does not have: a committed shard file truncated by another program
while it is mapped raises SIGBUS on the next touch of the lost pages instead of
``CorruptData``. The store itself never truncates a committed file; a file already short when
it is mapped is refused (the loop path then names the chunk). Costs: a mapped generation
holds its size in address space (reserved with ``MAP_NORESERVE``) and two memory maps per
shard file (``vm.max_map_count``, 65,530 by default, bounds them; a failed map declines the
generation to the loop) until it is deleted or the store closes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import platform
import sys
import threading
from collections.abc import Callable
from typing import Any

import crc32c
import numpy as np
import torch

from tierstore.records import GenRecord
from tierstore.shards import ShardMap
from tierstore.tiers.disk import DiskTier

_PAGE = mmap.PAGESIZE
_ALIGN = 2 << 20  # a PMD: the largest folio the kernel maps with one entry
_SAMPLE = 4  # rows whose pages are checked for residency (all of them in smaller gathers)
# Linux's mmap flags (the mmap module has no MAP_FIXED)
_PROT_NONE, _PROT_READ = 0, 1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 1, 2, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_RANDOM = 1


def _libc() -> Any:
    # the flag values above are Linux's on x86-64 and arm64 (other architectures differ)
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.mmap.restype = ctypes.c_void_p
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap.restype = ctypes.c_int
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.mincore.restype = ctypes.c_int
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def row_index(index: Any, rows: int) -> np.ndarray | None:
    """The rows an integer tensor or int ``index`` names (negatives resolved), in its shape;
    None for anything else or out of range (the loop path then checks it and raises)."""
    if isinstance(index, torch.Tensor):
        try:
            idx = index.numpy()  # a CUDA or meta tensor raises: the loop path takes it
        except (TypeError, RuntimeError):
            return None
        if idx.dtype.kind not in "iu":  # bool and float indices: the loop path refuses them
            return None
    elif isinstance(index, int) and not isinstance(index, bool):
        if not -rows <= index < rows:
            return None  # out of range, maybe of int64 too: the loop path raises InvalidIndex
        idx = np.asarray(index, np.int64)
    else:
        return None
    if idx.size == 1:
        lo = hi = int(idx.reshape(-1)[0])
    elif idx.size == 0:
        return idx.astype(np.int64)
    else:
        lo, hi = int(idx.min()), int(idx.max())
    if lo < -rows or hi >= rows:
        return None
    idx = idx.astype(np.int64, copy=False)
    return np.where(idx < 0, idx + rows, idx) if lo < 0 else idx


def servable(rec: GenRecord) -> bool:
    """Whether this path can serve gathers of ``rec``: rows of a raw-laid-out codec, stored as
    they are returned (no decoding), at least one inner chunk."""
    codec = rec.codec_obj
    return (bool(rec.shape) and rec.grid.n_chunks > 0 and codec.raw_layout
            and codec.decoded_dtype(rec.torch_dtype) == rec.torch_dtype)


class _Region:
    """One generation's shard files mapped side by side; unmapped once retired and unused."""

    def __init__(self, rec: GenRecord, paths: list[str]):
        smap = ShardMap.build(rec.chunks, rec.shard)
        self.dtype = rec.torch_dtype
        self.n_rows = rec.shape[0]
        self.tail = tuple(rec.shape[1:])
        # 2 MiB-aligned slots: file offsets and addresses agree modulo 2 MiB, so the kernel can
        # map the page cache's large folios whole (measured: 1024 rows in 2.0 ms with 4 KiB
        # alignment, 84 page faults; memmap's aligned mapping took 0.66 ms and 2 faults)
        self.slot = -(-int(smap.data_end.max()) // _ALIGN) * _ALIGN
        self.length = self.slot * len(paths)
        self.row_bytes = rec.grid.inner * rec.torch_dtype.itemsize
        self._vec_type = ctypes.c_ubyte * (-(-self.row_bytes // _PAGE) + 1)  # mincore's answer
        self.rows_per_chunk = rec.grid.rows
        self.chunk_bytes = np.fromiter((n for n, _ in rec.chunks), np.int64, len(rec.chunks))
        self.crcs = np.fromiter((c for _, c in rec.chunks), np.uint32, len(rec.chunks))
        #: per inner chunk: where its payload starts in the region
        self.starts = smap.offsets + (np.arange(len(rec.chunks), dtype=np.int64) // rec.shard) * self.slot
        self.users = 0
        self.retired = False
        self._reserved = self.length + _ALIGN
        raw = _LIBC.mmap(None, self._reserved, _PROT_NONE,
                         _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if raw in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "cannot reserve address space")
        self._raw: int = raw
        base = -(-raw // _ALIGN) * _ALIGN
        self.base: int = base
        try:
            for s, path in enumerate(paths):
                fd = os.open(path, os.O_RDONLY)
                try:
                    # only the inner chunks, never the index after them: a mapping longer
                    # than its slot would replace whatever lies beyond it (MAP_FIXED)
                    need = int(smap.data_end[s])
                    if os.fstat(fd).st_size < need:
                        raise OSError(f"{path} is short")  # the loop path names the chunk
                    assert need <= self.slot
                    at = _LIBC.mmap(base + s * self.slot, need, _PROT_READ, _MAP_SHARED | _MAP_FIXED,
                                    fd, 0)
                    if at != base + s * self.slot:
                        raise OSError(ctypes.get_errno(), f"cannot map {path}")
                finally:
                    os.close(fd)  # the mapping keeps the file
            _LIBC.madvise(base, self.length, _MADV_RANDOM)  # a fault reads its page, no more
        except BaseException:
            _LIBC.munmap(raw, self._reserved)
            raise
        #: the region's bytes, and every row_bytes-long run of them by its first byte: a fancy
        #: index of ``rows`` by byte offsets copies the rows (numpy: one thread, which stays
        #: fast on a busy machine where torch's parallel index_select waited for its threads)
        self.bytes = np.frombuffer((ctypes.c_uint8 * self.length).from_address(base), np.uint8)
        self.rows = np.lib.stride_tricks.as_strided(
            self.bytes, (self.length - self.row_bytes + 1, self.row_bytes), (1, 1), writeable=False)

    def unmap(self) -> None:
        self.bytes = self.rows = None  # type: ignore[assignment]
        _LIBC.munmap(self._raw, self._reserved)

    def resident(self, starts: np.ndarray) -> bool:
        """Whether the pages of the rows starting at ``starts`` (a sample) are in the page cache."""
        if len(starts) > _SAMPLE:
            starts = starts[np.linspace(0, len(starts) - 1, _SAMPLE).astype(np.int64)]
        vec = self._vec_type()
        mincore = _LIBC.mincore
        base, n = self.base, self.row_bytes
        for at in starts.tolist():
            page = at - at % _PAGE
            if mincore(base + page, at + n - page, vec) != 0:
                return False
            if not all(v & 1 for v in vec[: -(-(at + n - page) // _PAGE)]):
                return False
        return True


class MappedGather:
    """Row gathers of committed raw sharded tables from the page cache, on the caller's thread.

    Invariant: a generation enters ``_regions`` only under ``_lock`` and only if it is not in
    ``_forgotten``, the tombstones of the generations forgotten while an acquire was in flight.
    An acquire counts itself in flight (``_acquiring``) before it reads the head, so a
    generation forgotten after the head was read and before its mapping is registered is
    tombstoned and never kept; one forgotten before the head was read is no longer the head's.
    The tombstones are dropped whenever no acquire is in flight: they stay few.
    """

    def __init__(self, disk: DiskTier):
        self._disk = disk
        self._lock = threading.Lock()
        #: generation -> its mapping, or None when it cannot be mapped (a missing or short file)
        self._regions: dict[int, _Region | None] = {}
        #: generations forgotten while an acquire was in flight; never registered (see above)
        self._forgotten: set[int] = set()
        #: threads between the head read and the registration of its mapping
        self._acquiring = 0
        # the head map and committed set are read without the loop's lock: needs the GIL
        self.enabled = _LIBC is not None and getattr(sys, "_is_gil_enabled", lambda: True)()
        #: gathers served here, and those handed back to the loop (not resident, ...)
        self.served = 0
        self.declined = 0

    def forget(self, gen: int) -> None:
        """``gen``'s folder is about to be deleted: unmap it now, or when its last user is done."""
        with self._lock:
            if self._acquiring:
                self._forgotten.add(gen)
            region = self._regions.pop(gen, None)
            if region is not None:
                region.retired = True
                if region.users:
                    region = None  # its last user unmaps it
        if region is not None:
            region.unmap()

    def close(self) -> None:
        """Unmap every generation (those in use once their gathers are done); serve no more."""
        self.enabled = False
        with self._lock:
            gens = list(self._regions)
        for gen in gens:
            self.forget(gen)

    def _acquire(self, lookup: Callable[[], GenRecord | None]) -> tuple[GenRecord | None, _Region | None]:
        """The generation ``lookup`` names and a mapping of it with one more user (or None)."""
        with self._lock:
            self._acquiring += 1
        try:
            rec = lookup()
            return rec, (None if rec is None else self._map(rec))
        finally:
            with self._lock:
                self._acquiring -= 1
                if not self._acquiring:
                    self._forgotten.clear()

    def _map(self, rec: GenRecord) -> _Region | None:
        gen = rec.generation
        with self._lock:
            if gen in self._forgotten:
                return None
            if gen in self._regions:
                region = self._regions[gen]
                if region is not None:
                    region.users += 1
                return region
        paths = [self._disk.shard_path(rec.key, gen, rec.grid, s)
                 for s in range(-(-rec.grid.n_chunks // rec.shard))]
        try:
            made: _Region | None = _Region(rec, paths) if servable(rec) else None
            keep = True
        except FileNotFoundError:
            made, keep = None, False  # superseded and deleted meanwhile: the loop reads the head anew
        except OSError:
            made, keep = None, True  # short file: remembered, the loop path reports it every time
        with self._lock:
            if not self.enabled:  # closed meanwhile
                region, extra = None, made
            elif gen in self._forgotten:  # deleted while we mapped it: this gather only
                region, extra = made, None
                if made is not None:
                    made.retired = True
            elif gen in self._regions:  # another thread mapped it meanwhile
                region, extra = self._regions[gen], made
            else:
                region, extra = made, None
                if keep:
                    self._regions[gen] = made
            if region is not None:
                region.users += 1
        if extra is not None:
            extra.unmap()
        return region

    def _release(self, region: _Region, served: bool) -> None:
        with self._lock:
            if served:
                self.served += 1
            else:
                self.declined += 1
            region.users -= 1
            last = region.retired and region.users == 0
        if last:
            region.unmap()

    def get(self, lookup: Callable[[], GenRecord | None], index: Any) -> torch.Tensor | None:
        """The rows named by ``index`` (a dim-0 gather, torch semantics) of the generation
        ``lookup()`` returns, or None when this path cannot serve them (the caller then reads
        through the loop).

        ``lookup`` reads the head: it returns a committed generation or None (``AsyncStore.
        mapped_get`` passes it); it is called here, once the gather counts as in flight.
        """
        if not self.enabled:
            return None
        rec, region = self._acquire(lookup)
        if rec is None:
            return None
        got = None
        if region is not None:
            try:
                idx = row_index(index, region.n_rows)
                if idx is not None:
                    got = self._gather(region, idx)
            finally:
                self._release(region, got is not None)
        else:
            with self._lock:
                self.declined += 1
        return got

    @staticmethod
    def _gather(region: _Region, idx: np.ndarray) -> torch.Tensor | None:
        shape = (*idx.shape, *region.tail)
        if idx.size == 0:
            return torch.empty(shape, dtype=region.dtype)
        flat = idx.reshape(-1)
        cr, row_bytes = region.rows_per_chunk, region.row_bytes
        if cr == 1:
            chunks = flat
            starts = region.starts[flat]
        else:
            chunks = flat // cr
            starts = region.starts[chunks] + (flat - chunks * cr) * row_bytes
        if not region.resident(starts):
            return None  # cold: the loop's parallel preadv beats page faults
        out = region.rows[starts]
        f = crc32c.crc32c
        if cr == 1:  # each row is a whole inner chunk: check the copies (hot in the cache)
            if list(map(f, out)) != region.crcs[chunks].tolist():
                return None
        else:
            mv = memoryview(region.bytes)
            for c in np.unique(chunks).tolist():  # whole inner chunks, in the mapping
                at = int(region.starts[c])
                if f(mv[at : at + int(region.chunk_bytes[c])]) != int(region.crcs[c]):
                    return None
        res = torch.from_numpy(out).view(region.dtype)
        return res if res.shape == shape else res.reshape(shape)
