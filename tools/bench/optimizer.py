"""Benchmark: the trainer's CPU AdamW over store-resident state vs the same update in memory.

    python -m tools.bench.optimizer [--params-m 64] [--tensors 8] [--codec raw] [--ram-fraction 2]
                                    [--repeats 5] [--dir DIR]

One "step" updates ``--tensors`` fp32 tensors of ``--params-m`` million parameters in all:

- in memory: ``torch.optim.AdamW(fused=True).step()`` on tensors that stay put (the minimum: the
  arithmetic alone, one pass over weights, gradients and both moments);
- store: ``trainer.optimizer.StoreAdamW.update_group`` as the trainer runs it, over a store on
  the CPU whose RAM budget is ``--ram-fraction`` times the weights and moments at their stored
  size (>= 1: all of it stays in RAM; below 1 the rest is read from disk and written back).

The two alternate for ``--repeats`` steps after one warm-up step each; the table shows the medians
(the store's step timed around ``update_group``, without the bench's own reads of its counters),
the store's time split into AdamW's arithmetic and the store's own calls (``update``: lending the
state and taking it back), the minor page faults of one store step (fresh pages) and the RAM
tier's fresh buffers (not recycled from its spares), and its disk bytes against the minimum for
the budget (0 when the state fits). Below the table, each side's CPU seconds a step by thread
(Linux): on a machine with few cores the store's copies, checksums and hops take cores the
arithmetic would use. Every byte over the
in-memory time is store traffic: what the trainer's ``optimizer_s`` minus ``optimizer_math_s``
shows per training step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from tools.bench.cputime import delta, thread_times
from tools.bench.store import alternated_medians
from tools.table import render_table


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class _Timed:
    """A store proxy that adds up the seconds its ``get``, ``put`` and ``update`` calls take."""

    def __init__(self, store: Any) -> None:
        self._s = store
        self.store_s = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s, name)

    def __contains__(self, key: str) -> bool:
        return key in self._s

    def get(self, *a: Any, **k: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return self._s.get(*a, **k)
        finally:
            self.store_s += time.perf_counter() - t0

    def put(self, *a: Any, **k: Any) -> None:
        t0 = time.perf_counter()
        try:
            self._s.put(*a, **k)
        finally:
            self.store_s += time.perf_counter() - t0

    @contextlib.contextmanager
    def _timed(self, cm: Any) -> Iterator[Any]:
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            lent = stack.enter_context(cm)
            self.store_s += time.perf_counter() - t0
            try:
                yield lent
            finally:
                t1 = time.perf_counter()
                stack.close()
                self.store_s += time.perf_counter() - t1

    def update(self, *a: Any, **k: Any) -> Any:
        return self._timed(self._s.update(*a, **k))

    def update_many(self, *a: Any, **k: Any) -> Any:
        return self._timed(self._s.update_many(*a, **k))


def cpu_line(steps: list[dict[str, tuple[float, int]]], wall: float) -> str:
    """CPU seconds a step by thread (the mean over ``steps``: ``/proc`` counts in 10 ms ticks),
    their sum against the cores a ``wall``-second step has; "" without ``/proc``."""
    if not steps or not steps[0]:
        return ""
    names = {k for st in steps for k in st}
    mean = {k: sum(st.get(k, (0.0, 0))[0] for st in steps) / len(steps) for k in names}
    busy = [(k, v) for k, v in sorted(mean.items(), key=lambda kv: -kv[1]) if v >= 0.0005]
    total = sum(mean.values())
    cores = os.cpu_count() or 1
    return (f"{total:.3f} core-s a step ({total / max(wall, 1e-9):.1f} of {cores} cores over its {wall:.3f} s): "
            + ", ".join(f"{k} {v:.3f}" for k, v in busy))


def disk_rate(folder: str, nbytes: int, piece: int, sync: bool = False) -> tuple[float, float]:
    """Seconds to write ``nbytes`` over files of ``piece`` bytes written once before, and read them back.

    Over files that exist, as the store's write-backs for room write: a key's spilled state
    goes into the folder of the generation it supersedes (``recycle_folder``). ``sync``:
    fdatasync each file. The store's write-backs for room do not (a commit syncs what is still
    the head then), so the floor is measured without.
    """
    buf = os.urandom(min(piece, nbytes))
    paths = [os.path.join(folder, f"rate.{i}") for i in range(-(-nbytes // len(buf)))]

    def write_all() -> None:
        for p in paths:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, buf, 0)
                if sync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)

    write_all()  # the files the timed write goes over
    t0 = time.perf_counter()
    write_all()
    t1 = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.pread(fd, len(buf), 0)
        finally:
            os.close(fd)
    t2 = time.perf_counter()
    for p in paths:
        os.unlink(p)
    return t1 - t0, t2 - t1


def main(argv: Sequence[str] | None = None) -> int:
    """Time both sides, print the table and the ratio."""
    import tierstore
    from trainer.optimizer import AdamWHyper, StoreAdamW

    p = argparse.ArgumentParser(prog="tools.bench.optimizer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params-m", type=float, default=64.0, help="million parameters in all")
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--codec", default="raw", help="the moments' codec (raw, q8, q4, ...)")
    p.add_argument("--ram-fraction", type=float, default=2.0,
                   help="RAM budget / (weights + moments at their stored size)")
    p.add_argument("--repeats", type=int, default=5, help="alternated timed steps per side")
    p.add_argument("--dir", default=None, help="where the store goes (default: a temporary folder)")
    a = p.parse_args(argv)
    if a.tensors < 1 or a.params_m <= 0 or a.repeats < 1 or a.ram_fraction <= 0:
        p.error("--tensors, --params-m, --repeats and --ram-fraction must be positive")
    cols = 1024
    rows = max(1, int(a.params_m * 1e6 / a.tensors / cols))
    shape = (rows, cols)
    n = a.tensors * rows * cols
    names = [f"layers.{i}.weight" for i in range(a.tensors)]
    folder = a.dir or tempfile.mkdtemp(prefix="bench_optimizer_")
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    grads = {nm: torch.randn(shape, generator=g) for nm in names}
    h = AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.01)
    # in memory: the same tensors, torch's fused AdamW
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for _ in names]
    for q, nm in zip(params, names, strict=True):
        q.grad = grads[nm]
    plain = torch.optim.AdamW(params, lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay,
                              fused=True)
    bits = tierstore.codecs.get(a.codec).bits or 32  # None: as large as fp32
    moment_bytes = int(2 * n * bits / 8)
    budget = int(a.ram_fraction * (n * 4 + moment_bytes))
    store = tierstore.open(os.path.join(folder, "store"), mode="w", ram_budget=budget, device_budget=None,
                           device="cpu")
    try:
        for q, nm in zip(params, names, strict=True):
            store.put(nm, q.detach().clone())
        store.commit()  # the initial writes are not a step's
        timed = _Timed(store)
        opt = StoreAdamW(timed, [names], set(), a.codec, contextlib.nullcontext())
        step = [0]
        split: list[tuple[float, float, int, int, int, int]] = []
        step_s: list[float] = []

        cpu: dict[str, list[dict[str, tuple[float, int]]]] = {"in memory": [], "store": []}

        def store_step() -> None:
            step[0] += 1
            st0 = store.stats()  # the counters are read outside the timed step (a hop each)
            c0 = thread_times()
            s0, math0, f0 = timed.store_s, opt.update_s, _faults()
            t0 = time.perf_counter()
            opt.update_group(0, step[0], h, None, grads)
            step_s.append(time.perf_counter() - t0)
            cpu["store"].append(delta(c0, thread_times()))
            st1 = store.stats()
            split.append((opt.update_s - math0, timed.store_s - s0, _faults() - f0,
                          st1["bytes_read_disk"] - st0["bytes_read_disk"],
                          st1["bytes_written_disk"] - st0["bytes_written_disk"],
                          st1["host_fresh_buffers"] - st0["host_fresh_buffers"]))

        def plain_step() -> None:
            c0 = thread_times()
            plain.step()
            cpu["in memory"].append(delta(c0, thread_times()))

        store_step()  # warm-up: moments start at zero, nothing to read
        plain.step()
        split.clear()
        step_s.clear()
        cpu["store"].clear()
        _, t_plain = alternated_medians([store_step, plain_step], a.repeats)
        t_store = statistics.median(step_s)
        med = sorted(split, key=lambda r: r[0] + r[1])[len(split) // 2]
        gib = n * 4 / 2**30
        state = n * 4 + moment_bytes
        print(f"{n / 1e6:.1f}M fp32 parameters in {a.tensors} tensors of {list(shape)} ({gib:.2f} GiB of "
              f"weights); moments {a.codec}; RAM budget {budget / 2**30:.2f} GiB ({a.ram_fraction:g} x "
              f"weights + moments); torch threads {torch.get_num_threads()}, load average "
              f"{os.getloadavg()[0]:.2f}; medians of {a.repeats} alternated steps")
        mib = 2**20
        table = [["in memory: torch.optim.AdamW(fused=True)", f"{t_plain:.3f}", "1.00x", "", "", "", "", "", ""],
                 ["store: StoreAdamW.update_group", f"{t_store:.3f}", f"{t_store / t_plain:.2f}x",
                  f"{med[0]:.3f}", f"{med[1]:.3f}", f"{med[2]}", f"{med[5]}", f"{med[3] / mib:.0f}",
                  f"{med[4] / mib:.0f}"]]
        cols = ["side", "step s", "vs memory", "math s", "store s", "page faults", "fresh buffers", "read MiB",
                "written MiB"]
        print(render_table(cols, table, right=cols[1:]))
        for side, wall in (("in memory", t_plain), ("store", t_store)):
            line = cpu_line(cpu[side], wall)
            if line:
                print(f"{side}: {line}")
        least = max(0, state - budget)  # what does not fit is read, and written back, once a step
        print(f"disk per step (median step): read {med[3] / mib:.0f} MiB, written {med[4] / mib:.0f} MiB; "
              f"the minimum with this budget: {least / mib:.0f} MiB each way "
              f"({max(med[3], med[4]) / max(least, 1):.2f}x)" if least else
              f"disk per step (median step): read {med[3] / mib:.0f} MiB, written {med[4] / mib:.0f} MiB "
              "(the state fits the budget: the minimum is 0)")
        if least:
            w_s, r_s = disk_rate(folder, least, store.config.chunk_bytes or 16 * mib)
            floor = max(t_plain, w_s + r_s)
            print(f"this disk moves the minimum in {w_s:.3f} s written (over existing files, not synced, "
                  f"as the store's write-backs for room) + "
                  f"{r_s:.3f} s read = {w_s + r_s:.3f} s; the step's floor max(in memory, disk) = "
                  f"{floor:.3f} s; store step {t_store / floor:.2f}x the floor")
        # both sides ran the same steps on the same gradients: with raw moments, the same weights
        same = all(torch.equal(store.get(nm), q.detach()) for nm, q in zip(names, params, strict=True))
        print(f"weights after {a.repeats + 1} steps equal on both sides: {'yes' if same else 'NO'}"
              + ("" if a.codec == "raw" else f" (moments {a.codec}: not expected)"))
    finally:
        store.close(commit=False)
        if a.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0 if same or a.codec != "raw" else 1


if __name__ == "__main__":
    raise SystemExit(main())
