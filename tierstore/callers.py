"""Who calls the store: a thread of the sync facade, or an asyncio task of an async caller.

A wait for RAM room may wait for an open in-place ``update()`` to end, since ending it makes its
chunks writable and so their room reclaimable, but only if the update's holder is someone else
who is not waiting for room too: a holder waiting on itself, or two holders waiting on each
other, would wait forever. The identity travels in a context variable: the sync facade sets it to
the calling thread for each call's coroutine; an async caller is its task, fixed when it first
takes an update (``claim``), so the tasks it starts afterwards count as the same caller (a child
task waiting for room behind its parent's update is refused, never left waiting on it).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")

_CALLER: ContextVar[object | None] = ContextVar("tierstore_caller", default=None)


def current() -> object | None:
    """The caller running now: the facade's thread, the claiming task, else the current task."""
    caller = _CALLER.get()
    if caller is None:
        try:
            return asyncio.current_task()
        except RuntimeError:  # no running loop
            return None
    return caller


def claim() -> object | None:
    """``current()``, fixed for the rest of this task and the tasks it starts from now on."""
    caller = _CALLER.get()
    if caller is None:
        caller = asyncio.current_task()
        _CALLER.set(caller)
    return caller


def alive(caller: object | None) -> bool:
    """Whether ``caller`` can still act: a running thread or an unfinished task."""
    if isinstance(caller, threading.Thread):
        return caller.is_alive()
    if isinstance(caller, asyncio.Task):
        return not caller.done()
    return False


async def on_behalf_of(caller: threading.Thread, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` as ``caller``'s (the sync facade's thread that waits for it)."""
    _CALLER.set(caller)
    return await coro
