"""Data: the embedded default corpus, a byte-level tokenizer, fixed-length blocks, collation.

The default corpus is the text of the Python standard library's ``.py`` sources, found next to
the ``os`` module: it is on every machine that runs this code, needs no download, and is read in
sorted path order so that every run sees the same bytes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
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
    """The item order of one epoch: accelerate's seedable sampler (randperm seeded by seed + epoch).

    transformers' Trainer shuffles with exactly this permutation (``use_seedable_sampler`` is on
    by default), so a run here sees the items in the order a run there does.
    """
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(num_items, generator=g).tolist()


def has_length(dataset: Any) -> bool:
    """Whether ``len(dataset)`` works (an IterableDataset has none)."""
    try:
        len(dataset)
    except (TypeError, NotImplementedError):
        return False
    return True


def micro_batches_per_epoch(num_items: int, batch_size: int, drop_last: bool = True) -> int:
    """Micro-batches in one epoch; the last, partial one counts unless ``drop_last``."""
    micro = num_items // batch_size if drop_last else math.ceil(num_items / batch_size)
    if micro == 0:
        raise ValueError(f"dataset has {num_items} items, fewer than one batch of {batch_size}")
    return micro


def steps_per_epoch(num_items: int, batch_size: int, grad_accum: int, drop_last: bool = True) -> int:
    """Optimizer steps in one epoch (partial accumulations count)."""
    return math.ceil(micro_batches_per_epoch(num_items, batch_size, drop_last) / grad_accum)


Collator = Callable[[list[Any]], dict[str, Any]]


def complete_batch(batch: Any, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """A collator's batch with attention_mask and labels filled in where it left them out."""
    if not hasattr(batch, "keys") or "input_ids" not in batch:
        raise TypeError(f"the data collator must return a mapping with 'input_ids', got {type(batch).__name__}")
    out = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    ids = out["input_ids"].to(torch.long)
    out["input_ids"] = ids
    if out.get("attention_mask") is None:
        out["attention_mask"] = torch.ones_like(ids)
    if out.get("labels") is None:
        out["labels"] = ids.masked_fill(out["attention_mask"] == 0, IGNORE_INDEX)
    return {k: out[k] for k in ("input_ids", "attention_mask", "labels")}


def _collate_fn(collator: Collator | None, pad_token_id: int) -> Callable[[list[Any]], dict[str, torch.Tensor]]:
    if collator is None:
        return lambda items: collate(items, pad_token_id)
    return lambda items: complete_batch(collator(items), pad_token_id)


def _take(dataset: Any, idx: list[int]) -> list[Any]:
    many = getattr(dataset, "__getitems__", None)  # datasets.Dataset reads a batch at once
    return list(many(idx)) if many is not None else [dataset[i] for i in idx]


def step_batches(
    dataset: Any, batch_size: int, grad_accum: int, seed: int, start_step: int = 0, pad_token_id: int = 0,
    collator: Collator | None = None, drop_last: bool = True, shuffle: bool = True,
) -> Iterator[tuple[int, float, list[dict[str, torch.Tensor]]]]:
    """Yield (step, epoch after the step, micro-batches) forever from ``start_step``, deterministically.

    ``epoch`` is transformers' fractional ``state.epoch``: epochs done plus the share of this
    epoch's micro-batches consumed. An iterable dataset (no ``len``) is read in its own order and
    restarted when it runs out (its ``set_epoch`` is called, as transformers does).
    """
    fn = _collate_fn(collator, pad_token_id)
    if not has_length(dataset):
        yield from _iterable_batches(dataset, batch_size, grad_accum, start_step, fn, drop_last)
        return
    n = len(dataset)
    micro_per_epoch = micro_batches_per_epoch(n, batch_size, drop_last)
    per_epoch = math.ceil(micro_per_epoch / grad_accum)
    step = start_step
    while True:
        epoch, k = divmod(step, per_epoch)
        order = epoch_order(n, seed, epoch) if shuffle else list(range(n))
        first = k * grad_accum
        last = min(first + grad_accum, micro_per_epoch)
        micro = [fn(_take(dataset, order[j * batch_size: (j + 1) * batch_size])) for j in range(first, last)]
        yield step, epoch + last / micro_per_epoch, micro
        step += 1


def _iterable_batches(dataset: Any, batch_size: int, grad_accum: int, start_step: int,
                      fn: Callable[[list[Any]], dict[str, torch.Tensor]], drop_last: bool,
                      ) -> Iterator[tuple[int, float, list[dict[str, torch.Tensor]]]]:
    epoch, step, seen = 0, 0, 0
    skip = start_step * grad_accum  # micro-batches a resumed run has already trained on
    while True:
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        it = iter(dataset)
        micro: list[dict[str, torch.Tensor]] = []
        got_any = False
        while True:
            items = [x for _, x in zip(range(batch_size), it, strict=False)]
            if not items or (drop_last and len(items) < batch_size):
                break
            got_any = True
            seen += 1
            if seen <= skip:
                continue
            micro.append(fn(items))
            if len(micro) == grad_accum:
                step += 1
                yield start_step + step - 1, float(epoch), micro
                micro = []
        if micro:
            step += 1
            yield start_step + step - 1, float(epoch), micro
        if not got_any:
            raise ValueError(f"the iterable dataset yielded no batch of {batch_size} items")
        epoch += 1


def eval_batches(dataset: Any, batch_size: int, pad_token_id: int = 0, collator: Collator | None = None,
                 drop_last: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of the evaluation set in its order (transformers' sequential eval sampler)."""
    fn = _collate_fn(collator, pad_token_id)
    if not has_length(dataset):
        it = iter(dataset)
        while True:
            items = [x for _, x in zip(range(batch_size), it, strict=False)]
            if not items or (drop_last and len(items) < batch_size):
                return
            yield fn(items)
    n = len(dataset)
    stop = (n // batch_size) * batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        yield fn(_take(dataset, list(range(start, min(start + batch_size, n)))))


def drop_unused_columns(dataset: Any, model: Any) -> Any:
    """A datasets.Dataset without the columns ``model.forward`` does not take (transformers' rule)."""
    import inspect

    names = getattr(dataset, "column_names", None)
    remove = getattr(dataset, "remove_columns", None)
    if not isinstance(names, list) or remove is None:
        return dataset
    accepted = set(inspect.signature(model.forward).parameters) | {"label", "label_ids", "labels"}
    unused = [c for c in names if c not in accepted]
    if unused and len(unused) == len(names):
        raise ValueError(f"no column of the dataset ({names}) is an input of {type(model).__name__}.forward")
    return remove(unused) if unused else dataset
