"""The NVMe tier: chunk files in the zarr v3 layout, read and written with pread/pwrite.

Every method here is a plain blocking function; the store runs them on its own I/O thread pool.
Each call opens and closes its own file descriptor, except reads of shard files, which share a
small cache of read-only descriptors (``OpenFiles``): a gather of a few rows is one ``preadv``,
and an open is a path walk that, with cold metadata, costs several disk reads on its own.
A chunk file is the codec payload followed by a 4-byte little-endian crc32c of it, which is
exactly zarr's ``crc32c`` codec: plain zarr checks the same checksums.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import crc32c

# crc_trailer is re-exported: the store imports it with the disk tier's names
from tierstore.checksums import checksum, crc_trailer
from tierstore.errors import CorruptData, DiskError
from tierstore.faults import FaultPlan, pwritev_limited
from tierstore.keys import MAX_SEGMENT_BYTES, generation_relpath, parse_generation_relpath
from tierstore.layout import ChunkGrid
from tierstore.shards import shard_key

__all__ = ["IOV_MAX", "Buffer", "DiskTier", "Inner", "OpenFiles", "Run", "SyncLedger", "checksum", "coalesce", "crc_trailer"]

Buffer = memoryview
#: one run of adjacent inner chunks: (file offset, [(chunk index, crc32c, payload buffers)])
Run = tuple[int, list[tuple[int, int, list[Buffer]]]]
#: one inner chunk to read: (chunk index, file offset, crc32c, payload buffers)
Inner = tuple[int, int, int, list[Buffer]]
#: buffers a single preadv may take (Linux IOV_MAX is 1024)
IOV_MAX = 1024


def coalesce(entries: Sequence[Inner]) -> list[Run]:
    """Runs of file-adjacent inner chunks (``entries`` sorted by offset), each < IOV_MAX buffers."""
    runs: list[Run] = []
    end = -1
    iovs = 0
    for i, at, crc, bufs in entries:
        k = len(bufs) + 1  # and the crc trailer
        if at == end and iovs + k <= IOV_MAX:
            runs[-1][1].append((i, crc, bufs))
            iovs += k
        else:
            runs.append((at, [(i, crc, bufs)]))
            iovs = k
        end = at + sum(memoryview(b).nbytes for b in bufs) + 4
    return runs


_KEY_DIRS_REMEMBERED = 8192  # as many keys as the key check remembers (tierstore.keys)
_SYNCFS_ABOVE = 32  # beyond this many files and folders one syncfs beats fsync calls


def _load_syncfs() -> Callable[[int], int] | None:
    """libc's syncfs (Linux): flushes one file system, whatever the number of files."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.syncfs  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_syncfs = _load_syncfs()


#: bytes read (and checked) at a time from one chunk file
_READ_SEGMENT = 4 << 20


def _segments(views: list[memoryview], size: int) -> Iterator[list[memoryview]]:
    """``views`` cut into consecutive groups of at most ``size`` bytes (sub-views, no copy)."""
    group: list[memoryview] = []
    room = size
    for v in views:
        while len(v):
            take = v[:room]
            group.append(take)
            v = v[len(take):]
            room -= len(take)
            if room == 0:
                yield group
                group, room = [], size
    if group:
        yield group


