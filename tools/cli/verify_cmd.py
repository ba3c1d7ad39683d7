"""verify: re-read every chunk of a version, check its crc32c and the catalog against the files.

    tierstore verify STORE [--version V]

Prints one line per fault (key and chunk) and exits 1 when any is found, 0 when the version is
intact. Besides the checksums of every chunk it checks that each tensor's ``zarr.json`` agrees
with the catalog (key, generation, shape) and that no stray chunk files sit beside the chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tqdm import tqdm

import tierstore
from tools.cli.errors import EXIT_FAULT, EXIT_OK
from tools.cli.sizes import human_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    p.add_argument("store", metavar="STORE", help="the store folder")
    p.add_argument("--version", type=int, default=None, help="a retained commit (default: last)")


def _chunk_files(folder: str) -> int:
    """Chunk files under a generation folder (zarr's default key encoding puts them under c/)."""
    root = os.path.join(folder, "c")
    if os.path.isfile(root):
        return 1  # a 0-d tensor's only chunk is the file "c"
    return sum(len(files) for _, _, files in os.walk(root))


def check_metadata(store: tierstore.Store, key: str) -> list[tierstore.CorruptData]:
    """Faults where the tensor's zarr.json or its chunk files disagree with the catalog."""
    info = store.info(key)
    folder = store.zarr_path(key)
    meta_path = os.path.join(folder, "zarr.json")
    try:
        with open(meta_path, "rb") as f:
            meta = json.load(f)
        attrs = meta["attributes"]["tierstore"]
        found = (attrs["key"], int(attrs["generation"]), tuple(meta["shape"]))
    except FileNotFoundError:
        return [tierstore.CorruptData(f"{key!r}: zarr.json is missing: {meta_path}", key, None)]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        return [tierstore.CorruptData(f"{key!r}: zarr.json is unreadable ({e}): {meta_path}",
                                      key, None)]
    faults = []
    if found != (key, info.generation, tuple(info.shape)):
        faults.append(tierstore.CorruptData(
            f"{key!r}: zarr.json says key {found[0]!r} generation {found[1]} shape {found[2]}, "
            f"the catalog says generation {info.generation} shape {tuple(info.shape)}", key, None))
    n = _chunk_files(folder)
    if n > info.chunks:
        faults.append(tierstore.CorruptData(
            f"{key!r}: {n} chunk files on disk, the catalog names {info.chunks}", key, None))
    return faults


def run(args: argparse.Namespace) -> int:
    """Verify the version; print each fault; 1 if any."""
    store = tierstore.open(args.store, mode="r", version=args.version, ram_budget=None,
                           device_budget=None, device="cpu")
    try:
        keys = store.keys()
        infos = [store.info(k) for k in keys]
        faults: list[tierstore.CorruptData] = []
        commits = store.versions()
        opened = next((c for c in commits if c.version == args.version), None) \
            if args.version is not None else (commits[-1] if commits else None)
        if opened is not None and sorted(opened.generations) != keys:
            faults.append(tierstore.CorruptData(
                f"commit {opened.version} names {len(opened.generations)} tensors, the opened "
                f"version holds {len(keys)}"))
        total = sum(i.stored_nbytes for i in infos)
        with tqdm(total=total, desc="verify", unit="B", unit_scale=True, unit_divisor=1024,
                  file=sys.stderr, disable=getattr(args, "quiet", False)) as bar:
            for info in infos:
                found = store.verify([info.key]) + check_metadata(store, info.key)
                for fault in found:
                    tqdm.write(f"FAULT {fault.key} chunk {'-' if fault.chunk is None else fault.chunk}:"
                               f" {fault}", file=sys.stdout)
                faults += found
                bar.update(info.stored_nbytes)
    finally:
        store.close(commit=False)
    version = opened.version if opened is not None else None
    chunks = sum(i.chunks for i in infos)
    print(f"verified version {version}: {len(keys)} tensors, {chunks} chunks, "
          f"{human_bytes(total)}: {len(faults)} fault{'s' * (len(faults) != 1)}")
    return EXIT_FAULT if faults else EXIT_OK
