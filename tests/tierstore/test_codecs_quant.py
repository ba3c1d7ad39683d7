"""Quantized codecs: documented error bounds, the zero-point guarantee, a reference
implementation of the documented maps and layout, shapes, dtypes and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore
from tierstore import codecs
from tierstore.codecs import quant
from tools.moments import synthetic_moments

QUANT = ["q8", "q4", "q3", "q2"]

# Documented bounds on the relative L2 error ||decode(encode(x)) - x|| / ||x|| at the default
# blocks (q8/q4: 128, q3/q2: 64). Measured values in the comments; bounds add ~30% margin.
# real: the 2-D parameters' moments after 5 AdamW steps of a tiny byte-level Llama (conftest).
# synthetic: tools.moments.synthetic_moments(2**18, seed=0).
BOUNDS = {
    # (codec, signed, data): bound          measured
    ("q8", True, "real"): 0.009,           # 0.0066
    ("q8", False, "real"): 0.02,           # 0.0153
    ("q4", True, "real"): 0.16,            # 0.121
    ("q4", False, "real"): 0.33,           # 0.257
    ("q3", True, "real"): 0.33,            # 0.251
    ("q3", False, "real"): 0.34,           # 0.264
    ("q2", True, "real"): 0.90,            # 0.720
    ("q2", False, "real"): 0.75,           # 0.590
    ("q8", True, "synthetic"): 0.011,      # 0.0080
    ("q8", False, "synthetic"): 0.004,     # 0.0028
    ("q4", True, "synthetic"): 0.19,       # 0.146
    ("q4", False, "synthetic"): 0.036,     # 0.0273
    ("q3", True, "synthetic"): 0.46,       # 0.357
    ("q3", False, "synthetic"): 0.057,     # 0.0438
    ("q2", True, "synthetic"): 0.83,       # 0.638
    ("q2", False, "synthetic"): 0.25,      # 0.191
}


def _round_trip(codec: codecs.Codec, x: torch.Tensor) -> torch.Tensor:
    data = codec.encode(x)
    raw = data.numpy().tobytes() if isinstance(data, torch.Tensor) else bytes(data)
    return codec.decode(memoryview(raw), tuple(x.shape), x.dtype)


def _rel_err(y: torch.Tensor, x: torch.Tensor) -> float:
    return float((y.double() - x.double()).norm() / x.double().norm())


@pytest.fixture(scope="module")
def synthetic() -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic_moments(1 << 18, seed=0)


@pytest.mark.parametrize("key", sorted(BOUNDS), ids=lambda k: f"{k[0]}-{'m' if k[1] else 'v'}-{k[2]}")
def test_documented_error_bound(key: tuple[str, bool, str], real_moments, synthetic) -> None:
    name, signed, data = key
    m, v = real_moments if data == "real" else synthetic
    x = m if signed else v
    err = _rel_err(_round_trip(codecs.get(name, signed=signed), x), x)
    assert err <= BOUNDS[key], f"{name} signed={signed} on {data}: {err:.4f} > {BOUNDS[key]}"
    # a bound far above the measurement would be a test that cannot fail
    assert err >= BOUNDS[key] / 3


@pytest.mark.parametrize("name", QUANT)
def test_more_bits_less_error_and_unsigned_keeps_every_positive(name: str, real_moments) -> None:
    m, v = real_moments
    yv = _round_trip(codecs.get(name, signed=False), v)
    assert int(((v > 0) & (yv <= 0)).sum()) == 0
    assert bool((yv >= 0).all())
    # relative error per positive element is bounded by the log grid: half a step of the
    # block's log2 range, which spans at most the fp32 exponent range
    pos = v > 0
    ratio = (yv[pos] / v[pos]).log2().abs()
    assert float(ratio.max()) < 150 / ((1 << codecs.get(name).code_bits) - 1)


def test_error_decreases_with_bits(real_moments) -> None:
    m, v = real_moments
    for x, signed in ((m, True), (v, False)):
        errs = [_rel_err(_round_trip(codecs.get(n, signed=signed), x), x) for n in QUANT]
        assert errs == sorted(errs), errs


def _reference_decode(x: np.ndarray, bits: int, block: int, signed: bool) -> np.ndarray:
    """The documented maps, one block at a time with an explicit level table (slow, clear)."""
    out = np.zeros(len(x), dtype=np.float64)
    for s in range(0, len(x), block):
        xb = x[s:s + block].astype(np.float64)
        if signed:
            half = 2 ** (bits - 1) - 1
            grid = np.arange(-half, half + 1) / half
            amax = np.abs(xb).max()
            if amax == 0:
                continue
            companded = bits in (4, 8)
            y = np.sign(xb) * (np.sqrt(np.abs(xb) / amax) if companded else np.abs(xb) / amax)
            k = np.abs(y[:, None] - grid[None, :]).argmin(1)
            g = grid[k]
            out[s:s + block] = (np.sign(g) * g * g if companded else g) * np.float32(amax)
        else:
            pos = xb[xb > 0]
            if len(pos) == 0:
                continue
            lo = math.floor(math.log2(pos.min()) * 128) / 128
            hi = math.ceil(math.log2(pos.max()) * 128) / 128
            levels = np.linspace(lo, hi, 2**bits) if hi > lo else np.full(2**bits, lo)
            lg = np.log2(np.where(xb > 0, xb, 2.0**lo))
            k = np.abs(lg[:, None] - levels[None, :]).argmin(1)
            out[s:s + block] = 2.0 ** levels[k]
    return out


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("signed", [True, False])
def test_matches_reference_implementation(name: str, signed: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1003, generator=g) * torch.exp(2 * torch.randn(1003, generator=g))
    x = x if signed else x * x
    x[::97] = 0.0
    codec = codecs.get(name, signed=signed, block=50)
    got = _round_trip(codec, x).double().numpy()
    want = _reference_decode(x.numpy(), codec.code_bits, 50, signed)
    # ties and last-ulp differences may pick the neighbouring level in a few elements
    close = np.isclose(got, want, rtol=1e-5, atol=0)
    assert close.mean() > 0.995, f"{(~close).sum()} of {len(x)} differ from the reference"


def _reference_pack(codes: list[int], bits: int) -> bytes:
    """The documented planar layout, element by element."""
    n = len(codes)
    if bits == 8:
        return bytes(codes)
    if bits == 3:
        q = n // 8
        words = [sum(codes[j + k * q] << (3 * k) for k in range(8)) for j in range(q)]
        return bytes([w & 255 for w in words] + [(w >> 8) & 255 for w in words]
                     + [(w >> 16) & 255 for w in words])
    p = 8 // bits
    q = n // p
    return bytes(sum(codes[j + k * q] << (bits * k) for k in range(p)) for j in range(q))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_bit_packing_layout(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (64,), generator=g, dtype=torch.uint8)
    packed = quant._pack(codes, bits)
    assert packed.numpy().tobytes() == _reference_pack(codes.tolist(), bits)
    assert torch.equal(quant._unpack(packed, bits), codes)


def _floats() -> st.SearchStrategy[float]:
    tiny = float(np.finfo(np.float32).smallest_subnormal)
    f32 = lambda a, b: st.floats(float(np.float32(a)), float(np.float32(b)), width=32)  # noqa: E731
    return st.one_of(st.just(0.0), f32(tiny, 3e38), f32(1e-30, 1e-20), f32(1e10, 1e30))


@settings(max_examples=200, deadline=None)
@given(values=st.lists(_floats(), min_size=1, max_size=300),
       name=st.sampled_from(QUANT), block=st.integers(1, 200))
def test_no_positive_value_decodes_to_zero(values: list[float], name: str, block: int) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    y = _round_trip(codecs.get(name, signed=False, block=block), x)
    assert bool((y[x > 0] > 0).all())
    assert bool(torch.isfinite(y).all())
    # each positive value decodes within its block's [min, max] (to 1/128 octave)
    assert bool((y <= x.max() * 2 ** (1 / 128) * 1.0001).all())


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(float(np.float32(-1e30)), float(np.float32(1e30)), width=32),
                      min_size=1, max_size=200),
       name=st.sampled_from(QUANT), block=st.integers(1, 200))
def test_signed_keeps_sign_and_absmax(values: list[float], name: str, block: int) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    y = _round_trip(codecs.get(name, block=block), x)
    assert bool((y * x >= 0).all())  # never flips a sign (may round to zero)
    assert bool((y.abs() <= x.abs().max()).all())
    assert float(y.abs().max()) == float(x.abs().max())  # the absmax element is exact


SHAPES = [(), (0,), (1,), (7,), (3, 0, 5), (129,), (5, 77), (2, 3, 4, 5)]


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_shapes_and_dtypes_round_trip(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    for signed, data in ((True, x), (False, x.abs())):
        codec = codecs.get(name, signed=signed)
        assert codec.decoded_dtype(dtype) == torch.float32
        enc = codec.encode(data)
        assert enc.dtype == torch.uint8 and enc.numel() == codec.encoded_nbytes(shape)
        y = _round_trip(codec, data)
        assert y.shape == data.shape and y.dtype == torch.float32
        if data.numel():
            assert _rel_err(y, data.float()) < {"q8": 0.02, "q4": 0.2, "q3": 0.4, "q2": 0.9}[name]


@pytest.mark.parametrize("name", QUANT)
def test_bits_and_spec(name: str) -> None:
    codec = codecs.get(name, signed=False, block=32)
    assert codec.bits == codec.code_bits + 1.0
    assert codecs.from_spec(codec.spec()) == codec
    assert codecs.get(name) == codecs.get(name, signed=True)
    assert not codec.lossless
    x = torch.rand(32 * 1000)
    assert len(codec.encode(x).numpy().tobytes()) * 8 / x.numel() == codec.bits


def test_exact_zeros_and_constant_blocks() -> None:
    for name in QUANT:
        z = torch.zeros(300)
        assert torch.equal(_round_trip(codecs.get(name), z), z)
        assert torch.equal(_round_trip(codecs.get(name, signed=False), z), z)
        c = torch.full((300,), 3.5e-12)
        assert torch.allclose(_round_trip(codecs.get(name, signed=False), c), c, rtol=0.006)
        assert torch.allclose(_round_trip(codecs.get(name), c), c, rtol=1e-6)
        # in signed mode exact zeros stay zero next to large values
        mixed = torch.tensor([0.0, 1.0, -0.0, -2.0])
        assert _round_trip(codecs.get(name), mixed)[0] == 0.0


@pytest.mark.parametrize("name", QUANT)
def test_extreme_magnitudes(name: str) -> None:
    """Subnormal-only blocks and values next to float32's max decode finite and in range."""
    sub = torch.tensor([1e-45, -3e-42, 2e-40, 0.0], dtype=torch.float32)
    y = _round_trip(codecs.get(name), sub)
    assert bool(torch.isfinite(y).all()) and float(y.abs().max()) == float(sub.abs().max())
    yu = _round_trip(codecs.get(name, signed=False), sub.abs())
    assert bool((yu[sub != 0] > 0).all())
    big = torch.tensor([3.4e38, 3.0e38, 1.0], dtype=torch.float32)
    yb = _round_trip(codecs.get(name, signed=False), big)
    assert bool(torch.isfinite(yb).all()) and float(yb[0]) > 3.3e38
    assert bool(torch.isfinite(_round_trip(codecs.get(name), -big)).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("signed", [True, False])
def test_non_finite_raises(bad: float, signed: bool) -> None:
    x = torch.ones(1000)
    x[517] = bad
    with pytest.raises(tierstore.CodecError, match="NaN or infinity"):
        codecs.get("q4", signed=signed).encode(x)


def test_negative_in_unsigned_raises_and_negative_zero_is_fine() -> None:
    with pytest.raises(tierstore.CodecError, match="negative"):
        codecs.get("q4", signed=False).encode(torch.tensor([1.0, -1e-30, 2.0]))
    y = _round_trip(codecs.get("q4", signed=False), torch.tensor([-0.0, 1.0]))
    assert bool((y >= 0).all())


@pytest.mark.parametrize("params", [
    {"block": 0}, {"block": -128}, {"block": 64.0}, {"block": True}, {"block": "128"},
    {"signed": 1}, {"signed": "yes"}, {"bits": 4}, {"scale": "fp16"},
])
def test_bad_specs_raise(params: dict) -> None:
    with pytest.raises(tierstore.CodecError):
        codecs.get("q4", **params)


def test_bad_bits_dtype_and_length_raise() -> None:
    with pytest.raises(tierstore.CodecError, match="unknown codec"):
        codecs.get("q5")
    with pytest.raises(tierstore.CodecError, match="bits"):
        quant.check_params(5, 128, True)
    codec = codecs.get("q4")
    for dtype in (torch.float64, torch.int32, torch.bool):
        with pytest.raises(tierstore.CodecError, match="quantizes float32"):
            codec.encode(torch.zeros(4, dtype=dtype))
        with pytest.raises(tierstore.CodecError):
            codec.decoded_dtype(dtype)
    data = codec.encode(torch.randn(1000)).numpy().tobytes()
    with pytest.raises(tierstore.CodecError, match="bytes"):
        codec.decode(memoryview(data[:-1]), (1000,), torch.float32)
    with pytest.raises(tierstore.CodecError, match="compile mode"):
        quant.set_compile("sometimes")


@pytest.mark.slow
@pytest.mark.parametrize("signed", [True, False])
def test_compiled_kernels_match_eager(signed: bool) -> None:
    """Inductor's kernels (used for chunks >= 1 Mi elements) decode what eager decodes."""
    m, v = synthetic_moments((1 << 20) + 5, seed=3)
    x = m if signed else v
    try:
        quant.set_compile("never")
        eager = quant.quantize(x, 4, 128, signed)
        quant.set_compile("always")
        compiled = quant.quantize(x, 4, 128, signed)
        # the two may round a tie differently; the bytes hold the same format either way
        assert float((eager != compiled).float().mean()) < 1e-4
        got = quant.dequantize(eager, x.numel(), 4, 128, signed)
        quant.set_compile("never")
        want = quant.dequantize(eager, x.numel(), 4, 128, signed)
        assert torch.allclose(got, want, rtol=1e-6, atol=0)
    finally:
        quant.set_compile("auto")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("signed", [True, False])
def test_cuda_matches_cpu(name: str, signed: bool) -> None:
    m, v = synthetic_moments(100_003, seed=4)
    x = m if signed else v
    codec = codecs.get(name, signed=signed)
    cpu = codec.encode(x)
    gpu = codec.encode(x.cuda())
    assert gpu.is_cuda
    assert float((gpu.cpu() != cpu).float().mean()) < 1e-3
    back = quant.dequantize(gpu, x.numel(), codec.code_bits, codec.block, signed)
    assert back.is_cuda
    assert torch.allclose(back.cpu(), codec.decode(memoryview(cpu.numpy()), x.shape, x.dtype),
                          rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", QUANT)
def test_stochastic_rounding_is_unbiased(name: str) -> None:
    """Averaged over many encodes, stochastic codes land on the value (in the grid's domain)."""
    torch.manual_seed(0)
    x = torch.tensor([1.0, 0.3, -0.6, 0.05, -0.01, 0.7, 0.0, -1.0])
    sr = codecs.get(name, block=8, rounding="stochastic")
    companded = name in ("q8", "q4")
    grid = (lambda t: t.sign() * t.abs().sqrt()) if companded else (lambda t: t)
    mean = torch.stack([grid(_round_trip(sr, x)) for _ in range(3000)]).mean(0)
    assert torch.allclose(mean, grid(x), atol=0.02), (mean, grid(x))
    nearest = grid(_round_trip(codecs.get(name, block=8), x))
    if name == "q2":  # nearest rounding is biased here: 0.3 -> 0, 0.7 -> 1
        assert float((nearest - grid(x)).abs().max()) > 0.25
    v = torch.tensor([1e-8, 3e-6, 1e-4, 0.02, 1.0, 7.0, 0.0, 5e-3])
    usr = codecs.get(name, signed=False, block=8, rounding="stochastic")
    logs = torch.stack([_round_trip(usr, v)[v > 0].log2() for _ in range(3000)]).mean(0)
    assert torch.allclose(logs, v[v > 0].log2(), atol=0.1), (logs, v[v > 0].log2())


def test_stochastic_rounding_spec_and_levels() -> None:
    sr = codecs.get("q4", signed=False, rounding="stochastic")
    assert codecs.from_spec(sr.spec()) == sr != codecs.get("q4", signed=False)
    with pytest.raises(tierstore.CodecError, match="rounding"):
        codecs.get("q4", rounding="up")
    # values on the grid never move, whatever the draw
    levels = torch.tensor([-1.0, 0.0, 1.0, 0.0, -1.0] * 20)
    assert torch.equal(_round_trip(codecs.get("q2", rounding="stochastic", block=5), levels),
                       levels)
