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
from tools.bench.moments import synthetic_moments

QUANT = ["q8", "q4", "q3", "q2"]

# Documented bounds on the relative L2 error ||decode(encode(x)) - x|| / ||x|| at the default
# blocks (q8/q4: 128, q3/q2: 64). Measured values in the comments; bounds add ~30% margin.
# real: each 2-D parameter's moment after 5 AdamW steps of a tiny byte-level Llama (conftest),
# in its own shape (rank-1 scales over its rows and columns); real-flat: the same moments
# concatenated into one 1-D chunk (the block view); synthetic: tools.bench.moments.synthetic_moments
# (2**18, seed=0) as a (1024, 256) matrix, whose rows carry the scale and columns none.
BOUNDS = {
    # (codec, signed, data): bound          measured
    ("q8", True, "real"): 0.0045,          # 0.0034
    ("q8", False, "real"): 0.0043,         # 0.0033
    ("q4", True, "real"): 0.082,           # 0.0629
    ("q4", False, "real"): 0.028,          # 0.0212
    ("q3", True, "real"): 0.16,            # 0.120
    ("q3", False, "real"): 0.058,          # 0.0443
    ("q2", True, "real"): 0.43,            # 0.328
    ("q2", False, "real"): 0.19,           # 0.147
    ("q8", True, "real-flat"): 0.0056,     # 0.0043
    ("q8", False, "real-flat"): 0.006,     # 0.0046
    ("q4", True, "real-flat"): 0.098,      # 0.0754
    ("q4", False, "real-flat"): 0.040,     # 0.0305
    ("q3", True, "real-flat"): 0.21,       # 0.165
    ("q3", False, "real-flat"): 0.09,      # 0.0693
    ("q2", True, "real-flat"): 0.53,       # 0.409
    ("q2", False, "real-flat"): 0.30,      # 0.233
    ("q8", True, "synthetic"): 0.009,      # 0.0069
    ("q8", False, "synthetic"): 0.0034,    # 0.0026
    ("q4", True, "synthetic"): 0.164,      # 0.126
    ("q4", False, "synthetic"): 0.030,     # 0.0232
    ("q3", True, "synthetic"): 0.49,       # 0.378
    ("q3", False, "synthetic"): 0.069,     # 0.0534
    ("q2", True, "synthetic"): 0.69,       # 0.530
    ("q2", False, "synthetic"): 0.23,      # 0.178
}


def _round_trip(codec: codecs.Codec, x: torch.Tensor) -> torch.Tensor:
    data = codec.encode(x)
    raw = data.numpy().tobytes() if isinstance(data, torch.Tensor) else bytes(data)
    return codec.decode(memoryview(raw), tuple(x.shape), x.dtype)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a * b).sum() / (a.norm() * b.norm()))


def _rel_err(y: torch.Tensor, x: torch.Tensor) -> float:
    return float((y.double() - x.double()).norm() / x.double().norm())


def _flat(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in xs])


