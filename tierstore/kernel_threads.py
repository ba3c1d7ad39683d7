"""The OpenMP team size of the torch CPU kernels a background thread runs, set for that thread alone.

Why: torch's CPU kernels run on an OpenMP team per calling thread. libgomp lets a team's idle
threads spin between kernels only while the threads of all teams together do not outnumber
the cores; past that it spins about a hundred times, then sleeps on a futex, and every kernel
of the next parallel region waits for a wake-up. So one background thread that runs a single
multi-threaded kernel (an AdamW update, a codec, a large copy) creates a second team, and from
then on the training thread's team sleeps and wakes between its kernels. On the 2-core dev VM
the training thread blocked about 830 times a step where plain PyTorch blocked once, and both
cores sat idle 5% of the forward and backward, with no store work at all going on.

Why not ``torch.set_num_threads``: it also sets torch's process-wide default, which every
thread started later takes, so one call on a background thread would make any thread the caller
starts afterwards run its kernels on one core. ``omp_set_num_threads`` changes the calling
thread's own setting only (OpenMP's per-thread ICV); this module calls it in the OpenMP runtime
torch has loaded, after torch's lazy per-thread set-up, which would otherwise overwrite it at the
thread's first parallel kernel.

Where no OpenMP runtime is loaded (a build without OpenMP, or another platform), nothing is set
and ``limit_this_thread`` says so.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from typing import Any

import torch

#: basenames of the OpenMP runtimes torch builds link (GNU, Intel, LLVM)
_RUNTIMES = ("libgomp", "libiomp5", "libomp")


def _loaded_runtime() -> str | None:
    """The path of the OpenMP runtime mapped into this process (Linux), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if path.startswith("/") and os.path.basename(path).startswith(_RUNTIMES):
                    return path
    except OSError:
        return None
    return None


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the runtime torch uses, looked up once; None if there is none."""
    path = _loaded_runtime()
    if path is None:
        return None
    try:
        # the mapped library: dlopen returns the copy already loaded, torch's own
        return ctypes.CDLL(path).omp_set_num_threads  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def limit_this_thread(n: int) -> bool:
    """Run the calling thread's torch CPU kernels on ``n`` threads; False where it could not be set."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"kernel threads must be an int >= 1, got {n!r}")
    torch.get_num_threads()  # torch's lazy per-thread set-up runs here, not at the next kernel
    setter = _omp_set_num_threads()
    if setter is None:
        return False
    setter(n)
    return torch.get_num_threads() == n


def executor_options(n: int | None) -> dict[str, Any]:
    """``ThreadPoolExecutor`` arguments that limit each of its threads to ``n`` kernel threads ({} for None)."""
    return {} if n is None else {"initializer": limit_this_thread, "initargs": (n,)}
