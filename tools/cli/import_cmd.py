"""import: copy a .safetensors file or a (sharded) Hugging Face folder into a store.

    tierstore import SRC STORE [--codec raw] [--ram-budget 256MiB]

Every header (and the folder's model.safetensors.index.json) is validated before the store is
touched, so a malformed input commits nothing. Tensors then stream one at a time with plain
reads (nothing is unpickled). A folder's config.json and generation_config.json are kept as
uint8 tensors under ``meta/hf/`` for ``tierstore export --format hf``. One commit at the end
names the source.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tqdm import tqdm

import tierstore
from tierstore.export import INDEX_NAME, SINGLE_NAME
from tierstore.safetensors import SafetensorsHeader, read_header, read_tensor
from tools.cli.errors import EXIT_OK, MalformedInput, UsageError
from tools.cli.heap import return_freed_buffers_to_os
from tools.cli.hf_meta import HF_FILES, put_meta_file
from tools.cli.sizes import human_bytes, size_arg


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    p.add_argument("src", metavar="SRC", help="a .safetensors file or a Hugging Face folder")
    p.add_argument("store", metavar="STORE", help="the store folder (created if missing)")
    p.add_argument("--codec", default="raw", help="codec of the stored tensors (default raw)")
    p.add_argument("--ram-budget", default="256MiB", help="the store's RAM cache while writing")


def _index_files(folder: str) -> list[str]:
    """The shard files named by the folder's index, validated; in first-use order."""
    path = os.path.join(folder, INDEX_NAME)
    try:
        with open(path, "rb") as f:
            index = json.loads(f.read().decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise MalformedInput(f"{path}: not valid UTF-8 JSON ({e})") from None
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
        raise MalformedInput(f"{path}: needs a \"weight_map\" object of tensor name -> file name")
    files: list[str] = []
    for name in wmap.values():
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise MalformedInput(f"{path}: shard {name!r} is not a plain file name in the folder")
        if name not in files:
            files.append(name)
    return files


def source_files(src: str) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of SRC, and the index's weight map when SRC is a sharded folder."""
    if os.path.isfile(src):
        return [src], None
    if not os.path.isdir(src):
        raise UsageError(f"{src}: no such file or folder")
    if os.path.isfile(os.path.join(src, INDEX_NAME)):
        names = _index_files(src)
        with open(os.path.join(src, INDEX_NAME), "rb") as f:
            wmap = json.load(f)["weight_map"]
        return [os.path.join(src, n) for n in names], wmap
    if os.path.isfile(os.path.join(src, SINGLE_NAME)):
        return [os.path.join(src, SINGLE_NAME)], None
    raise UsageError(f"{src}: holds neither {INDEX_NAME} nor {SINGLE_NAME}")


def validate(files: list[str], wmap: dict[str, str] | None) -> list[SafetensorsHeader]:
    """Every header, checked alone and against each other and the index."""
    for path in files:
        if not os.path.isfile(path):
            raise MalformedInput(f"{path}: the index names this shard but it is missing")
    headers = [read_header(p) for p in files]
    owner: dict[str, str] = {}
    for h in headers:
        for e in h.tensors:
            if e.name in owner:
                raise MalformedInput(f"tensor {e.name!r} is in both {owner[e.name]} and {h.path}")
            owner[e.name] = h.path
            if wmap is not None and wmap.get(e.name) != os.path.basename(h.path):
                raise MalformedInput(f"{h.path}: tensor {e.name!r} is not mapped to this file by "
                                     f"{INDEX_NAME}")
    if wmap is not None:
        missing = sorted(set(wmap) - set(owner))
        if missing:
            raise MalformedInput(f"{INDEX_NAME} names {len(missing)} tensors no shard holds, "
                                 f"e.g. {missing[0]!r}")
    return headers


def hf_json_files(src: str) -> dict[str, bytes]:
    """The folder's config.json and generation_config.json bytes (checked to be JSON objects)."""
    found: dict[str, bytes] = {}
    if not os.path.isdir(src):
        return found
    for name in HF_FILES:
        path = os.path.join(src, name)
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            raw = f.read()
        try:
            ok = isinstance(json.loads(raw.decode("utf-8")), dict)
        except (ValueError, RecursionError):
            ok = False
        if not ok:
            raise MalformedInput(f"{path}: not a JSON object")
        found[name] = raw
    return found


def run(args: argparse.Namespace) -> int:
    """Validate everything, then stream the tensors into the store and commit once."""
    src = os.path.abspath(args.src)
    files, wmap = source_files(src)
    headers = validate(files, wmap)
    extras = hf_json_files(src)
    total = sum(e.nbytes for h in headers for e in h.tensors)
    try:
        tierstore.codecs.get(args.codec)
    except tierstore.StoreError as e:
        raise UsageError(str(e)) from None
    return_freed_buffers_to_os()  # one tensor at a time should cost one tensor of RSS
    store = tierstore.open(args.store, mode="a", ram_budget=size_arg(args.ram_budget, "--ram-budget"), device_budget=None,
                           device="cpu")
    try:
        with tqdm(total=total, desc="import", unit="B", unit_scale=True, unit_divisor=1024,
                  file=sys.stderr, disable=getattr(args, "quiet", False)) as bar:
            for h in headers:
                fd = os.open(h.path, os.O_RDONLY)
                try:
                    for entry in h.tensors:
                        t = read_tensor(fd, entry)
                        store.put(entry.name, t, codec=args.codec)
                        del t  # put has copied it: keep one tensor alive at a time
                        bar.update(entry.nbytes)
                finally:
                    os.close(fd)
        for name, raw in extras.items():
            put_meta_file(store, name, raw)
        version = store.commit(message=f"import {src}")
    finally:
        store.close(commit=False)  # on an error nothing of this import is committed
    n = sum(len(h.tensors) for h in headers)
    print(f"imported {n} tensors ({human_bytes(total)}) from {len(files)} file"
          f"{'s' * (len(files) != 1)} into {args.store} as version {version}")
    return EXIT_OK
