"""``blosc``: lossless, byte-shuffled compression with numcodecs' Blosc (zarr's own codec)."""

from __future__ import annotations

from typing import Any

import numcodecs
import numpy as np
import torch

from tierstore.codecs.base import Codec, decode_frame
from tierstore.codecs.registry import register
from tierstore.errors import CodecError

_CNAMES = ("lz4", "lz4hc", "blosclz", "zstd", "zlib")
# zarr v3 spells the shuffle as a word, numcodecs as an int
_SHUFFLES = {"noshuffle": numcodecs.Blosc.NOSHUFFLE, "shuffle": numcodecs.Blosc.SHUFFLE,
             "bitshuffle": numcodecs.Blosc.BITSHUFFLE}
# a numpy integer view per item size: blosc shuffles by the buffer's itemsize, so the bytes must
# reach it typed (bf16 has no numpy dtype, but shuffling only needs the width)
_INT_VIEW = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16),
             4: (torch.int32, np.int32), 8: (torch.int64, np.int64)}


def _typed_numpy(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view of ``t``'s memory whose itemsize is ``t``'s element size (no copy)."""
    flat = t.contiguous().reshape(-1)
    tdt, ndt = _INT_VIEW[flat.element_size()]
    if flat.numel() == 0:
        return np.empty(0, dtype=ndt)
    return flat.view(tdt).numpy()


@register
class BloscCodec(Codec):
    """Bit-exact; the bytes are zarr's ``bytes`` + ``blosc`` chain, so plain zarr reads them."""

    name = "blosc"
    lossless = True

    def __init__(self, cname: str = "lz4", clevel: int = 5, shuffle: str = "shuffle"):
        if cname not in _CNAMES:
            raise CodecError(f"blosc cname must be one of {_CNAMES}, got {cname!r}")
        if not isinstance(clevel, int) or isinstance(clevel, bool) or not 0 <= clevel <= 9:
            raise CodecError(f"blosc clevel must be an int in [0, 9], got {clevel!r}")
        if shuffle not in _SHUFFLES:
            raise CodecError(f"blosc shuffle must be one of {sorted(_SHUFFLES)}, got {shuffle!r}")
        self.cname, self.clevel, self.shuffle = cname, clevel, shuffle
        self._blosc = numcodecs.Blosc(cname=cname, clevel=clevel, shuffle=_SHUFFLES[shuffle])

    def params(self) -> dict[str, Any]:
        """Compressor name, level and shuffle mode."""
        return {"cname": self.cname, "clevel": self.clevel, "shuffle": self.shuffle}

    def encode(self, chunk: torch.Tensor) -> bytes:
        """A blosc frame of the chunk's little-endian bytes, shuffled by the element size."""
        return self._blosc.encode(_typed_numpy(chunk))

    def decode(self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Decompress straight into a new tensor of ``shape`` and ``dtype``."""
        out = torch.empty(shape, dtype=dtype)
        decode_frame(self._blosc, self.name, data, _typed_numpy(out).view(np.uint8))
        return out

    def zarr_codecs(self, dtype: torch.dtype) -> list[dict[str, Any]]:
        """``bytes`` then zarr's ``blosc`` with the element size as typesize."""
        typesize = torch.empty(0, dtype=dtype).element_size()
        return [
            {"name": "bytes", "configuration": {"endian": "little"}},
            {"name": "blosc", "configuration": {"typesize": typesize, "cname": self.cname,
                                                "clevel": self.clevel, "shuffle": self.shuffle,
                                                "blocksize": 0}},
        ]
