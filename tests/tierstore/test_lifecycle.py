"""A store's life outside the happy path: finalized without close, used after close, forked."""

from __future__ import annotations

import asyncio
import gc

import torch

import tierstore

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
