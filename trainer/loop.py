"""The training loop of one ``Trainer.train`` call, as named steps over its optimizer steps.

``TrainLoop`` builds what a run needs (the store's AdamW, its update worker, the streaming
engine, the per-step I/O account, the progress bar) and runs each optimizer step as the same
sequence of steps as ``transformers.Trainer``, callback events included:

1. ``_begin_epoch``: the epoch boundary (``on_epoch_end`` of the last one, ``on_epoch_begin``).
2. ``_split_micro_batches``: the step's loss-token count over every rank, then this rank's rows
   (data parallel).
3. ``_forward_backward``: each micro-batch through the engine into the gradient sink; in data
   parallel the step's loss, tokens and gradient norms summed over the ranks.
4. ``_clip``: the clipping coefficient from the global norm, then every group's update.
5. ``_advance``: the loss window, ``global_step`` and ``epoch``, ``on_step_end``, an early stop.
6. ``_account``: the step's timings and bytes per tier, which the next log carries.
7. ``_after_step``: the store's step mark, log/evaluate/save as the control flags ask.

Threads: the loop, the engine and the callbacks run on the caller's thread; the AdamW updates
run on the ``UpdateWorker``'s thread, which the engine waits for before it reads a group the
worker is still writing (``before_fetch``). Both reach the store under the trainer's lock. The
worker is drained and closed when the loop ends, however it ends.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer import distributed, session
from trainer.args import learning_rate_at
from trainer.data import has_length, step_batches
from trainer.io_account import StepAccount
from trainer.optimizer import EXP_AVG, EXP_AVG_SQ, AdamWHyper, StoreAdamW, UpdateWorker
from trainer.steps import RunLog, grad_sink
from trainer.streaming import StreamingEngine, count_loss_tokens

if TYPE_CHECKING:
    from trainer.api import Trainer


def no_decay_names(model: nn.Module) -> set[str]:
    """The parameters AdamW does not decay: transformers' rule (LayerNorm modules, biases, norms by name)."""
    patterns = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    out = set()
    for mname, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if isinstance(mod, nn.LayerNorm) or any(re.search(p, full.lower()) for p in patterns):
                out.add(full)
    names = {n for n, _ in model.named_parameters()}
    return out & names


@dataclass(frozen=True, slots=True)
class StepStart:
    """What the step's timings and I/O counters are measured from: one snapshot at its start."""

    t0: float
    stats: dict[str, Any]
    optimizer_s: float
    optimizer_math_s: float


