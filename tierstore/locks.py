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

The child closes its copies when it first runs, which may be a while after ``fork`` returned
in the parent on a loaded machine: a parent that closed and reopened its store at once found
its own LOCK still held by the child's copy (found by the model-based fuzz). So each fork made
while a lock is held comes with a handshake pipe: the child closes its write end right after
its copies of the lock descriptors, and ``writer_lock``, on finding the LOCK taken, first waits
(at most ``FORK_HANDSHAKE_S``) for the children whose handshake has not arrived, then tries
once more. A handshake that arrived is dropped at the next fork or lock attempt: the parent
keeps one descriptor per child that has not run yet, no more.

Threads: ``HeldLock`` objects are created and closed on any thread; the registry and the
handshakes are guarded by ``_lock``; the fork handlers run in the forking thread (the child's
in the child, where only that thread exists).
"""

from __future__ import annotations

import fcntl
import os
import select
import threading
import time
import weakref

from tierstore.errors import StoreLocked

_lock = threading.Lock()
_HELD: weakref.WeakSet[HeldLock] = weakref.WeakSet()
#: seconds ``writer_lock`` waits for forked children to close their copies of the lock descriptors
FORK_HANDSHAKE_S = 10.0
#: read ends of the handshakes of children that may not have run yet (the parent's)
_pending: list[int] = []
#: write ends of handshakes being forked now: every child closes the ones it inherited
_forking: list[int] = []


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
        try:
            fcntl.flock(held.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[arg-type]
        except BlockingIOError:
            if not _await_children(FORK_HANDSHAKE_S):
                raise
            fcntl.flock(held.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[arg-type]
    except BlockingIOError:
        held.close()
        raise StoreLocked(f"another process writes to {root} (its LOCK is held); "
                          "open with mode='r' to read") from None
    except BaseException:
        held.close()
        raise
    return held


def _reap_handshakes(timeout: float) -> bool:
    """Drop the handshakes that arrived within ``timeout`` s; whether there were any pending (lock held)."""
    if not _pending:
        return False
    deadline = time.monotonic() + timeout
    while _pending:
        ready, _, _ = select.select(_pending, [], [], max(0.0, deadline - time.monotonic()))
        for fd in ready:  # end of file: the child closed its write end (or exited)
            os.close(fd)
            _pending.remove(fd)
        if not ready:
            break
    return True


def _await_children(timeout: float) -> bool:
    """Wait until forked children have closed their copies of the lock descriptors; False if none was pending."""
    with _lock:
        return _reap_handshakes(timeout)


def _before_fork() -> None:
    """In the parent, before a fork: a handshake for the child when it inherits a held lock."""
    _lock.acquire()  # released in the after-fork handlers: no lock is taken or closed meanwhile
    if _HELD:
        _reap_handshakes(0.0)
        r, w = os.pipe()
        _pending.append(r)
        _forking.append(w)


def _after_fork_in_parent() -> None:
    """In the parent: close the write ends of the handshakes just made; the child holds its own."""
    try:
        for w in _forking:
            os.close(w)
        _forking.clear()
    finally:
        _lock.release()


def _drop_in_child() -> None:
    """After a fork, in the child: close the inherited descriptors without unlocking, then the handshake."""
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
    for fd in (*_pending, *_forking):  # the write end tells the parent: its lock is its own again
        try:
            os.close(fd)
        except OSError:
            pass
    _pending.clear()
    _forking.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_drop_in_child)
