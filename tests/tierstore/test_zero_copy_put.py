"""put(copy=False): the tensor's memory becomes the RAM tier's buffers, counted and never recycled."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import tierstore

CHUNK = 64 << 10  # chunk_bytes: 16,384 fp32 values a chunk


def _open(path, budget="1MiB"):
    return tierstore.open(path, "w", ram_budget=budget, chunk_bytes=CHUNK)


def test_adopted_chunks_are_the_callers_memory_and_counted(tmp_path) -> None:
    t = torch.randn(4 * 16384)  # 4 full chunks
    with _open(tmp_path / "s") as s:
        host = s.async_store._host
        before = host.used
        s.put("w", t, copy=False)
        assert host.used - before == t.numel() * 4  # counted in the budget
        held = host.lookup((s.async_store._head["w"].generation, 0))
        assert held.data_ptr() == t.data_ptr()  # no copy was made
        assert torch.equal(s.get("w"), t)
        s.commit()
    with tierstore.open(tmp_path / "s", "r") as s:
        assert torch.equal(s.get("w"), t)  # what reached the disk
        assert s.verify() == []


def test_an_edge_chunk_and_other_dtypes_round_trip(tmp_path) -> None:
    values = {
        "edge": torch.randn(2 * 16384 + 77),  # the padded last chunk is copied
        "half": torch.randn(3, 40000).half(),
        "int": torch.arange(50000, dtype=torch.int32),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }
    with _open(tmp_path / "s") as s:
        for k, v in values.items():
            s.put(k, v, copy=False)
        s.commit()
    with tierstore.open(tmp_path / "s", "r") as s:
        for k, v in values.items():
            got = s.get(k)
            assert got.dtype == v.dtype and torch.equal(got, v), k


def test_evicted_adopted_buffers_are_never_reused_for_other_chunks(tmp_path) -> None:
    # were an adopted buffer recycled as a spare, the next puts would write into the caller's
    # tensor: it would change under its owner and the stored value with it
    t = torch.randn(4 * 16384)
    keep = t.clone()
    with _open(tmp_path / "s", budget="512KiB") as s:
        s.put("w", t, copy=False)
        s.commit()  # written: its chunks are clean and may be evicted
        host = s.async_store._host
        for i in range(12):  # 12 x 256 KiB through a 512 KiB budget: evicts w's chunks
            s.put(f"x{i}", torch.full((4 * 16384,), float(i)))
        assert host.used <= host.budget
        assert torch.equal(t, keep)
        assert torch.equal(s.get("w"), keep)
        s.commit()
        for i in range(12):
            assert torch.equal(s.get(f"x{i}"), torch.full((4 * 16384,), float(i)))


def test_a_view_of_a_larger_tensor_is_copied(tmp_path) -> None:
    base = torch.randn(8 * 16384)
    part = base[: 4 * 16384]  # adopting it would keep all of base alive, uncounted
    want = part.clone()
    with _open(tmp_path / "s") as s:
        s.put("w", part, copy=False)
        base.zero_()
        assert torch.equal(s.get("w"), want)


def test_a_replaced_or_deleted_adopted_tensor_leaves_the_budget(tmp_path) -> None:
    with _open(tmp_path / "s") as s:
        host = s.async_store._host
        start = host.used
        s.put("w", torch.randn(4 * 16384), copy=False)
        s.delete("w")
        s.commit()  # the deleted generation is dropped once its writes have settled
        _settled(lambda: host.used == start)
        assert host.used == start  # uncounted, not kept as spares
        s.put("w", torch.randn(4 * 16384), copy=False)
        s.put("w", torch.randn(4 * 16384), copy=False)
        s.commit()
        _settled(lambda: host.used - start == 4 * 16384 * 4)
        assert host.used - start == 4 * 16384 * 4  # the replaced one is gone


def _settled(done, tries: int = 200) -> None:
    """Wait (up to ~10 s) for the store's background retirement to reach ``done()``."""
    for _ in range(tries):
        if done():
            return
        time.sleep(0.05)


def test_a_cancelled_adopting_put_leaves_nothing(tmp_path) -> None:
    async def main() -> None:
        a = await tierstore.open_async(tmp_path / "s", "w", ram_budget="256KiB", chunk_bytes=CHUNK)
        try:
            host = a._host
            await a.put("w", torch.randn(4 * 16384), copy=False)  # fills the budget, dirty
            used = host.used
            # the next put waits for room (w's chunks are still being written), then is cancelled
            task = asyncio.ensure_future(a.put("v", torch.randn(4 * 16384), copy=False))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert host.used <= used
            assert "v" not in a.keys()
            await a.commit()
            assert host.used <= host.budget
        finally:
            await a.close()

    asyncio.run(main())