class TrainLoop:
    """One ``train`` call's optimizer steps from ``start`` to ``end`` of a ``total``-step schedule.

    It works on its ``Trainer``'s state, control flags and callbacks, and leaves the trainer's
    ``_worker`` set while it runs (``evaluate`` and checkpoints inside the run use it).
    """

    def __init__(self, trainer: Trainer, start: int, end: int, total: int, per_epoch: int,
                 micro_per_epoch: int, ignore_keys: list[str] | None, stopping: bool) -> None:
        self.tr = trainer
        self.start, self.end, self.total = start, end, total
        self.per_epoch, self.micro_per_epoch = per_epoch, micro_per_epoch
        self.ignore_keys = ignore_keys
        self.stopping = stopping
        """Whether ``stop_at_step`` ends this call early (after a checkpoint at ``end``)."""
        self.cfg = trainer._cfg
        self.dp = trainer._dp
        self.st = trainer.state
        """The state this run advances (the trainer's, as ``train`` set it up)."""
        self.epoch: int | None = None
        self.epoch_first = start
        """The first step of the running epoch (an unsized dataset's epoch counts from it)."""

    # -- set-up and tear-down --------------------------------------------------------------
    def _build(self) -> None:
        """The optimizer over the store, its update worker, the engine, the I/O account and the bar."""
        from tqdm.auto import tqdm

        tr, cfg, dp = self.tr, self.cfg, self.dp
        store = self.store = tr.store
        self.groups = [names for _, names in tr.parts.groups()]
        compression = session.current().optimizer_compression
        if dp is None:
            # without clipping each group is updated as soon as backward hands over its gradients
            self.opt = StoreAdamW(store, self.groups, no_decay_names(tr.model), compression, tr._lock,
                                  backward_order=cfg.clip_norm is None)
        else:  # each rank updates its rows of every parameter and all-gathers the rest
            self.opt = distributed.ShardedAdamW(dp, store, self.groups, no_decay_names(tr.model), compression,
                                                tr._lock)
        self.worker = tr._worker = UpdateWorker(
            self.opt.update_group,
            kernel_threads=session.background_kernel_threads(session.compute_device(cfg), compression))
        self.engine = tr._engine = StreamingEngine(
            tr.parts, store, session.compute_device(cfg), bf16=cfg.bf16, store_lock=tr._lock,
            before_fetch=self.worker.wait_group, updating=self.worker.updating,
            window_bytes=store.stats().get("device_budget"))
        self.clip, self.all_params = cfg.clip_norm, tr.parts.all_params()
        # per-step bytes per tier in log_history; a rank's sharded moments have other keys, so
        # data parallel logs the bytes without the budgets' minimum
        all_params = self.all_params
        self.account = StepAccount(store, list(all_params) if dp is None else [],
                                   [p + n for p in (EXP_AVG, EXP_AVG_SQ) for n in all_params] if dp is None else [],
                                   clipping=self.clip is not None)
        self.bar = tqdm(total=self.total, initial=self.start,
                        disable=cfg.disable_tqdm or not self.st.is_world_process_zero, desc="train",
                        dynamic_ncols=True)
        self.sized = has_length(tr.train_dataset)
        self.run_log = RunLog(start=self.start, t0=time.time())

    def _on(self, event: Any) -> None:
        """Call one of the callback handler's events with the trainer's arguments, state and control."""
        tr = self.tr
        tr.control = event(tr.args, self.st, tr.control)

    def run(self) -> tuple[float, dict[str, Any]]:
        """Train; the run's mean step loss and transformers' end-of-training metrics (already logged)."""
        tr = self.tr
        self._build()
        self._on(tr.callback_handler.on_train_begin)
        if self.cfg.eval_on_start:
            tr._evaluate_during_train(self.ignore_keys)
        try:
            self._steps()
        except BaseException:
            # the loop's error is the one to report (a dead rank fails the update thread too)
            with contextlib.suppress(BaseException):
                self.worker.wait_all()
            raise
        finally:
            self.bar.close()
            try:
                self.worker.wait_all()
            finally:
                self.worker.close()
                tr._worker = None
        return self._finish()

    def _finish(self) -> tuple[float, dict[str, Any]]:
        tr, st, run = self.tr, self.st, self.run_log
        steps = st.global_step - self.start
        train_loss = (run.total + run.window) / max(steps, 0.001)  # the run's mean step loss
        runtime = time.time() - run.t0
        metrics = {"train_runtime": round(runtime, 4),
                   "train_samples_per_second": round(steps * tr._global_batch()
                                                     * self.cfg.gradient_accumulation_steps / runtime, 3),
                   "train_steps_per_second": round(steps / runtime, 3), "total_flos": float(st.total_flos),
                   "train_loss": train_loss}
        tr.log(metrics)
        self._on(tr.callback_handler.on_train_end)
        return train_loss, metrics

    # -- the steps -------------------------------------------------------------------------
    def _steps(self) -> None:
        tr, cfg = self.tr, self.cfg
        batches = step_batches(tr.train_dataset, tr._global_batch(), cfg.gradient_accumulation_steps,
                               cfg.sampler_seed, self.start, tr.pad_token_id, tr.data_collator,
                               cfg.dataloader_drop_last, cfg.train_sampling_strategy == "random")
        for step, epoch_after, micro in batches:
            if step >= self.end:
                break
            self._begin_epoch(step, epoch_after)
            begun = StepStart(time.perf_counter(), self.store.stats(), self.opt.busy_s, self.opt.update_s)
            lr = learning_rate_at(cfg, step, self.total)
            hyper = AdamWHyper(lr, cfg.adam_beta1, cfg.adam_beta2, cfg.adam_epsilon, cfg.weight_decay)
            micro, num_items = self._split_micro_batches(step, micro)
            self._on(tr.callback_handler.on_step_begin)
            loss_sum, tokens, grad_norm = self._forward_backward(step, micro, num_items, hyper)
            self._on(tr.callback_handler.on_pre_optimizer_step)
            self._clip(step, hyper, grad_norm)
            self._on(tr.callback_handler.on_optimizer_step)
            self._advance(step, epoch_after, loss_sum / num_items)
            self._account(step, begun, lr, grad_norm, tokens)
            self._after_step(begun)
            if tr.control.should_training_stop or tr.control.should_epoch_stop:
                break
        if self.epoch is not None:
            tr._end_epoch(self.run_log, self.ignore_keys)

    def _begin_epoch(self, step: int, epoch_after: float) -> None:
        """At the first step of a new epoch: close the last one, open this one."""
        e = step // self.per_epoch if self.sized else int(epoch_after)
        if e != self.epoch:
            if self.epoch is not None:
                self.tr._end_epoch(self.run_log, self.ignore_keys)
            self.epoch, self.epoch_first = e, step
            self._on(self.tr.callback_handler.on_epoch_begin)

    def _split_micro_batches(self, step: int, micro: list[dict[str, torch.Tensor]]
                             ) -> tuple[list[dict[str, torch.Tensor]], int]:
        """This rank's micro-batches of the step and the loss tokens of the whole global step."""
        # the loss is the token mean over the global step: every rank divides by the same count
        num_items = sum(count_loss_tokens(b["labels"]) for b in micro)
        if num_items == 0:
            raise ValueError(f"step {step + 1}: every label is -100; there is no loss to train on")
        if self.dp is not None:
            micro = distributed.local_rows(micro, self.dp.rank, self.dp.world)
        return micro, num_items

    def _forward_backward(self, step: int, micro: list[dict[str, torch.Tensor]], num_items: int,
                          hyper: AdamWHyper) -> tuple[float, int, float]:
        """Every micro-batch forward and backward: the step's summed loss, its tokens and the global grad norm."""
        tr, cfg, st, dp = self.tr, self.cfg, self.st, self.dp
        norms: dict[str, torch.Tensor] = {}
        loss_sum, tokens = 0.0, 0
        for j, batch in enumerate(micro):
            last = j == len(micro) - 1
            sink = grad_sink(self.opt, self.worker, norms, step + 1, hyper, self.clip, j, last, dp)
            # each group's update follows its backward: its weights are held until it begins
            keep = last and self.clip is None and dp is None
            self.engine.keep_for_update = self.opt.keep_for_update if keep else None
            try:
                loss_sum += self.engine.forward_backward(batch, num_items, sink)
            except BaseException:
                if keep:
                    self.opt.drop_kept()
                raise
            finally:
                self.engine.keep_for_update = None
            tokens += int(batch["attention_mask"].sum())
            st.num_input_tokens_seen += (int(batch["input_ids"].numel()) if cfg.include_num_input_tokens_seen
                                         == "all" else int(batch["attention_mask"].sum()))
            if j < len(micro) - 1:
                self._on(tr.callback_handler.on_substep_end)
        if dp is not None:  # the global step's loss and tokens; the norms of the summed gradients
            loss_sum, tokens_f = dp.sum([loss_sum, float(tokens)])
            tokens = int(tokens_f)
            norms = dp.grad_norms()
        grad_norm = float(torch.linalg.vector_norm(torch.stack([norms[n] for n in self.all_params]), 2.0))
        return loss_sum, tokens, grad_norm

    def _clip(self, step: int, hyper: AdamWHyper, grad_norm: float) -> None:
        """With max_grad_norm: every group's update, scaled by the clipping coefficient (else already under way)."""
        if self.clip is None:
            return
        # torch.nn.utils.clip_grad_norm_'s coefficient, computed in fp32 as it does.
        coef = float(torch.clamp(self.clip / (torch.tensor(grad_norm, dtype=torch.float32) + 1e-6), max=1.0))
        for g in range(len(self.groups)):
            self.worker.submit(g, step + 1, hyper, coef)

    def _advance(self, step: int, epoch_after: float, loss: float) -> None:
        """The step's loss into the window, the state's step and epoch, ``on_step_end``, an early stop."""
        tr, cfg, st = self.tr, self.cfg, self.st
        self.run_log.add(loss, cfg.logging_nan_inf_filter, step)
        st.global_step = step + 1
        st.epoch = (epoch_after if self.sized else
                    self.epoch + (st.global_step - self.epoch_first) * cfg.gradient_accumulation_steps
                    / self.micro_per_epoch)
        self._on(tr.callback_handler.on_step_end)
        if self.stopping and st.global_step >= self.end:
            tr.control.should_save = tr.control.should_training_stop = True

    def _account(self, step: int, begun: StepStart, lr: float, grad_norm: float, tokens: int) -> None:
        """The step's timings, stall and bytes per tier: the extra keys of the next training log."""
        step_s = time.perf_counter() - begun.t0
        after = self.store.stats()
        stall_s = float(after.get("stall_s", 0.0)) - float(begun.stats.get("stall_s", 0.0))
        self.run_log.last = {
            "learning_rate": lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens / step_s if step_s > 0 else math.inf, "stall_s": stall_s,
            "step_s": step_s, "optimizer_s": self.opt.busy_s - begun.optimizer_s,
            # of which AdamW's arithmetic; the rest is the store's reads and writes
            "optimizer_math_s": self.opt.update_s - begun.optimizer_math_s,
            **self.account.end(step + 1, begun.stats, after)}

    def _after_step(self, begun: StepStart) -> None:
        """Close the step in the store, log/evaluate/save as asked, free the CUDA cache, move the bar."""
        tr = self.tr
        tr._end_step(begun.t0)
        tr._maybe_log_save_evaluate(self.run_log, self.ignore_keys)
        empty_cache = getattr(tr.args, "torch_empty_cache_steps", None)
        if empty_cache and self.st.global_step % empty_cache == 0 and torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{self.run_log.last_loss:.4f}",
                             tok_s=f"{self.run_log.last['tokens_per_s']:.0f}")
