"""Every field of ``transformers.TrainingArguments``: honoured, warned about, or refused, and why.

``POLICY`` names each field of transformers' class (5.x) with what this trainer does with it:

- ``honoured``: applied with transformers' meaning (some are no-ops in one process, as they are
  in transformers' own Trainer there; the note says so);
- ``warned``: accepted, but a non-default value has no effect here; a ``UserWarning`` names the
  field and the reason;
- ``refused``: a non-default value raises ``ValueError`` naming the field and the reason,
  because training would silently mean something else.

A field that is missing from the table (a newer transformers) is warned about when it is set.
``convert`` applies the table and returns the light ``trainer.TrainingArguments``
(``from_hf_args`` also takes a light one as it is); the table in
docs/hf-trainer.md is generated from it by ``python -m tools.hf_args_table``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from trainer.args import SAMPLING, SCHEDULES, TrainingArguments

HONOURED, WARNED, REFUSED = "honoured", "warned", "refused"

_ONE = "one process: nothing to do, as in transformers' Trainer without a launcher"
_NO_WORKERS = "batches are collated on the training thread (no DataLoader worker processes)"
_DDP = "DDP's knob: under torchrun, trainer.distributed reduce-scatters each layer's gradients as a whole"
_HUB = "push_to_hub is refused, so this has no effect"
_BEST = "no best-model tracking (load_best_model_at_end is refused)"

#: field -> (status, what this trainer does with it)
POLICY: dict[str, tuple[str, str]] = {
    "output_dir": (HONOURED, "the store (output_dir/store), trainer_log.jsonl, trace.json, TensorBoard runs/, save_model's default"),
    "per_device_train_batch_size": (HONOURED, "sequences per micro-batch"),
    "num_train_epochs": (HONOURED, "fractional epochs as transformers counts them"),
    "max_steps": (HONOURED, "required for an IterableDataset"),
    "learning_rate": (HONOURED, "peak learning rate of AdamW"),
    "lr_scheduler_type": (HONOURED, f"{', '.join(SCHEDULES)}; any other schedule is refused"),
    "lr_scheduler_kwargs": (REFUSED, "the schedules take no extra arguments here"),
    "warmup_steps": (HONOURED, "an int, or a fraction of the run when < 1"),
    "optim": (HONOURED, "adamw_torch / adamw_torch_fused (the same AdamW, on the CPU over the store); any other optimizer is refused"),
    "optim_args": (REFUSED, "AdamW here takes only betas, eps and weight_decay"),
    "weight_decay": (HONOURED, "decoupled, not on biases and norm weights (transformers' grouping)"),
    "adam_beta1": (HONOURED, "AdamW beta1"),
    "adam_beta2": (HONOURED, "AdamW beta2"),
    "adam_epsilon": (HONOURED, "AdamW epsilon"),
    "optim_target_modules": (REFUSED, "GaLore/APOLLO-style optimizers are not implemented"),
    "gradient_accumulation_steps": (HONOURED, "loss is the token mean over the whole window (num_items_in_batch)"),
    "average_tokens_across_devices": (HONOURED, "under torchrun every rank divides by the loss tokens of the global step"),
    "max_grad_norm": (HONOURED, "global L2 clipping, torch's coefficient"),
    "label_smoothing_factor": (REFUSED, "the streaming loss is plain next-token cross entropy; label smoothing is not implemented"),
    "bf16": (HONOURED, "layers run under bf16 autocast; master weights and AdamW stay fp32"),
    "fp16": (REFUSED, "no fp16 loss scaler; use bf16=True or fp32"),
    "bf16_full_eval": (WARNED, "evaluation runs in the training precision (bf16 autocast when bf16=True); weights are not cast"),
    "fp16_full_eval": (REFUSED, "fp16 is not supported; use bf16"),
    "tf32": (HONOURED, "sets torch's TF32 matmul/cuDNN flags on CUDA"),
    "activation_checkpointing": (HONOURED, "always on: the engine keeps only layer-boundary activations"),
    "activation_checkpointing_kwargs": (WARNED, "the engine's own checkpointing at layer boundaries takes no options"),
    "gradient_checkpointing": (HONOURED, "always on: the engine keeps only layer-boundary activations"),
    "gradient_checkpointing_kwargs": (WARNED, "the engine's own checkpointing at layer boundaries takes no options"),
    "torch_compile": (WARNED, "layers run eagerly through torch.func.functional_call"),
    "torch_compile_backend": (WARNED, "layers run eagerly (torch_compile is not applied)"),
    "torch_compile_mode": (WARNED, "layers run eagerly (torch_compile is not applied)"),
    "use_liger_kernel": (REFUSED, "Liger kernels patch the model's modules; not supported by the streaming engine"),
    "liger_kernel_config": (REFUSED, "Liger kernels are not supported"),
    "use_cache": (HONOURED, "training never keeps a KV cache (use_cache=False), as the default asks; True is warned"),
    "neftune_noise_alpha": (REFUSED, "NEFTune embedding noise is not implemented"),
    "torch_empty_cache_steps": (HONOURED, "torch.cuda.empty_cache() every that many steps on CUDA"),
    "auto_find_batch_size": (REFUSED, "batch-size search on OOM is not implemented"),
    "logging_strategy": (HONOURED, "steps / epoch / no, through transformers' DefaultFlowCallback"),
    "logging_steps": (HONOURED, "an int, or a fraction of the run when < 1"),
    "logging_first_step": (HONOURED, "also log step 1"),
    "log_on_each_node": (HONOURED, _ONE),
    "logging_nan_inf_filter": (HONOURED, "a nan/inf step loss counts as the mean so far"),
    "include_num_input_tokens_seen": (HONOURED, "num_input_tokens_seen in the logs (all / non_padding)"),
    "log_level": (HONOURED, "transformers' logging verbosity"),
    "log_level_replica": (HONOURED, _ONE),
    "disable_tqdm": (HONOURED, "turns the trainer's progress bar off"),
    "report_to": (HONOURED, "transformers' integration callbacks (tensorboard writes events under output_dir/runs/); trainer_log.jsonl is always written"),
    "run_name": (HONOURED, "passed to the reporting integrations"),
    "project": (HONOURED, "passed to the reporting integrations"),
    "trackio_space_id": (HONOURED, "passed to the trackio integration"),
    "trackio_bucket_id": (HONOURED, "passed to the trackio integration"),
    "trackio_static_space_id": (HONOURED, "passed to the trackio integration"),
    "eval_strategy": (HONOURED, "steps / epoch / no, through transformers' DefaultFlowCallback"),
    "eval_steps": (HONOURED, "defaults to logging_steps, as in transformers"),
    "eval_delay": (HONOURED, "no evaluation before this step (or epoch)"),
    "per_device_eval_batch_size": (HONOURED, "sequences per evaluation batch"),
    "prediction_loss_only": (HONOURED, "evaluate() computes the loss only (and its perplexity)"),
    "eval_on_start": (HONOURED, "one evaluation before the first step"),
    "eval_do_concat_batches": (HONOURED, "only losses are gathered"),
    "eval_use_gather_object": (HONOURED, _ONE),
    "eval_accumulation_steps": (HONOURED, "only per-batch losses are kept, on the host"),
    "include_for_metrics": (WARNED, "there is no compute_metrics: evaluate() reports loss and perplexity only"),
    "batch_eval_metrics": (WARNED, "there is no compute_metrics: evaluate() reports loss and perplexity only"),
    "save_only_model": (WARNED, "a checkpoint is one store commit of weights, moments and trainer state; it is never model-only"),
    "save_strategy": (HONOURED, "steps / epoch / no (a checkpoint is a store commit); best is refused"),
    "save_steps": (HONOURED, "an int, or a fraction of the run when < 1"),
    "save_on_each_node": (HONOURED, _ONE),
    "save_total_limit": (HONOURED, "the store keeps that many commits (keep_last); None keeps all"),
    "enable_jit_checkpoint": (REFUSED, "checkpoint-on-SIGTERM is not implemented (a killed run resumes from its last commit)"),
    "push_to_hub": (REFUSED, "uploading checkpoints is not implemented; use save_model and push the folder"),
    "hub_token": (WARNED, _HUB),
    "hub_private_repo": (WARNED, _HUB),
    "hub_model_id": (WARNED, _HUB),
    "hub_strategy": (WARNED, _HUB),
    "hub_always_push": (WARNED, _HUB),
    "hub_revision": (WARNED, _HUB),
    "load_best_model_at_end": (REFUSED, "best-checkpoint tracking is not implemented"),
    "metric_for_best_model": (WARNED, _BEST),
    "greater_is_better": (WARNED, _BEST),
    "ignore_data_skip": (REFUSED, "resume always continues the data order exactly where the checkpoint left it"),
    "restore_callback_states_from_checkpoint": (WARNED, "callback states are not saved in the store"),
    "full_determinism": (HONOURED, "transformers.enable_full_determinism(seed)"),
    "seed": (HONOURED, "torch's RNG (dropout) and, without data_seed, the data order"),
    "data_seed": (HONOURED, "the data order (accelerate's seedable sampler: permutation seeded by data_seed + epoch)"),
    "use_cpu": (HONOURED, "compute on the CPU"),
    "accelerator_config": (WARNED, "accelerate does not prepare this trainer's data; the order equals its default seedable sampler"),
    "parallelism_config": (REFUSED, "tensor/context/sequence parallelism is not implemented"),
    "dataloader_drop_last": (HONOURED, "drop the last incomplete batch of an epoch"),
    "dataloader_num_workers": (WARNED, _NO_WORKERS),
    "dataloader_pin_memory": (HONOURED, "the store pins its own host buffers where CUDA is present"),
    "dataloader_persistent_workers": (WARNED, _NO_WORKERS),
    "dataloader_prefetch_factor": (WARNED, _NO_WORKERS),
    "dataloader_multiprocessing_context": (WARNED, _NO_WORKERS),
    "dataloader_in_order": (HONOURED, "batches are always in order"),
    "remove_unused_columns": (HONOURED, "datasets.Dataset columns the model's forward does not take are dropped"),
    "label_names": (REFUSED, "the loss reads the 'labels' column only"),
    "train_sampling_strategy": (HONOURED, f"{' / '.join(SAMPLING)}; length-grouped strategies are refused"),
    "length_column_name": (HONOURED, "only used by length-grouped sampling, which is refused"),
    "ddp_find_unused_parameters": (WARNED, _DDP),
    "ddp_bucket_cap_mb": (WARNED, _DDP),
    "ddp_broadcast_buffers": (WARNED, _DDP),
    "ddp_static_graph": (WARNED, _DDP),
    "ddp_backend": (WARNED, _DDP),
    "ddp_timeout": (HONOURED, "seconds a data-parallel collective waits for the other ranks (torchrun)"),
    "fsdp": (REFUSED, "the store already offloads and streams the model; FSDP sharding is not combined with it"),
    "fsdp_config": (REFUSED, "FSDP is not supported"),
    "deepspeed": (REFUSED, "the store replaces ZeRO offload; DeepSpeed is not supported"),
    "debug": (WARNED, "transformers' debug options (underflow/overflow, TPU metrics) are not implemented"),
    "skip_memory_metrics": (HONOURED, "memory metrics are skipped (False is warned: store.stats() has the per-tier peaks)"),
    "do_train": (HONOURED, "not used by transformers' Trainer either: for scripts"),
    "do_eval": (HONOURED, "not used by transformers' Trainer either: for scripts"),
    "do_predict": (HONOURED, "not used by transformers' Trainer either: for scripts"),
    "resume_from_checkpoint": (HONOURED, "not used by transformers' Trainer either: pass it to train()"),
    "local_rank": (HONOURED, "read from torchrun's LOCAL_RANK (the GPU of the rank); nothing to set by hand"),
}

#: light-argument fields read from an HF object of the same name
_COPIED = [f.name for f in dataclasses.fields(TrainingArguments)]

#: values of ``optim`` that are the AdamW this trainer runs
ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf")


def _plain(v: Any) -> Any:
    v = getattr(v, "value", v)  # transformers' str enums
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _hf_defaults() -> dict[str, Any]:
    try:
        from transformers import TrainingArguments as HF
    except ImportError:
        return {}
    out = {}
    for f in dataclasses.fields(HF):
        if f.default is not dataclasses.MISSING:
            out[f.name] = _plain(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = _plain(f.default_factory())
    return out


def _is_default(name: str, value: Any, default: Any) -> bool:
    value = _plain(value)
    # transformers' __post_init__ rewrites some defaults (None -> a value, "none" -> []).
    empty = (None, False, "", "no", "none", [], {}, 0)
    if value in empty and default in empty:
        return True
    if name == "accelerator_config":
        try:
            from transformers.trainer_pt_utils import AcceleratorConfig

            given = value.to_dict() if hasattr(value, "to_dict") else value
            base = AcceleratorConfig().to_dict()
            return not given or all(base.get(k) == v for k, v in given.items())
        except ImportError:
            return value is None
    if name in ("metric_for_best_model", "greater_is_better"):
        return True  # set by __post_init__ only with load_best_model_at_end, which is refused
    return value == default


def _check_special(name: str, value: Any) -> None:
    v = _plain(value)
    if name == "optim" and v not in ADAMW:
        raise ValueError(f"TrainingArguments.optim={v!r} is refused: this trainer runs AdamW "
                         f"({' / '.join(ADAMW)}) on the CPU over the store")
    if name == "lr_scheduler_type" and v not in SCHEDULES:
        raise ValueError(f"TrainingArguments.lr_scheduler_type={v!r} is refused: supported schedules are {SCHEDULES}")
    if name == "save_strategy" and v == "best":
        raise ValueError("TrainingArguments.save_strategy='best' is refused: best-checkpoint tracking is not implemented")
    if name == "train_sampling_strategy" and v not in SAMPLING:
        raise ValueError(f"TrainingArguments.train_sampling_strategy={v!r} is refused: supported are {SAMPLING}")
    if name == "use_cache" and v is True:
        warnings.warn("TrainingArguments.use_cache=True is ignored: training keeps no KV cache",
                      UserWarning, stacklevel=4)
    if name == "skip_memory_metrics" and v is False:
        warnings.warn("TrainingArguments.skip_memory_metrics=False is ignored: memory metrics are not "
                      "collected (store.stats() has the per-tier peaks)", UserWarning, stacklevel=4)


def check(hf_args: Any) -> None:
    """Warn about or refuse, by name, every field of ``hf_args`` this trainer cannot honour."""
    defaults = _hf_defaults()
    names = ([f.name for f in dataclasses.fields(hf_args)] if dataclasses.is_dataclass(hf_args)
             else [n for n in vars(hf_args) if not n.startswith("_")])
    for name in names:
        value = getattr(hf_args, name)
        _check_special(name, value)
        status, why = POLICY.get(name, (None, "this trainer does not know the field"))
        if status == HONOURED:
            continue
        default = defaults.get(name)
        if name not in defaults and status is None:
            continue  # an attribute that is no field of transformers' class
        if _is_default(name, value, default):
            continue
        if status == REFUSED:
            raise ValueError(f"TrainingArguments.{name}={_plain(value)!r} is refused: {why}")
        warnings.warn(f"TrainingArguments.{name}={_plain(value)!r} is ignored: {why}", UserWarning, stacklevel=3)


def convert(hf_args: Any) -> TrainingArguments:
    """The light ``TrainingArguments`` for ``hf_args`` after ``check`` (refusals raise ValueError)."""
    check(hf_args)
    values: dict[str, Any] = {}
    for name in _COPIED:
        if hasattr(hf_args, name):
            v = _plain(getattr(hf_args, name))
            if name == "disable_tqdm" and v is None:
                v = False
            if name == "max_grad_norm" and v is None:
                v = 0.0
            values[name] = v
    return TrainingArguments(**values)


def from_hf_args(hf_args: Any) -> TrainingArguments:
    """The light arguments for ``hf_args``: a light ``TrainingArguments`` as it is, transformers' converted.

    Every field of transformers' class is honoured, warned about or refused by name (``POLICY``).
    """
    if isinstance(hf_args, TrainingArguments):
        return hf_args
    return convert(hf_args)
