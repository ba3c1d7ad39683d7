"""Smoke test of the streaming trainer benchmark, and of its per-thread CPU and block counts."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tools.bench import cputime
from tools.bench import trainer as bench_trainer

linux = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc/self/task")


@linux
def test_thread_times_name_pool_threads_and_count_their_cpu_and_blocks() -> None:
    before = cputime.thread_times()
    go, done, release = threading.Event(), threading.Event(), threading.Event()

    def work() -> None:
        while time.thread_time() < 0.05:
            pass  # burn 50 ms of this thread's CPU
        for _ in range(5):
            go.wait(0.01)  # blocks: each wait that times out is a voluntary context switch
        done.set()
        release.wait(10)  # alive until counted

    t = threading.Thread(target=work, name="bench-pool_3")
    t.start()
    done.wait(10)
    during = cputime.thread_times()
    release.set()
    t.join()
    d = cputime.delta(before, during)
    cpu, blocks = d["bench-pool"]  # the pool number is dropped
    assert cpu >= 0.03
    assert blocks >= 5
    assert "MainThread" in d and "bench-pool_3" not in d


@linux
def test_the_benchmark_prints_blocks_and_each_streaming_runs_threads(tmp_path, capsys) -> None:  # noqa: ANN001
    assert bench_trainer.main(["--steps", "1", "--rounds", "1", "--batch", "2", "--seq", "32", "--hidden", "64",
                               "--intermediate", "128", "--layers", "8", "--heads", "2",
                               "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("run "))
    assert "blocks" in header.split()
    for run in bench_trainer.RUNS:
        row = next(line for line in out.splitlines() if line.startswith(run + " "))
        # the blocks column: a count, on every row
        assert row[len(run):].split()[6].isdigit(), row
    for run in bench_trainer.RUNS[2:]:
        line = next(line for line in out.splitlines() if line.startswith(f"{run}: core-s a step by thread: "))
        assert "MainThread" in line and "tierstore-loop" in line
