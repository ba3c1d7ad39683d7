"""Pins on generations: who still uses a generation, so that it is deleted only after the last user.

Two kinds of user, two records:
- ``PinTable``: in-flight reads, direct disk reads and prefetches of this process. Reference
  counts per generation id (ids are unique within a store, whatever the key). Owned by the
  store's event loop thread: ``pin``/``unpin`` run there only, so it needs no lock.
- reader leases: every read-only opener, in any process, writes ``readers/<pid>-<id>.lease``
  (JSON: pid, version, generation ids) and holds an ``flock`` on it for as long as it is open.
  The writer's garbage collection keeps every generation a live lease names. The flock, not the
  pid, says whether a reader lives: the kernel drops it when the process dies (SIGKILL too), pids
  are reused and differ across pid namespaces. A lease whose flock the writer can take belongs
  to a dead reader and is deleted (reclaimed). A forked child closes its copy of the lease's
  descriptor (``tierstore.locks``): a lease lives as long as its reader, not its children.

A lease is created under a temporary name, locked, filled and then renamed into place, so that
the writer never sees a ``.lease`` file that is unlocked or half written by a live reader.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
from collections.abc import Callable

from tierstore.errors import DiskError
from tierstore.locks import HeldLock

LEASE_DIR = "readers"
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


class PinTable:
    """Reference counts of the generations this process is reading (loop thread only)."""

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}
        #: called with a generation id when its last pin goes (the store collects it then)
        self.on_release: Callable[[int], None] = lambda generation: None

    def pin(self, generation: int) -> None:
        """Count one more user of ``generation``."""
        self._refs[generation] = self._refs.get(generation, 0) + 1

    def unpin(self, generation: int) -> None:
        """Count one user less; the last one triggers ``on_release``."""
        n = self._refs[generation] - 1
        if n:
            self._refs[generation] = n
            return
        del self._refs[generation]
        self.on_release(generation)

    def pinned(self, generation: int) -> bool:
        """Whether anything in this process still uses ``generation``."""
        return generation in self._refs

    def __len__(self) -> int:
        return len(self._refs)


class ReaderLease:
    """One read-only opener's pin on a version, kept (flocked) until ``release``."""

    def __init__(self, path: str, lock: HeldLock):
        self.path = path
        self._lock = lock

    @classmethod
    def acquire(cls, root: str, version: int, generations: list[int]) -> ReaderLease | None:
        """Write and lock a lease for ``generations``; None where the folder is not writable.

        A store folder this process cannot write to has no writer of this uid either; a reader
        there reads without a lease (a writer with more rights could still drop its version).
        """
        folder = os.path.join(root, LEASE_DIR)
        name = f"{os.getpid()}-{secrets.token_hex(6)}"
        body = json.dumps({"pid": os.getpid(), "version": version,
                           "generations": sorted(generations)}).encode()
        for _ in range(3):  # a writer may reclaim the temp file before it is locked: retry
            tmp = os.path.join(folder, f".{name}.tmp")
            try:
                os.makedirs(folder, exist_ok=True)
                lock = HeldLock(os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644))
            except OSError as e:
                if e.errno in _NOT_WRITABLE:
                    return None
                raise DiskError(f"cannot write a reader lease in {folder}: {e.strerror}") from e
            fd = lock.fd
            assert fd is not None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.write(fd, body)
                final = os.path.join(folder, f"{name}.lease")
                os.rename(tmp, final)
                return cls(final, lock)
            except FileNotFoundError:
                lock.close()  # reclaimed between create and lock: take a fresh name
                name = f"{os.getpid()}-{secrets.token_hex(6)}"
            except BaseException:
                lock.close()
                _unlink(tmp)
                raise
        raise DiskError(f"cannot keep a reader lease in {folder}: it is deleted as it is made")

    def release(self) -> None:
        """Delete the lease, then drop its lock (the writer may collect its generations).

        Nothing to do in a forked child: the lease is the parent's (``tierstore.locks``).
        """
        if self._lock.fd is None:
            return
        _unlink(self.path)
        self._lock.close()


def leased_generations(root: str) -> set[int] | None:
    """Generations named by live reader leases; reclaims the leases of dead readers.

    None when the leases cannot be read (the caller then keeps everything that may be leased).
    Blocking: runs on an io thread.
    """
    folder = os.path.join(root, LEASE_DIR)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return set()
    except OSError:
        return None
    out: set[int] = set()
    for name in names:
        if not (name.endswith(".lease") or name.endswith(".tmp")):
            continue
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # released meanwhile
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its reader is alive
                if name.endswith(".lease"):
                    out.update(_read_generations(fd))
                continue
            _unlink(path)  # we hold its lock: the reader is gone (a temp file: died making it)
        finally:
            os.close(fd)
    return out


def _read_generations(fd: int) -> list[int]:
    chunks = []
    while block := os.read(fd, 1 << 16):
        chunks.append(block)
    try:
        gens = json.loads(b"".join(chunks))["generations"]
        return [int(g) for g in gens]
    except (ValueError, KeyError, TypeError):
        return []  # not written by tierstore (leases are renamed into place only when complete)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
