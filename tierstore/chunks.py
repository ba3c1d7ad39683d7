"""Plain functions that turn tensor chunks into stored payloads and back.

They run on the store's CPU pool: no event loop, no I/O, no shared state.
"""

from __future__ import annotations

import torch

from tierstore.checksums import checksum
from tierstore.codecs import Codec
from tierstore.dtypes import as_bytes
from tierstore.layout import ChunkGrid

#: (first element inside the chunk, end element inside the chunk, offset in the destination)
Piece = tuple[int, int, int]


def encode_chunk(codec: Codec, flat: torch.Tensor, grid: ChunkGrid, i: int,
                 out: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The stored payload of chunk ``i`` of ``flat`` and its crc32c.

    For raw-layout codecs ``out`` is a preallocated buffer of the padded chunk size (reserved in
    the RAM tier); other codecs allocate their own output.
    """
    start, valid = grid.span(i)
    part = flat[start : start + valid]
    if codec.raw_layout:
        assert out is not None
        src = as_bytes(part)
        out[: src.numel()].copy_(src)
        out[src.numel() :].zero_()
        payload = out
    else:
        if valid < grid.chunk_numel:  # zarr stores edge chunks padded to the full chunk shape
            part = torch.cat([part, part.new_zeros(grid.chunk_numel - valid)])
        encoded = codec.encode(part.reshape(grid.chunk_shape))
        if isinstance(encoded, torch.Tensor):
            payload = encoded.reshape(-1).view(torch.uint8).contiguous()
            if payload.data_ptr() == part.data_ptr():
                payload = payload.clone()  # never alias the caller's tensor
        else:
            payload = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    return payload, checksum([payload.numpy()])


def decode_into(codec: Codec, grid: ChunkGrid, dtype: torch.dtype, payload: torch.Tensor,
                pieces: list[Piece], dest: torch.Tensor) -> None:
    """Decode one chunk's payload and copy the requested pieces into the flat ``dest``."""
    if codec.raw_layout:
        chunk = payload.view(dtype)
    elif len(pieces) == 1 and pieces[0][:2] == (0, grid.chunk_numel):
        # the whole chunk (an update's scratch, a full get): decoded where it goes, no copy
        off = pieces[0][2]
        codec.decode_into(memoryview(payload.numpy()), grid.chunk_shape, dtype,
                          dest[off : off + grid.chunk_numel])
        return
    else:
        chunk = codec.decode(memoryview(payload.numpy()), grid.chunk_shape, dtype).reshape(-1)
    for lo, hi, off in pieces:
        dest[off : off + hi - lo].copy_(chunk[lo:hi])


def pieces_by_chunk(grid: ChunkGrid, ranges: list[tuple[int, int, int]]) -> dict[int, list[Piece]]:
    """Group flat source ranges ``(start, stop, dest_offset)`` by the chunks that hold them."""
    out: dict[int, list[Piece]] = {}
    for start, stop, off in ranges:
        for i in grid.chunks_for(start, stop):
            c0, valid = grid.span(i)
            lo, hi = max(start, c0), min(stop, c0 + valid)
            if lo < hi:
                out.setdefault(i, []).append((lo - c0, hi - c0, off + lo - start))
    return out
