"""fuzz_store: run many model-checked random programs against the store (``tools.harness.modelcheck``).

    python -m tools.harness.fuzz_store --programs 50000 --seed 0 --jobs 4

Program ``i`` is ``generate(seed + i, features)``; each runs on a fresh store under a scratch
folder (tmpfs when there is one), from asyncio tasks and threads, with injected faults, and every
result is compared with the model. At the end it prints the counts, the failing seeds and the
first failure shrunk to a small program; the exit code is 1 on any mismatch or hang.
``--features`` picks what programs may do (default: every feature without a KNOWN defect;
``all`` adds those too).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator

from tools.harness.modelcheck import FEATURES, KNOWN, generate, run_program, shrink
from tools.harness.modelcheck.programs import BASE
from tools.harness.modelcheck.runner import collect_strays

_ROOT: str | None = None  # each worker process's scratch folder


def _root() -> str:
    global _ROOT
    if _ROOT is None:
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        _ROOT = tempfile.mkdtemp(prefix="tierstore-fuzz-", dir=base)
    return _ROOT


def _run_chunk(seeds: list[int], features: tuple[str, ...], size: dict[str, int],
               op_timeout_s: float) -> tuple[list[tuple[int, bool, bool, list[str]]], list[tuple[int, str]]]:
    """Run programs in a worker: (seed, ok, hang, failures) each, and late event-loop errors."""
    out = []
    for seed in seeds:
        o = run_program(generate(seed, features, **size), _root(), op_timeout_s)
        out.append((seed, o.ok, o.hang, o.failures[:3]))
    return out, collect_strays()  # loop errors that surfaced only at a full collection


def _chunks(start: int, n: int, size: int) -> Iterator[list[int]]:
    for lo in range(start, start + n, size):
        yield list(range(lo, min(lo + size, start + n)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m tools.harness.fuzz_store", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", type=int, default=1000, help="programs to run (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first program (default 0)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--features", default="",
                   help=f"comma-separated, or 'all'; default: {','.join(BASE)}")
    p.add_argument("--short", action="store_true", help="the CI test's short programs")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds a call may take (a hang)")
    p.add_argument("--shrink-s", type=float, default=120.0,
                   help="seconds spent shrinking the first failure (0: print it as is)")
    p.add_argument("--print", action="store_true", help="print each program before running it")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.programs < 1 or args.jobs < 1:
        p.error("--programs and --jobs must be >= 1")
    if args.features == "all":
        args.features = FEATURES
    elif args.features:
        args.features = tuple(f for f in args.features.split(",") if f)
        bad = set(args.features) - set(FEATURES)
        if bad:
            p.error(f"unknown features {sorted(bad)}; known: {','.join(FEATURES)}")
    else:
        args.features = BASE
    return args


def _progress(total: int, quiet: bool):  # noqa: ANN202  (tqdm or a plain counter)
    try:
        from tqdm import tqdm
        return tqdm(total=total, unit="prog", disable=quiet, file=sys.stderr)
    except ImportError:
        class Counter:
            def __init__(self) -> None:
                self.n = 0

            def update(self, k: int) -> None:
                self.n += k
                if not quiet and (self.n % 500 == 0 or self.n == total):
                    print(f"{self.n}/{total} programs", file=sys.stderr)

            def set_postfix_str(self, s: str) -> None:
                pass

            def close(self) -> None:
                pass
        return Counter()


def main(argv: list[str] | None = None) -> int:
    """Run the programs; print the summary; 0 if every program matched the model, else 1."""
    args = parse_args(argv)
    size = {"max_phases": 2, "max_ops": 4} if args.short else {}
    known = sorted(f for f in args.features if f in KNOWN)
    if known:
        print(f"note: {', '.join(f'{f} ({KNOWN[f]})' for f in known)} hit known defects", file=sys.stderr)
    if args.print:
        for s in range(args.seed, args.seed + min(args.programs, 20)):
            print(generate(s, args.features, **size).listing(), file=sys.stderr)
    t0 = time.perf_counter()
    failed: list[tuple[int, bool, list[str]]] = []
    done = 0
    bar = _progress(args.programs, args.quiet)
    chunk = max(1, min(50, args.programs // (args.jobs * 4) or 1))
    try:
        if args.jobs == 1:
            results = (_run_chunk(c, args.features, size, args.timeout)
                       for c in _chunks(args.seed, args.programs, chunk))
            pool = None
        else:
            pool = concurrent.futures.ProcessPoolExecutor(
                args.jobs, mp_context=multiprocessing.get_context("spawn"))
            futs = [pool.submit(_run_chunk, c, args.features, size, args.timeout)
                    for c in _chunks(args.seed, args.programs, chunk)]
            results = (f.result() for f in concurrent.futures.as_completed(futs))
        for batch, strays in results:
            done += len(batch)
            failed += [(seed, hang, failures) for seed, ok, hang, failures in batch if not ok]
            failed += [(seed, False, [f"event loop error after the run: {msg}"]) for seed, msg in strays]
            bar.update(len(batch))
            bar.set_postfix_str(f"fail {len({f[0] for f in failed})}")
        if pool is not None:
            pool.shutdown()
    finally:
        bar.close()
        if _ROOT is not None:
            shutil.rmtree(_ROOT, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    hangs = sorted({s for s, h, _ in failed if h})
    mismatches = sorted({s for s, h, _ in failed if not h} - set(hangs))
    print(f"programs: {done}  seeds: {args.seed}..{args.seed + args.programs - 1}  "
          f"features: {','.join(args.features)}{'  (short)' if args.short else ''}")
    print(f"mismatches: {len(mismatches)}  hangs: {len(hangs)}  time: {elapsed:.1f} s "
          f"({args.jobs} jobs)")
    if mismatches:
        print(f"mismatch seeds: {mismatches[:50]}")
    if hangs:
        print(f"hang seeds: {hangs[:50]}")
    if failed:
        seed, _, failures = sorted(failed)[0]
        for f in failures:
            print(f"seed {seed}: {f}")
        program = generate(seed, args.features, **size)
        if args.shrink_s > 0:
            root = tempfile.mkdtemp(prefix="tierstore-shrink-")
            try:
                program = shrink(program, root, budget_s=args.shrink_s, op_timeout_s=args.timeout)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            print(f"shrunk program of seed {seed} (still fails):")
        print(program.listing())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
