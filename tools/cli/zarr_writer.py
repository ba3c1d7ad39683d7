"""Writing store tensors into a plain zarr v3 group, one dim-0 piece at a time.

Each key becomes an array at the same path (``/`` makes nested groups). zarr has no bfloat16,
so bf16 tensors are written as their uint16 bits, as the store itself does on disk; the array
attribute ``tierstore.dtype`` names the logical dtype either way.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch
from tqdm import tqdm

import tierstore
from tierstore.export import iter_pieces, out_dtype
from tools.cli.errors import UsageError

_NUMPY = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
          torch.bfloat16: np.uint16, torch.int64: np.int64, torch.int32: np.int32,
          torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bf16 as its uint16 bits)."""
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


def write_zarr(store: tierstore.Store, infos: Sequence[tierstore.TensorInfo], out: str,
               cast: torch.dtype | None = None, chunk_bytes: int = 16 << 20,
               quiet: bool = False) -> int:
    """Copy ``infos``' tensors into a new zarr v3 group at ``out``; return the arrays written."""
    import zarr  # import on use: the other commands do not need it
    from zarr.errors import ContainsArrayError, ContainsGroupError

    root = zarr.open_group(out, mode="w-", zarr_format=3)
    total = sum(int(np.prod(i.shape)) * out_dtype(i.dtype, cast).itemsize for i in infos)
    with tqdm(total=total, desc="export", unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr, disable=quiet) as bar:
        for info in infos:
            dtype = out_dtype(info.dtype, cast)
            shape = tuple(info.shape)
            row_bytes = max(1, dtype.itemsize * (int(np.prod(shape[1:])) if shape else 1))
            rows = max(1, chunk_bytes // row_bytes)
            chunks = (min(rows, max(1, shape[0])), *(max(1, s) for s in shape[1:])) if shape else ()
            try:
                arr = root.create_array(
                    info.key, shape=shape, dtype=_NUMPY[dtype], chunks=chunks, compressors=None,
                    attributes={"tierstore": {"dtype": str(dtype).removeprefix("torch."),
                                              "codec": info.codec, "generation": info.generation}})
            except (ContainsArrayError, ContainsGroupError):
                raise UsageError(f"key {info.key!r} clashes with another key's zarr path (one "
                                 "is a prefix folder of the other)") from None
            start = 0
            for piece in iter_pieces(store, info, rows * row_bytes, cast):
                data = to_numpy(piece)
                if not shape:
                    arr[...] = data
                elif piece.shape[0]:
                    arr[start : start + piece.shape[0]] = data
                    start += piece.shape[0]
                bar.update(piece.numel() * dtype.itemsize)
    return len(infos)
