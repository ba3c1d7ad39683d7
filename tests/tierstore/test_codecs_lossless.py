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


@pytest.mark.parametrize("name", ["raw", "zstd", "blosc"])
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


def test_blosc_spec_and_errors() -> None:
    b = codecs.get("blosc", cname="zstd", clevel=3, shuffle="bitshuffle")
    assert codecs.from_spec(b.spec()) == b
    assert codecs.get("blosc").params() == {"cname": "lz4", "clevel": 5, "shuffle": "shuffle"}
    for bad in ({"cname": "snappy"}, {"clevel": 10}, {"clevel": "5"}, {"shuffle": 1}):
        with pytest.raises(tierstore.CodecError):
            codecs.get("blosc", **bad)
    with pytest.raises(tierstore.CodecError, match="does not decode"):
        b.decode(memoryview(b"garbage!" * 4), (8,), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool],
                         ids=str)
def test_blosc_shuffles_by_element_size(dtype: torch.dtype) -> None:
    """Byte-shuffling must see the element width (byte 3 of a blosc header is the typesize)."""
    t = torch.arange(100_000).to(dtype)
    frame = codecs.get("blosc").encode(t)
    assert frame[3] == t.element_size()
    if dtype == torch.float32:  # smooth data compresses far better shuffled
        plain = codecs.get("blosc", shuffle="noshuffle").encode(torch.linspace(0, 1, 100_000))
        assert len(codecs.get("blosc").encode(torch.linspace(0, 1, 100_000))) < 0.8 * len(plain)
