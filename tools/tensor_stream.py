"""Reading store tensors in dim-0 pieces, so that an export holds little more than one piece.

A tensor larger than ``piece_bytes`` is read as row slices (``Store.get(index=slice)``); the
pieces come in C order, so writing them one after another gives the tensor's bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

import tierstore

#: floating dtypes an export may cast to
CAST_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def out_dtype(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    """The exported dtype: ``cast`` for floating tensors, the stored dtype otherwise."""
    return cast if cast is not None and dtype.is_floating_point else dtype


def iter_pieces(store: tierstore.Store, info: tierstore.TensorInfo, piece_bytes: int,
                cast: torch.dtype | None = None) -> Iterator[torch.Tensor]:
    """The tensor of ``info`` as contiguous dim-0 pieces of at most ~``piece_bytes`` each."""
    shape = tuple(info.shape)
    target = out_dtype(info.dtype, cast)
    if not shape or info.nbytes <= piece_bytes or shape[0] <= 1:
        yield store.get(info.key).to(target).contiguous()
        return
    row_bytes = max(1, info.nbytes // shape[0])
    rows = max(1, piece_bytes // row_bytes)
    for start in range(0, shape[0], rows):
        part = store.get(info.key, index=slice(start, min(start + rows, shape[0])))
        yield part.to(target).contiguous()
        del part


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def return_freed_buffers_to_os(threshold: int = 1 << 20) -> bool:
    """Make glibc serve allocations of ``threshold`` bytes or more by mmap (freed = returned).

    Why: glibc raises its mmap threshold to the size of the last freed mmapped block (up to
    32 MiB), so after the first tensor every 16 MiB piece comes from the heap and freed pieces
    stay in the process (measured: 50-80 MiB more peak RSS over a 208 MiB export). Setting the
    threshold fixes it and turns the adjustment off. A no-op (False) outside glibc.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(-3, threshold))  # -3 = M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False
