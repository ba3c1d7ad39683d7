"""``zstd``: lossless compression of the raw bytes with numcodecs' Zstd (zarr's own codec)."""

from __future__ import annotations

from typing import Any

import numcodecs
import torch

from tierstore.codecs.base import Codec, decode_frame
from tierstore.codecs.registry import register
from tierstore.dtypes import as_bytes
from tierstore.errors import CodecError


@register
class ZstdCodec(Codec):
    """Bit-exact; the bytes are zarr's ``bytes`` + ``zstd`` chain, so zarr reads them."""

    name = "zstd"
    lossless = True

    def __init__(self, level: int = 1):
        if not isinstance(level, int) or isinstance(level, bool) or not -131072 <= level <= 22:
            raise CodecError(f"zstd level must be an int in [-131072, 22], got {level!r}")
        self.level = level
        self._zstd = numcodecs.Zstd(level=level)

    def params(self) -> dict[str, Any]:
        """The compression level."""
        return {"level": self.level}

    def encode(self, chunk: torch.Tensor) -> bytes:
        """Zstd frame of the chunk's little-endian bytes."""
        return self._zstd.encode(as_bytes(chunk.contiguous()).numpy())

    def decode(self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Decompress straight into a new tensor of ``shape`` and ``dtype``."""
        out = torch.empty(shape, dtype=dtype)
        decode_frame(self._zstd, self.name, data, as_bytes(out).numpy())
        return out

    def zarr_codecs(self, dtype: torch.dtype) -> list[dict[str, Any]]:
        """``bytes`` then zarr's ``zstd``."""
        return [
            {"name": "bytes", "configuration": {"endian": "little"}},
            {"name": "zstd", "configuration": {"level": self.level, "checksum": False}},
        ]
