"""The codec contract: how a chunk of a tensor becomes stored bytes and back.

A codec instance is a value: its ``spec()`` (name + params, JSON-able) is stored in the catalog
and ``from_spec`` rebuilds an equal codec. Encoding works on one chunk at a time; the store
adds the crc32c trailer itself, so codecs never see checksums.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import numpy as np
import torch

from tierstore.errors import CodecError


class Codec(abc.ABC):
    """Turns a torch tensor (one chunk) into bytes and back."""

    #: registry name, e.g. ``"raw"``
    name: ClassVar[str]
    #: True when ``decode(encode(t))`` is bit-identical to ``t``
    lossless: ClassVar[bool]
    #: True when the encoded bytes are the tensor's little-endian memory, so the store may
    #: read and write them in place (no encode/decode pass, no extra copy)
    raw_layout: ClassVar[bool] = False

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> Codec:
        """Rebuild from the parameters of a stored spec; codecs whose format changed override it."""
        return cls(**params)

    @property
    def bits(self) -> float | None:
        """Stored bits per element, scales included; None when it depends on dtype or data."""
        return None

    def params(self) -> dict[str, Any]:
        """The codec's parameters (JSON-able); empty for parameterless codecs."""
        return {}

    def spec(self) -> dict[str, Any]:
        """A JSON-able description that ``tierstore.codecs.from_spec`` turns back into this codec."""
        return {"name": self.name, **self.params()}

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise CodecError when this codec cannot store ``dtype``."""
        return None  # every dtype by default; lossy codecs narrow it

    def decoded_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype that ``decode`` returns for data put with ``dtype``."""
        return dtype

    @abc.abstractmethod
    def encode(self, chunk: torch.Tensor) -> torch.Tensor | bytes | memoryview:
        """Encode one contiguous CPU chunk into stored bytes (uint8 tensor, bytes or memoryview)."""

    @abc.abstractmethod
    def decode(self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Decode stored bytes into a CPU tensor of ``shape`` and ``dtype``."""

    def decode_into(self, data: memoryview, shape: tuple[int, ...], dtype: torch.dtype,
                    out: torch.Tensor) -> None:
        """``decode`` into ``out`` (flat, contiguous, of the decoded dtype and the chunk's size);
        codecs that can write there directly override this decode and copy."""
        out.copy_(self.decode(data, shape, dtype).reshape(-1))

    @abc.abstractmethod
    def zarr_codecs(self, dtype: torch.dtype) -> list[dict[str, Any]]:
        """The zarr v3 codec chain (array->bytes first) that reads these bytes, crc32c excluded."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.spec() == other.spec()

    def __hash__(self) -> int:
        return hash(repr(sorted(self.spec().items())))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({params})"


def decode_frame(frame_codec: Any, name: str, data: memoryview, dest: np.ndarray) -> None:
    """Decompress a numcodecs frame (zstd, blosc) into the uint8 array ``dest``, checking its size."""
    try:
        raw = frame_codec.decode(np.frombuffer(data, dtype=np.uint8))
    except Exception as e:  # numcodecs raises RuntimeError/ValueError on bad frames
        raise CodecError(f"{name} frame does not decode: {e}") from None
    if len(raw) != dest.nbytes:
        raise CodecError(f"{name} frame holds {len(raw)} bytes, expected {dest.nbytes}")
    dest[:] = np.frombuffer(raw, dtype=np.uint8)


def reject_params(name: str, params: dict[str, Any]) -> None:
    """Raise CodecError naming each parameter a parameterless codec was given."""
    if params:
        raise CodecError(f"codec {name!r} takes no parameters, got {sorted(params)}")
