"""Crash harness for the store: SIGKILL a writer at random moments, reopen, verify.

    python -m tools.harness.crash_store --trials 50 [--dir DIR]

Each trial starts a writer process that puts tensors (one a table in the sharded layout) and
commits in a loop, kills it after a random delay (during puts, write-back, fsync or the LMDB
commit), reopens the store as a writer
(which deletes the dead writer's orphans), checks that the last commit is intact (checksums of
every chunk) and holds exactly the values of its step, then runs a few more commits on it.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import torch

import tierstore

KEYS = 7
SHARDED = 6  # this key is a table in the sharded layout (inner chunks of 4 rows, 64 to a shard)


def expected(seed: int, step: int, j: int) -> torch.Tensor:
    """The value key ``j`` holds after ``step``: written at the last step divisible by j+1."""
    last = step - step % (j + 1)
    g = torch.Generator().manual_seed(seed * 100_003 + last * 101 + j)
    n = [10, 3000, 40_000, 150_000, 1, 70_000, 48_000][j]
    t = torch.randn(n, generator=g)
    return t.view(-1, 16) if j == SHARDED else t


def write_step(store: tierstore.Store, seed: int, step: int) -> None:
    """Put the keys that change at ``step``."""
    for j in range(KEYS):
        if step % (j + 1) == 0:
            layout = {"chunk_rows": 4, "shard_rows": 256} if j == SHARDED else {}
            store.put(f"layers.{j}.w", expected(seed, step, j), codec="zstd" if j == 2 else "raw",
                      **layout)


def writer(path: str, seed: int, start: int) -> None:
    """Commit steps forever (until killed), printing each committed step."""
    with tierstore.open(path, ram_budget="1MiB", chunk_bytes="64KiB", keep_last=2) as s:
        step = start
        while True:
            write_step(s, seed, step)
            s.commit(step=step)
            print(step, flush=True)
            step += 1


def check(path: str, seed: int) -> tuple[int | None, list[str]]:
    """Reopen after a crash; return the last committed step and the problems found."""
    problems: list[str] = []
    with tierstore.open(path, ram_budget="1MiB", chunk_bytes="64KiB", keep_last=2) as s:
        versions = s.versions()
        if not versions:
            return None, problems
        step = versions[-1].step
        assert step is not None
        problems += [f"verify: {f}" for f in s.verify()]
        for j in range(KEYS):
            got = s.get(f"layers.{j}.w")
            if not torch.equal(got, expected(seed, step, j)):
                problems.append(f"step {step}: layers.{j}.w differs from what was committed")
        for extra in range(step + 1, step + 3):  # the store keeps working after the crash
            write_step(s, seed, extra)
            s.commit(step=extra)
    return step + 2, problems


def trial(path: str, seed: int, delay: float) -> tuple[int | None, list[str]]:
    """One kill-and-check cycle on ``path``."""
    start = 0
    if os.path.isdir(os.path.join(path, "catalog")):
        with tierstore.open(path, mode="r") as r:
            vs = r.versions()
            start = (vs[-1].step or 0) + 1 if vs else 0
    code = "import sys; from tools.harness.crash_store import writer; writer(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", code, path, str(seed), str(start)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    # the clock starts at the writer's first commit, so a slow start-up (imports on a loaded
    # machine) never turns a trial into a kill before anything happened
    first = proc.stdout.readline() if proc.stdout else b""
    if not first:
        _, err = proc.communicate()
        return None, [f"writer died before its first commit: {err.decode()[-500:]}"]
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    if proc.returncode != -signal.SIGKILL:
        return None, [f"writer exited on its own ({proc.returncode}): {err.decode()[-500:]}"]
    return check(path, seed)


def main(argv: list[str] | None = None) -> int:
    """Run the trials and print a summary; exit 1 on any problem."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--dir", default=None, help="where to make the store (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    base = tempfile.mkdtemp(prefix="crash-", dir=args.dir)
    path = os.path.join(base, "store")
    failures = 0
    for i in range(args.trials):
        step, problems = trial(path, args.seed, rng.uniform(0.0, 1.5))
        failures += bool(problems)
        print(f"trial {i + 1}/{args.trials}: reopened at step {step}: "
              + ("ok" if not problems else "; ".join(problems)), flush=True)
    print(f"{args.trials} kills, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
