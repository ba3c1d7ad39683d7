"""The user-facing ``Trainer`` (train, evaluate, save_model, store); ``init`` and ``load_model`` are ``trainer.session``'s.

``Trainer`` has ``transformers.Trainer``'s arguments, loop order and callback events (its own
``TrainerState``/``TrainerControl``/``DefaultFlowCallback``, ``trainer.callbacks``), so that a script
written for transformers runs here with the same logged losses and the same callback sequence.
One store per run holds everything: fp32 master weights under their HF names, accumulated
gradients, Adam moments, the trainer's own state and the model's HF files
(``trainer.checkpoint``). A checkpoint is a store commit; resuming reopens the store and continues
from the last commit's step with the same data order and RNG state.

The class is the facade; the work is in modules beside it: ``train`` prepares the run (resume or
fresh weights, retention, the schedule) and hands its optimizer steps to ``trainer.loop``;
``trainer.resume`` finds and prepares the store to resume; ``evaluate`` runs
``trainer.evaluation``'s pass; ``save_model`` streams the weights out with ``tierstore.export``.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tierstore.export import write_safetensors
from trainer import distributed, memory, session
from trainer import model as model_mod
from trainer.args import TrainingArguments
from trainer.callbacks import TrainerControl, TrainerState, build_handler
from trainer.checkpoint import (
    drop_gradients,
    load_state,
    save_hf_files,
    save_state,
)
from trainer.data import (
    drop_unused_columns,
    eval_batches,
    has_length,
    micro_batches_per_epoch,
)
from trainer.evaluation import eval_losses, eval_metrics
from trainer.hf_args import from_hf_args
from trainer.loop import TrainLoop
from trainer.model import ModelParts, decompose
from trainer.optimizer import UpdateWorker
from trainer.resume import bring_to_checkpoint, resume_target
from trainer.session import SessionConfig, close_store, compute_device, init, load_model, open_store
from trainer.steps import RunLog, apply_runtime_args
from trainer.streaming import StreamingEngine

__all__ = ["SessionConfig", "TrainOutput", "Trainer", "close_store", "init", "load_model", "open_store"]

TRACE_NAME = "trace.json"  # where ``tierstore trace RUN_DIR`` looks


@dataclass(frozen=True, slots=True)
class TrainOutput:
    """What ``train`` returns (transformers' field names)."""

    global_step: int
    training_loss: float
    metrics: dict[str, Any]


_REFUSED_INIT = ("model_init", "compute_loss_func", "compute_metrics", "optimizer_cls_and_kwargs",
                 "preprocess_logits_for_metrics")


class Trainer:
    """Layer-streaming trainer for a Hugging Face causal LM with ``transformers.Trainer``'s API.

    The arguments have transformers' names, order and meaning. ``args`` is a
    ``transformers.TrainingArguments`` (every field honoured, warned about or refused by name,
    ``trainer.hf_args``) or the light ``trainer.TrainingArguments``. The weights, moments and
    state live in a Store (``<output_dir>/store`` unless ``init(offload_dir=)``); a model with
    real weights hands them to the store for the run and gets the trained ones back when
    ``train`` returns; a meta skeleton (``load_model``) stays one, and calling it says where its
    weights are.
    """

    def __init__(self, model: nn.Module | None = None, args: Any = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 model_init: Any = None, compute_loss_func: Any = None, compute_metrics: Any = None,
                 callbacks: list[Any] | None = None, optimizers: tuple[Any, Any] = (None, None),
                 optimizer_cls_and_kwargs: Any = None, preprocess_logits_for_metrics: Any = None, *,
                 pad_token_id: int | None = None) -> None:
        given = dict(model_init=model_init, compute_loss_func=compute_loss_func, compute_metrics=compute_metrics,
                     optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                     preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        for name in _REFUSED_INIT:
            if given[name] is not None:
                raise ValueError(f"Trainer({name}=...) is refused: this trainer computes the causal-LM loss "
                                 "itself, runs its own AdamW over the store and reports loss/perplexity only")
        if optimizers is not None and tuple(optimizers) != (None, None):
            raise ValueError("Trainer(optimizers=...) is refused: the optimizer is AdamW on the CPU over the store")
        if model is None:
            raise ValueError("Trainer needs a model (model_init is refused)")
        self.model = model
        self.args = args if args is not None else TrainingArguments()
        self._cfg = from_hf_args(self.args)
        self.parts: ModelParts = decompose(model)
        if processing_class is not None and pad_token_id is None:
            pad_token_id = getattr(processing_class, "pad_token_id", None)
        self.pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
        self.processing_class = processing_class
        self.data_collator = data_collator
        prepare = (lambda ds: drop_unused_columns(ds, model)) if self._cfg.remove_unused_columns else (lambda ds: ds)
        self.train_dataset = prepare(train_dataset) if train_dataset is not None else None
        if isinstance(eval_dataset, dict):
            self.eval_dataset: Any = {k: prepare(v) for k, v in eval_dataset.items()}
        else:
            self.eval_dataset = prepare(eval_dataset) if eval_dataset is not None else None
        if self._cfg.eval_strategy != "no" and eval_dataset is None:
            raise ValueError(f"eval_strategy={self._cfg.eval_strategy!r} needs an eval_dataset (transformers "
                             "refuses this too); pass one or set eval_strategy='no'")
        self.state = TrainerState()
        self.control = TrainerControl()
        self.callback_handler = build_handler(self._cfg.report_to, callbacks, model, processing_class)
        self._store = getattr(model, "_trainer_store", None)
        self._lock = threading.RLock()
        self._engine: StreamingEngine | None = None
        self._worker: UpdateWorker | None = None
        # torchrun (or an initialised process group) with several ranks: data parallel, else None
        self._dp = distributed.from_env(self._cfg.ddp_timeout, compute_device(self._cfg))
        self._mark_process_zero(self.state)
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)

    def _mark_process_zero(self, state: TrainerState) -> None:
        # transformers' flags: its integrations (and our jsonl log) write on the world's rank 0 only
        if self._dp is not None:
            state.is_world_process_zero = self._dp.rank == 0
            state.is_local_process_zero = self._dp.local_rank == 0

    # -- callbacks (transformers' names) --------------------------------------------------
    def add_callback(self, callback: Any) -> None:
        """Add a callback (class or instance)."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: Any) -> Any:
        """Remove a callback and return it."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: Any) -> None:
        """Remove a callback."""
        self.callback_handler.remove_callback(callback)

    # -- the store -------------------------------------------------------------------------
    def _store_root(self) -> str:
        # in data parallel the folder of the per-rank stores and their manifest (trainer.distributed)
        return session.current().offload_dir or os.path.join(self._cfg.output_dir, "store")

    def _default_store_path(self) -> str:
        return distributed.rank_store_path(self._store_root())

    @property
    def store(self) -> Any:
        """The tierstore Store this run uses (opened on first use)."""
        if self._store is None:
            self._store = open_store(self._default_store_path(), chunk_bytes=self._chunk_bytes())
        return self._store

    def _chunk_bytes(self) -> int | None:
        return session.model_chunk_bytes(self.model, compute_device(self._cfg))

    def close(self) -> None:
        """Close the store (a later Trainer on the same folder reopens it)."""
        if self._store is not None:
            close_store(self._store)
            self._store = None

    def _take_weights(self) -> bool:
        # A model with real weights hands them to the store and becomes a meta skeleton.
        real = any(p.device.type != "meta" for p in self.model.parameters())
        store = self.store
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if p.device.type != "meta":
                    store.put(name, p.detach().to(torch.float32).contiguous(), codec="raw")
        model_mod.to_meta_(self.model)
        self.model._trainer_store = store
        return real

    def _give_back_weights(self, real: bool) -> None:
        """Bind the store's weights back into a model that came with real ones; else say where they are."""
        self._drop_meta_hook()
        if real:
            with self._lock:
                model_mod.bind_weights_(self.model, self.store.get)
            return
        if getattr(self.model, "_trainer_meta_hook", None) is None:
            where = self._default_store_path() if self._store is None else self._store.path
            self.model._trainer_meta_hook = model_mod.guard_meta(self.model, where)

    def _drop_meta_hook(self) -> None:
        # the engine may run the top-level module itself (a model that is its own body)
        hook = getattr(self.model, "_trainer_meta_hook", None)
        if hook is not None:
            hook.remove()
            self.model._trainer_meta_hook = None

    def _check_weights(self) -> None:
        have = set(self.store.keys())
        missing = [n for n in self.parts.all_params() if n not in have]
        if missing:
            raise ValueError(f"the store at {self.store.path} lacks {len(missing)} weights of this model, e.g. "
                             f"{missing[:3]}: pass a model with weights, or one from trainer.load_model")

    def _checkpoint(self) -> None:
        """A store commit at this step boundary: no gradients, the state, the retention of save_total_limit."""
        if self._worker is not None:
            self._worker.wait_all()
        with self._lock:
            drop_gradients(self.store)
            save_state(self.store, self.state)
            version = self.store.commit(step=self.state.global_step, message=f"trainer step {self.state.global_step}")
        if self._dp is not None:  # phase two: the manifest makes the step a checkpoint on every rank
            self._dp.commit_manifest(distributed.manifest_root(self.store.path), self.state.global_step, version)
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _open_for_resume(self, resume: Any) -> None:
        """Open the store ``resume`` names (``trainer.resume``), ready to continue from its last checkpoint."""
        default = self._default_store_path()
        root = self._store_root() if resume is True else os.fspath(resume)
        target = resume_target(resume, root, default, self._cfg.output_dir, self._dp)
        if self._store is not None and os.path.abspath(self._store.path) != os.path.abspath(target.path):
            self.close()
        if self._store is None:
            self._store = open_store(target.path, chunk_bytes=self._chunk_bytes())
        bring_to_checkpoint(self._store, target, self._cfg.output_dir, self._dp, self._lock)

    # -- the loop --------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: bool | str | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, stop_at_step: int | None = None) -> TrainOutput:
        """Train to max_steps/num_train_epochs, as ``transformers.Trainer.train``.

        ``resume_from_checkpoint``: True resumes from the last commit of the run's store
        (``ValueError: No valid checkpoint found in output directory`` when there is none); a path
        names a store folder (or a run folder holding ``store/``). ``stop_at_step`` ends early
        after a checkpoint at that step (the schedule still spans the whole run).
        """
        if trial is not None:
            raise ValueError("train(trial=...) is refused: hyper-parameter search is not implemented")
        cfg, args = self._cfg, self.args
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if not has_length(self.train_dataset) and cfg.max_steps <= 0:
            raise ValueError("the train_dataset has no length (an IterableDataset): set max_steps > 0")
        apply_runtime_args(args)
        self._drop_meta_hook()
        real = self._resume(resume_from_checkpoint) if resume_from_checkpoint else self._start_fresh()
        store = self.store
        # save_total_limit, else mt.init(keep_last=), else every checkpoint (as transformers)
        keep = cfg.save_total_limit or session.current().keep_last or 1 << 30
        store.config.keep_last = keep if self._dp is None else distributed.retention(keep)
        with self._lock:
            save_hf_files(store, self.model, self.processing_class)
        start = self.state.global_step
        micro, per_epoch, total, epochs = self._schedule()
        st = self.state
        st.max_steps, st.num_train_epochs, st.train_batch_size = total, epochs, cfg.per_device_train_batch_size
        st.compute_steps(cfg, total)
        end = total if stop_at_step is None else min(total, stop_at_step)
        try:
            # every step frees and allocates the same activation sizes: kept in the heap, they
            # are not faulted in afresh by each op (a third of the CPU time of a step on the CPU)
            with memory.reuse_freed_buffers():
                loss = self._loop(start, end, total, per_epoch, micro, ignore_keys_for_eval,
                                  stop_at_step is not None)
        finally:
            self._write_trace()
        self._give_back_weights(real)
        return loss

    def _resume(self, resume: Any) -> bool:
        """Continue from the checkpoint ``resume`` names: its weights and state (whatever the model holds)."""
        self._open_for_resume(resume)
        real = any(p.device.type != "meta" for p in self.model.parameters())
        model_mod.to_meta_(self.model)
        self._check_weights()
        self.state = load_state(self.store)
        self._mark_process_zero(self.state)
        return real

    def _start_fresh(self) -> bool:
        """A new run: seeded, the model's weights in the store (rank 0's on every rank), a new state."""
        cfg = self._cfg
        if getattr(self.args, "full_determinism", False):
            from transformers import enable_full_determinism

            enable_full_determinism(cfg.seed)
        torch.manual_seed(cfg.seed)
        real = self._take_weights()
        self._check_weights()
        if self._dp is not None:  # every rank starts from rank 0's weights, as DDP does
            self._dp.broadcast_weights(self.store, self.parts.all_params(), self._lock)
        self.state = TrainerState()
        self._mark_process_zero(self.state)
        return real

    def _schedule(self) -> tuple[int, int, int, int]:
        """(micro-batches per epoch, optimizer steps per epoch, steps in the run, epochs)."""
        cfg = self._cfg
        if not has_length(self.train_dataset):
            return cfg.max_steps * cfg.gradient_accumulation_steps, cfg.max_steps, cfg.max_steps, 1
        micro = micro_batches_per_epoch(len(self.train_dataset), self._global_batch(), cfg.dataloader_drop_last)
        per_epoch = math.ceil(micro / cfg.gradient_accumulation_steps)
        total = cfg.total_steps(per_epoch)
        return micro, per_epoch, total, math.ceil(total / per_epoch)

    def _loop(self, start: int, end: int, total: int, per_epoch: int, micro_per_epoch: int,
              ignore_keys: list[str] | None, stopping: bool) -> TrainOutput:
        train_loss, metrics = TrainLoop(self, start, end, total, per_epoch, micro_per_epoch, ignore_keys,
                                        stopping).run()
        return TrainOutput(self.state.global_step, train_loss, metrics)

    def _global_batch(self) -> int:
        """Sequences per micro-batch over all ranks (each rank trains per_device_train_batch_size of them)."""
        return self._cfg.per_device_train_batch_size * (1 if self._dp is None else self._dp.world)

    def _end_epoch(self, run: RunLog, ignore_keys: list[str] | None) -> None:
        self.control = self.callback_handler.on_epoch_end(self.args, self.state, self.control)
        self._maybe_log_save_evaluate(run, ignore_keys)

    def _maybe_log_save_evaluate(self, run: RunLog, ignore_keys: list[str] | None) -> None:
        """transformers' order: log the window, evaluate, then checkpoint, as the control flags ask."""
        if self.control.should_log and self.state.global_step > run.last_logged:
            self._log(run.window_logs(self.state.global_step))
        if self.control.should_evaluate:
            self._evaluate_during_train(ignore_keys)
        if self.control.should_save:
            self._checkpoint()

    def _log(self, logs: dict[str, Any]) -> None:
        """Log one training window (``loss`` is its mean step loss); tools.harness.crash_train hooks this."""
        self.log(logs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add epoch (and tokens seen) to ``logs``, append them to log_history, call on_log."""
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        if self._cfg.include_num_input_tokens_seen != "no":
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def _evaluate_during_train(self, ignore_keys: list[str] | None) -> None:
        if isinstance(self.eval_dataset, dict):
            for name, ds in self.eval_dataset.items():
                self.evaluate(ds, ignore_keys, metric_key_prefix=f"eval_{name}")
        else:
            self.evaluate(ignore_keys=ignore_keys)

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """A forward-only streaming pass over the eval set: ``{prefix}_loss``, ``{prefix}_perplexity``, speed.

        ``eval_loss`` is transformers' number: each batch's token-mean loss, weighted by its
        sequences (``trainer.evaluation``).
        """
        ds = self.eval_dataset if eval_dataset is None else eval_dataset
        if ds is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(ds, dict):
            out: dict[str, float] = {}
            for name, part in ds.items():
                out.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return out
        if eval_dataset is not None and self._cfg.remove_unused_columns:
            ds = drop_unused_columns(ds, self.model)
        real = False
        if self._worker is None:  # not inside train(): the weights may still be in the model
            self._drop_meta_hook()
            if not set(self.parts.all_params()) <= set(self.store.keys()) or any(
                    p.device.type != "meta" for p in self.model.parameters()):
                real = self._take_weights()
            self._check_weights()
        engine = self._engine if self._worker is not None else StreamingEngine(
            self.parts, self.store, compute_device(self._cfg), bf16=self._cfg.bf16, store_lock=self._lock,
            window_bytes=self.store.stats().get("device_budget"))
        t0 = time.time()
        batches = eval_batches(ds, self._cfg.per_device_eval_batch_size, self.pad_token_id, self.data_collator,
                               self._cfg.dataloader_drop_last)
        losses = eval_losses(engine, self.model, batches, self._on_prediction_step)
        metrics = eval_metrics(losses, metric_key_prefix, t0, self._cfg.logging_nan_inf_filter)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        if self._worker is None:
            self._give_back_weights(real)
        return metrics

    def _on_prediction_step(self) -> None:
        self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)

    # -- trace and export ------------------------------------------------------------------
    def _end_step(self, t0: float) -> None:
        """Close the optimizer step in the store: its access trace (from which the predictor
        prefetches the next step's reads; without a mark it would only fill up) and its span."""
        mark = getattr(self.store, "mark_step", None)
        if mark is not None:
            mark()
        trace = getattr(self.store, "trace_span", None)
        if trace is not None:
            trace("step", "step", t0, time.perf_counter(), step=self.state.global_step)

    def _write_trace(self) -> None:
        """``output_dir/trace.json``: the store's I/O spans and the steps, for ``tierstore trace``."""
        if self._store is None:
            return
        os.makedirs(self._cfg.output_dir, exist_ok=True)
        name = TRACE_NAME if self._dp is None or self._dp.rank == 0 else f"trace-rank-{self._dp.rank}.json"
        with open(os.path.join(self._cfg.output_dir, name), "w") as f:
            f.write(self._store.chrome_trace())

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False,
                   max_shard_bytes: int = 1 << 30) -> str:
        """Write config.json, safetensors shards (and the tokenizer) that from_pretrained loads."""
        out = output_dir or self._cfg.output_dir
        if self._dp is not None and self._dp.rank != 0:
            return out  # every rank holds the same weights: rank 0 writes them (as transformers does)
        os.makedirs(out, exist_ok=True)
        self.model.config.save_pretrained(out)
        gen = getattr(self.model, "generation_config", None)
        if gen is not None and hasattr(gen, "save_pretrained"):
            gen.save_pretrained(out)
        if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(out)
        if any(p.device.type != "meta" for p in self.model.parameters()) and not self.store.keys(prefix=""):
            self._take_weights()
        with self._lock:  # streamed from the store piece by piece, as ``tierstore export`` does
            infos = [self.store.info(name) for name in self.parts.all_params()]
            write_safetensors(self.store, infos, out, max_shard_bytes, quiet=self._cfg.disable_tqdm)
        return out
