"""Store: the synchronous facade over AsyncStore, bridged by one background event loop thread.

Threads and ownership: each ``Store`` owns one ``LoopThread``; every call hops to it and waits.
The loop thread cannot wait for itself, and ``AsyncStore.close`` joins the store's io and cpu
pools, so a close must never run on one of those threads. That matters for a store dropped
without ``close()``: the cyclic garbage collector runs ``__del__`` on whichever thread allocates
when a collection triggers, often the store's own loop thread. Invariant: a finalizer that runs
on a thread of its store hands the close to a thread of its own (``_Finalizing``), and
``tierstore.open`` of that path in this process waits for such closes to finish, so the LOCK
is free again; anywhere else the finalizer closes synchronously. (The collection that finds
the facade finalizes the store's tasks with it, in no fixed order: a write that failed and was
not yet retrieved by a commit may be logged as "Task exception was never retrieved". Keeping
the store reachable from elsewhere would avoid that, but a failure that reached a caller holds
the caller's frames, so the facade itself would never be collected. Close stores explicitly.)
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import sys
import threading
import weakref
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import torch

from tierstore import callers
from tierstore.codecs import Codec
from tierstore.errors import StoreClosed, StoreError
from tierstore.kernel_threads import limit_this_thread
from tierstore.reads import Index
from tierstore.records import Commit, TensorInfo
from tierstore.store import AsyncStore
from tierstore.tiers.staging import StagingPool

T = TypeVar("T")


class LoopThread:
    """A daemon thread running an event loop; the store's coroutines all run on it."""

    def __init__(self, name: str = "tierstore-loop", kernel_threads: int | None = None):
        self.loop = asyncio.new_event_loop()
        self._kernel_threads = kernel_threads
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._kernel_threads is not None:  # before the loop runs any torch kernel
            limit_this_thread(self._kernel_threads)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result in the calling thread."""
        return self.submit(coro).result()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop without waiting: the future of its result."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise StoreError("a sync Store method was called from its own event loop thread")
        if not self._thread.is_alive() or self.loop.is_closed():
            coro.close()
            raise StoreClosed("the store's event loop has stopped (the store is closed)")
        return asyncio.run_coroutine_threadsafe(callers.on_behalf_of(threading.current_thread(), coro),
                                                self.loop)

    def owns_current_thread(self) -> bool:
        """Whether the calling thread is this loop's thread."""
        return threading.current_thread() is self._thread

    def call(self, fn: Any, *args: Any) -> Any:
        """Run a plain function on the loop thread (the owner of the store's state)."""
        async def _wrap() -> Any:
            return fn(*args)
        return self.run(_wrap())

    def stop(self) -> None:
        """Stop the loop and join its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


#: the explicit registry of open sync stores: at interpreter exit each is closed without a
#: commit (its last commit is what a reopen sees), before daemon threads are frozen; a store
#: left open used to hang the exit in ``__del__``
_OPEN_STORES: weakref.WeakSet[Store] = weakref.WeakSet()


def _close_open_stores() -> None:
    for store in list(_OPEN_STORES):
        try:
            store.close(commit=False)
        except StoreError:
            pass
    _Finalizing.wait_all()


class _Finalizing:
    """Closes of stores finalized on one of their own threads, each run by a thread of its own.

    ``wait(path)`` (called by ``tierstore.open``) joins those of ``path``, so that a reopen in
    this process finds the LOCK released; the threads are daemons, and interpreter exit waits
    for them (``_close_open_stores``) before daemon threads are frozen.
    """

    _lock = threading.Lock()
    _threads: dict[str, set[threading.Thread]] = {}

    @classmethod
    def start(cls, loop: LoopThread, astore: AsyncStore) -> None:
        """Close ``astore`` without a commit and stop ``loop``, on a new thread."""
        path = astore.path

        def run() -> None:
            try:
                _close_and_stop(loop, astore)
            finally:
                with cls._lock:
                    cls._threads[path].discard(thread)
                    if not cls._threads[path]:
                        del cls._threads[path]

        thread = threading.Thread(target=run, name="tierstore-finalize", daemon=True)
        with cls._lock:
            cls._threads.setdefault(path, set()).add(thread)
        thread.start()

    @classmethod
    def pending(cls, path: str) -> bool:
        """Whether a finalizing close of the store at ``path`` (a real path) is under way."""
        with cls._lock:
            return path in cls._threads

    @classmethod
    def wait(cls, path: str) -> None:
        """Return once the finalizing closes of the store at ``path`` (a real path) are done."""
        with cls._lock:
            threads = list(cls._threads.get(path, ()))
        for t in threads:
            t.join()

    @classmethod
    def wait_all(cls) -> None:
        """Return once every finalizing close is done."""
        with cls._lock:
            threads = [t for ts in cls._threads.values() for t in ts]
        for t in threads:
            t.join()


def _close_and_stop(loop: LoopThread, astore: AsyncStore, commit: bool = False) -> None:
    """Close ``astore`` on ``loop`` (from another thread), then stop the loop in any case."""
    try:
        loop.run(astore.close(commit=commit))
    finally:
        loop.stop()


def _on_store_thread(loop: LoopThread, astore: AsyncStore) -> bool:
    """Whether the calling thread is one a close of this store waits for (loop, io, delete, cpu)."""
    if loop.owns_current_thread():
        return True
    me = threading.current_thread()
    # ThreadPoolExecutor keeps its workers in ``_threads`` (CPython, since 3.2)
    return any(me in getattr(pool, "_threads", ())
               for pool in (astore._io, astore._deleter, astore._cpu))


atexit.register(_close_open_stores)


class _LoopHostTier:
    """The RAM tier as seen from another thread: its reservations run on the store's loop thread."""

    def __init__(self, loop: LoopThread, host: Any) -> None:
        self._loop = loop
        self._host = host
        self.budget = host.budget
        self.pin = host.pin

    def try_alloc(self, nbytes: int) -> torch.Tensor | None:
        """A buffer counted in the RAM budget, or None when the budget has no room."""
        return self._loop.call(self._host.try_alloc, nbytes)

    def release(self, buf: torch.Tensor) -> None:
        """Uncount a buffer; nothing to do once the store is closed (its budget is gone)."""
        try:
            self._loop.call(self._host.release, buf)
        except StoreError:
            pass


