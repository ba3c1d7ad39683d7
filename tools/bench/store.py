"""Store throughput vs the raw disk and memcpy, measured in one run.

    python -m tools.bench.store [--dir DIR] [--size 1GiB] [--tensor 64MiB] [--repeats 3]

- put: sequential puts of fp32 tensors through ``commit`` (fsync'd) vs a plain Python
  write + fsync of the same bytes to files on the same disk; once copying (``put``'s default:
  the caller may reuse its tensor at once) and once handing the memory over (``copy=False``);
- cold get: a fresh read-only open after evicting the files from the page cache
  (posix_fadvise DONTNEED) vs plain reads of the baseline files, evicted the same way;
- warm get: a get served by the RAM tier vs a memcpy of the same bytes into a new tensor.
Each figure is the median of ``--repeats`` runs; the ratios are what to compare across machines.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

import tierstore
from tierstore.config import human_bytes, parse_size


def evict(path: str) -> None:
    """Drop a file's (or a folder's files') pages from the page cache."""
    paths = [path]
    if os.path.isdir(path):
        paths = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def alternated_medians(fns: list[Callable[[], None]], repeats: int,
                       setup: Callable[[], None] | None = None) -> list[float]:
    """Median wall times of each of ``fns``, run in turn ``repeats`` times (``setup`` untimed).

    Alternating keeps a shared machine's drift (other jobs, page-cache and allocator state) from
    landing on one side only.
    """
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for side, fn in enumerate(fns):
            if setup:
                setup()
            t0 = time.perf_counter()
            fn()
            times[side].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def paired_medians(store_fn: Callable[[], None], base_fn: Callable[[], None], repeats: int,
                   setup: Callable[[], None] | None = None) -> tuple[float, float]:
    """``alternated_medians`` of a store side and its baseline."""
    a, b = alternated_medians([store_fn, base_fn], repeats, setup)
    return a, b


def run(root: str, total: int, tensor_bytes: int, repeats: int) -> list[tuple[str, float, float]]:
    """Run every benchmark; return rows of (name, store GB/s, baseline GB/s)."""
    n = max(1, total // tensor_bytes)
    tensors = [torch.randn(tensor_bytes // 4) for _ in range(n)]
    nbytes = n * tensor_bytes
    raw_dir = os.path.join(root, "raw")
    store_dir = os.path.join(root, "store")
    opts = dict(ram_budget=max(4 * tensor_bytes, 256 << 20), device_budget=None, chunk_bytes="16MiB")

    def clean() -> None:
        for d in (raw_dir, store_dir):
            shutil.rmtree(d, ignore_errors=True)
        os.makedirs(raw_dir)

    def raw_write() -> None:
        for i, t in enumerate(tensors):
            with open(os.path.join(raw_dir, f"t{i}"), "wb") as f:
                f.write(t.numpy().data)
                f.flush()
                os.fsync(f.fileno())
        fd = os.open(raw_dir, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def store_put(copy: bool = True) -> None:
        with tierstore.open(store_dir, mode="w", **opts) as s:
            for i, t in enumerate(tensors):
                s.put(f"layers.{i}.weight", t, copy=copy)
            s.commit(step=0)

    rows = []
    st_w, st_a, raw_w = alternated_medians([store_put, lambda: store_put(copy=False), raw_write],
                                           repeats, clean)
    rows.append(("put + commit (fsync)", nbytes / st_w, nbytes / raw_w))
    rows.append(("put(copy=False) + commit (fsync)", nbytes / st_a, nbytes / raw_w))
    store_put()
    raw_write()  # the files the get benchmarks read

    def raw_read() -> None:
        for i in range(n):
            with open(os.path.join(raw_dir, f"t{i}"), "rb", buffering=0) as f:
                out = torch.empty(tensor_bytes // 4)
                f.readinto(out.numpy().data)

    def store_get() -> None:
        with tierstore.open(store_dir, mode="r", **opts) as s:
            for i in range(n):
                s.get(f"layers.{i}.weight")

    def evict_both() -> None:
        evict(raw_dir)
        evict(store_dir)

    st_r, raw_r = paired_medians(store_get, raw_read, repeats, evict_both)
    rows.append(("cold get (page cache dropped)", nbytes / st_r, nbytes / raw_r))

    with tierstore.open(store_dir, mode="r", **opts) as s:
        keys = [f"layers.{i}.weight" for i in range(min(n, 2))]
        s.prefetch(keys, to="host", wait=True)  # now in the RAM tier
        warm_bytes = len(keys) * tensor_bytes
        src = tensors[: len(keys)]
        st_h, memcpy = paired_medians(lambda: [s.get(k) for k in keys],
                                      lambda: [torch.empty_like(t).copy_(t) for t in src],
                                      repeats * 3)
        hits = s.stats()["hits_host"]
    assert hits > 0
    rows.append(("warm get (RAM tier) vs memcpy", warm_bytes / st_h, warm_bytes / memcpy))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the table of throughputs and ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="a folder on the disk to measure (default: temp)")
    ap.add_argument("--size", default="1GiB", help="bytes written and read in total")
    ap.add_argument("--tensor", default="64MiB", help="bytes per tensor")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    total, tensor_bytes = parse_size(args.size), parse_size(args.tensor)
    assert total and tensor_bytes
    root = tempfile.mkdtemp(prefix="tierstore-bench-", dir=args.dir)
    try:
        rows = run(root, total, tensor_bytes, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"tierstore bench: {human_bytes(total)} in {human_bytes(tensor_bytes)} fp32 tensors, "
          f"median of {args.repeats}, {os.cpu_count()} cores")
    print(f"{'':34} {'store GB/s':>10} {'baseline GB/s':>14} {'ratio':>7}")
    for name, st, base in rows:
        print(f"{name:34} {st / 1e9:10.2f} {base / 1e9:14.2f} {st / base:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
