"""``raw``: the tensor's own little-endian bytes, the zero-copy codec."""

from __future__ import annotations

from typing import Any

import torch

from tierstore.codecs.base import Codec, reject_params
from tierstore.codecs.registry import register
from tierstore.dtypes import as_bytes


@register
class RawCodec(Codec):
    """Stores the tensor's memory as it is (little-endian hosts only, as are all torch builds)."""

    name = "raw"
    lossless = True
    raw_layout = True

    def __init__(self, **params: Any):
        reject_params(self.name, params)

    def encode(self, chunk: torch.Tensor) -> torch.Tensor:
        """The chunk's bytes, as a uint8 view (no copy)."""
        return as_bytes(chunk.contiguous())

    def decode(self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor over a copy of ``data``."""
        out = torch.empty(shape, dtype=dtype)
        as_bytes(out).numpy()[:] = memoryview(data).cast("B")
        return out

    def zarr_codecs(self, dtype: torch.dtype) -> list[dict[str, Any]]:
        """A single little-endian ``bytes`` codec."""
        return [{"name": "bytes", "configuration": {"endian": "little"}}]
