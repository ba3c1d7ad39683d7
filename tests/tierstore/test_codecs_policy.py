"""The per-tensor codec policy: small and 1-D tensors stay raw, v gets unsigned quantization."""

from __future__ import annotations

import pytest

import tierstore
from tierstore import codecs
from tierstore.codecs.policy import SMALL_TENSOR_ELEMENTS, choose_codec


def test_lossy_moments_get_signed_and_unsigned() -> None:
    shape = (256, 256)
    sr = {"rounding": "stochastic"}
    assert choose_codec("q4", shape, "exp_avg") == codecs.get("q4", signed=True, **sr)
    assert choose_codec("q4", shape, "exp_avg_sq") == codecs.get("q4", signed=False, **sr)
    assert choose_codec("q2", shape, "max_exp_avg_sq") == codecs.get("q2", signed=False, **sr)
    assert choose_codec("q8", shape, "param") == codecs.get("q8")  # not a moment: nearest


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
