"""``q8``/``q4``/``q3``/``q2``: rank-1-scaled quantization of optimizer states, as vectorized torch.

Scales. A chunk is quantized as a matrix: its natural one, ``(numel // shape[-1], shape[-1])``,
unless that has more than twice the rows plus columns of the *block view*
``(ceil(numel / block), block)`` (the flat chunk cut into rows of ``block`` elements,
zero-padded), which it then uses; 1-D and 0-d chunks always use the block view. Every
row and every column gets its maximum magnitude; element ``(i, j)`` is scaled by
``s_ij = min(row_i, col_j)``, the rank-1 normalization of Li, Chen, Zhu 2023 ("Memory Efficient
Optimizers with 4-bit States"). ``s_ij`` is an upper bound of ``|x_ij|`` that is tight wherever
the row or the column holds a large value, so a whole row of large entries no longer flattens a
block of small ones into one level (on captured AdamW ``v`` at q4: relative L2 error 0.005 against
0.06 for blockwise absmax with the same levels). In the block view the row maxima are exactly
the blockwise absmax scales, so the block view is never looser than per-block scaling.

Two maps, chosen by ``signed``:

* signed (Adam's first moment ``m``): ``y = x / s`` in ``[-1, 1]`` on a symmetric grid. q8, q4
  and q3 use ``2**bits - 1`` evenly spaced levels that include zero (the top code is unused); q2
  uses all four codes, levels ``-1, -1/3, 1/3, 1``. For q8, q4 and q2 the grid is on
  ``sign(y) * sqrt(|y|)``, decoded as ``sign(g) * g**2 * s``: square-root companding spends
  levels near zero, where heavy-tailed moments live, as bitsandbytes' dynamic map does, but is
  plain arithmetic both ways (q2's levels are thus ``+-1/9`` and ``+-1`` of ``s``); q3 uses the
  grid on ``y`` itself. Zero is a level at q3 and up on purpose: a grid without it decodes a tiny
  ``m`` to a fixed fraction of ``s``, which with a tiny ``v`` makes a large update; rounding a
  small ``m`` to zero only delays its update. At q2 the fourth level is worth more: with
  stochastic rounding, ternary ``-1, 0, 1`` injects about twice the update noise of the four
  levels (noise energy / update energy per step on captured AdamW moments: 2.18 vs 1.04), which
  cost 4% of final loss in ``tools.bench.convergence``. Scales are stored as float32. Exact
  zeros round-trip at q3 and up (at q2 next to nonzero values they decode to ``+-s/9``); an
  all-zero row or column decodes to zeros.
* unsigned (Adam's second moment ``v``): everything in log2. Row and column maxima are stored as
  int16 ``ceil(log2(max) * 128)`` (1/128 octave, rounded up so that ``s_ij >= x_ij``); per row,
  ``lo_i`` = the floor of the smallest ``log2(x_ij / s_ij)`` over its positive values (int16, the
  same units, at least -256 octaves). ``log2(x_ij / s_ij)``, in ``[lo_i, 0]``, is rounded to
  ``2**bits`` levels evenly between ``lo_i`` and 0. A positive value therefore never decodes to
  zero (the zero-point problem of Li et al.; decoded values are also floored at float32's
  smallest subnormal) and small values keep their relative precision at 2-3 bits (the log map of
  SOLO 2025). An exact zero in a row or column with positive values decodes to the row's lowest
  level; a row or column with none decodes to zeros. Negative input raises CodecError.

Stochastic rounding (the codecs' ``rounding="stochastic"``, which the trainer uses for moments)
rounds up or down at random so that the decoded value is unbiased for signed data and its log2
for unsigned data; its uniform numbers come from a counter hash of the element index plus a seed
taken from the chunk's own row maxima. An encode is thus a function of its input: the same chunk
encodes to the same bytes on any thread, in any run, and after a resume (training stays
reproducible bit for bit), and torch's random stream is never touched. An optimizer state
changes every step, and so does its seed.

Calibrated rounding (``rounding="calibrated"``, an ablation, not the policy's):
stochastic codes, then one gain per chunk folded into both scale vectors, exactly (signed:
float32 maxima times the gain) or to 1/128 octave (unsigned: the log2 maxima shifted), so that
the layout and the decoder are unchanged: a signed chunk decodes with the input's L2 norm, an
unsigned one with mean(v / v_decoded) = 1.

Both modes reject NaN and +-inf with CodecError (an optimizer state holding them is already
broken; storing them silently would hide it). Input is float32, bfloat16 or float16; decode
returns float32. Stored bytes, for a ``rows x cols`` matrix: signed ``[row maxima, float32]
[column maxima, float32][codes]``; unsigned ``[row log2 maxima, int16][row lo, int16][column log2
maxima, int16][codes]``. The ``rows * cols`` codes (rounded up to a multiple of 8 with zero
codes) are packed in planes so that every kernel reads and writes contiguous memory: with
P = 8 // bits, byte j of the 2/4-bit codes holds codes j, j + N/P, ... from the low bits up;
3-bit codes form N/8 24-bit words, word j holding codes j + k*N/8 at bit 3k, stored as three
planes (low, middle, high bytes). Bits per element: ``bits`` plus the scales, ``32 / block``
for long chunks in the block view, less in the matrix view of a wide chunk.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tierstore.errors import CodecError

SUPPORTED_BITS = (2, 3, 4, 5, 8)
# log2 scales are int16 in units of 1/128 octave: fp32's positive range, log2 in [-149, 128),
# fits, and 1/128 octave (0.54%) is well under the finest q8 step on real moments
LOG_UNITS = 128
# signed widths on a square-root companded grid; q3 uses the linear grid, since with 7 levels
# companding leaves too few for mid-sized values (relative L2 error on captured AdamW m, block
# 128: q3 0.26 companded vs 0.20 linear; at q4 0.110 vs 0.093, where companding is kept for the
# relative precision of small values)
COMPANDED_BITS = (2, 4, 5, 8)
#: maps of the signed grid: "sqrt" (the companded grid), "linear", "de" (dynamic exponent); the
#: width's default is sqrt, linear at q3 (COMPANDED_BITS)
SIGNED_MAPS = ("sqrt", "linear", "de")
#: scale layouts: "rank1" (row and column maxima, min of the two) or "absmax" (the block view
#: always, each row of ``block`` elements scaled by its own maximum only: the per-block absmax
#: of Li et al. and bitsandbytes)
SCALE_LAYOUTS = ("rank1", "absmax")
# largest log2 maximum (in LOG_UNITS) whose power of two is a finite float32
MAX_LOG = 128 * LOG_UNITS - 1
# lowest per-row lower bound (in LOG_UNITS): 256 octaves below the scale, past any float32 ratio
# that matters; rarer values still decode positive, just rounded up
MIN_LO = -32767
# smallest positive subnormal float32: the floor for divisors and for decoded unsigned values
FLOAT32_TINY = 2.0**-149
# marks a row or column with no positive value in unsigned mode; it decodes to zeros
EMPTY = -32768


def default_map(bits: int) -> str:
    """The signed map a width uses when its spec names none (the format before maps were named)."""
    return "sqrt" if bits in COMPANDED_BITS else "linear"


def de_levels(bits: int) -> list[float]:
    """The signed dynamic-exponent map of ``bits`` bits, ascending, in [-1, 1]: bitsandbytes'
    ``create_dynamic_map(signed=True, max_exponent_bits=bits - 1, total_bits=bits)`` as the 4-bit
    optimizer paper (Li et al. 2023) uses it for m. Per decade 10**-e, for e = bits-2 .. 0, the
    midpoints of 2**(bits-2-e) equal steps of [0.1, 1] times 10**-e, each with both signs; then 0
    and 1. At 4 bits: 0, +-0.0055, +-0.0325, +-0.0775, +-0.2125, +-0.4375, +-0.6625, +-0.8875,
    1: dense near zero, where most of a block's m values sit.
    """
    exp_bits = bits - 1
    out = [0.0, 1.0]
    for i in range(exp_bits):
        items = 2 ** i + 1
        bounds = [0.1 + 0.9 * k / (items - 1) for k in range(items)]
        means = [(a + b) / 2 for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        scale = 10.0 ** (-(exp_bits - 1) + i)
        out += [scale * m for m in means] + [-scale * m for m in means]
    return sorted(out)


def check_params(bits: int, block: int, signed: bool, signed_map: str | None = None,
                 scales: str = "rank1") -> None:
    """Raise CodecError naming the rule that ``bits``, ``block``, ``signed``, ``signed_map`` or
    ``scales`` breaks."""
    if signed_map is not None and signed_map not in SIGNED_MAPS:
        raise CodecError(f"quantization signed_map must be one of {SIGNED_MAPS}, got {signed_map!r}")
    if signed_map == "de" and bits not in (3, 4, 5):
        raise CodecError(f"the dynamic-exponent map is built for 3-5 bits, not {bits}")
    if scales not in SCALE_LAYOUTS:
        raise CodecError(f"quantization scales must be one of {SCALE_LAYOUTS}, got {scales!r}")
    if bits not in SUPPORTED_BITS or isinstance(bits, bool):
        raise CodecError(f"quantization bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise CodecError(f"quantization block must be a positive int, got {block!r}")
    if not isinstance(signed, bool):
        raise CodecError(f"quantization `signed` must be a bool, got {signed!r}")


def matrix_shape(shape: Sequence[int], block: int, scales: str = "rank1") -> tuple[int, int]:
    """(rows, cols) of the matrix a chunk of ``shape`` is quantized as (see the module doc)."""
    n = math.prod(shape)
    blocks = -(-n // block)
    if scales == "rank1" and len(shape) >= 2 and shape[-1] > 0:
        cols = int(shape[-1])
        rows = n // cols
        # the natural rows and columns carry the tensor's structure (a row of an embedding,
        # a column of a projection), worth up to twice the scales; (1, n) or (n, 1) are not
        if rows + cols <= 2 * (blocks + block):
            return rows, cols
    return blocks, block


def scale_nbytes(rows: int, cols: int, signed: bool, scales: str = "rank1") -> int:
    """Bytes of the row and column scales (and, unsigned, the row lower bounds)."""
    cols = cols if scales == "rank1" else 0  # block scales: row maxima only
    return 4 * (rows + cols) if signed else 4 * rows + 2 * cols


def encoded_nbytes(shape: Sequence[int], bits: int, block: int, signed: bool,
                   scales: str = "rank1") -> int:
    """Stored bytes of a chunk of ``shape``: scales plus packed codes (0 for an empty chunk)."""
    rows, cols = matrix_shape(shape, block, scales)
    if rows * cols == 0:
        return 0
    return scale_nbytes(rows, cols, signed, scales) + -(-rows * cols // 8) * bits


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (count a multiple of 8, each < 2**bits) into bytes, planar layout."""
    if bits == 8:
        return codes
    if bits in (3, 5):
        # planes of contiguous codes, not neighbours: strided gathers would not vectorize
        c = codes.view(8, -1).to(torch.int64)
        word = c[0]
        for i in range(1, 8):  # 8 fixed lanes, not a loop over rows
            word = word | (c[i] << (bits * i))
        return torch.stack([(word >> (8 * b)) & 255 for b in range(bits)]).to(torch.uint8).view(-1)
    c = codes.view(8 // bits, -1)
    out = c[0]
    for i in range(1, 8 // bits):
        out = out | (c[i] << (bits * i))
    return out


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``_pack``: all the codes the bytes hold."""
    if bits == 8:
        return packed
    if bits in (3, 5):
        b = packed.view(bits, -1).to(torch.int64)
        word = b[0]
        for i in range(1, bits):
            word = word | (b[i] << (8 * i))
        mask = (1 << bits) - 1
        return torch.stack([(word >> (bits * i)) & mask for i in range(8)]).to(torch.uint8).view(-1)
    mask = (1 << bits) - 1
    return torch.stack([(packed >> (bits * i)) & mask for i in range(8 // bits)]).view(-1)


# an odd multiplier below 2**31, so that 32-bit products stay inside int64 (no overflow, which
# is undefined behaviour in the C++ inductor emits); with xor-shifts it mixes 32 bits well
_HASH_MUL = 0x45D9F3B
_MASK32 = 0xFFFFFFFF


def _uniform(like: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) float32 of ``like``'s shape: a counter hash of (element index + seed).

    Not ``torch.rand_like``: inductor's CPU code for it ran at 0.55 GB/s of fp32 input, a
    quarter of the rest of the encoder; integer hashing vectorizes (and is the same in eager
    and compiled kernels, on CPU and CUDA). 24 random bits per value.
    """
    idx = torch.arange(like.numel(), device=like.device, dtype=torch.int64).view(like.shape)
    h = (idx + seed) & _MASK32
    h = h ^ (h >> 16)
    h = (h * _HASH_MUL) & _MASK32
    h = h ^ (h >> 16)
    h = (h * _HASH_MUL) & _MASK32
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def _data_seed(row_max: torch.Tensor) -> torch.Tensor:
    """A 31-bit seed from the bit patterns of a chunk's float32 row maxima (see the module doc)."""
    # 31-bit terms: the int64 sum cannot overflow below 2**32 rows; the mantissas' low bits
    # change with any change of a maximum
    bits = row_max.contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    return bits.sum() & 0x7FFFFFFF


#: ablation hook, not API (``tools.bench.moment_stats --v-target``): what stochastic rounding of an
#: unsigned value is unbiased in. "log2" (used) is the compromise: "value" keeps the averaged
#: v unbiased but, by Jensen, inflates 1/sqrt(v) (q2, v alone coded, 1.1M-param run: update
#: magnitude 1.70x fp32's, against 1.11x), and "rsqrt" (unbiased in the update's divisor) lets
#: v drift upwards through the average (v mean +102% vs +66%, update 0.91x). Read when a kernel
#: is built: compiled kernels keep the value they were compiled with.
V_STOCHASTIC_TARGET = "log2"
_LN2 = math.log(2.0)


def _round(t: torch.Tensor, seed: torch.Tensor | None) -> torch.Tensor:
    """Nearest, or with a ``seed`` stochastic rounding (up with probability the fraction)."""
    return t.round() if seed is None else (t + _uniform(t, seed)).floor()


def _signed_levels(bits: int) -> int:
    """Levels of the signed grid: 4 at q2 (no zero), else 2**bits - 1 (zero included)."""
    return 4 if bits == 2 else (1 << bits) - 1


# q2's inner level, as a fraction of the scale: (1/3)**2 on the companded grid
_Q2_INNER = 1.0 / 9.0


def _stochastic_q2(y: torch.Tensor, neg: torch.Tensor, u: torch.Tensor, a: float = _Q2_INNER
                   ) -> torch.Tensor:
    """q2 codes (0..3 for -1, -a, a, 1) of magnitudes ``y``, unbiased in value (``a`` = 1/9 on
    the companded grid, 1/3 on the linear one).

    Above a a value rounds between a and 1; below it, between -a and +a of its sign
    (the grid has no zero), keeping its own sign with probability (y + a) / (2a).
    """
    up = (u < (y - a) / (1.0 - a)).to(y.dtype)
    flip = (u >= (y + a) / (2.0 * a)).to(y.dtype)
    same_sign = torch.where(y >= a, 2.0 + up, 2.0 - flip)  # 3: 1, 2: 1/9, 1: -1/9 (signed)
    return torch.where(neg, 3.0 - same_sign, same_sign)


def _log_max(x: torch.Tensor, dim: int) -> torch.Tensor:
    """ceil(log2(max) * LOG_UNITS) along ``dim``, capped finite; EMPTY where the max is 0."""
    xmax = x.amax(dim=dim)
    # capped so that 2**max stays finite; the few values above 2**127.99 take the top code
    return torch.where(xmax <= 0, EMPTY, torch.ceil(torch.log2(xmax) * LOG_UNITS).clamp_max(MAX_LOG))


def _signed_value(k: torch.Tensor, bits: int, smap: str, u: torch.Tensor | None) -> torch.Tensor:
    """Codes (float) -> values in units of the scale; ``u`` the dither to subtract, if any."""
    if smap == "de":
        table = torch.tensor(de_levels(bits), dtype=torch.float32, device=k.device)
        return table[k.long()]
    step = 2.0 / (_signed_levels(bits) - 1)
    y = k * step - 1.0
    if u is not None:  # subtractive dither: the encoder added u - 1/2 codes before rounding
        y = y - (u - 0.5) * step
    return y * y.abs() if smap == "sqrt" else y


#: decoder corrections of dithered signed chunks (the codecs' ``correction``; see
#: ``_dither_corrected``)
DITHER_CORRECTIONS = ("bias", "norm")
#: ``correction="norm"`` takes this many times the dither's expected noise energy off the decoded
#: chunk's squared norm. One time is the noise a single round trip adds; an ``m`` re-coded every
#: step carries more (about beta1**2 / (1 - beta1**2) = 4.3 steps' worth at beta1 0.9), but a
#: shrink applied every step also compounds through the average, so the factor is measured, not
#: derived: at 2, q4's coded AdamW update is as long as fp32's (tools.bench.moment_stats, 1.1M
#: params, lr 3e-3: ratio 1.000; 1.017 at 1.5, 1.032 at 1).
NORM_NOISE_FACTOR = 2.0


def _dither_corrected(k: torch.Tensor, bits: int, smap: str, u: torch.Tensor, s: torch.Tensor,
                      norm: bool) -> torch.Tensor:
    """Dithered codes ``k`` (float) -> values, the dither ``u`` taken off, with the dither's bias
    removed and, with ``norm``, the chunk shortened by its expected noise (see
    ``DITHER_CORRECTIONS``).

    On the square-root map the decoder squares a value that carries the dither's error e
    (uniform in (-h, h), h half a step): E[z|z|] = t|t| + sign(t) h**2 / 3 for |t| >= h, an
    outward bias of every value (``m``'s gain 1.018 over 100 AdamW steps), taken off here;
    within h of zero (values under about h**2 of the scale) the bias is taken off linearly, an
    approximation that leaves part of it (0.001 of the scale decodes to 0.0017 on average,
    0.0024 uncorrected). The noise of a value is about
    (2 |z| e)**2, expected 4 z**2 h**2 / 3 + h**4 / 5; ``norm`` scales the chunk so that its
    squared norm loses NORM_NOISE_FACTOR times the sum of that (at most by half).
    """
    step = 2.0 / (_signed_levels(bits) - 1)
    h = step / 2
    z = k * step - 1.0 - (u - 0.5) * step
    if smap == "sqrt":
        a = z.abs()
        val = z * a - torch.sign(z) * torch.minimum(a * (h / 3), torch.full_like(a, h * h / 3))
        noise = z * z * (4 * h * h / 3) + h**4 / 5
    else:  # the linear map: subtractive dither is unbiased in value
        val = z
        noise = torch.full_like(z, h * h / 3)
    out = val * s
    if norm:
        e2 = (out * out).sum()
        var = (noise * s * s).sum()
        c = torch.sqrt(((e2 - NORM_NOISE_FACTOR * var) / e2.clamp_min(FLOAT32_TINY)).clamp(0.25, 1.0))
        out = out * c
    return out


def _de_codes(yv: torch.Tensor, bits: int, u: torch.Tensor | None) -> torch.Tensor:
    """Codes of signed values ``yv`` (in [-1, 1]) on the dynamic-exponent map: nearest level,
    or with ``u`` stochastic between the two levels around each value, unbiased in value."""
    table = de_levels(bits)
    if u is None:
        codes = torch.zeros_like(yv)
        for lo, hi in zip(table[:-1], table[1:], strict=True):  # 2**bits - 1 fixed thresholds
            codes = codes + (yv > (lo + hi) / 2).to(yv.dtype)
        return codes
    k = torch.zeros_like(yv)
    for level in table[1:-1]:  # the level at or below each value: 0 .. 2**bits - 2
        k = k + (yv >= level).to(yv.dtype)
    t = torch.tensor(table, dtype=torch.float32, device=yv.device)
    lo, hi = t[k.long()], t[k.long() + 1]
    return k + (u < (yv - lo) / (hi - lo)).to(yv.dtype)


def _encode_matrix(xm: torch.Tensor, bits: int, signed: bool, mode: str = "nearest",
                   smap: str | None = None, scales: str = "rank1"
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row scales, column scales, codes (uint8, unpacked) and per-row (max, min) to validate with.

    Packing stays outside: fused into this kernel with symbolic sizes, inductor recomputes
    each packed code's row and column by division and runs 5-10x slower than the two apart.
    """
    levels = (1 << bits) - 1  # highest code
    smap = smap or default_map(bits)
    rank1 = scales == "rank1"
    if signed:
        mag = xm.abs()
        rows = mag.amax(dim=1)
        cols = mag.amax(dim=0) if rank1 else rows[:0]
        seed = _data_seed(rows) if mode != "nearest" else None
        s = torch.minimum(rows[:, None], cols[None, :]) if rank1 else rows[:, None]
        # divide, not multiply by 1/s: a subnormal s has an infinite reciprocal
        y = mag / s.clamp_min(FLOAT32_TINY)
        npts = _signed_levels(bits)
        half = (npts - 1) / 2  # grid point k sits at k / half - 1 (companded domain)
        yc = torch.sqrt(y) if smap == "sqrt" else y
        neg = xm < 0  # not copysign: inductor's CPU code vectorizes torch.where
        if smap == "de":
            codes = _de_codes(torch.where(neg, -y, y), bits, None if seed is None else _uniform(y, seed))
        elif seed is None:
            codes = ((torch.where(neg, -yc, yc) + 1.0) * half).round().clamp(0, npts - 1)
            if bits == 2:
                # no zero level: a value so small against its scale that 1 - |y| rounds to 1.0
                # lands on the tie between -1/9 and +1/9, and the tie went to +1/9 whatever
                # its sign; a negative value keeps a negative code
                codes = torch.where(neg, codes.clamp_max(1), codes)
        elif mode == "dither":
            # subtractive dither: the decoder regenerates u from the stored row maxima and takes
            # it off again, so the error is uniform in (-1/2, 1/2) of a step whatever the value,
            # independent of it, and its variance (1/12 step**2) is half of stochastic
            # rounding's average (1/6)
            t = (torch.where(neg, -yc, yc) + 1.0) * half
            codes = (t + _uniform(y, seed) - 0.5).round().clamp(0, npts - 1)
        elif bits == 2:
            codes = _stochastic_q2(y, neg, _uniform(y, seed),
                                   _Q2_INNER if smap == "sqrt" else 1.0 / 3.0)
        else:
            # up with the probability that makes the decoded *value* unbiased (an optimizer
            # state is an average; a bias in the companded domain would grow its magnitude).
            # On the magnitude, then the sign, as the grid is symmetric about its zero level:
            # in the signed domain inductor's kernel ran 6x slower.
            k = torch.floor(yc * half).clamp(0, half - 1)
            lo, hi = k / half, (k + 1.0) / half
            if smap == "sqrt":
                lo, hi = lo * lo, hi * hi
            km = k + (_uniform(y, seed) < (y - lo) / (hi - lo)).to(k.dtype)
            codes = torch.where(neg, half - km, half + km)
        check_max, check_min = rows, rows
        if mode == "calibrated":
            # one gain for the chunk, folded into both scale vectors (s_ij = min(row, col) then
            # scales by it exactly, so decoding is unchanged): the decoded chunk gets the L2
            # norm of the input. Unbiased rounding of a value far below its step adds noise
            # orthogonal to it, and an m re-quantized every step keeps ~1 / (1 - beta1**2)
            # steps of that noise, which made the update longer than fp32's (q2: 2.3x)
            dec = _signed_value(codes, bits, smap, None) * s
            gain = xm.norm() / dec.norm().clamp_min(FLOAT32_TINY)
            gain = torch.where(dec.norm() > 0, gain, torch.ones_like(gain))
            rows, cols = rows * gain, cols * gain
    else:
        check_max, check_min = xm.amax(dim=1), xm.amin(dim=1)
        hr = _log_max(xm, 1)
        hc = _log_max(xm, 0) if rank1 else hr[:0]
        seed = _data_seed(check_max) if mode in ("stochastic", "calibrated") else None
        # log2 s_ij
        ls = (torch.minimum(hr[:, None], hc[None, :]) if rank1 else hr[:, None]) * (1.0 / LOG_UNITS)
        pos = xm > 0
        rel = torch.log2(xm) - ls  # <= 0 where positive; -inf at zeros, masked below
        lo = torch.where(pos, rel, torch.full_like(rel, float("inf"))).amin(dim=1)
        lo = torch.where(hr == EMPTY, EMPTY, torch.floor(lo * LOG_UNITS).clamp(MIN_LO, 0))
        lo_oct = (lo * (1.0 / LOG_UNITS))[:, None]
        step = torch.where(lo < 0, -levels * LOG_UNITS / lo.clamp_max(-1), torch.zeros_like(lo))
        # zeros take code 0, the row's lowest level
        rel = torch.where(pos, rel, lo_oct)
        t = (rel - lo_oct) * step[:, None]
        if seed is None or V_STOCHASTIC_TARGET == "log2":
            codes = _round(t, seed).clamp(0, levels)
        else:
            k = torch.floor(t).clamp(0, levels - 1)
            f = (t - k).clamp(0, 1)
            d = (1.0 / step.clamp_min(1e-30))[:, None]  # octaves per code
            if V_STOCHASTIC_TARGET == "value":
                p = torch.expm1(f * d * _LN2) / torch.expm1(d * _LN2).clamp_min(1e-30)
            else:  # unbiased in v ** -0.5
                p = -torch.expm1(-0.5 * f * d * _LN2) / (-torch.expm1(-0.5 * d * _LN2)).clamp_min(1e-30)
            p = torch.where(step[:, None] > 0, p, torch.zeros_like(p))
            codes = (k + (_uniform(t, seed) < p).to(k.dtype)).clamp(0, levels)
        if mode == "calibrated":
            # one shift of both log2 scale vectors (whole 1/128 octaves, so decoding is
            # unchanged) that makes the chunk's mean v / v_decoded 1: the update's squared
            # norm is sum(m**2 / v), and m**2 tracks v, so this keeps the update's length.
            # Rounding unbiased in log2 is not: its 1/sqrt(v) spreads, and noise lengthens it
            ld = torch.where(step[:, None] > 0,
                             ls + lo_oct + codes * (1.0 / step.clamp_min(1e-30))[:, None], ls + lo_oct)
            ratio = torch.where(pos, torch.exp2(torch.log2(xm.clamp_min(FLOAT32_TINY)) - ld), 0.0)
            mean = ratio.sum() / pos.sum().clamp_min(1)
            shift = torch.round(torch.log2(mean.clamp_min(1e-30)) * LOG_UNITS)
            shift = torch.where(pos.any(), shift, torch.zeros_like(shift))
            hr = torch.where(hr == EMPTY, EMPTY, (hr + shift).clamp(-MAX_LOG, MAX_LOG))
            hc = torch.where(hc == EMPTY, EMPTY, (hc + shift).clamp(-MAX_LOG, MAX_LOG))
        rows, cols = torch.stack([hr, lo]), hc
    return rows, cols, codes.to(torch.uint8), check_max, check_min


def _planes(nr: int, nc: int, bits: int) -> int:
    """How many code planes the decoder reads as a ``(planes, nr // planes, nc)`` view of the
    matrix: ``8 // bits`` at 2 and 4 bits when each plane is whole rows (then byte ``(r, c)`` of
    the packed codes holds element ``(r, c)`` of every plane), else 1 (the codes unpacked first).

    In that view every index is a product, never a quotient, so the compiled decoder reads the
    packed bytes in place: unpacked first, the codes took a fresh buffer of a byte an element
    (and a second for their concatenation), page faults that cost more than the decode."""
    planes = 8 // bits if bits in (2, 4) else 1
    return planes if planes > 1 and nr % planes == 0 and (nr * nc) % 8 == 0 else 1


def _decode_matrix(rows: torch.Tensor, cols: torch.Tensor, packed: torch.Tensor, bits: int,
                   signed: bool, mode: str = "nearest", smap: str | None = None,
                   nc: int | None = None) -> torch.Tensor:
    """Float32 values of the matrix the scales and codes hold, as ``(planes, rows / planes,
    cols)`` (``_planes``; flat, it is the matrix in order) (``nc`` the column count where
    ``cols`` holds no scales, block scales)."""
    levels = (1 << bits) - 1
    smap = smap or default_map(bits)
    rank1 = nc is None
    nr, nc = rows.shape[-1], (cols.shape[0] if nc is None else nc)
    planes = _planes(nr, nc, bits)
    shape = (planes, nr // planes, nc)  # element (r, c) at (r // (nr / planes), r % ..., c)
    if planes > 1:
        shifts = torch.arange(planes, device=packed.device, dtype=torch.int32).view(planes, 1, 1) * bits
        k = ((packed.view(1, nr // planes, nc).to(torch.int32) >> shifts) & levels).to(torch.float32)
    else:
        codes = _unpack(packed, bits)
        if codes.numel() != nr * nc:  # only when rows * cols is not a multiple of 8
            codes = codes[: nr * nc]
        k = codes.view(shape).to(torch.float32)
    if signed:
        u = _uniform(k, _data_seed(rows)) if mode.startswith("dither") else None
        r3 = rows.view(planes, -1, 1)
        s = torch.minimum(r3, cols.view(1, 1, nc)) if rank1 else r3
        if mode in ("dither-bias", "dither-norm"):
            return _dither_corrected(k, bits, smap, u, s, mode == "dither-norm")
        return _signed_value(k, bits, smap, u) * s
    hr, lo = rows[0].view(planes, -1, 1), rows[1].view(planes, -1, 1)
    ls = torch.minimum(hr, cols.view(1, 1, nc)) if rank1 else hr
    step = -lo / (LOG_UNITS * levels)
    out = torch.exp2((ls + lo) * (1.0 / LOG_UNITS) + k * step).clamp_min(FLOAT32_TINY)
    # an all-zero row or column; lo is EMPTY exactly when the row's maximum is
    return torch.where((ls == EMPTY) | (lo == EMPTY), 0.0, out)


# inductor-compiled twins of the two kernels (one fused loop each instead of ~20 eager passes),
# one per (kernel, bits, signed, rounding mode) so those stay constants; sizes are dynamic.
# Compiling costs seconds (less with inductor's on-disk cache warm), which one small chunk never
# repays but an optimizer state re-encoded every step repays within a few steps. So "auto" builds
# a kernel on first use of a large chunk, or once its eager runs have covered
# COMPILE_AFTER_ELEMENTS elements in this process (about a second of eager work: at 4.33M params
# the moments of two AdamW steps), whichever comes first.
# A chunk under PARALLEL_MIN_ELEMENTS runs a twin compiled for one thread: inductor's kernel opens
# an OpenMP parallel region whatever the size, and on busy cores that region waits for a worker
# the scheduler has not run yet, which made a 32 KiB chunk's decode 30x slower than eager.
_Key = tuple[str, int, bool, str, str, str]
_COMPILED: dict[tuple[_Key, bool], Callable[..., Any]] = {}  # (kernel, threaded) -> compiled
#: elements each kernel has run eagerly so far, towards COMPILE_AFTER_ELEMENTS
_EAGER_ELEMENTS: dict[_Key, int] = {}
#: rounding modes of the encoder; decoding is the same for all of them but "dither" (signed
#: only), whose decoder subtracts the dither again (see the module doc)
MODES = ("nearest", "stochastic", "calibrated", "dither")
COMPILE_MIN_ELEMENTS = 1 << 20
COMPILE_AFTER_ELEMENTS = 1 << 23
#: chunks with fewer elements run the single-threaded compiled kernel (a few hundred us of work)
PARALLEL_MIN_ELEMENTS = 1 << 18
_compile_mode = "auto"


def set_compile(mode: str) -> None:
    """Choose the kernels: "auto" (compiled for chunks >= 1 Mi elements, and for any chunk once
    the kernel has encoded or decoded 8 Mi elements eagerly), "always" or "never"."""
    global _compile_mode
    if mode not in ("auto", "always", "never"):
        raise CodecError(f"compile mode must be 'auto', 'always' or 'never', got {mode!r}")
    _compile_mode = mode


def _eager(name: str, bits: int, signed: bool, mode: str = "nearest", smap: str = "",
           scales: str = "rank1") -> Callable[..., Any]:
    """Kernel ``name`` with its constants bound as closure cells (dynamo specializes on them)."""
    if name == "encode":
        def encode(xm: torch.Tensor) -> Any:
            return _encode_matrix(xm, bits, signed, mode, smap or None, scales)
        return encode
    if name == "encode_into":
        planes = 8 // bits

        def encode_into(xm: torch.Tensor, packed: torch.Tensor) -> Any:
            # codes packed as they are made, into the payload (``packed``: its code bytes as
            # (rows / planes, cols)): plane i is rows i * rows / planes onwards, so each byte's
            # codes sit at products of its row and column, never quotients (see ``_planes``)
            rows, cols, codes, check_max, check_min = _encode_matrix(xm, bits, signed, mode,
                                                                     smap or None, scales)
            k = codes.view(planes, -1, xm.shape[1])
            out = k[0]
            for i in range(1, planes):
                out = out | (k[i] << (bits * i))
            packed.copy_(out)
            return rows, cols, check_max, check_min
        return encode_into

    def decode(rows: torch.Tensor, cols: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        # block scales: ``cols`` is a placeholder whose length is the column count
        nc = None if scales == "rank1" else cols.shape[0]
        return _decode_matrix(rows, cols, packed, bits, signed, mode, smap or None, nc)
    if name == "decode":
        return lambda *args: decode(*args).view(-1)

    def decode_into(rows: torch.Tensor, cols: torch.Tensor, packed: torch.Tensor,
                    out: torch.Tensor) -> None:
        # compiled, the values are stored into ``out`` as they are computed (no buffer between);
        # ``out`` comes in the planes' shape: flat, the kernel would find each element's row and
        # column by division (its sizes are symbols), unvectorized and 4-8x slower
        out.copy_(decode(rows, cols, packed))
    return decode_into


def _run(name: str, n: int, bits: int, signed: bool, mode: str, *args: torch.Tensor,
         smap: str = "", scales: str = "rank1") -> Any:
    """Run kernel ``name``, compiled when worth it; a failing compile falls back to eager."""
    key = (name, bits, signed, mode, smap, scales)
    threaded = n >= PARALLEL_MIN_ELEMENTS
    fn = _COMPILED.get((key, threaded))
    if _compile_mode == "never" or (_compile_mode == "auto" and fn is None and n < COMPILE_MIN_ELEMENTS):
        done = _EAGER_ELEMENTS.get(key, 0)
        if _compile_mode == "never" or done < COMPILE_AFTER_ELEMENTS:
            _EAGER_ELEMENTS[key] = done + n
            return _eager(*key)(*args)
    if fn is None:
        # dynamo caches compiled variants per code object, and all variants share the code of
        # ``_eager``'s closures: 4 widths x 2 modes x 3 roundings x 2 kernels x 2 thread counts
        # overflow its default limit of 8, past which it silently runs eager. Raise it (never
        # lower it).
        limit = len(_COMPILED) + 8
        cfg = torch._dynamo.config
        field = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # torch < 2.6
        if getattr(cfg, field) < limit:
            setattr(cfg, field, limit)
        # not dynamic=True: that would make bits symbolic too and defeat vectorizing
        options = None if threaded else {"cpp.threads": 1}
        fn = _COMPILED[key, threaded] = torch.compile(_eager(*key), options=options)
    for a in args:  # only the sizes vary between chunks
        for d in range(a.dim()):
            torch._dynamo.maybe_mark_dynamic(a, d)
    try:
        return fn(*args)
    except CodecError:
        raise
    except Exception:
        # a host without a working C++ toolchain fails at the first call; eager is correct
        fn = _COMPILED[key, threaded] = _eager(*key)
        return fn(*args)


def quantize(x: torch.Tensor, bits: int, block: int, signed: bool, name: str = "quant",
             stochastic: bool = False, mode: str | None = None, smap: str | None = None,
             scales: str = "rank1") -> torch.Tensor:
    """Encode a float tensor into the stored bytes (a uint8 tensor on ``x``'s device).

    ``stochastic`` rounds each value up or down at random with the probabilities that make the
    decoded value unbiased (signed; in log2 for unsigned), from random numbers that are a
    function of the chunk (see the module doc); decoding is the same either way. ``mode``, when
    given, names the rounding instead: "nearest", "stochastic", "calibrated" or "dither" (signed
    only; decode with the same mode). ``smap`` the signed map (None: the width's default) and
    ``scales`` the scale layout, as the codec's spec names them.
    """
    if mode is None:
        mode = "stochastic" if stochastic else "nearest"
    if mode not in MODES:
        raise CodecError(f"{name} rounding must be one of {MODES}, got {mode!r}")
    if mode == "dither" and (not signed or smap == "de"):
        raise CodecError(f"{name}: dithered rounding is for signed data on the sqrt or linear map")
    smap = "" if smap is None or smap == default_map(bits) else smap
    nr, nc = matrix_shape(x.shape, block, scales)
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    if nr * nc > n:  # the block view's last row; zeros move no maximum of either mode
        flat = torch.nn.functional.pad(flat, (0, nr * nc - n))
    planes = _planes(nr, nc, bits)
    payload: torch.Tensor | None = None
    if planes > 1:  # the codes packed by the kernel into the payload: no byte a code between
        head = scale_nbytes(nr, nc, signed, scales)
        payload = torch.empty(head + nr * nc * bits // 8, dtype=torch.uint8, device=x.device)
        rows, cols, check_max, check_min = _run(
            "encode_into", n, bits, signed, mode, flat.view(nr, nc),
            payload[head:].view(nr // planes, nc), smap=smap, scales=scales)
    else:
        rows, cols, codes, check_max, check_min = _run("encode", n, bits, signed, mode,
                                                       flat.view(nr, nc), smap=smap, scales=scales)
    # NaN and inf reach every row reduction, so validating the small per-row results is enough,
    # and costs no extra pass over the chunk
    if not bool(torch.isfinite(check_max).all() and torch.isfinite(check_min).all()):
        raise CodecError(f"{name} cannot encode NaN or infinity, and the chunk holds some")
    if not signed and bool((check_min < 0).any()):
        raise CodecError(
            f"{name} with signed=False stores non-negative data (e.g. Adam's exp_avg_sq), but the "
            "chunk holds negative values; use signed=True"
        )
    dtype = torch.float32 if signed else torch.int16
    parts = [t.to(dtype).reshape(-1).view(torch.uint8) for t in (rows, cols)]
    if payload is not None:
        torch.cat(parts, out=payload[:head])
        return payload
    codes = codes.view(-1)
    pad8 = (-codes.numel()) % 8
    if pad8:  # only when rows * cols is not a multiple of 8
        codes = torch.nn.functional.pad(codes, (0, pad8))
    return torch.cat([*parts, _pack(codes, bits)])


def dequantize(payload: torch.Tensor, shape: Sequence[int], bits: int, block: int, signed: bool,
               name: str = "quant", mode: str = "nearest", smap: str | None = None,
               scales: str = "rank1", correction: str | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a float32 tensor of ``shape`` from the stored bytes (a uint8 tensor; same device).

    ``mode`` matters only for "dither", whose decoder takes the dither off again, and then
    ``correction`` (None or one of ``DITHER_CORRECTIONS``) corrects the values. ``out``: a
    contiguous float32 tensor of as many elements to decode into (returned, viewed as ``shape``)
    instead of a new one: a large chunk's fresh output faulted in more pages than it decoded."""
    shape = tuple(shape)
    expected = encoded_nbytes(shape, bits, block, signed, scales)
    if payload.numel() != expected:
        raise CodecError(f"{name} chunk of shape {shape} must be {expected} bytes, got {payload.numel()}")
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=torch.float32, device=payload.device)
    nr, nc = matrix_shape(shape, block, scales)
    head = scale_nbytes(nr, nc, signed, scales)
    raw = payload[:head].clone()  # aligned copy: a view needs an offset divisible by the itemsize
    if signed:
        head_values = raw.view(torch.float32)
        rows, cols = head_values[:nr], head_values[nr:]
    else:
        head_values = raw.view(torch.int16).to(torch.float32)
        rows, cols = head_values[: 2 * nr].view(2, nr), head_values[2 * nr:]
    if scales != "rank1":  # no column scales: a placeholder that carries the column count
        cols = torch.empty(nc, dtype=torch.float32, device=payload.device)
    smap = "" if smap is None or smap == default_map(bits) else smap
    mode = "dither" if mode == "dither" else "nearest"  # one decoder for the other modes
    if correction is not None:
        if mode != "dither" or correction not in DITHER_CORRECTIONS:
            raise CodecError(f"{name}: correction {correction!r} is one of {DITHER_CORRECTIONS} "
                             "of a dithered signed chunk")
        mode = f"dither-{correction}"
    if out is not None:
        if out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous():
            raise CodecError(f"{name} decodes into a contiguous float32 tensor of {n} elements, "
                             f"not {out.dtype} of {out.numel()}")
        if nr * nc == n:  # else the block view's padded last row needs room of its own
            planes = _planes(nr, nc, bits)
            _run("decode_into", n, bits, signed, mode, rows, cols, payload[head:],
                 out.view(planes, nr // planes, nc), smap=smap, scales=scales)
            return out.view(shape)
    values = _run("decode", n, bits, signed, mode, rows, cols, payload[head:], smap=smap, scales=scales)
    if out is not None:
        return out.view(shape).copy_(values[:n].view(shape))
    return values[:n].view(shape)


def bytes_tensor(data: memoryview | bytes | bytearray | torch.Tensor) -> torch.Tensor:
    """A uint8 CPU tensor over stored bytes, without copying them."""
    if isinstance(data, torch.Tensor):
        return data.view(-1).view(torch.uint8)
    mv = memoryview(data).cast("B")
    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # the decoder only reads; torch warns because read-only buffers could be written
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mv, dtype=torch.uint8)
