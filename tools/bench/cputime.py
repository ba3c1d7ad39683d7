"""CPU seconds and blocks of this process's threads, by thread name (Linux ``/proc``).

The benchmarks print them beside their wall times: on a machine with few cores, a step's time
is as much the CPU its threads take from each other as the work of any one of them.
"""

from __future__ import annotations

import os
import re
import threading


def thread_times() -> dict[str, tuple[float, int]]:
    """(CPU seconds, times blocked) of this process's threads so far, by name; {} without ``/proc``.

    Python threads go by their name less any pool number (``tierstore-io_2``: ``tierstore-io``),
    the others (OpenMP workers, torch's own) as ``native``.
    """
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[str, tuple[float, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/status") as f:
                blocks = int(re.search(r"^voluntary_ctxt_switches:\s*(\d+)", f.read(), re.M).group(1))  # type: ignore[union-attr]
        except (OSError, AttributeError, IndexError):
            continue  # the thread ended meanwhile
        name = re.sub(r"_\d+$", "", names.get(int(tid), "native"))
        cpu, n = out.get(name, (0.0, 0))
        out[name] = (cpu + (int(fields[11]) + int(fields[12])) / tick, n + blocks)
    return out


def delta(before: dict[str, tuple[float, int]], after: dict[str, tuple[float, int]]) -> dict[str, tuple[float, int]]:
    """Per thread name: CPU seconds and blocks between two ``thread_times`` snapshots."""
    zero = (0.0, 0)
    return {k: (v[0] - before.get(k, zero)[0], v[1] - before.get(k, zero)[1]) for k, v in after.items()}
