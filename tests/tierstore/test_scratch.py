"""The update scratch pool: reuse by size, a bound on what it keeps, and updates that use it."""

from __future__ import annotations

import torch

import tierstore
from tierstore.scratch import ScratchPool


def test_the_pool_hands_back_a_kept_buffer_of_the_same_size() -> None:
    pool = ScratchPool(limit=1 << 20)
    a = pool.take(4096)
    ptr = a.data_ptr()
    assert pool.in_use == 4096 and pool.fresh == 1
    pool.give(a)
    del a
    assert pool.in_use == 0 and pool.kept_bytes == 4096
    b = pool.take(4096)
    assert b.data_ptr() == ptr and pool.fresh == 1 and pool.kept_bytes == 0
    assert pool.take(8192).numel() == 8192  # another size: a new buffer
    assert pool.fresh == 2 and pool.peak == 4096 + 8192


def test_the_pool_keeps_at_most_its_limit_oldest_first() -> None:
    pool = ScratchPool(limit=3 * 4096)
    bufs = [pool.take(4096) for _ in range(3)] + [pool.take(8192)]
    for b in bufs:
        pool.give(b)
    del b
    # kept: the last 4096 and the 8192; the two given back first made room
    assert pool.kept_bytes == 4096 + 8192
    big = pool.take(3 * 4096 + 1)
    pool.give(big)  # larger than the limit: never kept
    assert pool.kept_bytes == 4096 + 8192


def test_a_buffer_still_referenced_is_never_handed_out_again() -> None:
    pool = ScratchPool(limit=1 << 20)
    a = pool.take(4096)
    pool.give(a)  # the caller still holds ``a``
    b = pool.take(4096)
    assert b.data_ptr() != a.data_ptr() and pool.fresh == 2 and pool.kept_bytes == 0


def test_an_update_through_a_scratch_decodes_outside_the_ram_budget(tmp_path) -> None:
    """A coded key's update takes its scratch from the pool, not the RAM tier (where it pushed
    out chunks that were read again), and the second update reuses the first one's buffer."""
    ram = 128 * 4096
    with tierstore.open(tmp_path / "s", "w", device="cpu", ram_budget=ram, chunk_bytes=4096) as s:
        m = torch.randn(8 * 1024)  # its scratch: 32 KiB, within the 1/8 of the budget kept
        s.put("m", m, codec="q8")
        s.commit()
        for _ in range(2):
            before = s.stats()["host_bytes"]
            with s.update("m") as t:
                inside = s.stats()
                t.mul_(0.5)
            assert inside["host_bytes"] == before  # the scratch is not in the RAM tier
            assert inside["scratch_bytes"] == 32 * 1024
        st = s.stats()
        assert st["scratch_bytes"] == 0 and st["scratch_kept_bytes"] == 32 * 1024
        assert st["peak_scratch_bytes"] == 32 * 1024 and st["scratch_fresh_buffers"] == 1
        assert torch.allclose(s.get("m"), m * 0.25, atol=0.05)  # q8: within a step of its grid
