"""A store's life outside the happy path: finalized without close, used after close, forked."""

from __future__ import annotations

import asyncio
import gc
import os

import pytest
import torch

import tierstore
from tierstore.leases import leased_generations

OPTS = dict(chunk_bytes="16KiB", ram_budget="1MiB", device_budget="1MiB")


def _slow_close(monkeypatch) -> None:
    """Make every close take a while, so that a reopen right after a finalization would find
    the LOCK still held unless it waits for the finalizing close."""
    close = tierstore.AsyncStore.close

    async def slow(self, commit: bool = True) -> None:
        await asyncio.sleep(0.2)
        await close(self, commit=commit)

    monkeypatch.setattr(tierstore.AsyncStore, "close", slow)


def test_a_store_finalized_on_its_loop_thread_can_be_reopened(tmp_path, monkeypatch) -> None:
    """The cyclic GC runs finalizers on whichever thread allocates when it triggers, often the
    store's own loop thread: its close must not wait for that thread (which used to stop the
    loop with the LOCK, LMDB and pools still held, so every reopen raised StoreLocked)."""
    _slow_close(monkeypatch)
    path = tmp_path / "s"
    for _ in range(3):
        s = tierstore.open(path, mode="a", **OPTS)
        s.put("a", torch.arange(10.0))
        s.commit()
        s.put("b", torch.ones(5000))  # a write still pending when it is dropped
        s.cycle = s  # type: ignore[attr-defined]  # only the cyclic GC can free it
        loop = s._loop.loop
        del s
        gc.disable()
        try:
            async def collect() -> None:
                gc.collect()
            asyncio.run_coroutine_threadsafe(collect(), loop).result(timeout=60)
        finally:
            gc.enable()
        del loop
        with tierstore.open(path, mode="a", **OPTS) as r:
            assert r.keys() == ["a"]  # finalized without a commit: "b" is dropped
            assert torch.equal(r.get("a"), torch.arange(10.0))


def test_an_async_open_waits_for_a_finalizing_close(tmp_path, monkeypatch) -> None:
    _slow_close(monkeypatch)
    path = tmp_path / "s"
    s = tierstore.open(path, mode="w", **OPTS)
    s.put("a", torch.arange(10.0))
    s.commit()
    s.cycle = s  # type: ignore[attr-defined]
    loop = s._loop.loop
    del s

    async def collect_then_reopen() -> list[str]:
        gc.collect()  # finalizes the store here, on its loop thread
        return []

    gc.disable()
    try:
        asyncio.run_coroutine_threadsafe(collect_then_reopen(), loop).result(timeout=60)
    finally:
        gc.enable()

    async def reopen() -> list[str]:
        a = await tierstore.open_async(path, mode="a", **OPTS)
        try:
            return a.keys()
        finally:
            await a.close()

    assert asyncio.run(reopen()) == ["a"]


def test_close_on_the_stores_own_loop_thread_is_refused_and_harmless(tmp_path) -> None:
    s = tierstore.open(tmp_path / "s", mode="w", **OPTS)
    s.put("a", torch.arange(10.0))

    async def close_here() -> str:
        try:
            s.close()
        except tierstore.StoreError as e:
            return str(e)
        return "closed"

    msg = asyncio.run_coroutine_threadsafe(close_here(), s._loop.loop).result(timeout=60)
    assert "thread of the store" in msg
    assert not s.closed and s.keys() == ["a"]
    s.close()
    with tierstore.open(tmp_path / "s", mode="r", **OPTS) as r:
        assert r.keys() == ["a"]


#: arguments that would be valid for an open store, per public method of the facade
_CALLS = {
    "put": ("a", torch.ones(3)), "put_many": ([("a", torch.ones(3))],), "get": ("a",), "get_many": (["a"],), "prefetch": (["a"],),
    "window_empty": ((2,), torch.float32), "staging_pool": (1024, 1), "mark_step": (),
    "info": ("a",), "keys": (), "delete": ("a",), "commit": (), "versions": (), "stats": (),
    "zarr_path": ("a",), "verify": (), "chrome_trace": (), "trace_span": ("x", "y", 0.0, 1.0),
    "__contains__": ("a",), "update": ("a",), "plan": (["a"],), "restore": ("a", 1), "update_many": (["a"],),
}
#: public members that are not store operations: they work after close
_NOT_OPERATIONS = {"close", "closed", "async_store"}


