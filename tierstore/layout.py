"""Chunk grids: how a tensor is cut into contiguous chunks, and its zarr v3 metadata.

A chunk shape is ``(1, ..., 1, rows, *shape[d+1:])`` for a split dimension ``d``: every chunk is
then one contiguous run of the tensor's C-order memory, so raw chunks are read and written in
place, and a dim-0 slice maps to a contiguous run of chunks. The grid is zarr's ``regular``
grid with the ``default`` chunk key encoding, so plain zarr reads the files.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import torch

from tierstore.codecs.base import Codec
from tierstore.dtypes import dtype_name, zarr_data_type, zarr_fill_value


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkGrid:
    """A regular chunk grid whose chunks are contiguous runs of the flattened tensor."""

    shape: tuple[int, ...]
    #: the dimension cut into runs of ``rows``; dims before it have chunk extent 1
    split_dim: int
    #: chunk extent along ``split_dim``
    rows: int
    #: ``n_chunks``, computed once (asked for per chunk on the hot path)
    _n: int = dataclasses.field(default=-1, init=False, repr=False, compare=False)
    #: ``span(i)[1]`` of every chunk, once asked (an in-place update cuts each chunk's view by it)
    _valid: tuple[int, ...] | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def plan(cls, shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> ChunkGrid:
        """The grid with the largest contiguous chunks of at most ``chunk_bytes`` logical bytes."""
        shape = tuple(int(s) for s in shape)
        if not shape:
            return cls(shape, 0, 1)
        for d in range(len(shape)):
            inner = math.prod(shape[d + 1 :]) * itemsize
            if inner <= chunk_bytes:
                rows = shape[d] if inner == 0 else max(1, min(shape[d], chunk_bytes // inner))
                if rows < shape[d]:  # even out the runs so the edge chunk carries little padding
                    n = -(-shape[d] // rows)
                    rows = -(-shape[d] // n)
                return cls(shape, d, max(1, rows))
        raise AssertionError("unreachable: the last dimension always fits")

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """The zarr chunk shape (edge chunks are stored padded to it)."""
        if not self.shape:
            return ()
        d = self.split_dim
        # zarr needs every chunk extent >= 1, also for dims of length 0 (which have no chunks)
        return (1,) * d + (self.rows,) + tuple(max(1, s) for s in self.shape[d + 1 :])

    @property
    def inner(self) -> int:
        """Elements per unit of the split dimension."""
        return math.prod(self.shape[self.split_dim + 1 :]) if self.shape else 1

    @property
    def runs_per_prefix(self) -> int:
        """Chunks along the split dimension."""
        return -(-self.shape[self.split_dim] // self.rows) if self.shape else 1

    @property
    def n_chunks(self) -> int:
        """Number of chunks (0 for an empty tensor)."""
        n = self._n
        if n < 0:
            if not self.shape:
                n = 1
            elif math.prod(self.shape) == 0:
                n = 0
            else:
                n = math.prod(self.shape[: self.split_dim]) * self.runs_per_prefix
            object.__setattr__(self, "_n", n)
        return n

    @property
    def chunk_numel(self) -> int:
        """Elements in a (padded) chunk."""
        return math.prod(self.chunk_shape) if self.n_chunks else 0

    def span(self, i: int) -> tuple[int, int]:
        """(first flat element, valid element count) of chunk ``i``."""
        if not self.shape:
            return 0, 1
        p, q = divmod(i, self.runs_per_prefix)
        extent = self.shape[self.split_dim]
        start = (p * extent + q * self.rows) * self.inner
        valid = (min((q + 1) * self.rows, extent) - q * self.rows) * self.inner
        return start, valid

    def valid_counts(self) -> tuple[int, ...]:
        """Valid element count of every chunk (``span(i)[1]``), computed once."""
        v = self._valid
        if v is None:
            v = tuple(self.span(i)[1] for i in range(self.n_chunks))
            object.__setattr__(self, "_valid", v)
        return v

    def chunk_of(self, flat: int) -> int:
        """The chunk holding flat element ``flat``."""
        if not self.shape:
            return 0
        extent = self.shape[self.split_dim]
        p, within = divmod(flat, extent * self.inner)
        return p * self.runs_per_prefix + within // (self.rows * self.inner)

    def chunks_for(self, start: int, stop: int) -> range:
        """The chunks that hold any flat element in ``[start, stop)``."""
        if stop <= start:
            return range(0)
        return range(self.chunk_of(start), self.chunk_of(stop - 1) + 1)

    def zarr_key(self, i: int) -> str:
        """zarr v3 default-encoded chunk key (``c/i/j/...``) of chunk ``i``."""
        if not self.shape:
            return "c"
        d = self.split_dim
        p, q = divmod(i, self.runs_per_prefix)
        prefix = []
        for extent in reversed(self.shape[:d]):
            p, r = divmod(p, extent)
            prefix.append(r)
        idx = [*reversed(prefix), q] + [0] * (len(self.shape) - d - 1)
        return "c/" + "/".join(map(str, idx))

    def to_json(self) -> dict[str, Any]:
        """Catalog form."""
        return {"shape": list(self.shape), "split_dim": self.split_dim, "rows": self.rows}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ChunkGrid:
        """Inverse of ``to_json``."""
        return cls(tuple(int(s) for s in d["shape"]), int(d["split_dim"]), int(d["rows"]))


def zarr_metadata(grid: ChunkGrid, dtype: torch.dtype, codec: Codec, attrs: dict[str, Any]) -> bytes:
    """The ``zarr.json`` of one tensor generation."""
    decoded = codec.decoded_dtype(dtype)
    meta = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(grid.shape),
        "data_type": zarr_data_type(decoded),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(grid.chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": zarr_fill_value(decoded),
        "codecs": [*codec.zarr_codecs(dtype), {"name": "crc32c"}],
        "attributes": {"tierstore": {"dtype": dtype_name(decoded), **attrs}},
        "storage_transformers": [],
    }
    return json.dumps(meta).encode()  # compact: the C encoder (indent= falls back to Python)
