"""Pieces of one optimizer step of the training loop: the gradient sink, the loss window, process flags."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from trainer.optimizer import AdamWHyper, StoreAdamW, UpdateWorker


def grad_sink(opt: StoreAdamW, worker: UpdateWorker, norms: dict[str, torch.Tensor], step: int,
               hyper: AdamWHyper, clip: float | None, j: int, last: bool, dp: Any = None) -> Any:
    """The engine's gradient sink for micro-batch ``j`` of optimizer step ``step`` (1-based).

    With ``dp`` (a ``trainer.distributed.DataParallel``) the final sums of each group are
    reduce-scattered over the ranks as they arrive; the norms come from ``dp.grad_norms()``.
    """

    def sink(g: int, grads: dict[str, torch.Tensor]) -> None:
        if last and (clip is None or dp is not None):
            # The final sums go straight to the optimizer (or the reduction), not through the store.
            final = grads if j == 0 else opt.add_accumulated(grads)
        else:
            final = opt.accumulate(grads, first=j == 0)
        if last and dp is not None:
            dp.reduce(g, final)  # async: backward goes on while the ranks sum this group
            if clip is None:
                worker.submit(g, step, hyper, None, None, hold=True)  # waits for the reduction itself
            return
        if last:
            for name, t in final.items():
                norms[name] = torch.linalg.vector_norm(t, 2.0)
            if clip is None:  # no global norm to wait for: update this group now, on the worker
                worker.submit(g, step, hyper, None, final, hold=True)

    return sink


@dataclass(slots=True)
class RunLog:
    """The losses of one ``train`` call: the window since the last log and the run's total."""

    start: int
    t0: float
    window: float = 0.0
    total: float = 0.0
    last_loss: float = math.nan
    last_logged: int = -1
    last: dict[str, float] | None = None

    def __post_init__(self) -> None:
        self.last_logged = self.start

    def add(self, loss: float, nan_filter: bool, step: int) -> None:
        """Add the loss of 0-based ``step`` (a nan/inf one counts as the window's mean so far, filtered)."""
        self.last_loss = loss
        if nan_filter and not math.isfinite(loss):
            loss = self.window / (1 + step - self.last_logged)
        self.window += loss

    def window_logs(self, step: int) -> dict[str, Any]:
        """The log of the window ending at ``step``, which is then cleared."""
        n = step - self.last_logged
        logs = {"loss": self.window / n, **(self.last or {})}
        self.total += self.window
        self.window, self.last_logged = 0.0, step
        return logs


def apply_runtime_args(args: Any) -> None:
    """The process-wide settings transformers' Trainer applies: TF32 flags, logging verbosity."""
    tf32 = getattr(args, "tf32", None)
    if tf32 is not None and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
        torch.backends.cudnn.allow_tf32 = bool(tf32)
    level = getattr(args, "log_level", "passive")
    level = getattr(level, "value", level)
    if level and level != "passive":
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(hf_logging.get_log_levels_dict()[level])