def test_every_public_method_of_a_closed_store_raises_store_closed(tmp_path) -> None:
    s = tierstore.open(tmp_path / "s", mode="w", **OPTS)
    s.put("a", torch.ones(3))
    s.close()
    public = {n for n in dir(tierstore.Store) if not n.startswith("_")} | {"__contains__"}
    assert public - _NOT_OPERATIONS == set(_CALLS), "a new public method needs a row in _CALLS"
    for name, args in _CALLS.items():
        with pytest.raises(tierstore.StoreClosed):
            got = getattr(s, name)(*args)
            if name in ("update", "update_many"):  # context managers: the call starts on entering
                with got:
                    pass
    with pytest.raises(tierstore.StoreClosed):
        s.get("a", index=torch.tensor([0]))  # the caller-thread gather path too
    with pytest.raises(tierstore.StoreClosed):
        "a" in s  # noqa: B015
    s.close()  # a second close does nothing
    assert s.closed


def _fork_idle_child() -> tuple[int, int]:
    """Fork a child that does nothing until told; (pid, fd that ends it when written/closed).

    Returns once the child runs (its fork handlers have run)."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no imports, no store calls
        try:
            os.close(ready_r)
            os.close(go_w)
            os.write(ready_w, b"r")
            os.read(go_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(go_r)
    assert os.read(ready_r, 1) == b"r"
    os.close(ready_r)
    return pid, go_w


def _end_child(pid: int, go_w: int) -> None:
    os.close(go_w)
    os.waitpid(pid, 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_holds_neither_the_writer_lock_nor_a_reader_lease(tmp_path) -> None:
    """flock locks belong to the open file description, which a fork shares: a child that
    kept its copies held the LOCK after the parent closed (the parent's reopen raised
    StoreLocked) and a reader's lease after the reader died."""
    path = tmp_path / "s"
    s = tierstore.open(path, "w", **OPTS)
    s.put("a", torch.arange(10.0))
    s.commit()
    r = tierstore.open(path, "r", **OPTS)
    gens = {s.async_store._head["a"].generation}
    pid, go = _fork_idle_child()
    try:
        # the child closed its copies without unlocking: the parent still holds both locks
        with pytest.raises(tierstore.StoreLocked):
            tierstore.open(path, "a", **OPTS)
        assert leased_generations(str(path)) == gens
        s.close()
        with tierstore.open(path, "a", **OPTS) as again:  # raised StoreLocked while the child lived
            assert again.keys() == ["a"]
        # the reader dies (the kernel closes its descriptors; its lease file stays behind)
        lease = r.async_store._lease
        os.close(lease._lock.fd)
        lease._lock.fd = None
        assert leased_generations(str(path)) == set()  # reclaimed: no live process holds it
        r.close()
    finally:
        _end_child(pid, go)


_SLOW_CHILD = """
import os, sys, time
# registered before tierstore is imported: in a child it runs first, so the child keeps its
# copy of the LOCK descriptor for 0.5 s after fork() returned in the parent (a loaded machine)
os.register_at_fork(after_in_child=lambda: time.sleep(0.5))
import torch
import tierstore
path = sys.argv[1]
s = tierstore.open(path, "w", chunk_bytes="16KiB", ram_budget="1MiB", device_budget="1MiB")
s.put("a", torch.arange(4.0))
pid = os.fork()
if pid == 0:
    os._exit(0)
s.close()
t0 = time.monotonic()
with tierstore.open(path, "a", chunk_bytes="16KiB", ram_budget="1MiB", device_budget="1MiB") as again:
    print("reopened", again.keys(), round(time.monotonic() - t0, 2))
os.waitpid(pid, 0)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_reopen_right_after_a_fork_waits_for_the_child_to_let_go(tmp_path) -> None:
    """A child closes its copy of the LOCK descriptor only when it first runs: a parent that
    closed and reopened at once raised StoreLocked (found by the model-based fuzz under load)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _SLOW_CHILD, str(tmp_path / "s")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "reopened ['a']" in out.stdout
