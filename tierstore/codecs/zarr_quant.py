"""zarr v3 codecs ``tierstore.q8``/``q5``/``q4``/``q3``/``q2``: let plain zarr read quantized chunks.

Importing ``tierstore`` registers them with ``zarr.registry.register_codec``, so
``zarr.open_array`` on an array whose ``zarr.json`` lists e.g.
``{"name": "tierstore.q4", "configuration": {"signed": true, "block": 128, "scales": "rank1"}}``
decodes the chunks with the same math as ``tierstore.codecs.get("q4")``. The array's
``data_type`` must be ``float32`` (the quantized codecs' ``decoded_dtype``); a float16/float64
array gets the values cast. These are array->bytes codecs (they replace ``bytes``); the store appends ``crc32c``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from zarr.abc.codec import ArrayBytesCodec
from zarr.core.buffer import Buffer, NDBuffer
from zarr.registry import register_codec

from tierstore.codecs import quant
from tierstore.codecs.quant_codecs import Q2Codec, Q3Codec, Q4Codec, Q5Codec, Q8Codec, QuantCodec
from tierstore.errors import CodecError

if TYPE_CHECKING:
    from zarr.core.array_spec import ArraySpec


@dataclass(frozen=True)
class ZarrQuantCodec(ArrayBytesCodec):
    """Base of the zarr adapters; subclasses name the tierstore codec class they wrap."""

    is_fixed_size = True
    signed: bool = True
    block: int = 0  # 0 stands for the wrapped codec's default
    rounding: str = "nearest"  # how this codec encodes; decoding reads it only for "dither"
    scales: str = "rank1"
    signed_map: str | None = None  # None: the width's own map
    correction: str | None = None  # None: a dithered chunk decodes without correction
    tier_codec: Any = None

    #: the wrapped tierstore codec class (set by subclasses)
    codec_cls: ClassVar[type[QuantCodec]] = QuantCodec

    def __post_init__(self) -> None:
        block = self.block or self.codec_cls.default_block
        object.__setattr__(self, "block", block)
        object.__setattr__(self, "tier_codec", self.codec_cls(signed=self.signed, block=block,
                                                              rounding=self.rounding,
                                                              scales=self.scales,
                                                              signed_map=self.signed_map,
                                                              correction=self.correction))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ZarrQuantCodec:
        """Build from the ``zarr.json`` entry ``{"name": ..., "configuration": {...}}``."""
        config = dict(data.get("configuration") or {})
        unknown = set(config) - {"signed", "block", "rounding", "scales", "signed_map",
                               "correction"}
        if unknown:
            raise CodecError(f"{data.get('name')}: unknown configuration keys {sorted(unknown)}")
        # refuses tierstore 0.1.0's per-block chunks (no "scales") rather than misreading them
        cls.codec_cls.from_params(config)
        return cls(signed=config.get("signed", True), block=config.get("block", 0),
                   rounding=config.get("rounding", "nearest"), scales=config["scales"],
                   signed_map=config.get("signed_map"), correction=config.get("correction"))

    def to_dict(self) -> dict[str, Any]:
        """The ``zarr.json`` entry, as ``QuantCodec.zarr_codecs`` writes it."""
        return self.tier_codec.zarr_codecs(torch.float32)[0]

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        payload = quant.bytes_tensor(memoryview(np.ascontiguousarray(chunk_bytes.as_numpy_array())))
        values = self.tier_codec.decode_payload(payload, tuple(chunk_spec.shape))
        native = chunk_spec.dtype.to_native_dtype()
        arr = values.numpy().astype(native, copy=False)
        return chunk_spec.prototype.nd_buffer.from_numpy_array(arr)

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        arr = np.ascontiguousarray(chunk_array.as_numpy_array(), dtype=np.float32)
        data = self.tier_codec.encode(torch.from_numpy(arr))
        return chunk_spec.prototype.buffer.from_bytes(data.numpy().tobytes())

    def compute_encoded_size(self, input_byte_length: int, chunk_spec: ArraySpec) -> int:
        """Scales plus packed codes of one chunk."""
        return self.tier_codec.encoded_nbytes(tuple(chunk_spec.shape))


def _adapter(cls: type[QuantCodec]) -> type[ZarrQuantCodec]:
    """A frozen ZarrQuantCodec subclass wrapping ``cls``."""
    sub = dataclass(frozen=True)(type(f"Zarr{cls.__name__}", (ZarrQuantCodec,),
                                      {"codec_cls": cls, "__module__": __name__,
                                       "__doc__": f"zarr codec tierstore.{cls.name}."}))
    return sub


ZARR_CODECS: dict[str, type[ZarrQuantCodec]] = {}
for _cls in (Q8Codec, Q5Codec, Q4Codec, Q3Codec, Q2Codec):
    ZARR_CODECS[f"tierstore.{_cls.name}"] = _adapter(_cls)
    register_codec(f"tierstore.{_cls.name}", ZARR_CODECS[f"tierstore.{_cls.name}"])
