"""Lossless codecs: bit-exact round trips on random and special values; bad specs raise."""

from __future__ import annotations

import pytest
import torch

import tierstore
from tierstore import codecs

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]


def _sample(dtype: torch.dtype, n: int = 1000) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point:
        t = torch.randn(n, generator=g).to(dtype)
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0,
                                 torch.finfo(dtype).tiny / 4, torch.finfo(dtype).max], dtype=dtype)
        return torch.cat([t, specials])
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=dtype)


@pytest.mark.parametrize("name", ["raw", "zstd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lossless_bit_exact(name: str, dtype: torch.dtype) -> None:
    codec = codecs.get(name)
    t = _sample(dtype).reshape(-1, 1)
    data = codec.encode(t)
    if isinstance(data, torch.Tensor):
        data = data.numpy().tobytes()
    back = codec.decode(memoryview(data), tuple(t.shape), dtype)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(-1).view(torch.uint8) if dtype != torch.bool else back,
                       t.view(-1).view(torch.uint8) if dtype != torch.bool else t)


def test_spec_round_trip_and_errors() -> None:
    z = codecs.get("zstd", level=3)
    assert codecs.from_spec(z.spec()) == z
    with pytest.raises(tierstore.CodecError, match="unknown codec"):
        codecs.get("nope")
    with pytest.raises(tierstore.CodecError, match="level"):
        codecs.get("zstd", level="high")
    with pytest.raises(tierstore.CodecError, match="takes no parameters"):
        codecs.get("raw", block=4)
    with pytest.raises(tierstore.CodecError):
        codecs.from_spec({"level": 3})
    with pytest.raises(tierstore.CodecError, match="does not decode"):
        z.decode(memoryview(b"garbage!"), (2,), torch.float32)
