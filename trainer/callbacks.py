"""Callbacks with transformers' semantics: its own classes, plus the run's JSON-lines log.

``TrainerState``, ``TrainerControl``, ``TrainerCallback``, ``CallbackHandler`` and
``DefaultFlowCallback`` are transformers' own (``transformers.trainer_callback``), so a callback
written for ``transformers.Trainer`` sees the same events, the same state fields and the same
control flags here, and the decisions when to log, evaluate, save and stop are made by
transformers' ``DefaultFlowCallback`` itself. The reporting integrations (``report_to``) are
transformers' callbacks too (``TensorBoardCallback`` writes events under ``output_dir/runs/``).
``JsonlLogCallback`` is ours: every run appends each log to ``output_dir/trainer_log.jsonl``.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any

from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)

LOG_NAME = "trainer_log.jsonl"

__all__ = ["CallbackHandler", "DefaultFlowCallback", "JsonlLogCallback", "TrainerCallback", "TrainerControl",
           "TrainerState", "build_handler", "reporting_callbacks"]


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no nan/inf
    return v


class JsonlLogCallback(TrainerCallback):
    """Appends every log (with its step) as one JSON line to ``output_dir/trainer_log.jsonl``."""

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, logs: Any = None,
               **kwargs: Any) -> None:
        """Write one line per log call."""
        if not logs or not state.is_world_process_zero:  # data parallel: one log, rank 0's
            return
        os.makedirs(args.output_dir, exist_ok=True)
        entry = {k: _json_value(v) for k, v in {**logs, "step": state.global_step}.items()}
        with open(os.path.join(args.output_dir, LOG_NAME), "a") as f:
            f.write(json.dumps(entry) + "\n")


def reporting_callbacks(report_to: Any) -> list[Any]:
    """transformers' integration callbacks for ``report_to``; tensorboard is skipped (warned) when missing."""
    from transformers.integrations import get_reporting_integration_callbacks

    names = report_to
    if isinstance(names, str):
        names = [] if names == "none" else [names]
    names = list(names or [])
    out = []
    for name in names:
        for cls in get_reporting_integration_callbacks([name] if name != "all" else "all"):
            try:
                out.append(cls())
            except (RuntimeError, ImportError) as e:  # e.g. TensorBoardCallback without tensorboard
                warnings.warn(f"report_to={name!r}: {e}; not reporting there (trainer_log.jsonl is still "
                              "written)", UserWarning, stacklevel=3)
    return out


def build_handler(report_to: Any, callbacks: list[Any] | None, model: Any, processing_class: Any) -> CallbackHandler:
    """The handler transformers' Trainer would build: flow, integrations, then the user's callbacks."""
    default = [DefaultFlowCallback, JsonlLogCallback(), *reporting_callbacks(report_to)]
    return CallbackHandler(default + list(callbacks or []), model, processing_class, None, None)
