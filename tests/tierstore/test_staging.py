"""Staging pool: a fixed set of recycled host buffers, counted in the RAM budget, gated by events."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading

import pytest
import torch

import tierstore
from tierstore.errors import BudgetError, StoreError
from tierstore.tiers.device import DeviceWindow
from tierstore.tiers.host import HostTier
from tierstore.tiers.staging import StagingPool, staging_plan


class FakeEvent:
    """A CUDA event stand-in: done once ``synchronize`` ran or ``done`` was set."""

    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.synced = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synced += 1
        self.done = True


def test_pool_recycles_a_fixed_set_of_buffers() -> None:
    pool = StagingPool(4096, 3)
    ptrs = {b.data_ptr() for b in pool._bufs}
    seen = set()
    for _ in range(20):
        bufs = [pool.acquire() for _ in range(3)]
        seen |= {b.data_ptr() for b in bufs}
        for b in bufs:
            pool.release(b)
    assert seen == ptrs and pool.acquired == 60 and pool.count == 3
    assert not pool.pinned  # no CUDA here: plain pageable buffers


def test_pool_counts_in_the_ram_budget_and_gives_back_on_close() -> None:
    host = HostTier(budget=10 * 4096)
    pool = StagingPool(4096, 4, host=host)
    assert host.used == pool.nbytes == 4 * 4096
    assert host.try_alloc(7 * 4096) is None  # the pool's bytes leave only 6 buffers' room
    fresh = host.fresh_buffers
    for _ in range(10):
        pool.release(pool.acquire())
    assert host.fresh_buffers == fresh  # recycling allocates nothing
    pool.close()
    assert host.used == 0
    with pytest.raises(BudgetError, match="closed"):
        pool.acquire()


def test_pool_takes_what_the_budget_allows_and_refuses_nothing() -> None:
    assert StagingPool(4096, 8, host=HostTier(budget=3 * 4096)).count == 3
    with pytest.raises(BudgetError, match="no room"):
        StagingPool(4096, 2, host=HostTier(budget=100))
    with pytest.raises(BudgetError, match="buffer_bytes > 0"):
        StagingPool(0, 2)


def test_plan_is_sized_by_the_budgets() -> None:
    assert staging_plan(None, None) == (64 << 20, 4)
    size, n = staging_plan(1 << 30, None)  # 1 GiB RAM: at most 1/16 of it staged
    assert size * n <= (1 << 30) // 16 and size % 4096 == 0
    assert staging_plan(1 << 40, 8 << 20)[0] == 2 << 20  # a quarter of a small device window
    pool = StagingPool.from_host_tier(HostTier(budget=256 << 20))
    assert pool.nbytes <= (256 << 20) // 16


def test_released_buffer_waits_for_its_event() -> None:
    pool = StagingPool(4096, 1)
    buf = pool.acquire()
    ev = FakeEvent()
    pool.release(buf, after=ev)
    assert pool.acquire() is buf  # the only buffer: the host waits for the copy's event
    assert ev.synced == 1 and pool.waits == 1
    pool.release(buf, after=FakeEvent(done=True))
    assert pool.acquire() is buf and pool.waits == 1  # a completed event: no wait


def test_acquire_blocks_until_a_peer_releases() -> None:
    pool = StagingPool(4096, 1)
    buf = pool.acquire()
    timer = threading.Timer(0.05, pool.release, args=(buf,))
    timer.start()
    assert pool.acquire(timeout=10) is buf
    with pytest.raises(BudgetError, match="within"):
        pool.acquire(timeout=0.01)
    with pytest.raises(BudgetError, match="in pieces"):
        pool.acquire(nbytes=8192)


def test_window_on_cpu_stages_nothing() -> None:
    win = DeviceWindow(torch.device("cpu"), None)
    win.attach_staging(HostTier(budget=1 << 20))
    assert win.staging is None
    x = torch.randn(5, 7)
    assert torch.equal(asyncio.run(win.to_host(x)), x)


def test_window_events_are_keyed_by_tensor_identity() -> None:
    # tensors compare elementwise: a WeakKeyDictionary lookup of a CUDA window tensor raised
    # "Boolean value of Tensor ... is ambiguous" (seen on the first GPU run)
    win = DeviceWindow(torch.device("cpu"), None)
    a, b = torch.zeros(4), torch.zeros(4)
    win._events[a] = "event-a"
    assert win._events.get(a) == "event-a" and win._events.get(b) is None
    del a
    assert len(win._events) == 0  # the entry goes with its tensor


def test_cpu_store_reserves_no_staging(tmp_path) -> None:
    with tierstore.open(tmp_path, ram_budget="8MiB", device="cpu") as s:
        assert s.stats()["host_bytes"] == 0
        s.put("x", torch.randn(64, 64))
        torch.testing.assert_close(s.get("x", device="cpu"), s.get("x"))


def test_try_acquire_never_blocks() -> None:
    pool = StagingPool(4096, 1)
    buf = pool.acquire()
    assert pool.try_acquire() is None and pool.waits == 1
    ev = FakeEvent()
    pool.release(buf, after=ev)
    assert pool.try_acquire() is buf and ev.synced == 1  # a queued copy ends without peers


@pytest.mark.parametrize("codec", ["raw", "zstd", "q8"])
def test_staged_device_reads_equal_plain_reads(tmp_path, codec) -> None:
    # The CUDA read path (RAM tier -> staging buffers -> window) on a CPU window with a pool.
    with tierstore.open(tmp_path, ram_budget="16MiB", device_budget="4MiB", chunk_bytes="64KiB",
                        device="cpu") as s:
        a = s.async_store
        a._window.attach_staging(a._host, on_cpu=True)
        assert a._window.staging is not None and a._window.staging.buffer_bytes >= 1 << 20
        a._window.staging.close()
        pool = a._window.staging = StagingPool(48 * 4096, 3, host=a._host)  # pieces across chunks
        xs = {"odd": torch.randn(317, 411), "bf16": torch.randn(100, 999).to(torch.bfloat16),
              "scalar": torch.tensor(3.5), "ints": torch.arange(70_001, dtype=torch.int64)}
        for k, x in xs.items():
            s.put(k, x, codec=codec if x.dtype == torch.float32 else "raw")
        s.commit()
        for k in xs:
            before = pool.acquired
            want = s.get(k)  # the host read: the reference
            got = s.get(k, device="cpu")  # a window load: through the staging buffers
            assert torch.equal(got, want) and got.dtype == want.dtype and got.shape == want.shape, k
            assert pool.acquired > before and a._window.lookup(a._record(k).generation) is got
        s.prefetch(["odd"], to="device", wait=True)
        assert s.stats()["bytes_h2d"] >= sum(x.numel() * x.element_size() for x in xs.values())
        assert s.stats()["host_bytes"] >= pool.nbytes  # the pool is in the RAM budget


def test_store_staging_pool_is_counted_and_given_back(tmp_path) -> None:
    # on the CPU: a CUDA store's own upload pool would already hold the budget
    with tierstore.open(tmp_path, ram_budget="1MiB", device="cpu") as s:
        pool = s.staging_pool(128 * 1024, 16)  # asks for 2 MiB: the budget holds 8 buffers
        assert pool.count == 8 and s.stats()["host_bytes"] == pool.nbytes == 1 << 20
        assert s.async_store._host.try_alloc(4096) is None  # the pool holds the whole budget
        pool.release(pool.acquire())
        pool.close()
        assert s.stats()["host_bytes"] == 0
        s.put("x", torch.zeros(1024))
        with pytest.raises(BudgetError, match="no room"):
            s.staging_pool(2 << 20, 1)
    with pytest.raises(tierstore.StoreClosed):
        s.staging_pool(4096, 1)


def test_acquire_async_waits_for_a_release_from_another_thread() -> None:
    pool = StagingPool(4096, 1)
    buf = pool.acquire()

    async def take() -> torch.Tensor:
        threading.Timer(0.05, pool.release, args=(buf,)).start()
        return await asyncio.wait_for(pool.acquire_async(), timeout=10)

    assert asyncio.run(take()) is buf and pool.waits == 1


def test_acquire_async_cancelled_leaves_no_waiter() -> None:
    pool = StagingPool(4096, 1)
    buf = pool.acquire()

    async def give_up() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(pool.acquire_async(), timeout=0.02)

    asyncio.run(give_up())
    assert pool._waiters == []
    pool.release(buf)
    assert pool.try_acquire() is buf


def test_window_pool_refuses_blocking_acquire(tmp_path) -> None:
    with tierstore.open(tmp_path, ram_budget="16MiB", device="cpu") as s:
        win = s.async_store._window
        win.attach_staging(s.async_store._host, on_cpu=True)
        assert win.staging is not None and win.staging.loop_owned
        with pytest.raises(StoreError, match="acquire_async"):
            win.staging.acquire()


class _FakeCudaEvent:
    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def test_loop_never_blocks_on_an_exhausted_pool(tmp_path, monkeypatch) -> None:
    # A pool of one buffer, held by a coroutine across an await, while another coroutine on the
    # same loop uploads through the pool (the CUDA admit path, with streams and events faked on
    # the CPU). A loop thread that blocked on the pool would never run the holder's release.
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    with tierstore.open(tmp_path, ram_budget="16MiB", device="cpu") as s:
        a = s.async_store
        x = torch.randn(64, 100)
        s.put("x", x)
        win = a._window
        win.is_cuda, win._stream = True, object()
        pool = win.staging = StagingPool(4096, 1, host=a._host)
        held: list[torch.Tensor] = []

        async def scenario() -> torch.Tensor:
            taken = asyncio.Event()

            async def holder() -> None:
                buf = pool.try_acquire()
                assert buf is not None
                held.append(buf)
                taken.set()
                await asyncio.sleep(0.2)  # the buffer stays held across an await
                held.pop()
                pool.release(buf)

            h = asyncio.ensure_future(holder())
            await taken.wait()
            got = await a.get("x", index=slice(3, 40), device="cpu")  # the staged admit
            await h
            return got

        fut = asyncio.run_coroutine_threadsafe(scenario(), s._loop.loop)
        try:
            got = fut.result(timeout=20)
        except concurrent.futures.TimeoutError:
            for buf in list(held):
                pool.release(buf)  # unstick the loop so the store can close
            fut.result(timeout=20)
            win.is_cuda = False
            pytest.fail("the loop thread blocked on the exhausted staging pool (self-deadlock)")
        win.is_cuda = False
        assert torch.equal(got, x[3:40]) and pool.waits >= 1 and pool.acquired >= 3
