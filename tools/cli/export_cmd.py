"""export: write a store's tensors as safetensors shards, a Hugging Face folder, or zarr.

    tierstore export STORE OUT --format hf|safetensors|zarr [--dtype bf16|fp32]
                     [--max-shard-size 5GB] [--version V] [--ram-budget 256MiB]

Tensors stream one dim-0 piece at a time, so peak memory stays near the largest piece (at most
the largest tensor) whatever the model's size. ``hf`` adds the config.json and
the other files that ``tierstore import`` or the trainer kept under ``meta/hf/`` (config.json,
generation_config.json, a tokenizer's files; or ``--config``), so
``AutoModelForCausalLM.from_pretrained(OUT)`` (and ``AutoTokenizer``) load the folder. hf and safetensors exports skip
training state: keys under opt/, grad/, trainer/ and meta/ (``--all-keys`` keeps them).
OUT must not exist or be empty; files are written to OUT.partial and renamed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch

import tierstore
from tierstore.export import write_safetensors
from tools.cli.errors import EXIT_OK, UsageError
from tools.cli.heap import return_freed_buffers_to_os
from tools.cli.hf_meta import HF_META, read_meta_file
from tools.cli.sizes import human_bytes, size_arg
from tools.cli.zarr_writer import write_zarr

#: floating dtypes an export may cast to
CAST_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}

#: key prefixes that are training state, not model weights
STATE_PREFIXES = ("opt/", "grad/", "trainer/", "meta/")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    p.add_argument("store", metavar="STORE", help="the store folder")
    p.add_argument("out", metavar="OUT", help="the folder to create")
    p.add_argument("--format", required=True, choices=("hf", "safetensors", "zarr"))
    p.add_argument("--dtype", choices=sorted(CAST_DTYPES), default=None,
                   help="cast floating tensors (default: keep the stored dtype)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="safetensors shard limit, bytes or e.g. 500MB (default 5GB)")
    p.add_argument("--version", type=int, default=None, help="a retained commit (default: last)")
    p.add_argument("--ram-budget", default="256MiB", help="the store's RAM cache while reading")
    p.add_argument("--piece-size", default="64MiB",
                   help="larger tensors are read in dim-0 pieces of about this size")
    p.add_argument("--config", default=None, help="config.json to use for --format hf")
    p.add_argument("--all-keys", action="store_true", help="also export opt/ grad/ trainer/ meta/")


def hf_config(store: tierstore.Store, config_path: str | None, cast: torch.dtype | None) -> dict:
    """The config.json to write: from ``--config`` or the store, with ``dtype`` set on a cast."""
    if config_path is not None:
        with open(config_path, "rb") as f:
            raw = f.read()
    else:
        raw = read_meta_file(store, "config.json")
        if raw is None:
            raise UsageError(f"the store has no {HF_META}config.json (import a Hugging Face "
                             "folder, or pass --config PATH, or use --format safetensors)")
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise UsageError(f"config.json is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise UsageError("config.json must hold a JSON object")
    if cast is not None:
        name = str(cast).removeprefix("torch.")
        config["dtype"] = name  # transformers 5 reads "dtype"; 4.x reads "torch_dtype"
        if "torch_dtype" in config:
            config["torch_dtype"] = name
    return config


def _prepare_out(out: str) -> str:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f"{out} exists and is not an empty folder; choose a new OUT")
    partial = out.rstrip(os.sep) + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    return partial


def run(args: argparse.Namespace) -> int:
    """Export the version; the folder appears at OUT only when complete."""
    max_shard = size_arg(args.max_shard_size, "--max-shard-size")
    piece = size_arg(args.piece_size, "--piece-size")
    cast = CAST_DTYPES[args.dtype] if args.dtype else None
    out = os.path.abspath(args.out)
    partial = _prepare_out(out)
    quiet = getattr(args, "quiet", False)
    return_freed_buffers_to_os()  # peak memory near one piece, not a heap of freed pieces
    store = tierstore.open(args.store, mode="r", version=args.version,
                           ram_budget=size_arg(args.ram_budget, "--ram-budget"), device_budget=None,
                           device="cpu")
    try:
        keys = store.keys()
        if args.format != "zarr" and not args.all_keys:
            keys = [k for k in keys if not k.startswith(STATE_PREFIXES)]
        infos = [store.info(k) for k in keys]
        config = hf_config(store, args.config, cast) if args.format == "hf" else None
        if args.format == "zarr":
            write_zarr(store, infos, partial, cast, chunk_bytes=piece, quiet=quiet)
        else:
            os.makedirs(partial)
            write_safetensors(store, infos, partial, max_shard, cast, piece, quiet)
        if config is not None:
            with open(os.path.join(partial, "config.json"), "w") as f:
                json.dump(config, f, indent=2)
                f.write("\n")
            # generation config, tokenizer files (kept by import, or by the trainer's processing_class)
            for key in store.keys(prefix=HF_META):
                name = key[len(HF_META):]
                if name == "config.json" or "/" in name:
                    continue
                with open(os.path.join(partial, name), "wb") as f:
                    f.write(read_meta_file(store, name) or b"")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        store.close(commit=False)
    if os.path.isdir(out):
        os.rmdir(out)  # empty, checked above
    os.rename(partial, out)
    total = sum(i.nbytes for i in infos)
    print(f"exported {len(infos)} tensors ({human_bytes(total)} stored dtype) to {out} "
          f"as {args.format}")
    return EXIT_OK
