"""Waiting for tasks without letting the waiter's cancellation cut them short.

The store's promise that a cancelled call happened completely or not at all rests on these two:
work that must finish (a commit's catalog transaction, the end of an update, a write-behind a
commit drains) runs as its own task, and the caller waits for it with one of these instead of
``await task`` or ``asyncio.gather``, which would cancel the task along with the caller. Both run
on the store's event loop thread.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def finish_despite_cancel(task: asyncio.Task[Any]) -> None:
    """Wait until ``task`` is done even if the caller is cancelled meanwhile (again and again)."""
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            continue
    if not task.cancelled():
        task.exception()  # retrieved: the caller's cancellation is what propagates


async def settle(tasks: list[asyncio.Task[Any]]) -> list[BaseException]:
    """Wait for ``tasks`` without cancelling them if the caller is cancelled (unlike ``gather``);
    return their failures (a cancellation counts), each retrieved so that asyncio logs none."""
    if tasks:
        await asyncio.wait(tasks)
    return [asyncio.CancelledError() if t.cancelled() else t.exception() for t in tasks
            if t.cancelled() or t.exception() is not None]  # type: ignore[misc]


def mark_retrieved(fut: asyncio.Future[Any]) -> None:
    """Mark a finished future's failure retrieved (asyncio logs one nobody retrieved); a done callback."""
    if not fut.cancelled():
        fut.exception()
