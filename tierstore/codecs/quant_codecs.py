"""The lossy ``q8``/``q4``/``q3``/``q2`` codecs: one class per bit width over ``quant``'s math.

Default blocks (the row length of the block view that chunks too narrow for their own rows and
columns use): 128 for q8 and q4 (the 4-bit optimizer paper's block), 64 for q3 and q2, where
fewer levels make a tight range matter more than the 0.5 bit/element of scales.

The spec names the scale layout, ``"scales": "rank1"``. tierstore 0.1.0 wrote q-codec chunks
with per-block scales and no such key; those bytes mean something else, so a spec without the
key is refused with an error that says so, instead of being decoded into wrong values.

Format versions after that are new parameter values, never new meanings of old ones: ``scales:
"absmax"`` (per-block absmax, no column scales), ``signed_map: "linear" | "de"`` (absent: the
width's own map, as before the key existed), ``rounding: "dither"`` (its decoder differs),
``correction: "bias" | "norm"`` (a dithered chunk's decoder corrects its values; absent: as
before the key existed). A
reader of an older release refuses such a spec by the parameter's name ("scales must be one
of", "rounding must be one of", "unexpected keyword argument 'signed_map'") instead of
misreading the bytes; every spec an older release wrote reads here unchanged.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tierstore.codecs import quant
from tierstore.codecs.base import Codec
from tierstore.codecs.registry import register
from tierstore.errors import CodecError

FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)
#: "nearest" is deterministic; "stochastic" rounds up or down at random so that the code is
#: unbiased, which keeps an optimizer state that is re-quantized every step from sticking at a
#: level when its per-step change is smaller than half a quantization step (signal swamping).
#: "calibrated" (an ablation) is stochastic with one gain per chunk folded into the
#: stored scales (signed: the decoded L2 norm is the input's; unsigned: mean(v / decoded) is 1).
#: Decoding is identical for those three; only ``encode`` differs. "dither" (signed only) is
#: subtractive dither: nearest rounding after adding a pseudo-random offset that the decoder
#: regenerates from the stored row maxima and subtracts, so the rounding error is independent of
#: the value and half stochastic rounding's on average; chunks written with it decode only with it.
ROUNDINGS = ("nearest", "stochastic", "calibrated", "dither")
#: the scale layouts this version reads and writes (see ``quant``)
SCALE_LAYOUTS = quant.SCALE_LAYOUTS


class QuantCodec(Codec):
    """Rank-1-scaled quantization with a signed (companded) or unsigned (log2) map; see ``quant``."""

    lossless = False
    #: code width in bits
    code_bits: ClassVar[int]
    #: elements per scale when ``block`` is not given
    default_block: ClassVar[int]

    def __init__(self, signed: bool = True, block: int | None = None, rounding: str = "nearest",
                 scales: str = "rank1", signed_map: str | None = None,
                 correction: str | None = None):
        block = self.default_block if block is None else block
        quant.check_params(self.code_bits, block, signed, signed_map, scales)
        if rounding not in ROUNDINGS:
            raise CodecError(f"quantization rounding must be one of {ROUNDINGS}, got {rounding!r}")
        if rounding == "dither" and (not signed or signed_map == "de"):
            raise CodecError("rounding 'dither' is for signed data on the sqrt or linear map "
                             "(Adam's m); use 'stochastic' for the unsigned v")
        if correction is not None and (rounding != "dither" or correction not in quant.DITHER_CORRECTIONS):
            raise CodecError(f"quantization correction must be one of {quant.DITHER_CORRECTIONS}, "
                             f"of rounding 'dither', got {correction!r} with rounding {rounding!r}")
        if signed_map == quant.default_map(self.code_bits):
            signed_map = None  # the width's own map: the spec stays what older releases wrote
        self.signed, self.block, self.rounding, self.scales = signed, block, rounding, scales
        self.signed_map = signed_map
        self.correction = correction

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> QuantCodec:
        """Rebuild from a stored spec, refusing tierstore 0.1.0's per-block layout (no ``scales``)."""
        if "scales" not in params:
            raise CodecError(
                f"codec {cls.name!r} spec {params} has no 'scales': its chunks were written by "
                "tierstore 0.1.0 with per-block scales, which this version cannot read; export "
                "them with tierstore 0.1.0 or re-create the store"
            )
        return cls(**params)

    @property
    def bits(self) -> float:
        """Code bits plus 32 bits of scales per ``block`` elements (long chunks, block view;
        unsigned with block scales: 32 bits of log2 maximum and lower bound too)."""
        return self.code_bits + 32 / self.block

    def params(self) -> dict[str, Any]:
        """``signed``, ``block``, ``rounding``, ``scales`` and, when not the width's own,
        ``signed_map``."""
        out: dict[str, Any] = {"signed": self.signed, "block": self.block,
                               "rounding": self.rounding, "scales": self.scales}
        if self.signed_map is not None:
            out["signed_map"] = self.signed_map
        if self.correction is not None:
            out["correction"] = self.correction
        return out

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Only float32, bfloat16 and float16 are quantized."""
        if dtype not in FLOAT_INPUTS:
            raise CodecError(
                f"codec {self.name!r} quantizes float32, bfloat16 or float16, not {dtype}; "
                "use 'raw', 'zstd' or 'blosc' for other dtypes"
            )

    def decoded_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Always float32: the codes carry no more precision than that, whatever went in."""
        self.check_dtype(dtype)
        return torch.float32

    def encode(self, chunk: torch.Tensor) -> torch.Tensor:
        """Scales then bit-packed codes, as a uint8 tensor on the chunk's device."""
        self.check_dtype(chunk.dtype)
        return quant.quantize(chunk, self.code_bits, self.block, self.signed, self.name,
                              mode=self.rounding, smap=self.signed_map, scales=self.scales)

    def decode(self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A float32 tensor of ``shape`` from the stored bytes."""
        self.check_dtype(dtype)
        return self.decode_payload(quant.bytes_tensor(data), shape)

    def decode_into(self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype,
                    out: torch.Tensor) -> None:
        """``decode`` straight into ``out``: no float32 chunk of its own (see ``quant.dequantize``)."""
        self.check_dtype(dtype)
        quant.dequantize(quant.bytes_tensor(data), shape, self.code_bits, self.block, self.signed,
                         self.name, mode=self.rounding, smap=self.signed_map, scales=self.scales,
                         correction=self.correction, out=out)

    def decode_payload(self, payload: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """A float32 tensor of ``shape`` from the stored bytes as a uint8 tensor (any device)."""
        return quant.dequantize(payload, shape, self.code_bits, self.block, self.signed, self.name,
                                mode=self.rounding, smap=self.signed_map, scales=self.scales,
                                correction=self.correction)

    def zarr_codecs(self, dtype: torch.dtype) -> list[dict[str, Any]]:
        """The registered zarr codec ``tierstore.<name>``; the zarr array's dtype is float32."""
        return [{"name": f"tierstore.{self.name}", "configuration": self.params()}]

    def encoded_nbytes(self, shape: tuple[int, ...]) -> int:
        """Stored bytes of a chunk of ``shape`` (scales included)."""
        return quant.encoded_nbytes(shape, self.code_bits, self.block, self.signed, self.scales)


@register
class Q8Codec(QuantCodec):
    """8-bit codes; block 128 by default (8.25 bits/element)."""

    name = "q8"
    code_bits = 8
    default_block = 128


@register
class Q5Codec(QuantCodec):
    """5-bit codes; block 128 by default (5.25 bits/element): one more bit for Adam's m beside a
    q4 v (``tools.bench.convergence --codecs q4+m=q5``)."""

    name = "q5"
    code_bits = 5
    default_block = 128


@register
class Q4Codec(QuantCodec):
    """4-bit codes; block 128 by default (4.25 bits/element)."""

    name = "q4"
    code_bits = 4
    default_block = 128


@register
class Q3Codec(QuantCodec):
    """3-bit codes; block 64 by default (3.5 bits/element)."""

    name = "q3"
    code_bits = 3
    default_block = 64


@register
class Q2Codec(QuantCodec):
    """2-bit codes; block 64 by default (2.5 bits/element)."""

    name = "q2"
    code_bits = 2
    default_block = 64
