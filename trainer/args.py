"""Training arguments (transformers' field names) and the learning-rate schedules.

``TrainingArguments`` is a light dataclass for users without transformers; ``from_hf_args`` reads
the same fields from a ``transformers.TrainingArguments``. The schedule lambdas copy the formulas
of ``transformers.optimization`` so that a run here follows the same learning-rate curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")


@dataclass(kw_only=True, slots=True)
class TrainingArguments:
    """The subset of ``transformers.TrainingArguments`` that this trainer honours."""

    output_dir: str = "trainer_output"
    """Where checkpoints (the store, by default) and the final model go."""
    per_device_train_batch_size: int = 8
    """Sequences per micro-batch."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; the loss is the token mean over all of them."""
    learning_rate: float = 5e-5
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """Decoupled weight decay, not applied to biases and norm weights (as transformers does)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon, added after the bias-corrected square root (torch semantics)."""
    max_grad_norm: float | None = 1.0
    """Clip the global L2 norm of all gradients to this; 0 or None turns clipping off."""
    num_train_epochs: float = 3.0
    """Epochs to train when max_steps is not positive."""
    max_steps: int = -1
    """Optimizer steps to train; overrides num_train_epochs when positive."""
    lr_scheduler_type: str = "linear"
    """One of linear, cosine, constant, constant_with_warmup."""
    warmup_steps: float = 0
    """Warm-up steps; a value in (0, 1) is a fraction of the total (transformers 5 semantics)."""
    warmup_ratio: float = 0.0
    """Warm-up as a fraction of the total steps, used when warmup_steps is 0."""
    logging_steps: int = 500
    """Log every this many steps (the first step is always logged)."""
    save_steps: int = 500
    """Commit a checkpoint to the store every this many steps; 0 turns periodic saves off."""
    seed: int = 42
    """Seed of the data order and of torch's RNG (dropout)."""
    bf16: bool = False
    """Compute layers in bf16 (autocast); master weights and optimizer stay fp32."""
    disable_tqdm: bool = False
    """Turn the progress bar off."""

    def __post_init__(self) -> None:
        if self.per_device_train_batch_size < 1:
            raise ValueError(f"per_device_train_batch_size must be >= 1, got {self.per_device_train_batch_size}")
        if self.gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {self.gradient_accumulation_steps}")
        if self.learning_rate < 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {v}")
        if self.adam_epsilon <= 0:
            raise ValueError(f"adam_epsilon must be > 0, got {self.adam_epsilon}")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 or None, got {self.max_grad_norm}")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ValueError("set max_steps > 0 or num_train_epochs > 0: there is nothing to train")
        if self.lr_scheduler_type not in SCHEDULES:
            raise ValueError(f"lr_scheduler_type {self.lr_scheduler_type!r} is not one of {SCHEDULES}")
        if self.warmup_steps < 0 or not 0.0 <= self.warmup_ratio <= 1.0:
            raise ValueError("warmup_steps must be >= 0 and warmup_ratio in [0, 1]")
        if self.logging_steps < 1:
            raise ValueError(f"logging_steps must be >= 1, got {self.logging_steps}")
        if self.save_steps < 0:
            raise ValueError(f"save_steps must be >= 0, got {self.save_steps}")

    @property
    def clip_norm(self) -> float | None:
        """The clipping threshold, or None when clipping is off."""
        return self.max_grad_norm if self.max_grad_norm else None

    def warmup_for(self, total_steps: int) -> int:
        """Warm-up steps for a run of ``total_steps`` (transformers' get_warmup_steps)."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        if self.warmup_steps > 0:
            return math.ceil(total_steps * self.warmup_steps)
        return math.ceil(total_steps * self.warmup_ratio)

    def total_steps(self, steps_per_epoch: int) -> int:
        """Optimizer steps of the whole run."""
        if self.max_steps > 0:
            return self.max_steps
        return math.ceil(self.num_train_epochs * steps_per_epoch)


def from_hf_args(hf_args: Any) -> TrainingArguments:
    """The light arguments with the values of a ``transformers.TrainingArguments``."""
    if isinstance(hf_args, TrainingArguments):
        return hf_args
    values: dict[str, Any] = {}
    for f in fields(TrainingArguments):
        if hasattr(hf_args, f.name):
            values[f.name] = getattr(hf_args, f.name)
    sched = values.get("lr_scheduler_type")
    if sched is not None and not isinstance(sched, str):
        values["lr_scheduler_type"] = getattr(sched, "value", str(sched))
    if getattr(hf_args, "fp16", False):
        raise ValueError("fp16 is not supported by this trainer: use bf16=True or fp32")
    return TrainingArguments(**values)


def lr_lambda(kind: str, step: int, warmup: int, total: int, num_cycles: float = 0.5) -> float:
    """The multiplier of the peak LR at optimizer step ``step`` (0-based), as transformers has it."""
    if kind == "constant":
        return 1.0
    if step < warmup:
        if kind in ("linear", "cosine"):
            return float(step) / float(max(1, warmup))
        return float(step) / float(max(1.0, warmup))
    if kind == "constant_with_warmup":
        return 1.0
    if kind == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    if kind == "cosine":
        progress = float(step - warmup) / float(max(1, total - warmup))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))
    raise ValueError(f"unknown lr_scheduler_type {kind!r}; choose one of {SCHEDULES}")


def learning_rate_at(args: TrainingArguments, step: int, total: int) -> float:
    """The learning rate used by the update of optimizer step ``step`` (0-based)."""
    return args.learning_rate * lr_lambda(args.lr_scheduler_type, step, args.warmup_for(total), total)