def _round_trip_each(codec: codecs.Codec, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoded, original), each tensor round-tripped in its own shape, both flattened."""
    return _flat([_round_trip(codec, x) for x in xs]), _flat(xs)


@pytest.fixture(scope="module")
def synthetic() -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic_moments(1 << 18, seed=0)


def _data(kind: str, signed: bool, real_moments, synthetic) -> list[torch.Tensor]:
    """The tensors (in their chunk shapes) of one BOUNDS data kind."""
    if kind == "synthetic":
        return [synthetic[0 if signed else 1].view(1024, 256)]
    xs = [m if signed else v for m, v in real_moments]
    return xs if kind == "real" else [_flat(xs)]


@pytest.mark.parametrize("key", sorted(BOUNDS), ids=lambda k: f"{k[0]}-{'m' if k[1] else 'v'}-{k[2]}")
def test_documented_error_bound(key: tuple[str, bool, str], real_moments, synthetic) -> None:
    name, signed, kind = key
    y, x = _round_trip_each(codecs.get(name, signed=signed), _data(kind, signed, real_moments, synthetic))
    err = _rel_err(y, x)
    assert err <= BOUNDS[key], f"{name} signed={signed} on {kind}: {err:.4f} > {BOUNDS[key]}"
    # a bound far above the measurement would be a test that cannot fail
    assert err >= BOUNDS[key] / 3


@pytest.mark.parametrize("name", QUANT)
def test_more_bits_less_error_and_unsigned_keeps_every_positive(name: str, real_moments) -> None:
    yv, v = _round_trip_each(codecs.get(name, signed=False), [v for _, v in real_moments])
    assert int(((v > 0) & (yv <= 0)).sum()) == 0
    assert bool((yv >= 0).all())
    # relative error per positive element is bounded by the log grid: half a step of its row's
    # log2 range, which spans at most 256 octaves (plus 1/128 octave of rounded bounds)
    pos = v > 0
    ratio = (yv[pos] / v[pos]).log2().abs()
    assert float(ratio.max()) < 128.01 / ((1 << codecs.get(name).code_bits) - 1)


def test_error_decreases_with_bits(real_moments) -> None:
    for idx, signed in ((0, True), (1, False)):
        xs = [mv[idx] for mv in real_moments]
        errs = [_rel_err(*_round_trip_each(codecs.get(n, signed=signed), xs)) for n in QUANT]
        assert errs == sorted(errs), errs


def test_rank1_scales_beat_blockwise_on_real_moments(real_moments) -> None:
    """The reason for rank-1 scales: on real v, the matrix view errs less than the block view."""
    vs = [v for _, v in real_moments]
    for name in ("q4", "q2"):
        # 97 is prime to the 64 columns, so the block view's column maxima mean nothing
        # there and its scales are in effect per-block absmax ones
        codec = codecs.get(name, signed=False, block=97)
        matrix = _rel_err(*_round_trip_each(codec, vs))
        block = _rel_err(*_round_trip_each(codec, [v.reshape(-1) for v in vs]))
        assert matrix < 0.85 * block, (name, matrix, block)


@pytest.mark.parametrize(("shape", "block", "view"), [
    ((37, 29), 50, (37, 29)),       # natural: 66 scales, block view 22 + 50
    ((256, 64), 128, (256, 64)),    # 320 <= 2 * (128 + 128)
    ((1, 5000), 128, (40, 128)),    # one long row: the block view
    ((5000, 1), 128, (40, 128)),    # one long column: the block view
    ((1003,), 50, (21, 50)),        # 1-D: always the block view, zero-padded
    ((), 128, (1, 128)),
    ((4, 6, 10), 128, (24, 10)),    # leading dims fold into rows
])
def test_matrix_view_rule(shape: tuple[int, ...], block: int, view: tuple[int, int]) -> None:
    assert quant.matrix_shape(shape, block) == view


def _reference_decode(x: np.ndarray, bits: int, signed: bool) -> np.ndarray:
    """The documented maps on a matrix, one row at a time with an explicit level table."""
    x = x.astype(np.float32)
    out = np.zeros(x.shape, dtype=np.float64)
    rmax, cmax = np.abs(x).max(1), np.abs(x).max(0)
    for i in range(x.shape[0]):
        if signed:
            s = np.minimum(rmax[i], cmax).astype(np.float64)
            # q2: four levels without zero; wider: 2**bits - 1 levels including zero
            grid = np.linspace(-1, 1, 4 if bits == 2 else 2**bits - 1)
            companded = bits in (2, 4, 8)
            y = np.where(s > 0, np.abs(x[i]) / np.where(s > 0, s, 1), 0.0)
            y = np.sign(x[i]) * (np.sqrt(y) if companded else y)
            g = grid[np.abs(y[:, None] - grid[None, :]).argmin(1)]
            out[i] = (np.sign(g) * g * g if companded else g) * s
            continue
        if rmax[i] == 0:
            continue
        hr = math.ceil(math.log2(rmax[i]) * 128)
        hc = np.array([math.ceil(math.log2(c) * 128) if c > 0 else -32768 for c in cmax])
        ls = np.minimum(hr, hc) / 128
        pos = x[i] > 0
        rel = np.log2(np.where(pos, x[i], 1.0)) - ls
        lo = max(math.floor(rel[pos].min() * 128), -32767) / 128
        levels = np.linspace(lo, 0, 2**bits)
        k = np.abs(np.where(pos, rel, lo)[:, None] - levels[None, :]).argmin(1)
        out[i] = np.where(hc > -32768, np.maximum(2.0 ** (ls + levels[k]), 2.0**-149), 0.0)
    return out


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape", [(37, 29), (1003,)], ids=str)
def test_matches_reference_implementation(name: str, signed: bool, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(1)
    n = math.prod(shape)
    x = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))
    x = x if signed else x * x
    x[::97] = 0.0
    x = x.view(shape)
    if len(shape) == 2:
        x[:, 3] = 0.0  # an all-zero column
    x.view(-1)[5 * 29: 6 * 29] = 0.0  # an all-zero row (of the natural view)
    codec = codecs.get(name, signed=signed, block=50)
    got = _round_trip(codec, x).double().numpy().reshape(-1)
    rows, cols = quant.matrix_shape(shape, 50)
    padded = np.zeros(rows * cols, dtype=np.float32)
    padded[:n] = x.numpy().reshape(-1)
    want = _reference_decode(padded.reshape(rows, cols), codec.code_bits, signed).reshape(-1)[:n]
    # ties and last-ulp differences may pick the neighbouring level in a few elements
    close = np.isclose(got, want, rtol=1e-5, atol=0)
    assert close.mean() > 0.995, f"{(~close).sum()} of {n} differ from the reference"


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


def test_q2_keeps_the_sign_of_a_value_tiny_against_its_scale() -> None:
    """Found by the test above: at q2 (no zero level) -1 beside 1.1e15 in a block decoded to
    +1.25e14, as ``1 - |y|`` rounded to 1.0 and the tie went to the positive code."""
    x = torch.tensor([0.0, 1125899772624896.0, 1125899772624896.0, -1.0])
    y = _round_trip(codecs.get("q2", block=2), x)
    assert bool((y * x >= 0).all()) and float(y[3]) < 0


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
    # the block view: 1000 rows of 32, int16 log2 maximum and lower bound per row, int16 log2
    # maximum per column, then the codes
    expected = 4 * 1000 + 2 * 32 + x.numel() * codec.code_bits // 8
    assert len(codec.encode(x).numpy().tobytes()) == expected == codec.encoded_nbytes(x.shape)
    assert expected * 8 / x.numel() == pytest.approx(codec.bits, abs=0.02)
    signed = codecs.get(name, block=32)
    assert signed.encoded_nbytes(x.shape) == 4 * (1000 + 32) + x.numel() * codec.code_bits // 8


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
        codecs.get("q6")
    with pytest.raises(tierstore.CodecError, match="bits"):
        quant.check_params(6, 128, True)
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
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("stochastic", [False, True])
def test_compiled_kernels_match_eager(signed: bool, bits: int, stochastic: bool) -> None:
    """Inductor's kernels (used for chunks >= 1 Mi elements) encode and decode as eager does:
    the same codes up to ties, also with stochastic rounding (the same data, the same hash)."""
    m, v = synthetic_moments(1031 * 1021, seed=3)
    x = (m if signed else v).view(1031, 1021)  # the matrix view, sizes dynamic in both dims
    try:
        quant.set_compile("never")
        eager = quant.quantize(x, bits, 128, signed, stochastic=stochastic)
        quant.set_compile("always")
        compiled = quant.quantize(x, bits, 128, signed, stochastic=stochastic)
        # the two may round a tie differently; the bytes hold the same format either way
        assert eager.shape == compiled.shape
        assert float((eager != compiled).float().mean()) < 1e-3
        got = quant.dequantize(eager, x.shape, bits, 128, signed)
        quant.set_compile("never")
        want = quant.dequantize(eager, x.shape, bits, 128, signed)
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
    back = quant.dequantize(gpu, x.shape, codec.code_bits, codec.block, signed)
    assert back.is_cuda
    assert torch.allclose(back.cpu(), codec.decode(memoryview(cpu.numpy()), x.shape, x.dtype),
                          rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", QUANT)
def test_stochastic_rounding_is_unbiased(name: str) -> None:
    """Averaged over many encodes, stochastic codes land on the value: signed ones in value, so
    that an averaged state (Adam's m) is unbiased; unsigned ones in log2."""
    torch.manual_seed(0)
    x = torch.tensor([1.0, 0.3, -0.6, 0.05, -0.01, 0.7, 0.0, -1.0])
    # a second row of ones makes every column maximum 1, so every scale s_ij is exactly 1; a
    # third row of new small values per draw gives each encode its own seed (random numbers
    # are a function of the chunk's row maxima)
    sr = codecs.get(name, rounding="stochastic")

    def draws(first: torch.Tensor, top: float) -> list[torch.Tensor]:
        return [torch.stack([first, torch.full((8,), top), torch.rand(8) * 0.5 * top])
                for _ in range(3000)]
    mean = torch.stack([_round_trip(sr, m)[0] for m in draws(x, 1.0)]).mean(0)
    assert torch.allclose(mean, x, atol=0.02), (mean, x)
    nearest = _round_trip(codecs.get(name), torch.stack([x, torch.ones(8)]))[0]
    if name == "q2":  # nearest rounding is biased here: 0.7 -> 1, 0.3 -> 1/9
        assert float((nearest - x).abs().max()) > 0.25
    v = torch.tensor([1e-8, 3e-6, 1e-4, 0.02, 1.0, 7.0, 0.0, 5e-3])
    usr = codecs.get(name, signed=False, rounding="stochastic")
    logs = torch.stack([_round_trip(usr, m)[0][v > 0].log2() for m in draws(v, 7.0)]).mean(0)
    # one draw errs by at most a step of the row's log2 range (~29.4 octaves over 2**bits - 1
    # steps, ~10 octaves at q2), so the mean of 3000 has a standard deviation <= step / 2 / 55
    step = math.log2(7.0 / 1e-8) / ((1 << codecs.get(name).code_bits) - 1)
    assert torch.allclose(logs, v[v > 0].log2(), atol=max(0.1, 4 * step / 2 / 3000**0.5)), logs


def test_encodes_are_functions_of_the_data_and_leave_the_random_stream_alone() -> None:
    """Stochastic rounding draws from a hash seeded by the chunk itself: the same chunk gives
    the same bytes in any thread or run (reproducible, resumable training), another chunk other
    random numbers, and torch's generator is never touched."""
    x = torch.randn(64, 64)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    sr = codecs.get("q2", rounding="stochastic")
    a = sr.encode(x)
    codecs.get("q4").encode(x)
    assert torch.equal(torch.rand(4), expected)
    assert torch.equal(sr.encode(x.clone()), a)
    y = x.clone()
    y[7, 7] = y.abs().max() * 1.5  # a new row maximum: a new seed
    b = sr.encode(y)
    assert float((a != b).float().mean()) > 0.2  # the codes are re-drawn, not one changed


def test_stochastic_rounding_spec_and_levels() -> None:
    sr = codecs.get("q4", signed=False, rounding="stochastic")
    assert codecs.from_spec(sr.spec()) == sr != codecs.get("q4", signed=False)
    with pytest.raises(tierstore.CodecError, match="rounding"):
        codecs.get("q4", rounding="up")
    # values on the grid never move, whatever the draw
    levels = torch.tensor([-1.0, 0.0, 1.0, 0.0, -1.0] * 20)
    assert torch.equal(_round_trip(codecs.get("q2", rounding="stochastic", block=5), levels),
                       levels)


@pytest.mark.parametrize(("target", "power"), [("value", 1.0), ("rsqrt", -0.5)])
def test_v_rounding_ablation_targets_are_unbiased(monkeypatch: pytest.MonkeyPatch, target: str,
                                                  power: float) -> None:
    """The ablation hook behind tools.bench.moment_stats --v-target: stochastic codes of v are
    unbiased in v ** power (the codecs' own target, log2, is tested above)."""
    monkeypatch.setattr(quant, "V_STOCHASTIC_TARGET", target)
    # 12.8 octaves over q2's 3 steps: levels 19x apart, so that 2000 draws pin the mean down
    v = torch.tensor([1e-3, 3e-3, 0.01, 0.05, 1.0, 7.0, 2.5, 5e-3])
    usr = codecs.get("q2", signed=False, rounding="stochastic")
    draws = [torch.stack([v, torch.full((8,), 7.0), torch.rand(8) * 3.5]) for _ in range(2000)]
    got = torch.stack([_round_trip(usr, d)[0] ** power for d in draws]).mean(0)
    assert torch.allclose(got, v**power, rtol=0.15), (got, v**power)
    # and not in log2: the mean log lands below (value, by Jensen) or above (rsqrt) the value's
    logs = torch.stack([_round_trip(usr, d)[0].log2() for d in draws[:500]]).mean(0)
    mid = (v > 1e-3) & (v < 7.0)  # strictly between two of the row's levels
    assert bool(((logs - v.log2()) * (1 if power > 0 else -1) < 0)[mid].all()), logs - v.log2()


@pytest.mark.parametrize("name", QUANT)
def test_calibrated_rounding_keeps_the_norm_and_the_update_length(name: str, real_moments) -> None:
    """rounding="calibrated": stochastic codes with one gain per chunk folded into the scales.
    Signed: the decoded chunk has the input's L2 norm (stochastic rounding's is longer: its
    noise is orthogonal to the value). Unsigned: mean(v / v_decoded) is 1 to within the
    1/128-octave grain of the stored log2 scales (what keeps sum(m**2 / v) of the update)."""
    m, v = max(real_moments, key=lambda mv: mv[0].numel())
    cal, sr = codecs.get(name, rounding="calibrated"), codecs.get(name, rounding="stochastic")
    dm, dm_sr = _round_trip(cal, m), _round_trip(sr, m)
    assert float(dm.norm() / m.norm()) == pytest.approx(1.0, abs=1e-4)
    if name != "q8":  # q8's noise is below 0.1% of the norm
        assert float(dm_sr.norm() / m.norm()) > 1.001
    # the same codes as stochastic rounding, only the scales differ: the same signs and zeros
    assert torch.equal(torch.sign(dm), torch.sign(dm_sr))
    ucal = codecs.get(name, signed=False, rounding="calibrated")
    dv = _round_trip(ucal, v)
    pos = v > 0
    assert float((v[pos] / dv[pos]).mean()) == pytest.approx(1.0, abs=2 ** (1 / 256) - 1 + 1e-4)
    assert bool((dv[pos] > 0).all())  # the zero-point guarantee holds
    # decoding is the same for every rounding: a plain codec reads calibrated bytes alike
    data = cal.encode(m)
    plain = codecs.get(name).decode(memoryview(data.numpy()), tuple(m.shape), m.dtype)
    assert torch.equal(plain, dm)
    assert torch.equal(cal.encode(m.clone()), data)  # a function of the chunk, as stochastic


def test_calibrated_rounding_edge_cases() -> None:
    """All-zero and constant chunks keep their exact decodes; the spec round-trips."""
    for signed in (True, False):
        cal = codecs.get("q2", signed=signed, rounding="calibrated", block=8)
        assert codecs.from_spec(cal.spec()) == cal
        assert torch.equal(_round_trip(cal, torch.zeros(4, 8)), torch.zeros(4, 8))
        assert torch.equal(_round_trip(cal, torch.full((4, 8), 0.5)), torch.full((4, 8), 0.5))
    with pytest.raises(tierstore.CodecError, match="rounding"):
        quant.quantize(torch.ones(8), 4, 8, True, mode="random")


def test_auto_compiles_a_kernel_once_its_eager_work_repays_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small chunks run eagerly until their kernel has covered COMPILE_AFTER_ELEMENTS elements
    (an optimizer state re-encoded every step), then that kernel alone is compiled."""
    built: list[tuple] = []

    def fake_compile(fn, options=None):  # records what would be compiled; runs eagerly
        built.append(fn)
        return fn
    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(quant, "_COMPILED", {})
    monkeypatch.setattr(quant, "_EAGER_ELEMENTS", {})
    monkeypatch.setattr(quant, "COMPILE_AFTER_ELEMENTS", 3000)
    x = torch.randn(32, 40)  # 1280 elements; codes packed by the kernel (``encode_into``)
    for _ in range(3):
        quant.quantize(x, 4, 128, True)
    assert not built  # eager while fewer than 3000 elements were done before the call
    assert quant._EAGER_ELEMENTS[("encode_into", 4, True, "nearest", "", "rank1")] == 2560 + 1280
    quant.quantize(x, 4, 128, True)
    assert list(quant._COMPILED) == [(("encode_into", 4, True, "nearest", "", "rank1"), False)]
    quant.set_compile("never")
    try:
        quant.quantize(x.abs(), 4, 128, False)
        assert all(k[0] != ("encode_into", 4, False, "nearest", "", "rank1") for k in quant._COMPILED)
    finally:
        quant.set_compile("auto")


def test_small_chunks_run_a_kernel_compiled_for_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk under PARALLEL_MIN_ELEMENTS runs a twin compiled with ``cpp.threads=1`` (no OpenMP
    region to wait in on busy cores); a larger one the kernel with the default thread count."""
    built: list[dict | None] = []

    def fake_compile(fn, options=None):
        built.append(options)
        return fn
    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(quant, "_COMPILED", {})
    monkeypatch.setattr(quant, "PARALLEL_MIN_ELEMENTS", 1000)
    quant.set_compile("always")
    try:
        small, large = torch.randn(16, 32), torch.randn(64, 32)  # 512 and 2048 elements
        for x in (small, small, large, large):
            quant.dequantize(quant.quantize(x, 8, 32, True), x.shape, 8, 32, True)
    finally:
        quant.set_compile("auto")
    assert built == [{"cpp.threads": 1}, {"cpp.threads": 1}, None, None]  # encode, decode each
    assert sorted(threaded for _, threaded in quant._COMPILED) == [False, False, True, True]


def test_q5_packs_five_bit_planes_and_beats_q4() -> None:
    """5-bit codes: 8 codes a 40-bit word, in 5 byte planes (the 3-bit layout, wider)."""
    codes = torch.randint(0, 32, (64,), dtype=torch.uint8)
    packed = quant._pack(codes, 5)
    q = 8
    words = [sum(int(codes[j + k * q]) << (5 * k) for k in range(8)) for j in range(q)]
    assert packed.tolist() == [(w >> (8 * b)) & 255 for b in range(5) for w in words]
    assert torch.equal(quant._unpack(packed, 5), codes)
    m, _ = synthetic_moments(1 << 16, seed=0)
    x = m.view(256, 256)
    q5, q4 = codecs.get("q5"), codecs.get("q4")
    assert _rel_err(_round_trip(q5, x), x) < 0.6 * _rel_err(_round_trip(q4, x), x)
    assert q5.encoded_nbytes(x.shape) == 4 * 512 + x.numel() * 5 // 8


def test_dynamic_exponent_map_with_block_scales() -> None:
    """signed_map="de" is Li et al.'s 4-bit map; scales="absmax" stores row maxima only (a new
    name: 0.1.0's per-block layout, which had no name, stays refused)."""
    levels = quant.de_levels(4)
    assert len(levels) == 16 and levels[0] == -0.8875 and levels[-1] == 1.0 and 0.0 in levels
    assert min(abs(v) for v in levels if v) == pytest.approx(0.0055)
    codec = codecs.get("q4", signed_map="de", scales="absmax")
    assert codec.spec()["signed_map"] == "de" and codecs.from_spec(codec.spec()) == codec
    x = torch.randn(300, 128) * torch.logspace(-6, 0, 128)
    assert codec.encoded_nbytes(x.shape) == 4 * 300 + 300 * 128 // 2  # no column scales
    y = _round_trip(codec, x)
    s = x.abs().amax(dim=1, keepdim=True)
    # every value decodes to a level of the map times its row's maximum, the nearest one
    table = torch.tensor(levels)
    want = table[(x / s - table[:, None, None]).abs().argmin(0)] * s
    assert torch.allclose(y, want, rtol=1e-6, atol=0)


def test_dithered_rounding_is_unbiased_and_decodes_only_with_its_dither() -> None:
    x = torch.tensor([1.0, 0.3, -0.6, 0.05, -0.01, 0.7, 0.0, -1.0])
    dither = codecs.get("q4", rounding="dither")
    torch.manual_seed(0)
    draws = [torch.stack([x, torch.ones(8), torch.rand(8) * 0.5]) for _ in range(2000)]
    mean = torch.stack([_round_trip(dither, d)[0] for d in draws]).mean(0)
    assert torch.allclose(mean, x, atol=0.01), mean
    m, _ = synthetic_moments(1 << 16, seed=1)
    big = m.view(256, 256)
    data = dither.encode(big)
    back = dither.decode(memoryview(data.numpy()), (256, 256), torch.float32)
    plain = codecs.get("q4").decode(memoryview(data.numpy()), (256, 256), torch.float32)
    assert _rel_err(back, big) < _rel_err(plain, big)  # the decoder takes the dither off
    with pytest.raises(tierstore.CodecError, match="dither"):
        codecs.get("q4", signed=False, rounding="dither")


def test_dither_corrections_take_off_the_bias_and_shorten_the_chunk() -> None:
    """correction="bias": the square-root map's dithered decode is unbiased in value beyond a step
    of zero (the plain one is biased outwards by h**2 / 3 of the scale); "norm" also shortens the decoded chunk by
    the dither's expected noise energy. Both are named in the spec; the bytes are the same."""
    plain = codecs.get("q4", rounding="dither")
    bias = codecs.get("q4", rounding="dither", correction="bias")
    h = 1.0 / 14  # half a step of q4's companded grid
    for value in (0.3, -0.6, 0.7, 0.02, -0.001):
        # 511 x 511 copies of ``value``, each scaled by 1 (a first row and column of ones)
        t = torch.full((512, 512), value)
        t[0, :], t[:, 0] = 1.0, 1.0
        mean_plain = float(_round_trip(plain, t)[1:, 1:].mean())
        mean_bias = float(_round_trip(bias, t)[1:, 1:].mean())
        if abs(value) ** 0.5 > 2 * h:  # inside the grid: the plain decode is h**2 / 3 too far out
            assert (mean_plain - value) * math.copysign(1, value) == pytest.approx(h * h / 3, abs=3e-4)
            assert abs(mean_bias - value) < 3e-4, (value, mean_bias)
        else:  # within a step of zero the correction is linear, an approximation: less bias
            assert abs(mean_bias - value) < 0.75 * abs(mean_plain - value), (value, mean_bias)
    m, _ = synthetic_moments(1 << 16, seed=1)
    big = m.view(256, 256)
    norm = codecs.get("q4", rounding="dither", correction="norm")
    data = plain.encode(big)
    assert torch.equal(data, norm.encode(big)) and torch.equal(data, bias.encode(big))
    dec = {c.correction: c.decode(memoryview(data.numpy()), (256, 256), torch.float32)
           for c in (plain, bias, norm)}
    assert dec["norm"].norm() < dec["bias"].norm() < dec[None].norm()
    assert _cos(dec["norm"], dec["bias"]) > 0.99999  # one gain for the chunk
    for c in (bias, norm):
        assert c.spec()["correction"] == c.correction and codecs.from_spec(c.spec()) == c
    assert "correction" not in plain.spec()
    with pytest.raises(tierstore.CodecError, match="correction must be one of"):
        codecs.get("q4", rounding="stochastic", correction="bias")
    with pytest.raises(tierstore.CodecError, match="correction must be one of"):
        codecs.get("q4", rounding="dither", correction="gain")


def test_new_formats_are_new_spec_values_and_old_specs_read_unchanged() -> None:
    """A spec without signed_map is the width's own map (what older releases wrote); naming that
    map keeps the spec as it was; the new values are refused by older readers by name."""
    old = {"name": "q4", "signed": True, "block": 128, "rounding": "stochastic", "scales": "rank1"}
    assert codecs.from_spec(old).spec() == old
    assert codecs.get("q4", signed_map="sqrt").spec() == codecs.get("q4").spec()
    assert codecs.get("q3", signed_map="linear").spec() == codecs.get("q3").spec()
    with pytest.raises(tierstore.CodecError, match="signed_map must be one of"):
        codecs.get("q4", signed_map="log")
    with pytest.raises(tierstore.CodecError, match="scales must be one of"):
        codecs.from_spec({**old, "scales": "tiles"})


@pytest.mark.parametrize("compile_mode, bits", [
    ("never", 2), ("never", 3), ("never", 4), ("never", 8),
    # compiled only where the planes are read in place (3 and 8 bits unpack as before)
    pytest.param("always", 2, marks=pytest.mark.slow), pytest.param("always", 4, marks=pytest.mark.slow)])
def test_decoding_into_a_buffer_equals_a_fresh_decode(compile_mode: str, bits: int) -> None:
    """``dequantize(out=)`` writes the values a fresh decode returns into the caller's buffer:
    code planes read in place (rows a multiple of the planes), codes unpacked first (odd rows),
    or a copy (the block view's padded last row); a buffer of the wrong size or dtype is refused."""
    m, v = synthetic_moments(64 * 128, seed=5)
    try:
        quant.set_compile(compile_mode)
        for shape in [(64, 128), (63, 128), (1000,)]:
            n = math.prod(shape)
            for x, signed, mode in [(m, True, "dither"), (m, True, "stochastic"), (v, False, "stochastic")]:
                x = x[:n].reshape(shape)
                enc = quant.quantize(x, bits, 128, signed, mode=mode)
                want = quant.dequantize(enc, shape, bits, 128, signed, mode=mode)
                out = torch.full(shape, float("nan"))
                got = quant.dequantize(enc, shape, bits, 128, signed, mode=mode, out=out)
                assert got.data_ptr() == out.data_ptr() and torch.equal(out, want)
        enc = quant.quantize(v.view(64, 128), bits, 128, False)
        for bad in (torch.empty(8192, dtype=torch.float64), torch.empty(8191)):
            with pytest.raises(tierstore.CodecError, match="float32 tensor of 8192 elements"):
                quant.dequantize(enc, (64, 128), bits, 128, False, out=bad)
    finally:
        quant.set_compile("auto")


def test_a_store_decodes_whole_quantized_chunks_in_place_and_edge_chunks_through_a_copy(tmp_path) -> None:
    """A get or an update of a coded tensor decodes each whole chunk straight into its place in
    the result (``Codec.decode_into``); the edge chunk, padded, goes through a chunk of its own.
    Both read back what a plain decode of the same bytes gives."""
    m, _ = synthetic_moments(301 * 128, seed=6)
    x = m.view(301, 128)
    codec = codecs.get("q4", signed=True, rounding="dither")
    calls: list[int] = []
    real = type(codec).decode_into

    def counting(self, data, shape, dtype, out):  # type: ignore[no-untyped-def]
        calls.append(out.numel())
        return real(self, data, shape, dtype, out)

    with tierstore.open(tmp_path / "s", "w", chunk_bytes=64 * 128 * 4, device="cpu") as s:
        s.put("m", x, codec=codec)
        grid = s.async_store._head["m"].grid
        rows = grid.chunk_numel // 128
        whole = 301 // rows
        assert 0 < whole < grid.n_chunks  # whole chunks and a padded edge one
        type(codec).decode_into = counting  # type: ignore[method-assign]
        try:
            got = s.get("m")
            with s.update("m") as t:
                t.mul_(2)
        finally:
            type(codec).decode_into = real  # type: ignore[method-assign]
        assert calls == [grid.chunk_numel] * (2 * whole)
        want = torch.cat([codec.decode(memoryview(codec.encode(x[i:i + rows].contiguous()).numpy()),
                                       (rows, 128), torch.float32) for i in range(0, 301, rows)
                          if i + rows <= 301])
        assert torch.equal(got[: whole * rows], want)
        assert torch.allclose(got, x, atol=float(x.abs().max()) * 0.2)


@pytest.mark.parametrize("compile_mode", ["never", pytest.param("always", marks=pytest.mark.slow)])
@pytest.mark.parametrize("bits", [2, 4])
def test_codes_packed_by_the_kernel_are_the_planar_bytes_of_the_codes(compile_mode: str, bits: int) -> None:
    """Where each code plane is whole rows the encoder packs as it quantizes, into the payload;
    the bytes are the scales and ``_pack`` of the codes the unpacked kernel makes, as before."""
    m, v = synthetic_moments(64 * 128, seed=7)
    try:
        quant.set_compile(compile_mode)
        for x, signed, mode in [(m, True, "dither"), (m, True, "nearest"), (v, False, "stochastic")]:
            xm = x.view(64, 128)
            rows, cols, codes, _, _ = quant._run("encode", xm.numel(), bits, signed, mode, xm)
            dtype = torch.float32 if signed else torch.int16
            want = torch.cat([rows.to(dtype).view(-1).view(torch.uint8),
                              cols.to(dtype).view(-1).view(torch.uint8),
                              quant._pack(codes.reshape(-1), bits)])
            assert torch.equal(quant.quantize(xm, bits, 128, signed, mode=mode), want)
    finally:
        quant.set_compile("auto")
