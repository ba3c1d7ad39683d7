"""bench: store throughput against the raw disk and memcpy, then codec speed and error.

    tierstore bench [--dir DIR] [--size 1GiB] [--tensor 64MiB] [--repeats 3] [--no-codecs]

Runs ``tools.bench_store`` and, when that module is installed, ``tools.bench_codecs``. Both are
imported on use, so the other commands work without them.
"""

from __future__ import annotations

import argparse
import importlib

from tools.errors import EXIT_OK, UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    p.add_argument("--dir", default=None, help="a folder on the disk to measure (default: temp)")
    p.add_argument("--size", default="1GiB", help="bytes written and read in total")
    p.add_argument("--tensor", default="64MiB", help="bytes per tensor")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    p.add_argument("--no-codecs", action="store_true", help="skip the codec benchmark")


def _module(name: str) -> object | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise  # the module exists but one of its own imports is missing: a real error
        return None


def run(args: argparse.Namespace) -> int:
    """Run the store benchmark, then the codec one if installed; the first non-zero code wins."""
    if args.repeats < 1:
        raise UsageError("--repeats must be >= 1")
    store_bench = _module("tools.bench_store")
    if store_bench is None:
        raise UsageError("tools.bench_store is not installed in this checkout")
    argv = ["--size", args.size, "--tensor", args.tensor, "--repeats", str(args.repeats)]
    if args.dir:
        argv += ["--dir", args.dir]
    code = int(store_bench.main(argv) or 0)  # type: ignore[attr-defined]
    codec_bench = None if args.no_codecs else _module("tools.bench_codecs")
    if codec_bench is not None:
        print()
        code = code or int(codec_bench.main([]) or 0)  # type: ignore[attr-defined]
    return code or EXIT_OK
