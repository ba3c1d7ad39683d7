"""Overlapping calls, cancellation and faults: one regression test per defect of issue 10.

Interleavings are forced, not hoped for: a ``GatedPlan`` holds chosen I/O calls on their io
thread until the test opens the gate, so "a read in flight while a put replaces its tensor" is
a fixed schedule. Timeouts here only turn a hang into a failure; no test measures time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import shutil
import threading

import pytest
import torch

import tierstore
from tierstore.faults import FaultPlan
from tierstore.tiers.disk import DiskTier

HANG = 30.0  # seconds after which a call counts as hung


@dataclasses.dataclass
class GatedPlan(FaultPlan):
    """A fault plan that also holds every call at ``gated`` sites until ``gate`` is set."""

    gated: set[str] = dataclasses.field(default_factory=set)
    #: hold only calls whose path ends with this (the io pool has just 4 threads)
    suffix: str = "/c/0"
    gate: threading.Event = dataclasses.field(default_factory=threading.Event)
    entered: threading.Event = dataclasses.field(default_factory=threading.Event)

    def check(self, site: str, path: str) -> None:
        """Hold a gated call (and say so), then apply the plan's faults."""
        if site in self.gated and path.endswith(self.suffix):
            self.entered.set()
            if not self.gate.wait(HANG):
                raise OSError(errno.ETIMEDOUT, "gate never opened", path)
        super().check(site, path)


async def entered(plan: GatedPlan) -> None:
    """Wait until an io thread sits in a gated call."""
    ok = await asyncio.get_running_loop().run_in_executor(None, plan.entered.wait, HANG)
    assert ok, "no call reached the gate"


async def commit_held_in_catalog(s: tierstore.AsyncStore, n: int) -> tuple[GatedPlan, asyncio.Future[int]]:
    """Put ``a`` (``n`` elements), start a commit and hold it inside its catalog transaction."""
    await s.put("a", vec(n, 1))
    plan = GatedPlan(gated={"catalog"}, suffix="")
    s.inject_faults(plan)
    commit = asyncio.ensure_future(s.commit())
    await entered(plan)
    return plan, commit