def _consume(views: list[memoryview], n: int) -> list[memoryview]:
    """The buffers left to transfer after ``n`` more bytes went through (short reads/writes)."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views = views[1:]
    if n:
        views = [views[0][n:], *views[1:]]
    return views


class SyncLedger:
    """Paths created or written since they were last made durable: what the next commit fsyncs.

    A path enters the ledger the moment it exists on disk (a folder as ``mkdir`` returns, a file
    once written), so a failure part-way through creating a generation's folders loses none of
    them, and it leaves only when a sync that covered it succeeded: a failed, retried or
    cancelled commit syncs it again. The folder holding each new entry is recorded with it
    (fsyncing a folder is what makes the entries in it durable). Written from io threads and
    the loop thread, hence the lock.
    """

    def __init__(self) -> None:
        self._paths: set[str] = set()
        self._lock = threading.Lock()
        self._prune_at = 0  # ``prune`` checks again once the ledger is twice what it kept

    def created(self, path: str) -> None:
        """``path`` is new: it and the folder holding its entry must be synced."""
        with self._lock:
            self._paths.add(path)
            self._paths.add(os.path.dirname(path))

    def written(self, path: str) -> None:
        """``path`` (in a folder already recorded) has unsynced contents."""
        with self._lock:
            self._paths.add(path)

    def prune(self, limit: int = 4096) -> None:
        """Forget paths deleted since they were recorded, once there are more than ``limit``.

        Write-backs for room leave their syncs to the next commit, and most of what they write
        (training state superseded a step later) is deleted before then: without this, the
        ledger would grow by every such file between commits. Checked under the lock, so a
        path re-created meanwhile is recorded again after (``created`` follows the mkdir).
        """
        with self._lock:
            if len(self._paths) <= max(limit, self._prune_at):
                return
            self._paths = {p for p in self._paths if os.path.lexists(p)}
            self._prune_at = 2 * len(self._paths)

    def pending(self) -> list[str]:
        """Every path awaiting a sync, sorted."""
        with self._lock:
            return sorted(self._paths)

    def synced(self, paths: Iterable[str]) -> None:
        """A sync covering ``paths`` succeeded."""
        with self._lock:
            self._paths.difference_update(paths)

    def __len__(self) -> int:
        with self._lock:
            return len(self._paths)


class OpenFiles:
    """Read-only descriptors of recently read files, shared by the io threads (LRU, bounded).

    A descriptor in use is never closed under its reader: eviction and ``forget`` close it when
    its last user lets go. Files are never replaced in place (a generation's folder is new and
    its files are written where they lie), so a cached descriptor always reads the current bytes.
    """

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._fds: OrderedDict[str, list[int]] = OrderedDict()  # path -> [fd, users]
        self._retired: dict[int, int] = {}  # fd -> users, of descriptors dropped while in use

    @contextmanager
    def open(self, path: str) -> Iterator[int]:
        """A read-only descriptor of ``path`` for the ``with`` block (OSError as ``os.open``)."""
        with self._lock:
            entry = self._fds.get(path)
            if entry is not None:
                entry[1] += 1
                self._fds.move_to_end(path)
        if entry is None:
            fd = os.open(path, os.O_RDONLY)
            with self._lock:
                entry = self._fds.get(path)
                if entry is None:  # another thread may have opened it meanwhile: keep one
                    entry = self._fds[path] = [fd, 1]
                    self._evict()
                else:
                    entry[1] += 1
                    os.close(fd)
        try:
            yield entry[0]
        finally:
            with self._lock:
                self._release(entry)

    def _release(self, entry: list[int]) -> None:
        fd = entry[0]
        if fd in self._retired:
            self._retired[fd] -= 1
            if not self._retired[fd]:
                del self._retired[fd]
                os.close(fd)
        else:
            entry[1] -= 1

    def _drop(self, path: str) -> None:
        fd, users = self._fds.pop(path)
        if users:
            self._retired[fd] = users  # its last user closes it
        else:
            os.close(fd)

    def _evict(self) -> None:
        while len(self._fds) > self.capacity:
            self._drop(next(iter(self._fds)))

    def forget(self, folder: str) -> None:
        """Close (or mark for closing) every descriptor of a file under ``folder``."""
        prefix = folder.rstrip(os.sep) + os.sep
        with self._lock:
            for path in [p for p in self._fds if p.startswith(prefix)]:
                self._drop(path)

    def close(self) -> None:
        """Close every unused descriptor; those in use close when their reader lets go."""
        with self._lock:
            for path in list(self._fds):
                self._drop(path)


class DiskTier:
    """Owns ``<root>/data``: one folder per tensor generation, one file per chunk."""

    def __init__(self, root: str):
        self.data_dir = os.path.join(os.path.realpath(root), "data")
        #: fault injection for tests; None in normal use
        self.faults: FaultPlan | None = None
        self.open_files = OpenFiles()
        #: key -> (its folders' checked prefix, ending in "@"; bytes of the folder name before
        #: the generation's digits), for ``generation_dir``
        self._key_dirs: dict[str, tuple[str, int]] = {}

    def check_faults(self, site: str, path: str) -> None:
        """Raise the injected OSError if the fault plan fails this call (tests); else nothing."""
        if self.faults is not None:
            self.faults.check(site, path)

    def generation_dir(self, key: str, generation: int) -> str:
        """The folder of one generation; never outside the data folder."""
        known = self._key_dirs.get(key)
        if known is not None and known[1] + len(str(generation)) <= MAX_SEGMENT_BYTES:
            return f"{known[0]}{generation}"
        path = os.path.normpath(os.path.join(self.data_dir, generation_relpath(key, generation)))
        if os.path.commonpath([path, self.data_dir]) != self.data_dir:
            raise DiskError(f"key {key!r} resolves outside the store")  # unreachable by key rules
        # every call of a training step asks for a folder (about 40 us checked): a key's
        # checked prefix is kept, and only the length of the generation's digits varies
        suffix = f"@{generation}"
        if path.endswith(suffix):
            if len(self._key_dirs) >= _KEY_DIRS_REMEMBERED:
                self._key_dirs.clear()
            last = key.rpartition("/")[2]
            self._key_dirs[key] = (path[: -len(str(generation))], len(last.encode("utf-8")) + 1)
        return path

    def chunk_path(self, key: str, generation: int, grid: ChunkGrid, i: int) -> str:
        """The file of chunk ``i``."""
        return os.path.join(self.generation_dir(key, generation), grid.zarr_key(i))

    def shard_path(self, key: str, generation: int, grid: ChunkGrid, s: int) -> str:
        """The file of shard ``s`` of a sharded generation (``tierstore.shards``)."""
        return os.path.join(self.generation_dir(key, generation), shard_key(grid, s))

    def folders_of(self, key: str, generation: int, grid: ChunkGrid, chunks: range,
                   shard: int = 0) -> set[str]:
        """The generation's folder and every folder holding one of ``chunks``' files."""
        if shard:
            files = {self.shard_path(key, generation, grid, i // shard) for i in chunks}
        else:
            files = {self.chunk_path(key, generation, grid, i) for i in chunks}
        return {os.path.dirname(f) for f in files} | {self.generation_dir(key, generation)}

    def make_dirs(self, key: str, generation: int, grid: ChunkGrid, chunks: range,
                  ledger: SyncLedger | None = None, shard: int = 0) -> list[str]:
        """Create the folders the chunks need; record each in ``ledger`` as it is made.

        ``shard`` > 0: the chunks are inner chunks, ``shard`` to a file. Returns the folders
        created; on a failure part-way the ledger still holds the ones made.
        """
        created: list[str] = []
        for d in sorted(self.folders_of(key, generation, grid, chunks, shard)):
            parts: list[str] = []
            p = d
            while not os.path.isdir(p):
                parts.append(p)
                p = os.path.dirname(p)
            for q in reversed(parts):
                try:
                    self.check_faults("mkdir", q)
                    os.mkdir(q)
                    created.append(q)
                    if ledger is not None:
                        ledger.created(q)
                except FileExistsError:
                    pass
                except OSError as e:
                    raise DiskError(f"cannot create {q}: {e.strerror}") from e
        return created

    def adopt_folder(self, key: str, old_gen: int, new_gen: int, grid: ChunkGrid,
                     ledger: SyncLedger) -> None:
        """Rename generation ``old_gen``'s folder (same key and grid) to ``new_gen``'s.

        A folder made and deleted per write costs about 2 ms a generation on ext4 (mkdir, rmdir
        and the blocks freed and allocated again), several times the write of a 1 MiB chunk
        over blocks the file already has. Every entry of the renamed tree enters the ledger as
        if new: none of it was synced under its new name.
        """
        old, new = self.generation_dir(key, old_gen), self.generation_dir(key, new_gen)
        self.open_files.forget(old)
        try:
            self.check_faults("mkdir", new)
            os.rename(old, new)
        except OSError as e:
            raise DiskError(f"cannot rename {old} to {new}: {e.strerror}") from e
        for d in self.folders_of(key, new_gen, grid, range(grid.n_chunks)):
            ledger.created(d)
        ledger.prune()  # the old names are gone, as if deleted

    def write_file(self, path: str, parts: Sequence[Buffer], sync: bool) -> None:
        """Write ``parts`` as the whole content of ``path``; fdatasync it if ``sync``.

        Syncing large chunks here, on a write-behind thread, keeps the disk busy while puts go
        on; small files are synced in one batch by the commit (``sync_paths``).
        """
        self.write_at(path, None, parts, sync)

    def write_at(self, path: str, at: int | None, parts: Sequence[Buffer], sync: bool,
                 overwrite: bool = False) -> None:
        """Write ``parts`` at byte ``at`` of ``path`` (created if new); ``None``: the whole file.

        A shard file is written in pieces by concurrent calls (each inner chunk at its offset,
        the index at the end), so those open it without truncating. ``overwrite`` (with
        ``at=None``): write over the file's old bytes, then cut it to the new length, never
        truncating it to zero first: ext4 flushes a file truncated to zero and rewritten when
        it is closed (``auto_da_alloc``), about 2 ms a MiB on the write path.
        """
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if at is None and not overwrite else 0)
        try:
            self.check_faults("write", path)
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            raise DiskError(f"cannot create {path}: {e.strerror}") from e
        try:
            views = [memoryview(p).cast("B") for p in parts if len(memoryview(p).cast("B"))]
            offset = at or 0
            while views:
                batch = views[:IOV_MAX]  # pwritev takes at most IOV_MAX buffers
                if self.faults is not None and self.faults.short_writes is not None:
                    n = pwritev_limited(fd, batch, offset, self.faults.short_writes)
                else:
                    n = os.pwritev(fd, batch, offset)
                if n == 0:
                    raise DiskError(f"write to {path} made no progress")
                offset += n
                views = _consume(views, n)  # a short write resumes inside its buffer
            if overwrite and at is None:
                os.ftruncate(fd, offset)
            if sync:
                self.check_faults("fsync", path)
                os.fdatasync(fd)
        except OSError as e:
            raise DiskError(f"writing {path} failed: {e.strerror} (errno {e.errno})") from e
        finally:
            os.close(fd)

    def read_chunk(self, path: str, key: str, chunk: int, payload_len: int, crc: int,
                   into: Sequence[Buffer], at: int | None = None) -> None:
        """Read a chunk's payload into ``into`` (buffers summing to ``payload_len``), check crc.

        ``at``: the chunk is an inner chunk at that offset of a shard file.
        """
        if at is not None:
            self.read_runs(path, key, [(at, [(chunk, crc, list(into))])])
            return
        trailer = bytearray(4)
        views = [memoryview(b).cast("B") for b in into] + [memoryview(trailer)]
        try:
            self.check_faults("read", path)
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptData(f"chunk file of {key!r} chunk {chunk} is missing: {path}",
                              key, chunk) from None
        except OSError as e:
            raise DiskError(f"cannot open {path}: {e.strerror}") from e
        computed = 0
        try:
            size = os.fstat(fd).st_size
            if size != payload_len + 4:
                raise CorruptData(
                    f"chunk file of {key!r} chunk {chunk} has {size} bytes, expected "
                    f"{payload_len + 4} (truncated or overwritten): {path}", key, chunk)
            if hasattr(os, "posix_fadvise") and size > _READ_SEGMENT:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            offset = 0
            # in segments, each checked as it lands: the kernel reads the next one ahead while
            # this thread takes the crc32c of the last (one read, then one crc, left the disk
            # idle for the crc: 10-15% of a cold read)
            for seg in _segments([v for v in views if len(v)], _READ_SEGMENT):
                pending = seg
                while pending:
                    n = os.preadv(fd, pending, offset)
                    if n == 0:
                        raise CorruptData(f"chunk file of {key!r} chunk {chunk} ended early: {path}",
                                          key, chunk)
                    offset += n
                    pending = _consume(pending, n)
                for v in seg:
                    if v.obj is not trailer:
                        computed = crc32c.crc32c(v, computed)
        except OSError as e:
            raise DiskError(f"reading {path} failed: {e.strerror} (errno {e.errno})") from e
        finally:
            os.close(fd)
        stored = int.from_bytes(trailer, "little")
        if stored != crc or computed != crc:
            raise CorruptData(f"checksum mismatch in {key!r} chunk {chunk}: {path}", key, chunk)

    def read_runs(self, path: str, key: str, runs: Sequence[Run]) -> None:
        """Read runs of adjacent inner chunks of one shard file, one ``preadv`` a run; check each.

        A run is ``(offset, [(chunk, crc, buffers), ...])``: the buffers of each inner chunk sum
        to its payload; its 4-byte crc32c trailer is read after them. A run must hold at most
        ``_IOV_MAX`` buffers with the trailers (the caller splits longer ones).
        """
        try:
            self.check_faults("read", path)
            with self.open_files.open(path) as fd:
                self._read_runs(fd, path, key, runs)
        except FileNotFoundError:
            first = runs[0][1][0][0] if runs and runs[0][1] else 0
            raise CorruptData(f"shard file of {key!r} chunk {first} is missing: {path}",
                              key, first) from None
        except OSError as e:
            raise DiskError(f"reading {path} failed: {e.strerror} (errno {e.errno})") from e

    def _read_runs(self, fd: int, path: str, key: str, runs: Sequence[Run]) -> None:
        """``read_runs`` on an open descriptor of ``path``."""
        size = os.fstat(fd).st_size
        for at, items in runs:
            trailers = [bytearray(4) for _ in items]
            views: list[memoryview] = []
            for (_, _, bufs), tr in zip(items, trailers, strict=True):
                views.extend(memoryview(b).cast("B") for b in bufs)
                views.append(memoryview(tr))
            total = sum(len(v) for v in views)
            if at + total > size:
                # name the first inner chunk the file does not hold whole
                end = at
                for (i, _, bufs), _tr in zip(items, trailers, strict=True):
                    end += sum(memoryview(b).nbytes for b in bufs) + 4
                    if end > size:
                        raise CorruptData(
                            f"shard file of {key!r} ends at {size} B, inside chunk {i} "
                            f"(truncated): {path}", key, i)
            offset = at
            pending = [v for v in views if len(v)]
            while pending:
                n = os.preadv(fd, pending, offset)
                if n == 0:
                    raise CorruptData(f"shard file of {key!r} ended early at chunk "
                                      f"{items[0][0]}: {path}", key, items[0][0])
                offset += n
                pending = _consume(pending, n)
            for (i, crc, bufs), tr in zip(items, trailers, strict=True):
                if int.from_bytes(tr, "little") != crc or checksum(bufs) != crc:
                    raise CorruptData(f"checksum mismatch in {key!r} chunk {i} "
                                      f"(inner chunk of {path})", key, i)

    def read_many(self, key: str, jobs: Sequence[tuple[str, Sequence[Inner]]]) -> None:
        """Read inner chunks of several shard files of one tensor, in one thread hop.

        Each job is a file and its inner chunks ``(chunk, offset, crc, buffers)`` sorted by
        offset; adjacent ones are read by one ``preadv`` (``coalesce``).
        """
        for path, entries in jobs:
            self.read_runs(path, key, coalesce(entries))

    def sync_paths(self, paths: Sequence[str]) -> None:
        """Make files and folders durable: one ``syncfs`` for many paths, else fsync each."""
        if len(paths) > _SYNCFS_ABOVE and _syncfs is not None:
            try:
                self.check_faults("fsync", self.data_dir)
                fd = os.open(self.data_dir, os.O_RDONLY)
            except OSError as e:  # found by tools.harness.modelcheck: a bare OSError escaped commit()
                raise DiskError(f"syncfs of {self.data_dir} failed: {e.strerror}") from e
            try:
                if _syncfs(fd) != 0:
                    err = ctypes.get_errno()
                    raise DiskError(f"syncfs of {self.data_dir} failed: {os.strerror(err)}")
            finally:
                os.close(fd)
        else:
            self.fsync_paths(paths)

    def fsync_paths(self, paths: Sequence[str]) -> None:
        """fsync files and folders (folders make new entries durable)."""
        for p in paths:
            try:
                fd = os.open(p, os.O_RDONLY)
            except FileNotFoundError:
                continue  # deleted since (a superseded generation): nothing to make durable
            except OSError as e:
                raise DiskError(f"cannot open {p} to fsync: {e.strerror}") from e
            try:
                self.check_faults("fsync", p)
                os.fsync(fd)
            except OSError as e:
                raise DiskError(f"fsync of {p} failed: {e.strerror} (errno {e.errno})") from e
            finally:
                os.close(fd)

    def delete_generation(self, key: str, generation: int) -> None:
        """Remove one generation's folder and its now-empty parents."""
        path = self.generation_dir(key, generation)
        self.open_files.forget(path)
        try:
            self.check_faults("delete", path)
        except OSError:
            return  # a folder left behind is an orphan: the next writer open deletes it
        shutil.rmtree(path, ignore_errors=True)
        parent = os.path.dirname(path)
        while parent != self.data_dir and os.path.commonpath([parent, self.data_dir]) == self.data_dir:
            try:
                os.rmdir(parent)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    break
                raise
            parent = os.path.dirname(parent)

    def scan_generations(self) -> list[tuple[str, int]]:
        """Every (key, generation) folder on disk."""
        found: list[tuple[str, int]] = []
        if not os.path.isdir(self.data_dir):
            return found
        for dirpath, dirnames, _ in os.walk(self.data_dir):
            keep = []
            for name in dirnames:
                rel = os.path.relpath(os.path.join(dirpath, name), self.data_dir)
                parsed = parse_generation_relpath(rel)
                if parsed is not None:
                    found.append(parsed)
                else:
                    keep.append(name)
            dirnames[:] = keep  # do not descend into generation folders
        return found
