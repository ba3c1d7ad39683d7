"""Round trips: every dtype, odd shapes, huge tensors, slices, gathers, and zarr interop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

import tierstore

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]


def sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_and_shapes_bit_exact(tmp_path, dtype: torch.dtype, codec: str) -> None:
    shapes = [(), (0,), (0, 5), (5, 0), (1,), (7,), (33, 17), (3, 4, 5)]
    with tierstore.open(tmp_path, ram_budget="64KiB", chunk_bytes="4KiB") as s:
        tensors = {f"t{i}": sample(sh, dtype, i) for i, sh in enumerate(shapes)}
        for k, t in tensors.items():
            s.put(k, t, codec=codec)
        for k, t in tensors.items():  # from the RAM tier, before any commit
            assert bits_equal(s.get(k), t), k
        s.commit()
    with tierstore.open(tmp_path, mode="r") as r:  # from disk
        for k, t in tensors.items():
            assert bits_equal(r.get(k), t), k
            assert r.info(k).shape == tuple(t.shape)


def test_special_float_values_bit_exact(tmp_path) -> None:
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 3.4e38])
    nan_payload = torch.tensor([0x7FC00123], dtype=torch.int32).view(torch.float32)
    t = torch.cat([t, nan_payload])
    with tierstore.open(tmp_path) as s:
        s.put("x", t)
        s.commit()
    with tierstore.open(tmp_path, mode="r") as r:
        assert bits_equal(r.get("x"), t)


def test_non_contiguous_input(tmp_path) -> None:
    base = torch.randn(64, 48)
    views = {"t": base.t(), "stride": base[::3, 1::2], "expand": torch.randn(1, 8).expand(16, 8)}
    with tierstore.open(tmp_path, chunk_bytes="1KiB", ram_budget="64KiB") as s:
        for k, v in views.items():
            s.put(k, v)
        s.commit()
        for k, v in views.items():
            assert torch.equal(s.get(k), v)


def test_tensor_four_times_the_ram_budget(tmp_path) -> None:
    budget = 1 << 20
    t = torch.randn(4 * budget // 4 + 123, dtype=torch.float32)  # > 4x the budget in bytes
    with tierstore.open(tmp_path, ram_budget=budget, device_budget=budget) as s:
        s.put("big", t)
        assert torch.equal(s.get("big"), t)  # partly dirty in RAM, partly on disk
        s.commit()
        assert torch.equal(s.get("big"), t)
        assert torch.equal(s.get("big", index=slice(budget // 4, budget // 4 + 1000)),
                           t[budget // 4 : budget // 4 + 1000])
        assert s.stats()["peak_host_bytes"] <= budget
        with pytest.raises(tierstore.BudgetError, match="device window"):
            s.get("big", device="cpu" if not torch.cuda.is_available() else "cuda")


def test_read_your_writes_in_every_tier(tmp_path) -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with tierstore.open(tmp_path, ram_budget="256KiB", device_budget="256KiB",
                        chunk_bytes="16KiB") as s:
        a1, a2, a3 = (torch.full((100, 100), float(v)) for v in (1, 2, 3))
        s.put("a", a1)
        assert torch.equal(s.get("a"), a1)                       # dirty in RAM
        assert torch.equal(s.get("a", device=dev).cpu(), a1)     # device window
        s.put("a", a2)
        assert torch.equal(s.get("a", device=dev).cpu(), a2)     # window must not serve a1
        s.commit()
        for i in range(8):                                       # push "a" out of RAM
            s.put(f"filler{i}", torch.randn(100, 100))
        s.commit()
        for i in range(8):  # and out of the window (a CPU window serves host gets too)
            s.get(f"filler{i}", device=dev)
        reads = s.stats()["reads_disk"]
        assert torch.equal(s.get("a"), a2)                       # from disk
        assert s.stats()["reads_disk"] > reads
        s.put("a", a3)
        assert torch.equal(s.get("a"), a3)
        assert torch.equal(s.get("a", index=torch.tensor([99, 0])), a3[[99, 0]])
        s.delete("a")
        with pytest.raises(tierstore.KeyNotFound):
            s.get("a")
        s.commit()
    with tierstore.open(tmp_path, mode="r") as r:
        assert "a" not in r.keys()
        assert r.keys(prefix="filler") == [f"filler{i}" for i in range(8)]


@pytest.mark.parametrize("codec", ["raw", "zstd", "q8"])
def test_host_gets_are_private_copies(tmp_path, codec: str) -> None:
    """A host get hands the caller its own tensor (the trainer updates them in place): writing
    to it changes nothing stored, whether the chunks came from RAM or from disk."""
    with tierstore.open(tmp_path, ram_budget="64KiB", chunk_bytes="16KiB") as s:
        a = torch.randn(64, 64)
        s.put("a", a, codec=codec)
        want = s.get("a")
        for _ in range(2):                      # the first read may come from RAM, then disk
            got = s.get("a")
            got.add_(1.0)
            got[3:5] = 0.0
            assert torch.equal(s.get("a"), want)
            s.commit()
            s.put("filler", torch.randn(128, 128))  # push "a" out of the RAM tier


def test_slices_and_gathers_match_torch(tmp_path) -> None:
    t = torch.randn(1000, 7, 3)
    with tierstore.open(tmp_path, chunk_bytes="1KiB", ram_budget="32KiB") as s:
        s.put("e", t)
        s.commit()
        for sl in [slice(0, 1000), slice(10, 20), slice(-5, None), slice(500, 400), slice(999, 1000)]:
            assert torch.equal(s.get("e", index=sl), t[sl]), sl
        rows = torch.tensor([5, 900, 5, 0, 999, -1])
        assert torch.equal(s.get("e", index=rows), t[rows])
        assert torch.equal(s.get("e", index=[3, 2, 1]), t[[3, 2, 1]])
        assert torch.equal(s.get("e", index=17), t[17])
        assert s.get("e", index=torch.tensor([], dtype=torch.int64)).shape == (0, 7, 3)


def test_wide_rows_split_inside_a_row(tmp_path) -> None:
    t = torch.randn(3, 5000)  # one row is larger than a chunk
    with tierstore.open(tmp_path, chunk_bytes="4KiB", ram_budget="64KiB") as s:
        s.put("w", t)
        s.commit()
        assert s.info("w").chunks > 3
        assert torch.equal(s.get("w"), t)
        assert torch.equal(s.get("w", index=slice(1, 2)), t[1:2])
        assert torch.equal(s.get("w", index=[2, 0]), t[[2, 0]])


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool], ids=str)
def test_plain_zarr_reads_committed_arrays(tmp_path, dtype: torch.dtype, codec: str) -> None:
    t = sample((37, 11), dtype, 3)
    with tierstore.open(tmp_path, chunk_bytes="256B", ram_budget="64KiB") as s:
        s.put("layers.0.w", t, codec=codec)
        s.commit()
        path = s.zarr_path("layers.0.w")
    z = zarr.open_array(path, mode="r")
    got = np.asarray(z[:])
    want = t.view(torch.uint16) if dtype == torch.bfloat16 else t
    assert z.attrs["tierstore"]["dtype"] == str(dtype).removeprefix("torch.")
    np.testing.assert_array_equal(got, want.numpy())


def test_versions_are_readable(tmp_path) -> None:
    with tierstore.open(tmp_path, keep_last=3) as s:
        for step in range(5):
            s.put("w", torch.full((4,), float(step)))
            s.commit(step=step, message=f"step {step}")
        vs = s.versions()
    assert [c.step for c in vs] == [2, 3, 4]
    assert vs[-1].message == "step 4"
    for c in vs:
        with tierstore.open(tmp_path, mode="r", version=c.version) as r:
            assert torch.equal(r.get("w"), torch.full((4,), float(c.step)))
    with pytest.raises(tierstore.StoreNotFound, match="not retained"):
        tierstore.open(tmp_path, mode="r", version=vs[0].version - 1)


async def test_async_store(tmp_path) -> None:
    s = await tierstore.open_async(tmp_path)
    try:
        await s.put("x", torch.arange(10))
        assert torch.equal(await s.get("x"), torch.arange(10))
        assert await s.commit(step=1) == 1
    finally:
        await s.close()
