"""Training arguments (transformers' field names) and the learning-rate schedules.

``TrainingArguments`` is a light dataclass for users without transformers' own (which needs
accelerate); ``trainer.hf_args.from_hf_args`` reads a ``transformers.TrainingArguments`` field by
field into it, honouring, warning about or refusing every one of its fields by name. This module
is below ``trainer.hf_args`` and imports nothing from it: the conversion needs the light class,
never the other way round. The light class has the fields, defaults and meaning of
transformers' (5.x) for everything it holds, so transformers' own callbacks
(``DefaultFlowCallback``, ``TensorBoardCallback``) read it as they read theirs. The schedule lambdas copy the formulas of ``transformers.optimization`` so that a
run here follows the same learning-rate curve.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")
STRATEGIES = ("no", "steps", "epoch")
SAMPLING = ("random", "sequential")
TOKENS_SEEN = ("no", "all", "non_padding")


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
    logging_strategy: str = "steps"
    """When to log: "steps" (every logging_steps), "epoch" or "no"."""
    logging_steps: float = 500
    """Log every this many steps (a value < 1 is a fraction of the run)."""
    logging_first_step: bool = False
    """Also log the first step."""
    logging_nan_inf_filter: bool = True
    """A nan/inf step loss counts as the window's mean so far (transformers' filter)."""
    include_num_input_tokens_seen: str | bool = "no"
    """Log num_input_tokens_seen: "all" tokens of input_ids, "non_padding", or "no"."""
    save_strategy: str = "steps"
    """When to checkpoint (a store commit): "steps", "epoch" or "no"."""
    save_steps: float = 500
    """Commit a checkpoint every this many steps; 0 turns periodic saves off."""
    save_total_limit: int | None = None
    """Checkpoints (store commits) to keep; None keeps every one (the store's retention)."""
    eval_strategy: str = "no"
    """When to evaluate on eval_dataset: "steps" (every eval_steps), "epoch" or "no"."""
    eval_steps: float | None = None
    """Evaluate every this many steps; None means logging_steps (as transformers has it)."""
    eval_delay: float = 0
    """Steps (or epochs) to wait before the first evaluation."""
    eval_on_start: bool = False
    """Evaluate once before the first step."""
    per_device_eval_batch_size: int = 8
    """Sequences per evaluation batch."""
    report_to: str | list[str] = "none"
    """Integrations to report to ("tensorboard", "all", "none", ...); trainer_log.jsonl is always written."""
    run_name: str | None = None
    """A name for the run (shown by the reporting integrations)."""
    seed: int = 42
    """Seed of torch's RNG (dropout) and, without data_seed, of the data order."""
    data_seed: int | None = None
    """Seed of the data order; None uses seed."""
    train_sampling_strategy: str = "random"
    """Item order: "random" (a seeded permutation per epoch) or "sequential"."""
    dataloader_drop_last: bool = False
    """Drop the last, incomplete batch of an epoch."""
    remove_unused_columns: bool = True
    """Drop datasets.Dataset columns the model's forward does not take (as transformers does)."""
    bf16: bool = False
    """Compute layers in bf16 (autocast); master weights and optimizer stay fp32."""
    use_cpu: bool = False
    """Compute on the CPU even where CUDA is available."""
    disable_tqdm: bool = False
    """Turn the progress bar off."""
    ddp_timeout: int = 1800
    """Seconds a data-parallel collective waits for the other ranks before ``DistributedError``."""

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
        if self.ddp_timeout <= 0:
            raise ValueError(f"ddp_timeout must be > 0 seconds, got {self.ddp_timeout}")
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
        if self.logging_steps <= 0:
            raise ValueError(f"logging_steps must be > 0, got {self.logging_steps}")
        if self.save_steps < 0:
            raise ValueError(f"save_steps must be >= 0, got {self.save_steps}")
        for name in ("logging_strategy", "save_strategy", "eval_strategy"):
            v = _enum_value(getattr(self, name))
            if v not in STRATEGIES:
                raise ValueError(f"{name} must be one of {STRATEGIES}, got {v!r}")
            setattr(self, name, v)
        if self.eval_steps is None and self.eval_strategy == "steps":
            self.eval_steps = self.logging_steps  # transformers' default
        if self.eval_steps is not None and self.eval_steps <= 0:
            raise ValueError(f"eval_steps must be > 0, got {self.eval_steps}")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ValueError(f"save_total_limit must be >= 1 or None, got {self.save_total_limit}")
        if self.per_device_eval_batch_size < 1:
            raise ValueError(f"per_device_eval_batch_size must be >= 1, got {self.per_device_eval_batch_size}")
        if self.train_sampling_strategy not in SAMPLING:
            raise ValueError(f"train_sampling_strategy must be one of {SAMPLING}, got "
                             f"{self.train_sampling_strategy!r} (length-grouped sampling is not supported)")
        if self.include_num_input_tokens_seen is True:
            self.include_num_input_tokens_seen = "all"
        elif self.include_num_input_tokens_seen is False:
            self.include_num_input_tokens_seen = "no"
        if self.include_num_input_tokens_seen not in TOKENS_SEEN:
            raise ValueError(f"include_num_input_tokens_seen must be one of {TOKENS_SEEN}, "
                             f"got {self.include_num_input_tokens_seen!r}")
        if isinstance(self.report_to, str):
            self.report_to = [] if self.report_to in ("none", "") else [self.report_to]
        self.report_to = list(self.report_to)

    @property
    def eval_batch_size(self) -> int:
        """Sequences per evaluation batch (transformers' property name)."""
        return self.per_device_eval_batch_size

    @property
    def train_batch_size(self) -> int:
        """Sequences per training micro-batch (transformers' property name)."""
        return self.per_device_train_batch_size

    @property
    def sampler_seed(self) -> int:
        """The seed of the data order: data_seed, else seed."""
        return self.seed if self.data_seed is None else self.data_seed

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_json_string(self) -> str:
        """The fields as JSON (what transformers' TensorBoardCallback logs as text)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

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


def _enum_value(v: Any) -> Any:
    return getattr(v, "value", v)


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
