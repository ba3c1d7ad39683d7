"""Value types: catalog records (what a tensor generation and a commit are) and public infos."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from tierstore.codecs import Codec, from_spec
from tierstore.dtypes import dtype_name, torch_dtype
from tierstore.errors import CorruptData, StoreError
from tierstore.keys import validate_key
from tierstore.layout import ChunkGrid

#: crc32c of a chunk an in-place update changed, until it is written (computed there, once)
CRC_PENDING = -1


@dataclasses.dataclass(frozen=True, slots=True)
class GenRecord:
    """One immutable generation of a tensor: what it is and where its chunks are."""

    key: str
    generation: int
    dtype: str
    codec: dict[str, Any]
    grid: ChunkGrid
    #: per chunk: (stored payload bytes without the crc trailer, crc32c of the payload)
    chunks: tuple[tuple[int, int], ...]
    #: inner chunks per shard file (``tierstore.shards``); 0 = one file per chunk (format 1)
    shard: int = 0
    #: ``codec_obj``, built on first use (codecs are immutable): the hot path asks for it per update
    _codec: Codec | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    #: ``decoded_dtype``, ``nbytes`` and ``stored_nbytes`` once asked (per update and per
    #: eviction decision on the hot path; each is a function of the immutable fields)
    _decoded: torch.dtype | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _nbytes: int = dataclasses.field(default=-1, init=False, repr=False, compare=False)
    _stored: int = dataclasses.field(default=-1, init=False, repr=False, compare=False)

    def moved(self, generation: int, chunks: tuple[tuple[int, int], ...]) -> GenRecord:
        """This record as ``generation`` with ``chunks``: the same tensor, codec and layout."""
        rec = GenRecord(self.key, generation, self.dtype, self.codec, self.grid, chunks, self.shard)
        for name in ("_codec", "_decoded", "_nbytes"):  # functions of what did not change
            object.__setattr__(rec, name, getattr(self, name))
        return rec

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        return self.grid.shape

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype the tensor was put with."""
        return torch_dtype(self.dtype)

    @property
    def decoded_dtype(self) -> torch.dtype:
        """The dtype ``get`` returns."""
        d = self._decoded
        if d is None:
            d = self.codec_obj.decoded_dtype(self.torch_dtype)
            object.__setattr__(self, "_decoded", d)
        return d

    @property
    def codec_obj(self) -> Codec:
        """The codec instance."""
        c = self._codec
        if c is None:
            c = from_spec(self.codec)
            object.__setattr__(self, "_codec", c)
        return c

    @property
    def nbytes(self) -> int:
        """Logical bytes of the decoded tensor."""
        n = self._nbytes
        if n < 0:
            n = self.decoded_dtype.itemsize
            for s in self.shape:
                n *= s
            object.__setattr__(self, "_nbytes", n)
        return n

    @property
    def stored_nbytes(self) -> int:
        """Bytes on disk: payloads (scales included), 4-byte crc32c trailers, shard indexes."""
        n = self._stored
        if n < 0:
            n = sum(n for n, _ in self.chunks) + 4 * len(self.chunks)
            if self.shard:
                n += -(-len(self.chunks) // self.shard) * (16 * self.shard + 4)
            object.__setattr__(self, "_stored", n)
        return n

    def to_json(self) -> bytes:
        """Catalog form."""
        d = {"key": self.key, "generation": self.generation, "dtype": self.dtype,
             "codec": self.codec, "grid": self.grid.to_json(), "chunks": self.chunks}
        if self.shard:
            d["shard"] = self.shard  # absent in format-1 records: unsharded
        return json.dumps(d).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> GenRecord:
        """Parse and check a catalog record; CorruptData if it is malformed or inconsistent."""
        try:
            d = json.loads(raw)
            rec = cls(
                key=validate_key(d["key"]), generation=int(d["generation"]),
                dtype=str(d["dtype"]), codec=dict(d["codec"]), grid=ChunkGrid.from_json(d["grid"]),
                chunks=tuple((int(n), int(c)) for n, c in d["chunks"]),
                shard=int(d.get("shard", 0)),
            )
            torch_dtype(rec.dtype)
            rec.codec_obj  # noqa: B018  (the spec must name a registered codec)
            g = rec.grid
            if (rec.generation < 1 or any(s < 0 for s in g.shape) or g.rows < 1
                    or not (0 <= g.split_dim < max(1, len(g.shape)))):
                raise ValueError(f"impossible grid {g} or generation {rec.generation}")
            if rec.shard < 0 or (rec.shard and (g.split_dim != 0 or not g.shape)):
                raise ValueError(f"sharding {rec.shard} needs a grid split along dim 0, got {g}")
            if len(rec.chunks) != g.n_chunks or any(n < 0 or not 0 <= c < 2**32 for n, c in rec.chunks):
                raise ValueError(f"{len(rec.chunks)} chunk entries for a grid of {g.n_chunks}")
            return rec
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError,
                StoreError) as e:
            raise CorruptData(f"malformed generation record in the catalog: {e}") from None

    @staticmethod
    def new(key: str, generation: int, dtype: torch.dtype, codec: Codec, grid: ChunkGrid,
            chunks: list[tuple[int, int]], shard: int = 0) -> GenRecord:
        """A record for a freshly put tensor."""
        return GenRecord(key, generation, dtype_name(dtype), codec.spec(), grid, tuple(chunks), shard)


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    """What ``Store.info`` reports about a tensor."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    codec: dict[str, Any]
    nbytes: int
    stored_nbytes: int
    #: tiers holding some of the tensor now: a subset of ("device", "host", "disk")
    tiers: tuple[str, ...]
    generation: int
    chunks: int
    #: True when this generation is not in any commit yet
    uncommitted: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Commit:
    """A durable, named version of the store."""

    version: int
    step: int | None
    time: float
    message: str
    #: key -> generation
    generations: dict[str, int] = dataclasses.field(repr=False, compare=False)

    def to_json(self) -> bytes:
        """Catalog form."""
        return json.dumps({"version": self.version, "step": self.step, "time": self.time,
                           "message": self.message, "generations": self.generations}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Commit:
        """Parse and check a catalog record; CorruptData if it is malformed."""
        try:
            d = json.loads(raw)
            step = d["step"]
            gens = {validate_key(k): int(v) for k, v in d["generations"].items()}
            if any(g < 1 for g in gens.values()):
                raise ValueError("generation ids start at 1")
            return cls(int(d["version"]), None if step is None else int(step), float(d["time"]),
                       str(d["message"]), gens)
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError,
                StoreError) as e:
            raise CorruptData(f"malformed commit record in the catalog: {e}") from None
