"""The per-tensor codec policy: small and 1-D tensors stay raw, v gets unsigned quantization."""

from __future__ import annotations

import pytest
import torch

import tierstore
from tierstore import codecs
from tierstore.codecs.policy import FIRST_MOMENT_PARAMS, SMALL_TENSOR_ELEMENTS, choose_codec


def test_lossy_moments_get_signed_and_unsigned() -> None:
    shape = (256, 256)
    sr = {"rounding": "stochastic"}
    assert choose_codec("q8", shape, "exp_avg") == codecs.get("q8", signed=True, **sr)
    assert choose_codec("q2", shape, "exp_avg") == codecs.get("q2", signed=True, **sr)
    assert choose_codec("q4", shape, "exp_avg_sq") == codecs.get("q4", signed=False, **sr)
    assert choose_codec("q2", shape, "max_exp_avg_sq") == codecs.get("q2", signed=False, **sr)
    assert choose_codec("q4", shape, "momentum_buffer") == codecs.get("q4", signed=True, **sr)
    assert choose_codec("q8", shape, "param") == codecs.get("q8")  # not a moment: nearest


def test_q4_first_moment_gets_subtractive_dither_on_the_square_root_map() -> None:
    m = choose_codec("q4", (256, 256), "exp_avg")
    assert m == codecs.get("q4", signed=True, rounding="dither")
    assert FIRST_MOMENT_PARAMS["q4"] == {"rounding": "dither"}
    # the spec names the rounding (a dithered chunk decodes differently), so the chunks written
    # before (nearest on the dynamic-exponent map, or stochastic) keep their own spec
    assert m.spec() == {"name": "q4", "signed": True, "block": 128, "rounding": "dither", "scales": "rank1"}
    before = codecs.from_spec({"name": "q4", "signed": True, "block": 128, "rounding": "nearest",
                               "scales": "rank1", "signed_map": "de"})
    x = torch.randn(64, 128)
    assert torch.allclose(before.decode(memoryview(before.encode(x).numpy()), (64, 128), torch.float32), x,
                          atol=0.2 * float(x.abs().max()))
    old = codecs.from_spec({"name": "q4", "signed": True, "block": 128, "rounding": "stochastic",
                            "scales": "rank1"})
    x = torch.randn(64, 128)
    assert torch.equal(old.decode(memoryview(old.encode(x).numpy()), (64, 128), torch.float32),
                       codecs.get("q4", signed=True, rounding="nearest").decode(
                           memoryview(old.encode(x).numpy()), (64, 128), torch.float32))
    # an explicit instance is kept as built
    mine = codecs.get("q4", signed=True, rounding="stochastic")
    assert choose_codec(mine, (256, 256), "exp_avg") is mine


def test_small_and_1d_tensors_stay_raw() -> None:
    raw = codecs.get("raw")
    assert choose_codec("q4", (4096 * 4,), "exp_avg") == raw  # 1-D, however large
    assert choose_codec("q4", (), "exp_avg_sq") == raw
    assert choose_codec("q4", (63, 65), "exp_avg") == raw  # 4095 elements
    assert choose_codec("q4", (64, 64), "param") == codecs.get("q4")  # exactly the threshold
    assert SMALL_TENSOR_ELEMENTS == 64 * 64
    assert choose_codec("q4", (0, 5000), "exp_avg") == raw


def test_lossless_and_instances_are_kept() -> None:
    assert choose_codec("zstd", (8,), "exp_avg") == codecs.get("zstd")
    assert choose_codec("blosc", (512, 512), "exp_avg_sq") == codecs.get("blosc")
    mine = codecs.get("q4", signed=True, block=32)
    assert choose_codec(mine, (512, 512), "exp_avg_sq") is mine
    assert choose_codec(mine, (512,), "exp_avg_sq") == codecs.get("raw")


def test_bad_requests_raise() -> None:
    with pytest.raises(tierstore.CodecError, match="unknown codec"):
        choose_codec("q6", (512, 512), "exp_avg")
    with pytest.raises(tierstore.CodecError, match="role"):
        choose_codec("q4", (512, 512), "")
    with pytest.raises(tierstore.CodecError, match="requested"):
        choose_codec(4, (512, 512), "exp_avg")  # type: ignore[arg-type]
