"""bench: store throughput against the raw disk and memcpy, then codec speed and error.

    tierstore bench [--dir DIR] [--size 1GiB] [--tensor 64MiB] [--repeats 3] [--no-codecs]
    tierstore bench --list

Runs ``tools.bench.store`` and, when that module is installed, ``tools.bench.codecs``. Both are
imported on use, so the other commands work without them. ``--list`` prints every benchmark
(what it measures, its command) and runs none.
"""

from __future__ import annotations

import argparse
import importlib

from tools.cli.errors import EXIT_OK, UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    p.add_argument("--dir", default=None, help="a folder on the disk to measure (default: temp)")
    p.add_argument("--size", default="1GiB", help="bytes written and read in total")
    p.add_argument("--tensor", default="64MiB", help="bytes per tensor")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    p.add_argument("--no-codecs", action="store_true", help="skip the codec benchmark")
    p.add_argument("--list", action="store_true",
                   help="list every benchmark (what it measures, its command) and run none")


def listing() -> str:
    """Every benchmark: its command on one line, what it measures indented below."""
    from tools.bench import benchmarks

    lines = ["Benchmarks (tierstore bench runs tools.bench.store, then tools.bench.codecs):"]
    for b in benchmarks():
        lines += [b.command, f"    {b.measures}"]
    lines.append("Each takes --help; measured figures: docs/benchmarks.md")
    return "\n".join(lines)


def _module(name: str) -> object | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise  # the module exists but one of its own imports is missing: a real error
        return None


def run(args: argparse.Namespace) -> int:
    """Run the store benchmark, then the codec one if installed; the first non-zero code wins.
    With ``--list``, print the benchmarks instead."""
    if args.list:
        print(listing())
        return EXIT_OK
    if args.repeats < 1:
        raise UsageError("--repeats must be >= 1")
    store_bench = _module("tools.bench.store")
    if store_bench is None:
        raise UsageError("tools.bench.store is not installed in this checkout")
    argv = ["--size", args.size, "--tensor", args.tensor, "--repeats", str(args.repeats)]
    if args.dir:
        argv += ["--dir", args.dir]
    code = int(store_bench.main(argv) or 0)  # type: ignore[attr-defined]
    codec_bench = None if args.no_codecs else _module("tools.bench.codecs")
    if codec_bench is not None:
        print()
        code = code or int(codec_bench.main([]) or 0)  # type: ignore[attr-defined]
    print("\nthe other benchmarks: tierstore bench --list")
    return code or EXIT_OK