class Store:
    """A tiered tensor store with blocking methods; see ``tierstore.open``."""

    def __init__(self, astore: AsyncStore, loop: LoopThread):
        self._a = astore
        self._loop = loop
        self.path = astore.path
        self.mode = astore.mode
        self.config = astore.config
        #: keys each thread has lent by ``update``: the same thread touching one would wait forever
        self._held = threading.local()
        _OPEN_STORES.add(self)

    def _held_keys(self) -> set[str]:
        keys = getattr(self._held, "keys", None)
        if keys is None:
            keys = self._held.keys = set()
        return keys

    def _refuse_held(self, key: str | None) -> None:
        """StoreError where this thread would wait on its own ``update`` (of ``key``, or any: None)."""
        held = self._held_keys()
        if held and (key is None or key in held):
            what = f"{key!r}" if key is not None else f"{sorted(held)[:3]}"
            raise StoreError(f"{what} is lent to an update() open in this thread: finish it first "
                             "(inside it, use the tensor it lent)")

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has run; every operation of a closed store raises StoreClosed."""
        return self._loop is None

    @property
    def async_store(self) -> AsyncStore:
        """The AsyncStore behind this facade (its coroutines run on the facade's loop)."""
        return self._a

    def put(self, key: str, tensor: torch.Tensor, codec: str | dict[str, Any] | Codec = "raw", *,
            chunk_rows: int | None = None, shard_rows: int | None = None, copy: bool = True,
            lazy: bool = False) -> None:
        """Store ``tensor`` under ``key``; returns once the bytes are copied.

        ``chunk_rows=`` stores a table sharded, in inner chunks of that many rows (gathers read
        only the inner chunks holding their rows); ``copy=False`` hands the tensor's memory to
        the store instead of copying it (do not modify it afterwards); ``lazy=True`` writes it
        only when the budget or a commit needs it (a short-lived value never touches the disk);
        see ``AsyncStore.put``.
        """
        self._refuse_held(key)
        self._running().run(self._a.put(key, tensor, codec, chunk_rows=chunk_rows,
                                        shard_rows=shard_rows, copy=copy, lazy=lazy))

    def put_many(self, items: Sequence[tuple[str, torch.Tensor]], codec: str | dict[str, Any] | Codec = "raw", *,
                 copy: bool = True, lazy: bool = False, wait: bool = True) -> concurrent.futures.Future[None] | None:
        """``put(key, tensor, codec, copy=copy, lazy=lazy)`` of each pair in order, in one hop to the loop.

        A layer's gradients at once: each hop wakes the loop thread, which on busy cores runs
        late and takes a core from the caller's kernels. The puts before a failing one stand.
        ``wait=False`` returns at once with the future of the puts (its ``result()`` raises
        their error); until it is done the tensors must not change, and a call on these keys
        from another thread may run before the puts.
        """
        items = list(items)
        for key, _ in items:
            self._refuse_held(key)

        async def _all() -> None:
            for key, tensor in items:
                await self._a.put(key, tensor, codec, copy=copy, lazy=lazy)

        future = self._running().submit(_all())
        if not wait:
            return future
        future.result()
        return None

    @contextlib.contextmanager
    def update(self, key: str, *, chunked: bool = False) -> Iterator[Any]:
        """Lend ``key``'s value writable; what the block leaves in it becomes the new head.

        ``with store.update("w") as t: t.add_(g)``: a raw tensor in RAM is changed where it
        lives (no copy, no disk write until the budget or a commit needs one); ``chunked=True``
        lends one flat view per chunk (in place for tensors of several chunks too). Other
        threads' reads of ``key`` wait for the end; see ``AsyncStore.update``.
        """
        self._refuse_held(key)
        u = self._running().run(self._a.begin_update(key, chunked=chunked))
        held = self._held_keys()
        held.add(key)
        try:
            yield u.value()
        finally:
            held.discard(key)
            self._running().run(self._a.end_update(u))

    @contextlib.contextmanager
    def update_many(self, keys: Sequence[str], *, chunked: bool = False,
                    then_delete: Sequence[str] = ()) -> Iterator[list[Any]]:
        """``update`` of several keys at once, in one hop to the loop each way: the list of loans.

        The keys are lent in sorted order (two callers never wait on each other in a cycle);
        all of them or, on an error, none. ``then_delete``: keys deleted in the hop that ends
        the updates, once they ended and only if the block raised nothing (a gradient consumed
        by the update it was lent to).
        """
        keys = list(keys)
        for key in {*keys, *then_delete}:
            self._refuse_held(key)
        us = self._running().run(self._a.begin_updates(keys, chunked=chunked))
        held = self._held_keys()
        held.update(keys)
        gone = list(then_delete)
        ok = False
        try:
            yield [u.value() for u in us]
            ok = True
        finally:
            held.difference_update(keys)

            async def _end() -> None:
                await self._a.end_updates(us)
                for key in gone if ok else ():
                    await self._a.delete(key)

            self._running().run(_end())

    def get(self, key: str, device: str | torch.device | None = None, index: Index = None,
            copy: bool = True) -> torch.Tensor:
        """The newest value of ``key`` on the host, or in the device window with ``device=``.

        A host tensor is the caller's own copy; a window tensor is shared: treat it as read-only.
        ``copy=False`` on a CPU window lends the RAM tier's buffer instead of copying it (raw
        codec, one chunk; else a copy as usual): read-only too, see ``AsyncStore.get`` (a write
        into it makes the commit that needs the changed chunk, or the key's next update, raise
        ``LoanWritten``).
        A row gather of a committed sharded table whose pages are in the page cache is served on
        this thread without a hop to the loop (``AsyncStore.mapped_get``).
        """
        self._refuse_held(key)
        loop = self._running()
        if index is not None and device is None:
            got = self._a.mapped_get(key, index)
            if got is not None:
                return got
        t = loop.run(self._a.get(key, device=device, index=index, copy=copy))
        self._a._window.wait_ready(t)
        return t

    def get_many(self, keys: Sequence[str], device: str | torch.device | None = None,
                 then_prefetch: Sequence[tuple[Sequence[str], str]] = (), copy: bool = True) -> list[torch.Tensor]:
        """``[get(k, device, copy=copy) for k in keys]`` in one hop to the store's loop (a layer's weights at once).

        ``then_prefetch``: ``(keys, to)`` hints started once the reads are done, in the same hop
        (the next layer's weights while this one computes).
        """
        async def _all() -> list[torch.Tensor]:
            out = [await self._a.get(k, device=device, copy=copy) for k in keys]
            for hint, to in then_prefetch:
                if hint:
                    await self._a.prefetch(hint, to=to)  # type: ignore[arg-type]
            return out

        out = self._running().run(_all())
        for t in out:
            self._a._window.wait_ready(t)
        return out

    def window_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor in the device window, counted in its budget while alive.

        Scratch for a caller's own data (generation's KV workspace); raises BudgetError when the
        window has no room for it beside the tensors held now.
        """
        return self._running().call(self._a._window.alloc, tuple(int(s) for s in shape), dtype)

    def staging_pool(self, buffer_bytes: int, count: int) -> StagingPool:
        """A pool of up to ``count`` host buffers (pinned with CUDA) counted in the RAM budget.

        For copies a caller runs itself (the trainer's gradient drain); ``close()`` the pool to
        give the bytes back. Raises BudgetError when not even one buffer fits the budget.
        """
        loop = self._running()
        return StagingPool(buffer_bytes, count, pin=self._a._host.pin, host=_LoopHostTier(loop, self._a._host))

    def _running(self) -> LoopThread:
        """The store's loop, or StoreClosed: every public operation starts here."""
        loop = self._loop
        if loop is None:
            raise StoreClosed(f"the store at {self.path} is closed")
        return loop

    def prefetch(self, keys: Sequence[str] | str, to: str = "host", wait: bool = False) -> None:
        """Hint that ``keys`` will be read soon; loading starts in the background (``wait``: finish)."""
        self._running().run(self._a.prefetch(keys, to=to, wait=wait))  # type: ignore[arg-type]

    def plan(self, keys: Sequence[str] | None, hot: Sequence[str] = ()) -> None:
        """Declare the order the workload updates ``keys`` in, cycle after cycle (None: forget it).

        Eviction and write-back then let go of what is needed last, and reads run ahead along
        it: state larger than the RAM budget moves the minimum of bytes a cycle. ``hot``: keys
        read more often than once a cycle (a model's weights), kept in RAM ahead of the others.
        """
        self._running().call(self._a.plan, _listed(keys), _listed(hot))

    def mark_step(self) -> None:
        """Close a step of the access trace (the predictor learns the order)."""
        self._running().call(self._a.mark_step)

    def info(self, key: str) -> TensorInfo:
        """Shape, dtype, codec, sizes and current tiers of ``key``."""
        return self._running().call(self._a.info, key)

    def keys(self, prefix: str = "") -> list[str]:
        """Sorted keys that start with ``prefix``."""
        return self._running().call(self._a.keys, prefix)

    def __contains__(self, key: str) -> bool:
        return bool(self._running().call(self._a.__contains__, key))

    def delete(self, key: str) -> None:
        """Remove ``key`` from the head."""
        self._refuse_held(key)
        self._running().run(self._a.delete(key))

    def restore(self, key: str, version: int) -> None:
        """Make ``key``'s head what retained commit ``version`` holds (its stored bytes, no re-encode)."""
        self._refuse_held(key)
        self._running().run(self._a.restore(key, version))

    def commit(self, step: int | None = None, message: str = "") -> int:
        """Make the head a durable, atomic version; returns its id."""
        self._refuse_held(None)
        return self._running().run(self._a.commit(step=step, message=message))

    def versions(self) -> list[Commit]:
        """Retained commits, oldest first."""
        return self._running().call(self._a.versions)

    def stats(self) -> dict[str, Any]:
        """Counters, tier occupancy and peaks, prediction accuracy."""
        return self._running().call(self._a.stats)

    def zarr_path(self, key: str) -> str:
        """The folder of ``key``'s current generation, readable with ``zarr.open_array``."""
        return self._running().call(self._a.zarr_path, key)

    def verify(self, keys: Sequence[str] | None = None) -> list[Any]:
        """Re-read every committed chunk (of ``keys``, default all) from disk; the CorruptData faults."""
        return self._running().run(self._a.verify(keys))

    def chrome_trace(self) -> str:
        """The I/O trace as Chrome trace JSON (open in Perfetto)."""
        self._running()
        return self._a.tracer.chrome_trace()

    def trace_span(self, name: str, cat: str, start: float, end: float, **args: Any) -> None:
        """Record a caller's span (``time.perf_counter`` seconds, e.g. a trainer step) in the trace."""
        self._running()
        self._a.tracer.span(name, cat, start, end, **args)

    def close(self, commit: bool = True) -> None:
        """Commit pending changes (unless ``commit=False``), then release files and threads.

        ``commit=False`` drops what was put since the last commit (a trainer whose step state
        lives outside the store closes that way after an error).
        """
        loop = self._loop
        if loop is None:
            return
        if _on_store_thread(loop, self._a):
            raise StoreError("close() was called on a thread of the store itself (its event loop "
                             "or a pool): call it from another thread")
        _OPEN_STORES.discard(self)
        self._loop = None  # type: ignore[assignment]
        _close_and_stop(loop, self._a, commit=commit)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # an exception inside the block discards the uncommitted changes, like a transaction
        self.close(commit=exc_type is None)

    def __del__(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is None or sys.is_finalizing():
            return
        self._loop = None  # type: ignore[assignment]
        if _on_store_thread(loop, self._a):
            _Finalizing.start(loop, self._a)  # this thread cannot wait for the close
            return
        try:
            _close_and_stop(loop, self._a)
        except StoreError:
            pass


def _listed(keys: Sequence[str] | None) -> Any:
    """``keys`` as a list made on the calling thread (None and a lone str as they are: refused there)."""
    return keys if keys is None or isinstance(keys, str) else list(keys)
