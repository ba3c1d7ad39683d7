"""Evaluation's loss pass and metrics: ``eval_loss`` as transformers reports it, and perplexity.

The pass is forward-only through the streaming engine, one eval batch at a time, with the model
in eval mode (no dropout) and put back in the mode it had. ``eval_loss`` is transformers' number:
each batch's token-mean loss, weighted by its sequences (accelerate drops the padding of the last
batch, so transformers repeats each batch's loss once per sequence).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


def eval_losses(engine: Any, model: nn.Module, batches: Iterable[dict[str, torch.Tensor]],
                on_batch: Callable[[], None]) -> list[tuple[float, int]]:
    """(the batch's token-mean loss, the sequences in the batch) of every batch; ``on_batch`` after each."""
    was_training = model.training
    model.eval()
    losses: list[tuple[float, int]] = []
    try:
        for batch in batches:
            s, n = engine.loss(batch)
            losses.append((s / n if n else math.nan, int(batch["input_ids"].shape[0])))
            on_batch()
    finally:
        model.train(was_training)
    return losses


def eval_metrics(losses: list[tuple[float, int]], prefix: str, t0: float, nan_filter: bool) -> dict[str, float]:
    """``{prefix}_loss``, ``_perplexity``, ``_runtime`` (since ``t0``, a ``time.time()``) and the speeds.

    With ``nan_filter`` (logging_nan_inf_filter) the non-finite batch losses are left out, unless
    every one is.
    """
    n_batches, n_samples = len(losses), sum(b for _, b in losses)
    if nan_filter and any(math.isfinite(x) for x, _ in losses):
        losses = [(x, b) for x, b in losses if math.isfinite(x)]
    if not losses:
        raise ValueError("the eval_dataset yielded no batch")
    loss = sum(x * b for x, b in losses) / sum(b for _, b in losses)
    runtime = time.time() - t0
    return {f"{prefix}_loss": loss,
            f"{prefix}_perplexity": math.exp(loss) if loss < 700 else math.inf,
            f"{prefix}_runtime": round(runtime, 4),
            f"{prefix}_samples_per_second": round(n_samples / runtime, 3),
            f"{prefix}_steps_per_second": round(n_batches / runtime, 3)}
