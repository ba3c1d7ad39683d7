"""generate: stream a stored model's layers through the device window and print the continuation.

    tierstore generate STORE --prompt TEXT [--prompt TEXT ...] [--max-new-tokens 32]
                       [--do-sample --temperature T --top-k K --top-p P --seed S]
                       [--ram-budget 1GiB] [--device-budget 256MiB] [--device cpu|cuda]

STORE is a store the trainer wrote or ``tierstore import`` filled from a Hugging Face folder
(its ``meta/hf/config.json`` says what the model is). The prompts are encoded with the
tokenizer the store keeps under ``meta/hf/`` (a Trainer with a ``processing_class`` puts it
there); without one, as UTF-8 bytes (token ids 0-255, for byte-level models such as the
demo's). Several prompts run as one left-padded batch: one pass over the weights per token for
all of them. The KV cache lives in the store under the budgets and is deleted afterwards; the
store's committed versions are never changed. A progress bar shows tokens/s (``-q``: none);
the last line on stderr gives the totals. ``--ids`` prints token ids instead of text.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

from tools.cli.errors import EXIT_OK, UsageError
from tools.cli.sizes import size_arg


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    p.add_argument("store", metavar="STORE", help="a store the trainer wrote or tierstore import filled")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling generator")
    p.add_argument("--ram-budget", default=None, help="RAM tier budget (default: the trainer's)")
    p.add_argument("--device-budget", default="256MiB", help="device window budget")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--ids", action="store_true", help="print token ids, not text")


def _tokenizer(store: Any) -> Any:
    """The tokenizer kept under meta/hf/, or None."""
    from tools.cli.hf_meta import HF_META

    names = [k[len(HF_META):] for k in store.keys(prefix=HF_META)]
    if "tokenizer_config.json" not in names and "tokenizer.json" not in names:
        return None
    from transformers import AutoTokenizer

    from tools.cli.hf_meta import read_meta_file

    with tempfile.TemporaryDirectory(prefix="tierstore-tok-") as tmp:
        for name in names:
            raw = read_meta_file(store, name)
            if raw is not None and "/" not in name:
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(raw)
        return AutoTokenizer.from_pretrained(tmp)


def _encode(prompts: list[str], tok: Any, vocab: int) -> tuple[Any, Any]:
    """Left-padded ids and mask of the prompts."""
    import torch

    if tok is not None:
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token or tok.unk_token
        enc = tok(prompts, return_tensors="pt", padding=True)
        return enc["input_ids"], enc["attention_mask"]
    if vocab < 256:
        raise UsageError(f"the store keeps no tokenizer and the model's vocabulary ({vocab}) is too small "
                         "for byte tokens")
    rows = [list(p.encode("utf-8")) for p in prompts]
    if any(not r for r in rows):
        raise UsageError("--prompt must not be empty")
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def _decode(ids: list[int], tok: Any) -> str:
    if tok is not None:
        return str(tok.decode(ids, skip_special_tokens=True))
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", "replace")


def run(args: argparse.Namespace) -> int:
    """Generate from the store; print each prompt's continuation on stdout."""
    from tools.cli.train_cmd import _trainer

    mt = _trainer("trainer", needs=("generate",))
    import torch
    from tqdm.auto import tqdm

    from trainer.checkpoint import is_store

    if not is_store(args.store):
        raise UsageError(f"{args.store}: not a tierstore store (no catalog/ in it)")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    vram = size_arg(args.device_budget, "--device-budget")
    ram = size_arg(args.ram_budget, "--ram-budget") if args.ram_budget is not None else None
    mt.init(offload_dir=args.store, max_vram_gb=f"{vram}B", max_ram_gb=None if ram is None else f"{ram}B",
            device=args.device)
    from trainer.generate import skeleton_from_store
    from trainer.session import close_store, open_store

    store = open_store(args.store)
    bar = None
    try:
        skeleton = skeleton_from_store(store)
        tok = _tokenizer(store)
        ids, mask = _encode(args.prompt, tok, int(getattr(skeleton.config, "vocab_size", 0)))
        batch = ids.shape[0]
        bar = tqdm(total=args.max_new_tokens, desc="generate", unit="tok", disable=bool(args.quiet), file=sys.stderr)
        t0 = time.perf_counter()
        steps = 0

        def on_token(_new: torch.Tensor) -> None:
            nonlocal steps
            steps += 1
            bar.update(1)
            dt = time.perf_counter() - t0
            bar.set_postfix(tok_s=f"{steps * batch / dt:.1f}" if dt > 0 else "-")

        out = mt.generate(store, ids, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, attention_mask=mask,
                          seed=args.seed, device=args.device, on_token=on_token)
        dt = time.perf_counter() - t0
        bar.close()
        width = ids.shape[1]
        for i in range(batch):
            new = out[i, width:].tolist()
            print(" ".join(map(str, new)) if args.ids else args.prompt[i] + _decode(new, tok))
        print(f"{steps} tokens x {batch} prompts in {dt:.2f} s: {steps * batch / dt:.1f} tokens/s",
              file=sys.stderr)
    finally:
        if bar is not None:
            bar.close()
        close_store(store)  # no commit: the KV blocks are gone and the store's versions unchanged
    return EXIT_OK
