"""Sharded layout: many small inner chunks of a table in a few zarr v3 shard files.

A tensor put with ``chunk_rows=`` is cut along dim 0 into *inner chunks* of that many rows (the
unit of caching, of the codec and of the crc32c), and ``shard`` inner chunks share one *shard
file*. The file is exactly what zarr v3's ``sharding_indexed`` codec reads: the inner chunks
back to back (each its codec payload and a 4-byte crc32c), then an index of ``(offset, nbytes)``
little-endian uint64 pairs, one per inner chunk, and the index's own crc32c. A gather reads only
the inner chunks that hold its rows, at offsets known from the catalog (each inner chunk's stored
size is in the generation record), so the hot path never reads the index; plain zarr does.

Inner chunk ``i`` lives in shard ``i // shard`` at position ``i % shard``. Sharded tensors have
``split_dim == 0`` (the grid's rows are the inner chunk's rows), so an edge shard simply has
fewer inner chunks: zarr reads the missing ones as absent (fill value), which they are outside
the array's shape.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import numpy as np
import torch

from tierstore.checksums import TRAILER, checksum
from tierstore.codecs.base import Codec
from tierstore.dtypes import dtype_name, zarr_data_type, zarr_fill_value
from tierstore.layout import ChunkGrid

#: logical bytes of one shard file when ``put`` is not told ``shard_rows``
DEFAULT_SHARD_BYTES = 64 * 2**20
_EMPTY = 2**64 - 1  # zarr's index entry of an absent inner chunk


def shard_count(grid: ChunkGrid, shard: int) -> int:
    """Number of shard files of a sharded grid."""
    return -(-grid.n_chunks // shard) if grid.n_chunks else 0


def shard_key(grid: ChunkGrid, s: int) -> str:
    """zarr v3 default-encoded key (``c/s/0/...``) of shard ``s``."""
    return "c/" + "/".join(map(str, [s] + [0] * (len(grid.shape) - 1)))


def shard_members(grid: ChunkGrid, shard: int, s: int) -> range:
    """The inner chunks held by shard ``s``."""
    return range(s * shard, min(grid.n_chunks, (s + 1) * shard))


@dataclasses.dataclass(frozen=True, slots=True)
class ShardMap:
    """Where each inner chunk sits in its shard file: byte offsets, from the catalog's sizes."""

    #: per inner chunk: offset of its payload in its shard file
    offsets: np.ndarray
    #: per shard: bytes of the inner chunks (where the index starts)
    data_end: np.ndarray
    shard: int

    @classmethod
    def build(cls, chunks: tuple[tuple[int, int], ...], shard: int) -> ShardMap:
        """Offsets for a record's inner chunk sizes (payloads; each is followed by its crc)."""
        sizes = np.fromiter((n + TRAILER for n, _ in chunks), np.int64, len(chunks))
        offsets = np.zeros(len(chunks), np.int64)
        n_shards = -(-len(chunks) // shard) if len(chunks) else 0
        data_end = np.zeros(n_shards, np.int64)
        for s in range(n_shards):
            lo, hi = s * shard, min(len(chunks), (s + 1) * shard)
            run = np.cumsum(sizes[lo:hi])
            offsets[lo + 1 : hi] = run[:-1]
            data_end[s] = run[-1]
        return cls(offsets, data_end, shard)

    def location(self, i: int) -> tuple[int, int]:
        """(shard, byte offset in its file) of inner chunk ``i``."""
        return i // self.shard, int(self.offsets[i])


def shard_index(payload_sizes: list[int], shard: int) -> bytes:
    """A shard's index (``index_location: end``) and its crc32c, as zarr reads it.

    ``payload_sizes``: the stored payloads of the shard's inner chunks, in order; the
    positions past them (an edge shard) are absent.
    """
    table = np.full((shard, 2), _EMPTY, dtype="<u8")
    at = 0
    for j, n in enumerate(payload_sizes):
        table[j] = (at, n + TRAILER)
        at += n + TRAILER
    raw = table.tobytes()
    return raw + struct.pack("<I", checksum([raw]))


def sharded_zarr_metadata(grid: ChunkGrid, shard: int, dtype: torch.dtype, codec: Codec,
                          attrs: dict[str, Any]) -> bytes:
    """The ``zarr.json`` of a sharded generation: a regular grid of shards, each an index codec."""
    decoded = codec.decoded_dtype(dtype)
    inner = list(grid.chunk_shape)
    outer = [inner[0] * shard, *inner[1:]]
    meta = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(grid.shape),
        "data_type": zarr_data_type(decoded),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": outer}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": zarr_fill_value(decoded),
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": inner,
            "codecs": [*codec.zarr_codecs(dtype), {"name": "crc32c"}],
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                             {"name": "crc32c"}],
            "index_location": "end",
        }}],
        "attributes": {"tierstore": {"dtype": dtype_name(decoded), "shard": shard, **attrs}},
        "storage_transformers": [],
    }
    return json.dumps(meta).encode()


def plan_sharded(shape: tuple[int, ...], itemsize: int, chunk_rows: int,
                 shard_rows: int | None) -> tuple[ChunkGrid, int]:
    """The inner chunk grid and inner chunks per shard for ``put(chunk_rows=, shard_rows=)``.

    The caller has checked the arguments (positive ints, ``shard_rows`` a multiple).
    """
    rows = max(1, min(chunk_rows, shape[0]))
    grid = ChunkGrid(tuple(int(s) for s in shape), 0, rows)
    if shard_rows is None:
        inner_bytes = max(1, grid.chunk_numel * itemsize)
        shard = max(1, DEFAULT_SHARD_BYTES // inner_bytes)
    else:
        shard = shard_rows // chunk_rows
    return grid, max(1, min(shard, max(1, grid.n_chunks)))
