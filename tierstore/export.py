"""Writing store tensors as (sharded) safetensors files, one tensor piece at a time.

The header of a shard needs only shapes and dtypes (from ``Store.info``), so it is written first
and the data streams after it: peak memory is one piece of one tensor, not a shard. Pieces are
dim-0 slices (``Store.get(index=slice)``) in C order, so writing them one after another gives the
tensor's bytes. Shards follow the Hugging Face layout: ``model.safetensors`` alone, or
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json`` when the tensors
exceed the shard size. Both ``tierstore export`` and the trainer's ``save_model`` write this way.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from tierstore.dtypes import as_bytes
from tierstore.errors import CorruptData, InvalidKey
from tierstore.records import TensorInfo
from tierstore.safetensors import header_bytes

if TYPE_CHECKING:
    from tierstore.sync import Store

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def out_dtype(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    """The exported dtype: ``cast`` for floating tensors, the stored dtype otherwise."""
    return cast if cast is not None and dtype.is_floating_point else dtype


def iter_pieces(store: Store, info: TensorInfo, piece_bytes: int,
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


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Keys grouped into shards in order; a shard closes before it would pass the limit.

    A tensor larger than the limit gets a shard of its own (as transformers does).
    """
    shards: list[list[str]] = [[]]
    used = 0
    for key, n in sizes:
        if shards[-1] and used + n > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += n
    return [s for s in shards if s] or [[]]


def write_shard(store: Store, path: str, infos: Sequence[TensorInfo],
                cast: torch.dtype | None, piece_bytes: int, bar: tqdm) -> None:
    """One safetensors file holding ``infos``' tensors, streamed piece by piece."""
    # widest dtypes first: with the 8-byte aligned header every tensor starts aligned
    ordered = sorted(infos, key=lambda i: -out_dtype(i.dtype, cast).itemsize)
    head, _ = header_bytes(
        (i.key, out_dtype(i.dtype, cast), tuple(i.shape)) for i in ordered)
    with open(path, "wb") as f:
        f.write(head)
        for info in ordered:
            expect = math.prod(info.shape) * out_dtype(info.dtype, cast).itemsize
            written = 0
            for piece in iter_pieces(store, info, piece_bytes, cast):
                written += f.write(as_bytes(piece).numpy())
                bar.update(piece.numel() * piece.element_size())
                del piece
            if written != expect:  # the header promised these bytes: never write a lying file
                raise CorruptData(f"{info.key!r}: read {written} bytes, expected {expect}",
                                  info.key, None)


def write_safetensors(store: Store, infos: Sequence[TensorInfo], out: str,
                      max_shard_bytes: int, cast: torch.dtype | None = None,
                      piece_bytes: int = 64 << 20, quiet: bool = False) -> list[str]:
    """Write ``infos``' tensors into the folder ``out``; return the file names written."""
    by_key = {i.key: i for i in infos}
    if "__metadata__" in by_key:
        raise InvalidKey("key '__metadata__' is reserved by the safetensors header; exclude it")
    sizes = [(i.key, math.prod(i.shape) * out_dtype(i.dtype, cast).itemsize) for i in infos]
    shards = plan_shards(sizes, max_shard_bytes)
    total = sum(n for _, n in sizes)
    names = ([SINGLE_NAME] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    with tqdm(total=total, desc="export", unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr, disable=quiet) as bar:
        for name, keys in zip(names, shards, strict=True):
            write_shard(store, os.path.join(out, name), [by_key[k] for k in keys], cast,
                        piece_bytes, bar)
    if len(shards) == 1:
        return names
    index = {"metadata": {"total_size": total},
             "weight_map": {k: name for name, keys in zip(names, shards, strict=True) for k in keys}}
    with open(os.path.join(out, INDEX_NAME), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
    return [*names, INDEX_NAME]
