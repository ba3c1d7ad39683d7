"""``q8``/``q4``/``q3``/``q2``: blockwise quantization of optimizer states, as vectorized torch.

Two maps, chosen by ``signed``:

* signed (Adam's first moment ``m``): per block of ``block`` elements an fp32 absmax scale and
  a symmetric grid of ``2**bits - 1`` levels over ``[-1, 1]`` that includes zero (the top code
  is unused). For q8 and q4 the grid is on ``y = sign(x) * sqrt(|x| / absmax)``, decoded as
  ``sign(y) * y**2 * absmax``: square-root companding spends levels near zero, where
  heavy-tailed moments live, as bitsandbytes' dynamic map does, but is plain arithmetic both
  ways. q3 and q2 use the grid on ``x / absmax`` itself (q2 is ternary). Zero is a level on
  purpose: a grid without it decodes a tiny ``m`` to ``absmax / (2**bits - 1)``, which with a
  tiny ``v`` makes a huge update; rounding a small ``m`` to zero only delays its update. Exact
  zeros round-trip; an all-zero block decodes to zeros.
* unsigned (Adam's second moment ``v``): per block the min and max of ``log2(v)`` over its positive
  values, rounded outward to 1/128 octave and stored as two int16; ``log2(v)`` is rounded to
  ``2**bits`` levels evenly between them. A positive value therefore never decodes to zero (the
  zero-point problem of Li et al. 2023) and small values keep their relative precision at 2-3
  bits (the log map of SOLO 2025). An exact zero decodes to the block's smallest level (its
  smallest positive value, within 1/128 octave); an all-zero block decodes to zeros. Negative
  input raises CodecError.

Both modes reject NaN and +-inf with CodecError (an optimizer state holding them is already
broken; storing them silently would hide it). Input is float32, bfloat16 or float16; decode
returns float32. The stored bytes are ``[4 bytes of scale per block][codes, bit-packed]``:
the code count N is ``num_blocks * block`` (input padded with zeros to whole blocks), rounded
up to a multiple of 8, and packed in planes so that
every kernel reads and writes contiguous memory: with P = 8 // bits, byte j of the 2/4-bit
codes holds codes j, j + N/P, ... from the low bits up; 3-bit codes form N/8 24-bit words,
word j holding codes j + k*N/8 at bit 3k, stored as three planes (low, middle, high bytes). Stored bits per element: ``bits + 32 / block``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from tierstore.errors import CodecError

SUPPORTED_BITS = (2, 3, 4, 8)
# log2 bounds are int16 in units of 1/128 octave: fp32's positive range, log2 in [-149, 128),
# fits, and 1/128 octave (0.54%) is well under the finest q8 step on real moments
LOG_UNITS = 128
# signed widths that use square-root companding; q3 and q2 use the linear grid, since with 3 or 7
# levels companding leaves too few for mid-sized values (relative L2 error on captured AdamW m,
# block 128: q2 0.96 companded vs 0.71 linear, q3 0.26 vs 0.20; at q4 0.110 vs 0.093, where
# companding is kept for the relative precision of small values)
COMPANDED_BITS = (4, 8)
# largest log2 bound (in LOG_UNITS) whose power of two is a finite float32
MAX_LOG = 128 * LOG_UNITS - 1
# smallest positive subnormal float32, the floor for a nonzero absmax divisor
FLOAT32_TINY = 2.0**-149
# marks a block with no positive value in unsigned mode; it decodes to zeros
EMPTY_BLOCK = -32768


def check_params(bits: int, block: int, signed: bool) -> None:
    """Raise CodecError naming the rule that ``bits``, ``block`` or ``signed`` breaks."""
    if bits not in SUPPORTED_BITS or isinstance(bits, bool):
        raise CodecError(f"quantization bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise CodecError(f"quantization block must be a positive int, got {block!r}")
    if not isinstance(signed, bool):
        raise CodecError(f"quantization `signed` must be a bool, got {signed!r}")


def num_blocks(n: int, block: int) -> int:
    """Blocks holding ``n`` elements (the last one may be partial)."""
    return -(-n // block)


def encoded_nbytes(n: int, bits: int, block: int) -> int:
    """Stored bytes of ``n`` elements: 4 bytes of scale per block plus the packed codes."""
    nb = num_blocks(n, block)
    return 4 * nb + (-(-nb * block // 8)) * bits


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (count a multiple of 8, each < 2**bits) into bytes, planar layout."""
    if bits == 8:
        return codes
    if bits == 3:
        # planes of contiguous codes, not neighbours: strided gathers would not vectorize
        c = codes.view(8, -1).to(torch.int32)
        word = c[0]
        for i in range(1, 8):  # 8 fixed lanes, not a loop over blocks
            word = word | (c[i] << (3 * i))
        return torch.stack([word & 255, (word >> 8) & 255, word >> 16]).to(torch.uint8).view(-1)
    c = codes.view(8 // bits, -1)
    out = c[0]
    for i in range(1, 8 // bits):
        out = out | (c[i] << (bits * i))
    return out


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``_pack``: all the codes the bytes hold."""
    if bits == 8:
        return packed
    if bits == 3:
        b = packed.view(3, -1).to(torch.int32)
        word = b[0] | (b[1] << 8) | (b[2] << 16)
        return torch.stack([(word >> (3 * i)) & 7 for i in range(8)]).to(torch.uint8).view(-1)
    mask = (1 << bits) - 1
    return torch.stack([(packed >> (bits * i)) & mask for i in range(8 // bits)]).view(-1)


def _round(t: torch.Tensor, stochastic: bool) -> torch.Tensor:
    """Nearest, or stochastic rounding (up with probability equal to the fraction)."""
    return (t + torch.rand_like(t)).floor() if stochastic else t.round()


def _encode_blocks(xb: torch.Tensor, bits: int, signed: bool, stochastic: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scales, packed codes, and per-block (max, min) to validate with, of padded blocks."""
    levels = (1 << bits) - 1  # highest code
    if signed:
        absmax = xb.abs().amax(dim=1)
        # divide, not multiply by 1/absmax: a subnormal absmax has an infinite reciprocal
        mag = xb.abs() / absmax.clamp_min(FLOAT32_TINY)[:, None]
        if bits in COMPANDED_BITS:
            mag = torch.sqrt(mag)
        y = torch.where(xb < 0, -mag, mag)  # not copysign: inductor's CPU code vectorizes this
        half = (1 << (bits - 1)) - 1  # codes 0..2*half; the top code is unused
        codes = _round(y * half + half, stochastic).clamp(0, 2 * half)
        scales = absmax
        check_max, check_min = absmax, absmax
    else:
        xmax = xb.amax(dim=1)
        check_min = xb.amin(dim=1)
        xmin = torch.where(xb > 0, xb, torch.full_like(xb, float("inf"))).amin(dim=1)
        empty = xmax <= 0
        # capped so that 2**hi stays finite; the few values above 2**127.99 take the top code
        hi = torch.where(empty, EMPTY_BLOCK,
                         torch.ceil(torch.log2(xmax) * LOG_UNITS).clamp_max(MAX_LOG))
        lo = torch.where(empty, EMPTY_BLOCK, torch.floor(torch.log2(xmin) * LOG_UNITS))
        span = hi - lo
        step = torch.where(span > 0, levels * LOG_UNITS / span.clamp_min(1), torch.zeros_like(span))
        # log2(0) = -inf is clamped below any block bound, so zeros take code 0 (the block min)
        lg = torch.log2(xb).clamp_min(-150.0)
        codes = _round((lg - (lo / LOG_UNITS)[:, None]) * step[:, None], stochastic).clamp(0, levels)
        scales = torch.stack([lo, hi], dim=1)
        check_max = xmax
    codes = codes.to(torch.uint8).view(-1)
    pad8 = (-codes.numel()) % 8
    if pad8:  # only when the block is not a multiple of 8
        codes = torch.nn.functional.pad(codes, (0, pad8))
    return scales, _pack(codes, bits), check_max, check_min


def _decode_blocks(scales: torch.Tensor, packed: torch.Tensor, block: int, bits: int,
                   signed: bool) -> torch.Tensor:
    """Float32 values of all the full blocks that scales and packed codes hold."""
    levels = (1 << bits) - 1
    codes = _unpack(packed, bits)
    nb = scales.shape[0]
    if codes.numel() != nb * block:  # only when the block is not a multiple of 8
        codes = codes[: nb * block]
    kb = codes.view(nb, block).to(torch.float32)
    if signed:
        half = (1 << (bits - 1)) - 1
        y = kb * (1.0 / half) - 1.0
        if bits in COMPANDED_BITS:
            y = y * y.abs()
        return (y * scales[:, None]).view(-1)
    lo, hi = scales[:, 0], scales[:, 1]
    base = torch.where(lo == EMPTY_BLOCK, float("-inf"), lo / LOG_UNITS)
    step = (hi - lo) / (LOG_UNITS * levels)
    return torch.exp2(kb * step[:, None] + base[:, None]).view(-1)


# inductor-compiled twins of the two kernels (one fused loop each instead of ~15 eager passes),
# one per (kernel, bits, signed) so those stay constants; sizes are dynamic. Built on first use
# of a large chunk: compiling costs seconds that small chunks never repay.
_COMPILED: dict[tuple[str, int, int, bool, bool], Callable[..., Any]] = {}
COMPILE_MIN_ELEMENTS = 1 << 20
_compile_mode = "auto"


def set_compile(mode: str) -> None:
    """Choose the kernels: "auto" (compiled for chunks >= 1 Mi elements), "always" or "never"."""
    global _compile_mode
    if mode not in ("auto", "always", "never"):
        raise CodecError(f"compile mode must be 'auto', 'always' or 'never', got {mode!r}")
    _compile_mode = mode


def _eager(name: str, block: int, bits: int, signed: bool,
           stochastic: bool = False) -> Callable[..., Any]:
    """Kernel ``name`` with its constants bound as closure cells (dynamo specializes on them)."""
    if name == "encode":
        def encode(xb: torch.Tensor) -> Any:
            return _encode_blocks(xb.view(-1, block), bits, signed, stochastic)
        return encode

    def decode(scales: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return _decode_blocks(scales, packed, block, bits, signed)
    return decode


def _run(name: str, n: int, block: int, bits: int, signed: bool, stochastic: bool,
         *args: Any) -> Any:
    """Run kernel ``name``, compiled when worth it; a failing compile falls back to eager."""
    key = (name, block, bits, signed, stochastic)
    if _compile_mode == "never" or (_compile_mode == "auto" and n < COMPILE_MIN_ELEMENTS):
        return _eager(*key)(*args)
    fn = _COMPILED.get(key)
    if fn is None:
        # dynamo caches compiled variants per code object, and all variants share the code of
        # ``_eager``'s closures: 4 widths x 2 modes x blocks x 2 kernels overflow its default
        # limit of 8, past which it silently runs eager. Raise it (never lower it).
        limit = len(_COMPILED) + 8
        cfg = torch._dynamo.config
        field = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # torch < 2.6
        if getattr(cfg, field) < limit:
            setattr(cfg, field, limit)
        # not dynamic=True: that would make block and bits symbolic too and defeat vectorizing
        fn = _COMPILED[key] = torch.compile(_eager(*key))
    for a in args:  # only the element counts vary between chunks
        torch._dynamo.maybe_mark_dynamic(a, 0)
    try:
        return fn(*args)
    except CodecError:
        raise
    except Exception:
        # a host without a working C++ toolchain fails at the first call; eager is correct
        _COMPILED[key] = _eager(*key)
        return _COMPILED[key](*args)


def quantize(x: torch.Tensor, bits: int, block: int, signed: bool, name: str = "quant",
             stochastic: bool = False) -> torch.Tensor:
    """Encode a float tensor into the stored bytes (a uint8 tensor on ``x``'s device).

    ``stochastic`` rounds each value up or down at random with the probabilities that make the
    code unbiased (in the companded or log2 domain); decoding is the same either way.
    """
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device)
    nb = num_blocks(n, block)
    pad = nb * block - n
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))  # zeros move no bound of either mode
    scales, packed, check_max, check_min = _run("encode", n, block, bits, signed, stochastic, flat)
    # NaN and inf reach every block reduction, so validating the small per-block results is
    # enough, and costs no extra pass over the chunk
    if not bool(torch.isfinite(check_max).all() and torch.isfinite(check_min).all()):
        raise CodecError(f"{name} cannot encode NaN or infinity, and the chunk holds some")
    if not signed and bool((check_min < 0).any()):
        raise CodecError(
            f"{name} with signed=False stores non-negative data (e.g. Adam's exp_avg_sq), but the "
            "chunk holds negative values; use signed=True"
        )
    scale_bytes = scales.to(torch.float32 if signed else torch.int16).contiguous().view(torch.uint8)
    return torch.cat([scale_bytes.view(-1), packed])


def dequantize(payload: torch.Tensor, n: int, bits: int, block: int, signed: bool,
               name: str = "quant") -> torch.Tensor:
    """Decode ``n`` float32 values from the stored bytes (a uint8 tensor; same device out)."""
    expected = encoded_nbytes(n, bits, block)
    if payload.numel() != expected:
        raise CodecError(f"{name} chunk of {n} values must be {expected} bytes, got {payload.numel()}")
    if n == 0:
        return torch.empty(0, dtype=torch.float32, device=payload.device)
    nb = num_blocks(n, block)
    raw_scales = payload[: 4 * nb].clone()  # aligned copy: a view needs an offset divisible by 4
    if signed:
        scales = raw_scales.view(torch.float32)
    else:
        scales = raw_scales.view(torch.int16).view(nb, 2).to(torch.float32)
    out = _run("decode", n, block, bits, signed, False, scales, payload[4 * nb:])
    return out[:n]


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
