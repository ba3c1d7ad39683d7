"""train: the trainer from the command line; with no arguments it runs the trainer's demo.

    tierstore train                                   the demo (trainer.demo.main())
    tierstore train --model CONFIG.json|HF_DIR --data tokens.npy|file.txt ... [--max-steps N]
                    [--learning-rate LR] [--per-device-train-batch-size B]
                    [--gradient-accumulation-steps G] [--output-dir DIR] ...

Data is a .npy array of token ids (loaded without pickles) or text files, read as UTF-8 bytes
(byte tokens 0-255, for models whose vocabulary has at least 256 entries); the tokens are cut
into --block-size blocks. The run's store is DIR/store (--output-dir DIR, default
trainer_output) unless --offload-dir names another folder; DIR also gets trainer_log.jsonl and
trace.json (``tierstore trace DIR`` draws it). --resume continues from the store's last commit
and fails in one line when there is none. A thin layer over ``trainer``: imported only when this runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from typing import Any

from tools.cli.errors import EXIT_OK, MalformedInput, UsageError

#: TrainingArguments fields exposed as flags: name -> type
FIELDS: dict[str, Any] = {
    "output_dir": str, "max_steps": int, "num_train_epochs": float, "learning_rate": float,
    "per_device_train_batch_size": int, "gradient_accumulation_steps": int,
    "weight_decay": float, "warmup_steps": float, "lr_scheduler_type": str,
    "max_grad_norm": float, "logging_steps": int, "save_steps": int, "seed": int,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments (all optional: none at all runs the demo)."""
    p.add_argument("--model", default=None, help="a config.json file or a Hugging Face folder")
    p.add_argument("--data", nargs="+", default=None, help=".npy token ids or text files")
    p.add_argument("--block-size", type=int, default=None, help="tokens per sequence (256)")
    for name, typ in FIELDS.items():
        p.add_argument("--" + name.replace("_", "-"), type=typ, default=None,
                       help=f"TrainingArguments.{name}")
    p.add_argument("--bf16", action="store_true", default=None, help="compute in bf16")
    p.add_argument("--offload-dir", default=None, help="where the store lives")
    p.add_argument("--max-ram-gb", type=float, default=None, help="host RAM cache budget")
    p.add_argument("--max-vram-gb", type=float, default=None, help="device window budget")
    p.add_argument("--optimizer-compression", default=None,
                   help="moment codec: q8, q4, q2, raw (default: the trainer's)")
    p.add_argument("--resume", action="store_true", default=None, help="resume from output_dir")
    p.add_argument("--save-model", default=None, help="also save a from_pretrained folder here")


def _trainer(module: str = "trainer", needs: tuple[str, ...] = ()) -> Any:
    """Import ``module`` of the trainer, or explain that it is missing (exit 2)."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise UsageError(f"{module} is not importable ({e}); install this project with its "
                         "trainer (pip install -e '.[train]')") from None
    missing = [n for n in needs if not hasattr(mod, n)]
    if missing:
        raise UsageError(f"the installed {module} lacks {', '.join(missing)}")
    return mod


def load_tokens(paths: list[str]) -> Any:
    """One 1-D int64 tensor of token ids from .npy files (no pickles) and text files."""
    import numpy as np
    import torch

    parts = []
    for path in paths:
        if path.endswith(".npy"):
            try:
                arr = np.load(path, allow_pickle=False)
            except (ValueError, RecursionError) as e:
                raise MalformedInput(f"{path}: not a plain .npy array ({e})") from None
            if arr.dtype.kind not in "iu":
                raise MalformedInput(f"{path}: token ids must be integers, got {arr.dtype}")
            parts.append(torch.from_numpy(arr.reshape(-1).astype(np.int64)))
        else:
            with open(path, "rb") as f:
                parts.append(torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long())
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


class TokenBlocks:
    """A map-style dataset of ``input_ids`` blocks cut from one token stream."""

    def __init__(self, tokens: Any, block_size: int) -> None:
        n = tokens.numel() // block_size
        if n == 0:
            raise UsageError(f"{tokens.numel()} tokens are fewer than one block of {block_size}")
        self.blocks = tokens[: n * block_size].reshape(n, block_size)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.blocks[i]}


def model_source(path: str) -> Any:
    """What ``trainer.load_model`` takes: a folder path, or a config built from a JSON file."""
    if os.path.isdir(path):
        return path
    from transformers import AutoConfig

    with open(path, "rb") as f:
        try:
            d = json.loads(f.read())
        except (ValueError, RecursionError) as e:
            raise MalformedInput(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise MalformedInput(f"{path}: a model config needs a \"model_type\"")
    try:
        return AutoConfig.for_model(**d)
    except (ValueError, RecursionError) as e:
        raise MalformedInput(f"{path}: {e}") from None


def has_checkpoint(store_dir: str) -> bool:
    """Whether ``store_dir`` is a store with a committed trainer state (read-only look, creates nothing)."""
    if not os.path.isdir(os.path.join(store_dir, "catalog")):
        return False
    import tierstore

    with tierstore.open(store_dir, mode="r", ram_budget="16MiB", device_budget=None, device="cpu") as s:
        return bool(s.versions()) and "trainer/state" in s.keys(prefix="trainer/")


def run(args: argparse.Namespace) -> int:
    """Run the demo, or train the given model on the given data."""
    options = {k: v for k, v in vars(args).items()
               if v is not None and k not in ("command", "quiet", "_module", "model")}
    if args.model is None:
        if options:
            raise UsageError("--model is required with " + ", ".join("--" + k.replace("_", "-") for k in options))
        return int(_trainer("trainer.demo", ("main",)).main([]) or EXIT_OK)
    if not args.data:
        raise UsageError("--data is required with --model")
    mt = _trainer("trainer", ("Trainer", "TrainingArguments", "init", "load_model"))
    fields = {k: getattr(args, k) for k in [*FIELDS, "bf16"] if getattr(args, k) is not None}
    try:
        targs = mt.TrainingArguments(**fields)
    except (ValueError, RecursionError) as e:
        raise UsageError(str(e)) from None
    init = {k: getattr(args, k) for k in ("offload_dir", "max_ram_gb", "max_vram_gb")
            if getattr(args, k) is not None}
    if args.optimizer_compression is not None:
        init["optimizer_compression"] = args.optimizer_compression
    out_dir = args.output_dir or getattr(targs, "output_dir", None) or "trainer_output"
    offload = init.setdefault("offload_dir", os.path.join(out_dir, "store"))
    if args.resume and not has_checkpoint(offload):
        raise UsageError(f"--resume: No valid checkpoint found in output directory {out_dir} "
                         f"(no committed run in {offload})")
    mt.init(**init)
    source = model_source(args.model)
    dataset = TokenBlocks(load_tokens(args.data), args.block_size or 256)
    model = mt.load_model(source)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and int(dataset.blocks.max()) >= vocab:
        raise UsageError(f"token id {int(dataset.blocks.max())} is outside the model's "
                         f"vocabulary of {vocab}")
    trainer = mt.Trainer(model=model, train_dataset=dataset, args=targs)
    try:
        result = trainer.train(resume_from_checkpoint=bool(args.resume))
        if args.save_model:
            trainer.save_model(args.save_model)
    finally:
        close = getattr(trainer, "close", None)
        if close is not None:
            close()
    print(f"trained {getattr(result, 'global_step', '?')} steps; "
          f"loss {getattr(result, 'training_loss', '?')}; output in {out_dir}")
    return EXIT_OK
