"""Bytes a training step moves through each tier, and the least the budgets let it move.

A step reads each weight for forward and again for backward (its recompute under activation
checkpointing), reads the moments once and writes weights and moments once; whatever the RAM tier
and the window (together ``C`` bytes) hold across steps need not come from disk again. A cached
weight byte saves two reads and a cached moment byte one, so the best cache holds weights first:
at least ``2 W + M - 2 min(C, W) - min(max(0, C - W), M)`` bytes are read (no moments at step 1:
they start at zero) and ``W + M`` written, ``W`` and ``M`` being the stored bytes of the weights and
of the moments. That holds when each group is updated right after its gradients are final (its
weights are still cached from backward). Clipping needs every gradient first (``G`` bytes, all
alive when backward ends): the updates then start after backward, reading ``W + M + G`` bytes of
which the cache holds at most ``C``, so the update phase reads at least ``W + M + G - C`` (the
weights and moments it needs but the gradients crowd out, or the gradients spilled), on top of
forward's and backward's ``2 max(0, W - C)``; gradients beyond ``C`` are also written once.
The CPU optimizer runs beside the next step, so a step's counted bytes hold some of the previous
step's updates: compare averages over steps, not single steps.

A window on the CPU adds to ``C`` only the weights it copies (``cpu_window_capacity``): a raw
weight in one chunk is lent to the layer from the RAM tier and counted in the RAM budget, so
it takes no window room, and the window's budget carries nothing of it between passes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import tierstore.codecs

#: log_history key -> store.stats() counter
COUNTERS = {
    "io_disk_read_bytes": "bytes_read_disk",
    "io_disk_written_bytes": "bytes_written_disk",
    "io_h2d_bytes": "bytes_h2d",
    "io_d2h_bytes": "bytes_d2h",
}


def moved(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, int]:
    """Bytes per tier between two ``store.stats()`` snapshots, under the log_history keys."""
    return {k: int(after.get(c, 0)) - int(before.get(c, 0)) for k, c in COUNTERS.items()}


def minimum(weights: int, moments: int, ram_budget: int | None, window: int | None,
            first_step: bool = False, held_grads: int = 0) -> tuple[int, int]:
    """(read, written) disk bytes a step needs at least with these budgets (None: unbounded)."""
    written = weights + moments
    if ram_budget is None or window is None:
        return 0, written  # everything can stay in RAM after it is first read
    cap = ram_budget + window
    read_m = 0 if first_step else moments
    spill = max(0, held_grads - cap)
    if held_grads:  # the update phase starts after backward: everything it reads, less the cache
        return 2 * max(0, weights - cap) + max(0, weights + read_m + held_grads - cap), written + spill
    saved = 2 * min(cap, weights) + min(max(0, cap - weights), read_m)
    return 2 * weights + read_m - saved, written


def cpu_window_capacity(device_budget: int | None, copied: int) -> int:
    """What a CPU window holds between passes: the ``copied`` bytes of weights it cannot lend, up to its budget."""
    return copied if device_budget is None else min(device_budget, copied)


def copied_weight_bytes(store: Any, params: Iterable[str]) -> int:
    """Bytes of the weights among ``params`` that a CPU window copies: several chunks or a coded codec."""
    total = 0
    for k in params:
        info = store.info(k)
        if info.chunks != 1 or not tierstore.codecs.from_spec(info.codec).raw_layout:
            total += info.nbytes
    return total


def stored_bytes(store: Any, keys: Iterable[str]) -> int | None:
    """Stored bytes of ``keys`` (None when one is not in the store yet)."""
    total = 0
    have = set(store.keys())
    for k in keys:
        if k not in have:
            return None
        total += store.info(k).stored_nbytes
    return total


class StepAccount:
    """Per-step I/O figures for log_history: bytes moved per tier and the budgets' minimum."""

    def __init__(self, store: Any, params: list[str], moment_keys: list[str], clipping: bool = False) -> None:
        self.store = store
        self.params = params
        self.moment_keys = moment_keys
        self.clipping = clipping  # clipping holds every gradient (the weights' logical bytes) until backward ends
        self._weights: int | None = None
        self._window: int | None = None  # what the window adds to the RAM tier between passes
        self._grads = 0
        self._moments: int | None = None

    def end(self, step: int, before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, float]:
        """Step ``step``'s figures (1-based) from ``store.stats()`` at its start and end.

        The stored sizes are read once, when every key exists.
        """
        out: dict[str, float] = dict(moved(before, after))
        if self._weights is None:
            self._weights = stored_bytes(self.store, self.params)
            cfg = self.store.config
            self._window = cfg.device_budget
            if self._weights is not None and cfg.device.type == "cpu":
                self._window = cpu_window_capacity(cfg.device_budget, copied_weight_bytes(self.store, self.params))
            if self._weights is not None and self.clipping:
                self._grads = sum(self.store.info(k).nbytes for k in self.params)
        if self._moments is None and step > 1:  # written by step 1's updates
            self._moments = stored_bytes(self.store, self.moment_keys)
        if self._weights is None:
            return out
        m = self._moments or 0
        cfg = self.store.config
        lo_read, lo_written = minimum(self._weights, m, cfg.ram_budget, self._window, step == 1,
                                      held_grads=self._grads)
        out["io_min_disk_read_bytes"] = lo_read
        out["io_min_disk_written_bytes"] = lo_written
        lo = lo_read + lo_written
        out["io_disk_vs_min"] = (out["io_disk_read_bytes"] + out["io_disk_written_bytes"]) / lo if lo else 0.0
        return out
