"""Data: the embedded default corpus, a byte-level tokenizer, fixed-length blocks, collation.

The default corpus is the text of the Python standard library's ``.py`` sources, found next to
the ``os`` module: it is on every machine that runs this code, needs no download, and is read in
sorted path order so that every run sees the same bytes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; three specials follow them."""

    bos_token_id: int = 256
    eos_token_id: int = 257
    pad_token_id: int = 258

    @property
    def vocab_size(self) -> int:
        """Number of token ids: 256 bytes plus the specials."""
        return 259

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """UTF-8 bytes of ``text`` as token ids, optionally framed by BOS/EOS."""
        ids = list(text.encode("utf-8"))
        return ([self.bos_token_id] if add_bos else []) + ids + ([self.eos_token_id] if add_eos else [])

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Text of the byte tokens in ``ids``; specials and padding are dropped."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def stdlib_source_files() -> list[str]:
    """The standard library's top-level ``.py`` files, sorted, as absolute paths."""
    root = os.path.dirname(os.path.abspath(os.__file__))
    # Top level only: site-packages and test suites below it vary between installations.
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    return [os.path.join(root, n) for n in names if os.path.isfile(os.path.join(root, n))]


def default_corpus_bytes(max_bytes: int | None = 4 << 20) -> bytes:
    """The embedded corpus: stdlib sources joined by blank lines, cut at ``max_bytes``."""
    parts: list[bytes] = []
    total = 0
    for path in stdlib_source_files():
        with open(path, "rb") as f:
            data = f.read()
        parts.append(data + b"\n\n")
        total += len(data) + 2
        if max_bytes is not None and total >= max_bytes:
            break
    blob = b"".join(parts)
    return blob if max_bytes is None else blob[:max_bytes]


class BlockDataset(Dataset):
    """Fixed-length ``input_ids`` blocks cut from one token stream (the tail is dropped)."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2 to have a next-token target, got {block_size}")
        n = tokens.numel() // block_size
        if n == 0:
            raise ValueError(f"{tokens.numel()} tokens are fewer than one block of {block_size}")
        self.blocks = tokens[: n * block_size].reshape(n, block_size).to(torch.long)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i]}


def default_dataset(block_size: int = 256, max_bytes: int | None = 4 << 20) -> BlockDataset:
    """Blocks of byte tokens (all < 256) from the embedded stdlib corpus."""
    data = default_corpus_bytes(max_bytes)
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return BlockDataset(tokens, block_size)


def _as_long_tensor(x: Any, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(torch.long).reshape(-1)
    try:
        return torch.as_tensor(x, dtype=torch.long).reshape(-1)
    except (TypeError, ValueError) as e:
        raise TypeError(f"dataset item field {what!r} is not a sequence of ints: {e}") from None


def collate(items: Sequence[dict[str, Any]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Pad items to the longest one: input_ids, attention_mask, labels (-100 on padding)."""
    if not items:
        raise ValueError("cannot collate an empty batch")
    ids, labels, masks = [], [], []
    for item in items:
        if not hasattr(item, "__getitem__") or "input_ids" not in item:
            raise TypeError(f"dataset items must be mappings with 'input_ids', got {type(item).__name__}")
        x = _as_long_tensor(item["input_ids"], "input_ids")
        m = _as_long_tensor(item["attention_mask"], "attention_mask") if "attention_mask" in item and item["attention_mask"] is not None else torch.ones_like(x)
        y = _as_long_tensor(item["labels"], "labels") if "labels" in item and item["labels"] is not None else x.masked_fill(m == 0, IGNORE_INDEX)
        if not (x.shape == m.shape == y.shape):
            raise ValueError(f"input_ids, attention_mask and labels differ in length: {x.shape}, {m.shape}, {y.shape}")
        ids.append(x)
        labels.append(y)
        masks.append(m)
    width = max(x.numel() for x in ids)

    def pad(seqs: list[torch.Tensor], value: int) -> torch.Tensor:
        out = torch.full((len(seqs), width), value, dtype=torch.long)
        for i, s in enumerate(seqs):
            out[i, : s.numel()] = s
        return out

    return {"input_ids": pad(ids, pad_token_id), "attention_mask": pad(masks, 0), "labels": pad(labels, IGNORE_INDEX)}


def epoch_order(num_items: int, seed: int, epoch: int) -> list[int]:
    """The item order of one epoch: a permutation seeded by (seed, epoch), same on every run."""
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_items, generator=g).tolist()


def steps_per_epoch(num_items: int, batch_size: int, grad_accum: int) -> int:
    """Optimizer steps in one epoch (a last partial batch is dropped; partial accumulations count)."""
    micro = num_items // batch_size
    if micro == 0:
        raise ValueError(f"dataset has {num_items} items, fewer than one batch of {batch_size}")
    return math.ceil(micro / grad_accum)


def step_batches(
    dataset: Any, batch_size: int, grad_accum: int, seed: int, start_step: int = 0, pad_token_id: int = 0
) -> Iterator[tuple[int, int, list[dict[str, torch.Tensor]]]]:
    """Yield (step, epoch, micro-batches) forever from ``start_step`` in the deterministic order."""
    n = len(dataset)
    per_epoch = steps_per_epoch(n, batch_size, grad_accum)
    micro_per_epoch = n // batch_size
    step = start_step
    while True:
        epoch, k = divmod(step, per_epoch)
        order = epoch_order(n, seed, epoch)
        first = k * grad_accum
        last = min(first + grad_accum, micro_per_epoch)
        micro = []
        for j in range(first, last):
            idx = order[j * batch_size : (j + 1) * batch_size]
            micro.append(collate([dataset[i] for i in idx], pad_token_id))
        yield step, epoch, micro
        step += 1
