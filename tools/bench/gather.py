"""Row gathers from a sharded table vs ``numpy.memmap`` fancy indexing, measured in one run.

    python -m tools.bench.gather [--table-gib 2] [--ram-mib 256] [--cols 1024] [--chunk-rows 1]
                                 [--rows 1,32,1024] [--warm-repeats 30] [--cold-repeats 7]
                                 [--reread]

An fp32 table is put with ``chunk_rows=`` (sharded: one crc32c per inner chunk, checked on
every read) into a store with the given RAM budget, and the same bytes are written to a flat
file for ``numpy.memmap``. Both are then gathered with the same random rows, the store and the
memmap alternated call by call:
- warm: both files in the page cache (read once beforehand); the store serves the gathers on
  the calling thread from its mapping of the shard files (``tierstore.mapped``), crc32c checked;
  the output counts how many it served that way and how many went through the loop (the RAM
  tier, then ``preadv``);
- cold: before each call the table's files (the store's data folder and the flat file) are
  evicted from the page cache with ``posix_fadvise(DONTNEED)``, the memmap is mapped afresh, and
  the rows are new random ones; one store stays open (so its threads, open descriptors and the
  interpreter's code are warm, as in a serving process; a whole-system ``drop_caches`` would also
  evict the code of both sides and time page-ins of library code, not of the table), and the
  output gives its RAM-tier hits in this phase (a table 8x the budget mostly misses).
Figures are medians; the ratio is store time / memmap time (the goal: <= 2x warm, <= 1x cold).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

import tierstore


def _files(path: str) -> list[str]:
    if os.path.isdir(path):
        return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    return [path]


def evict(paths: list[str]) -> None:
    """Evict the files under ``paths`` from the page cache (``posix_fadvise(DONTNEED)``)."""
    os.sync()  # DONTNEED skips dirty pages
    for root in paths:
        for p in _files(root):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_through(paths: list[str]) -> None:
    """Read every file once so that the page cache holds it."""
    for root in paths:
        for p in _files(root):
            with open(p, "rb", buffering=0) as f:
                while f.read(16 << 20):
                    pass


def build(workdir: str, rows: int, cols: int, chunk_rows: int, ram: int) -> tuple[str, str]:
    """Put the table into a store and write it flat; return (store path, flat file path)."""
    store_path = os.path.join(workdir, "store")
    flat_path = os.path.join(workdir, "table.f32")
    g = torch.Generator().manual_seed(0)
    table = torch.empty(rows, cols)
    step = max(1, (64 << 20) // (cols * 4))
    for lo in range(0, rows, step):  # in slices: randn of 2 GiB at once needs twice the memory
        table[lo : lo + step] = torch.randn(min(step, rows - lo), cols, generator=g)
    t0 = time.perf_counter()
    with tierstore.open(store_path, "w", ram_budget=ram) as s:
        s.put("emb", table, chunk_rows=chunk_rows)
        s.commit()
    print(f"put + commit of the sharded table: {time.perf_counter() - t0:.1f} s", flush=True)
    table.numpy().tofile(flat_path)
    fd = os.open(flat_path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    del table
    return store_path, flat_path


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table-gib", type=float, default=2.0)
    ap.add_argument("--ram-mib", type=int, default=256)
    ap.add_argument("--cols", type=int, default=1024, help="fp32 columns (1024 = 4 KiB rows)")
    ap.add_argument("--chunk-rows", type=int, default=1, help="rows per inner chunk")
    ap.add_argument("--rows", default="1,32,1024", help="gather sizes, comma-separated")
    ap.add_argument("--warm-repeats", type=int, default=30)
    ap.add_argument("--cold-repeats", type=int, default=7)
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reread", action="store_true",
                    help="warm: evict both files and read them back before the warm phase (the "
                         "page-cache state reads leave, instead of what the writes left)")
    args = ap.parse_args(argv)
    n_rows = int(args.table_gib * 2**30) // (args.cols * 4)
    sizes = [int(x) for x in args.rows.split(",")]
    ram = args.ram_mib * 2**20
    workdir = tempfile.mkdtemp(prefix="bench_gather_", dir=args.dir)
    rng = np.random.default_rng(args.seed)
    try:
        print(f"table {n_rows} x {args.cols} fp32 ({n_rows * args.cols * 4 / 2**30:.2f} GiB), "
              f"RAM budget {args.ram_mib} MiB, inner chunk {args.chunk_rows} row(s) "
              f"({args.chunk_rows * args.cols * 4} B + 4 B crc32c), checksums on", flush=True)
        store_path, flat_path = build(workdir, n_rows, args.cols, args.chunk_rows, ram)
        files = [os.path.join(store_path, "data"), flat_path]
        results: dict[tuple[str, int], tuple[float, float]] = {}

        # warm: page cache full, one store open for all calls
        if args.reread:
            evict(files)
        read_through(files)
        s = tierstore.open(store_path, "r", ram_budget=ram)
        mm = np.memmap(flat_path, np.float32, "r", shape=(n_rows, args.cols))
        try:
            for n in sizes:
                ts, tm = [], []
                for _ in range(args.warm_repeats):
                    idx = rng.integers(0, n_rows, n)
                    ti = torch.from_numpy(idx)
                    t0 = time.perf_counter()
                    got = s.get("emb", index=ti)
                    ts.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    ref = mm[idx]
                    tm.append(time.perf_counter() - t0)
                    assert np.array_equal(got.numpy(), ref), "store and memmap disagree"
                results[("warm", n)] = (statistics.median(ts), statistics.median(tm))
            hits = s.stats()
        finally:
            s.close()
            del mm

        # cold: the table's pages evicted before every call, one store open throughout
        s = tierstore.open(store_path, "r", ram_budget=ram)
        try:
            s.get("emb", index=torch.from_numpy(rng.integers(0, n_rows, 8)))  # threads started
            before = s.stats()
            for n in sizes:
                ts, tm = [], []
                for _ in range(args.cold_repeats):
                    idx = rng.integers(0, n_rows, n)
                    ti = torch.from_numpy(idx)
                    evict(files)
                    t0 = time.perf_counter()
                    got = s.get("emb", index=ti)
                    ts.append(time.perf_counter() - t0)
                    evict(files)
                    mm = np.memmap(flat_path, np.float32, "r", shape=(n_rows, args.cols))
                    t0 = time.perf_counter()
                    ref = np.array(mm[idx])
                    tm.append(time.perf_counter() - t0)
                    del mm
                    assert np.array_equal(got.numpy(), ref), "store and memmap disagree"
                results[("cold", n)] = (statistics.median(ts), statistics.median(tm))
            after = s.stats()
        finally:
            s.close()

        print(f"\nwarm: gathers served from the mapped page cache {hits['mapped_gathers']} of "
              f"{hits['mapped_gathers'] + hits['mapped_declined']}, RAM-tier hits {hits['hits_host']}, "
              f"inner chunks read {hits['reads_disk']}; cold: mapped "
              f"{after['mapped_gathers'] - before['mapped_gathers']}, RAM-tier hits "
              f"{after['hits_host'] - before['hits_host']}, inner chunks read "
              f"{after['reads_disk'] - before['reads_disk']}, page cache evicted with "
              f"posix_fadvise(DONTNEED) before each call\n")
        print("| cache | rows | store get (ms) | memmap (ms) | store / memmap | goal |")
        print("|---|---:|---:|---:|---:|---|")
        for (mode, n), (a, b) in results.items():
            goal = "<= 2x" if mode == "warm" else "<= 1x"
            print(f"| {mode} | {n} | {a * 1e3:.3f} | {b * 1e3:.3f} | {a / b:.2f}x | {goal} |")
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