async def settle(s: tierstore.AsyncStore) -> None:
    """Wait until every write-behind is on disk (no dirty chunk left)."""
    for _ in range(int(HANG * 100)):
        if s.stats()["dirty_chunks"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("write-behind never finished")


def vec(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def folders(path) -> set[tuple[str, int]]:
    return set(DiskTier(str(path)).scan_generations())


# ---------------------------------------------------------------- defect 1


def test_mode_w_while_a_reader_is_open_keeps_the_new_commit(tmp_path) -> None:
    with tierstore.open(tmp_path, mode="w") as s:
        s.put("old", vec(10, 1))
    reader = tierstore.open(tmp_path, mode="r")
    try:
        with tierstore.open(tmp_path, mode="w") as s:  # wipes the store the reader has open
            s.put("new", vec(10, 2))
    finally:
        reader.close()
    with tierstore.open(tmp_path, mode="r") as r:
        assert r.keys() == ["new"]
        assert torch.equal(r.get("new"), vec(10, 2))
        assert r.verify() == []


def test_catalog_environments_are_keyed_by_the_file_not_the_path(tmp_path) -> None:
    from tierstore.catalog import Catalog

    first = Catalog(str(tmp_path / "c"), create=True)
    try:
        shutil.rmtree(tmp_path / "c")  # what mode="w" does under an opener that holds it
        second = Catalog(str(tmp_path / "c"), create=True)
        try:
            assert second._env is not first._env
            assert os.path.exists(tmp_path / "c" / "data.mdb")
        finally:
            second.close()
    finally:
        first.close()


# ---------------------------------------------------------------- defect 2


async def test_commit_cancelled_mid_catalog_transaction_happens_completely(tmp_path) -> None:
    s = await tierstore.open_async(tmp_path, mode="w")
    await s.put("a", vec(100, 1))
    plan = GatedPlan(gated={"catalog"}, suffix="")
    s.inject_faults(plan)
    commit = asyncio.ensure_future(s.commit(step=1))
    await entered(plan)
    commit.cancel()
    await asyncio.sleep(0.05)
    assert not commit.done()  # the cancellation waits for the transaction under way
    plan.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await commit
    # when the cancellation arrives, the commit happened in memory too: no version still landing
    assert [c.step for c in s.versions()] == [1]
    await s.put("a", vec(100, 2))  # must not delete the folder the commit names
    s.inject_faults(None)
    await s.close(commit=False)
    with tierstore.open(tmp_path, mode="r") as r:
        assert r.verify() == []
        assert torch.equal(r.get("a"), vec(100, 1))


# ---------------------------------------------------------------- defect 3


def test_folders_of_a_failed_mkdir_are_fsynced_by_the_retry(tmp_path) -> None:
    root = tmp_path / "s"
    with tierstore.open(root, mode="w", chunk_bytes="16KiB", ram_budget="1MiB") as s:
        gen = 1
        data = str(root / "data")
        deep = os.path.join(data, "x", f"y@{gen}", "c")
        plan = FaultPlan(fail_at={("mkdir", deep)})
        s.async_store.inject_faults(plan)
        s.put("x/y", vec(10_000, 3))  # three chunks under data/x/y@1/c
        assert s.info("x/y").generation == gen
        s.commit()  # the first attempt's folder creation failed; the commit retried it
        s.async_store.inject_faults(None)
    synced = {p for _, site, p in plan.log if site == "fsync"}
    made = {dirpath for dirpath, _, _ in os.walk(data)}
    files = {os.path.join(d, f) for d, _, fs in os.walk(data) for f in fs}
    assert ("mkdir", deep) in {(site, p) for _, site, p in plan.log}
    missing = (made | files | {str(root)}) - synced
    assert not missing, sorted(missing)


# ---------------------------------------------------------------- defect 4


async def test_get_racing_a_put_of_the_same_key_reads_the_old_generation(tmp_path) -> None:
    s = await tierstore.open_async(tmp_path, mode="w", ram_budget="64KiB", chunk_bytes="16KiB")
    try:
        await s.put("k", vec(16_384, 1))  # 64 KiB: four chunks, uncommitted
        old = s.info("k").generation
        await s.put("filler", vec(16_384, 2))  # pushes k's (written) chunks out of RAM
        await settle(s)
        plan = GatedPlan(gated={"read"})
        s.inject_faults(plan)
        get = asyncio.ensure_future(s.get("k"))
        await entered(plan)  # the get reads k's old generation from disk
        await s.put("k", vec(16_384, 3))  # supersedes it: its folder must outlive the read
        await asyncio.gather(*s._retiring)
        plan.gate.set()
        got = await asyncio.wait_for(get, HANG)
        assert torch.equal(got, vec(16_384, 1))
        s.inject_faults(None)
    finally:
        plan.gate.set()
        await s.close()
    assert ("k", old) not in folders(tmp_path)  # deleted once the read let go


# ---------------------------------------------------------------- defect 5


async def test_get_of_a_compressed_tensor_on_a_full_disk_does_not_hang(tmp_path) -> None:
    z = torch.arange(4096, dtype=torch.float32)
    with tierstore.open(tmp_path, mode="w") as s:
        s.put("z", z, codec="zstd")
    s = await tierstore.open_async(tmp_path, ram_budget="64KiB", chunk_bytes="16KiB")
    try:
        s.inject_faults(FaultPlan(fail_sites={"write"}, error=errno.ENOSPC))
        await s.put("fill", vec(16_384, 1))  # fills RAM with chunks that cannot be written
        with pytest.raises(tierstore.BudgetError):
            await asyncio.wait_for(s.put("more", vec(16_384, 2)), HANG)
        got = await asyncio.wait_for(s.get("z"), HANG)  # raises or reads: never waits forever
        assert torch.equal(got, z)
        assert s.stats()["host_bytes"] <= 64 * 1024
    finally:
        s.inject_faults(None)
        await s.close(commit=False)


# ---------------------------------------------------------------- defect 7


@pytest.mark.parametrize("mode", ["w", "a"])
def test_mode_w_refuses_a_folder_that_holds_data_but_no_store(tmp_path, mode) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.bin").write_bytes(b"precious")
    with pytest.raises(tierstore.StoreError, match="not a tierstore"):
        tierstore.open(tmp_path, mode=mode)
    assert (tmp_path / "data" / "mine.bin").read_bytes() == b"precious"


def test_mode_w_still_recreates_an_empty_or_real_store(tmp_path) -> None:
    (tmp_path / "data").mkdir()  # what a crash right after creating data/ leaves
    with tierstore.open(tmp_path, mode="w") as s:
        s.put("a", vec(5, 1))
    with tierstore.open(tmp_path, mode="w") as s:  # a real store is wiped as asked
        assert s.keys() == []


# ---------------------------------------------------------------- defect 9


async def test_two_deletes_queued_behind_a_commit(tmp_path) -> None:
    s = await tierstore.open_async(tmp_path, mode="w")
    plan, commit = await commit_held_in_catalog(s, 10)
    try:
        first = asyncio.ensure_future(s.delete("a"))
        second = asyncio.ensure_future(s.delete("a"))
        await asyncio.sleep(0)
        plan.gate.set()
        assert await commit == 1
        await first
        with pytest.raises(tierstore.KeyNotFound, match="'a'"):
            await second
        assert "a" not in s
    finally:
        plan.gate.set()
        s.inject_faults(None)
        await s.close(commit=False)


# ---------------------------------------------------------------- suspected ones


async def test_put_cancelled_waiting_for_the_commit_lock_leaves_nothing(tmp_path) -> None:
    s = await tierstore.open_async(tmp_path, mode="w")
    plan, commit = await commit_held_in_catalog(s, 10)
    try:
        put = asyncio.ensure_future(s.put("b", vec(3000, 2)))
        for _ in range(5):
            await asyncio.sleep(0)  # the put copies its bytes, then queues for the lock
        put.cancel()
        plan.gate.set()
        assert await commit == 1
        with pytest.raises(asyncio.CancelledError):
            await put
        assert "b" not in s
        s.inject_faults(None)
    finally:
        plan.gate.set()
        await s.close()
    assert {k for k, _ in folders(tmp_path)} == {"a"}
    assert s._writes == {}


async def test_prefetch_finishing_after_its_generation_was_dropped(tmp_path) -> None:
    with tierstore.open(tmp_path, mode="w", chunk_bytes="16KiB") as s:
        s.put("k", vec(16_384, 1))
    s = await tierstore.open_async(tmp_path, keep_last=1, chunk_bytes="16KiB")
    try:
        old = s.info("k").generation
        plan = GatedPlan(gated={"read"}, fail_sites={"delete"})  # a folder left for the reopen
        s.inject_faults(plan)
        prefetch = asyncio.ensure_future(s.prefetch(["k"], wait=True))
        await entered(plan)
        await s.put("k", vec(16_384, 2))
        await s.commit()  # retention drops the generation the prefetch is loading
        plan.gate.set()
        await asyncio.wait_for(prefetch, HANG)
        await asyncio.gather(*s._retiring)
        assert not any(s._host.holds((old, i)) for i in range(4))  # no dead chunk in RAM
        assert torch.equal(await s.get("k"), vec(16_384, 2))
    finally:
        plan.gate.set()
        s.inject_faults(None)
        await s.close()


async def test_cancelled_gets_and_prefetches_leave_the_store_consistent(tmp_path) -> None:
    s = await tierstore.open_async(tmp_path, mode="w", ram_budget="64KiB", chunk_bytes="16KiB")
    try:
        await s.put("k", vec(16_384, 1))
        await s.put("filler", vec(16_384, 2))
        await settle(s)
        plan = GatedPlan(gated={"read"})
        s.inject_faults(plan)
        get = asyncio.ensure_future(s.get("k"))
        pre = asyncio.ensure_future(s.prefetch(["k"], wait=True))
        await entered(plan)
        get.cancel()
        pre.cancel()
        await asyncio.gather(get, pre, return_exceptions=True)
        await s.put("k", vec(16_384, 3))
        plan.gate.set()
        s.inject_faults(None)
        assert torch.equal(await asyncio.wait_for(s.get("k"), HANG), vec(16_384, 3))
        assert await s.commit() == 1
    finally:
        plan.gate.set()
        await s.close()
    with tierstore.open(tmp_path, mode="r") as r:
        assert r.verify() == []
        assert torch.equal(r.get("k"), vec(16_384, 3))
    assert sorted(k for k, _ in folders(tmp_path)) == ["filler", "k"]


async def test_open_cancelled_while_its_files_open_releases_the_lock(tmp_path, monkeypatch) -> None:
    gate, started = threading.Event(), threading.Event()
    real = tierstore.AsyncStore._open_files

    def slow_open(self) -> None:
        started.set()
        gate.wait(HANG)  # the caller is cancelled here; then LOCK and the catalog are taken
        real(self)

    monkeypatch.setattr(tierstore.AsyncStore, "_open_files", slow_open)
    opening = asyncio.ensure_future(tierstore.open_async(tmp_path, mode="w"))
    assert await asyncio.get_running_loop().run_in_executor(None, started.wait, HANG)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    gate.set()
    monkeypatch.setattr(tierstore.AsyncStore, "_open_files", real)
    for _ in range(500):  # the cancelled open lets go once its io call ends
        try:
            s = await tierstore.open_async(tmp_path)
            break
        except tierstore.StoreLocked:
            await asyncio.sleep(0.01)
    else:
        raise AssertionError("a cancelled open kept the writer lock")
    await s.put("a", vec(3, 1))
    await s.close()


async def test_a_cancelled_prefetch_wait_does_not_cancel_a_get_sharing_its_load(tmp_path) -> None:
    with tierstore.open(tmp_path, mode="w", chunk_bytes="16KiB") as s:
        s.put("k", vec(16_384, 1))
    s = await tierstore.open_async(tmp_path, mode="r", device="cpu", chunk_bytes="16KiB")
    try:
        plan = GatedPlan(gated={"read"})
        s.inject_faults(plan)
        pre = asyncio.ensure_future(s.prefetch(["k"], to="device", wait=True))
        await entered(plan)
        get = asyncio.ensure_future(s.get("k", device="cpu"))  # waits on the prefetch's load
        await asyncio.sleep(0)
        pre.cancel()
        await asyncio.gather(pre, return_exceptions=True)
        plan.gate.set()
        assert torch.equal(await asyncio.wait_for(get, HANG), vec(16_384, 1))
    finally:
        plan.gate.set()
        s.inject_faults(None)
        await s.close()


# ---------------------------------------------------------------- found by the 50,000-program fuzz


async def test_put_waits_for_room_a_retiring_generation_still_holds(tmp_path) -> None:
    # seed 1017006: a deleted, uncommitted generation's write still ran while a put waited for
    # RAM room; the stuck check saw dirty chunks and no pending write and raised BudgetError
    s = await tierstore.open_async(tmp_path, mode="w", chunk_bytes=256, ram_budget=256)
    plan = GatedPlan(gated={"write"})
    s.inject_faults(plan)
    await s.put("a", vec(64, 1))  # one chunk, the whole budget; its write is held at the gate
    await entered(plan)
    await s.delete("a")  # retires the generation once its write settles
    put_b = asyncio.ensure_future(s.put("b", vec(64, 2)))
    await asyncio.sleep(1.5)  # longer than the tier's 1 s wait for room
    assert not put_b.done(), put_b.exception() if put_b.done() else None
    plan.gate.set()
    await asyncio.wait_for(put_b, HANG)
    s.inject_faults(None)
    await s.commit()
    assert torch.equal(await s.get("b"), vec(64, 2))
    assert s.keys() == ["b"]
    await s.close()
