"""The device window on CUDA: copies on the window's stream, events, budgets (skipped without CUDA)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import tierstore

pytestmark = pytest.mark.cuda


def test_cuda_round_trip_and_window(tmp_path) -> None:
    with tierstore.open(tmp_path, ram_budget="64MiB", device_budget="8MiB", device="cuda") as s:
        host = torch.randn(512, 1024)  # 2 MiB
        s.put("w", host.cuda())  # a device tensor goes down to the host tier
        assert s.stats()["bytes_d2h"] == host.numel() * 4
        t = s.get("w", device="cuda")
        assert t.is_cuda and torch.equal(t.cpu(), host)
        assert s.get("w", device="cuda") is t  # a window hit
        s.prefetch(["w"], to="device")
        for i in range(6):
            s.put(f"x{i}", torch.randn(512, 1024))
        s.commit()
        del t
        for i in range(6):
            y = s.get(f"x{i}", device="cuda")
            assert (y * 2).sum().item() == pytest.approx((s.get(f"x{i}") * 2).sum().item(), rel=1e-5)
            del y
        st = s.stats()
        assert st["peak_device_bytes"] <= 8 * 2**20
        assert st["bytes_h2d"] >= 6 * 2**21


def test_cuda_window_refuses_when_references_hold_it(tmp_path) -> None:
    with tierstore.open(tmp_path, device_budget="4MiB", device="cuda") as s:
        for i in range(3):
            s.put(f"x{i}", torch.randn(1024, 512))  # 2 MiB each
        held = [s.get("x0", device="cuda"), s.get("x1", device="cuda")]
        with pytest.raises(tierstore.BudgetError, match="still referenced"):
            s.get("x2", device="cuda")
        del held
        assert s.get("x2", device="cuda").is_cuda


def test_cuda_staging_pool_is_pinned_and_counted(tmp_path) -> None:
    with tierstore.open(tmp_path, ram_budget="256MiB", device_budget="64MiB", device="cuda") as s:
        pool = s.async_store._window.staging
        assert pool is not None and pool.pinned
        assert all(b.is_pinned() for b in pool._bufs)
        assert s.stats()["host_bytes"] == pool.nbytes  # the pool is in the RAM budget
        big = torch.randn(3 * pool.buffer_bytes // 4 + 123)  # several staged pieces
        s.put("big", big)
        before = pool.acquired
        t = s.get("big", device="cuda")
        assert pool.acquired > before + 1  # uploaded through the pool in pieces
        assert torch.equal(t.cpu(), big)
        s.put("back", t * 2)  # a device tensor leaves on the D2H stream through the pool
        assert torch.equal(s.get("back"), big * 2)


def test_cuda_window_upload_is_asynchronous_and_event_gated(tmp_path) -> None:
    from tierstore.tiers.device import DeviceWindow
    from tierstore.tiers.host import HostTier

    host = HostTier(budget=64 << 20, pin=True)
    win = DeviceWindow(torch.device("cuda"), None)
    win.attach_staging(host)
    assert win.staging is not None and host.used == win.staging.nbytes
    xs = [torch.randn(1 << 20) for _ in range(8)]  # 4 MiB each, more than the pool holds

    async def admit_all() -> list[torch.Tensor]:
        return [await win.admit(None, x) for x in xs]

    ts = asyncio.run(admit_all())
    for x, t in zip(xs, ts, strict=True):
        win.wait_ready(t)
        assert torch.equal(t.cpu(), x)
    win.clear()
    assert host.used == 0
