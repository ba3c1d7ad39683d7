"""flock locks this process holds through a descriptor (the writer's LOCK, the readers' leases),
and what a forked child does with them.

An ``flock`` belongs to the open file description, which ``fork`` shares with the child: a
child that kept its copy of the descriptor would hold the lock for as long as it lives (a
DataLoader worker, a subprocess started with ``fork``), so the parent could not reopen its own
store after closing it, and a dead reader's lease would look alive. ``O_CLOEXEC`` (Python's
default) helps only where the child calls ``exec``. So every ``HeldLock`` closes its copy in
the child, from an ``os.register_at_fork`` handler, *without unlocking*: ``LOCK_UN`` would act
on the shared description and release the parent's lock too, while closing one of several
descriptors of a description leaves the lock with the others (the parent's). The child's
object then reads as released, so that nothing in the child unlocks, unlinks or closes what
belongs to the parent. (``fcntl``/``lockf`` record locks are not inherited by a child at all,
but a process drops them when it closes *any* descriptor of the file, which LMDB and a second
open of the same store in one process would do by accident; OFD locks are Linux-only.)

Threads: ``HeldLock`` objects are created and closed on any thread; the registry is guarded by
``_lock``; the fork handler runs in the child, where only the forking thread exists.
"""

from __future__ import annotations

import fcntl
import os
import threading
import weakref

from tierstore.errors import StoreLocked

_lock = threading.Lock()
_HELD: weakref.WeakSet[HeldLock] = weakref.WeakSet()


class HeldLock:
    """A descriptor through which this process holds (or is about to take) an ``flock``."""

    def __init__(self, fd: int):
        #: the descriptor, None once closed here or inherited by a forked child
        self.fd: int | None = fd
        with _lock:
            _HELD.add(self)

    def close(self) -> None:
        """Close the descriptor: the lock goes with it (nothing to do when already closed)."""
        with _lock:
            fd, self.fd = self.fd, None
            _HELD.discard(self)
        if fd is not None:
            os.close(fd)


def writer_lock(root: str) -> HeldLock:
    """Take the writer's LOCK of the store at ``root``; StoreLocked when another process has it."""
    held = HeldLock(os.open(os.path.join(root, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644))
    try:
        fcntl.flock(held.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[arg-type]
    except BlockingIOError:
        held.close()
        raise StoreLocked(f"another process writes to {root} (its LOCK is held); "
                          "open with mode='r' to read") from None
    except BaseException:
        held.close()
        raise
    return held


def _drop_in_child() -> None:
    """After a fork, in the child: close the inherited descriptors without unlocking."""
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    for held in list(_HELD):
        fd, held.fd = held.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_in_child)
