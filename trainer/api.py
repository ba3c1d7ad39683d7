"""The user-facing trainer: ``init``, ``load_model``, ``Trainer`` (train, save_model, store).

One store per run holds everything: fp32 master weights under their HF names, accumulated
gradients, Adam moments, and the trainer's own state (``trainer/state`` as JSON bytes,
``trainer/rng``). A checkpoint is a store commit; resuming reopens the store and continues from
the last commit's step with the same data order and RNG state.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import tierstore
import tierstore.config
from tierstore.export import write_safetensors
from trainer import memory
from trainer import model as model_mod
from trainer.args import TrainingArguments, from_hf_args, learning_rate_at
from trainer.data import step_batches, steps_per_epoch
from trainer.model import ModelParts, decompose
from trainer.optimizer import AdamWHyper, StoreAdamW, UpdateWorker
from trainer.streaming import StreamingEngine, count_loss_tokens

_GIB = 1 << 30
STATE_KEY = "trainer/state"
RNG_KEY = "trainer/rng"


@dataclass(kw_only=True, slots=True)
class SessionConfig:
    """What ``init`` set: where the store lives and its budgets."""

    offload_dir: str | None = None
    """The store's folder; None means <output_dir>/store (or a temporary folder for load_model)."""
    device_budget: int | str | None = None
    """Bytes of the device window (max_vram_gb)."""
    ram_budget: int | str | None = None
    """Bytes of the host RAM cache (max_ram_gb)."""
    optimizer_compression: bool | str | None = True
    """True: q4 Adam moments; a codec name; False/"raw": raw."""
    device: str | None = None
    """The compute device; None: cuda if available, else cpu."""
    keep_last: int | None = None
    """Commits the store retains (None: tierstore's default); 1 keeps one copy of the state on disk."""


_session = SessionConfig()
_open_stores: dict[str, Any] = {}


def _budget(gb: float | str | None, what: str) -> int | str | None:
    if gb is None or isinstance(gb, str):
        return gb
    if gb <= 0:
        raise ValueError(f"{what} must be > 0 GB, got {gb}")
    return int(gb * _GIB)


def _default_ram_budget(device_budget: int | str | None = None, device: str | None = None) -> int:
    # From the memory available now (trainer.memory says how), not a fixed share of the total.
    cpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
    window = tierstore.config.parse_size(device_budget, "max_vram_gb") if device_budget is not None else None
    return memory.default_ram_budget(window, cpu_window=cpu)


def init(offload_dir: str | None = None, max_vram_gb: float | str | None = 80, max_ram_gb: float | str | None = None,
         optimizer_compression: bool | str | None = True, device: str | None = None,
         keep_last: int | None = None) -> SessionConfig:
    """Configure where the store lives and its budgets (GB as numbers, or size strings like "64MiB")."""
    global _session
    memory.tune_malloc()  # freed tensors go back to the OS, so RSS follows what is really held
    vram = _budget(max_vram_gb, "max_vram_gb")
    _session = SessionConfig(
        offload_dir=offload_dir,
        device_budget=vram,
        ram_budget=_budget(max_ram_gb, "max_ram_gb") if max_ram_gb is not None else _default_ram_budget(vram, device),
        optimizer_compression=optimizer_compression,
        device=device,
        keep_last=keep_last,
    )
    return _session


def _device() -> torch.device:
    if _session.device is not None:
        return torch.device(_session.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def open_store(path: str, mode: str = "a") -> Any:
    """The session's store at ``path``: opened once per process with the configured budgets."""
    path = os.path.abspath(path)
    store = _open_stores.get(path)
    if store is not None and not store.closed:
        return store
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    extra = {} if _session.keep_last is None else {"keep_last": _session.keep_last}
    store = tierstore.open(path, mode=mode, ram_budget=_session.ram_budget, device_budget=_session.device_budget,
                           device=str(_device()), **extra)
    # a store left open by a failed run is closed at exit, without a commit, by tierstore itself
    _open_stores[path] = store
    return store


def close_store(store: Any) -> None:
    """Close a store opened by ``open_store`` and forget it."""
    for path, s in list(_open_stores.items()):
        if s is store:
            del _open_stores[path]
    # No implicit "close" commit: the head after the last checkpoint would pair new weights
    # with the trainer state of the old one.
    store.close(commit=False)


def load_model(path_or_config: Any) -> nn.Module:
    """A meta-device skeleton of a causal LM whose weights are streamed into the session store.

    A store that already holds a training run's checkpoint keeps its weights (so that
    ``resume_from_checkpoint`` continues the run); use a fresh ``offload_dir`` to start over.
    """
    import tempfile
    import warnings

    path = _session.offload_dir or tempfile.mkdtemp(prefix="trainer-store-")
    store = open_store(path)
    if STATE_KEY in store.keys(prefix="trainer/") and store.versions():
        model = model_mod.skeleton_for(path_or_config)
        missing = [n for n in decompose(model).all_params() if n not in set(store.keys())]
        if missing:
            raise ValueError(f"the store at {path} holds a run of another model (lacks {missing[:3]}); "
                             "use a fresh offload_dir")
        warnings.warn(f"the store at {path} holds a training run (last commit at step "
                      f"{store.versions()[-1].step}); its weights are kept, not replaced by "
                      f"{path_or_config!r}", stacklevel=2)
    else:
        model = model_mod.load_model(path_or_config, store)
    model._trainer_store = store  # the Trainer finds the weights here
    return model


def _no_decay_names(model: nn.Module) -> set[str]:
    # transformers' Trainer: no decay for LayerNorm modules and names matching these patterns.
    patterns = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    out = set()
    for mname, mod in model.named_modules():
        for pname, _ in mod.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if isinstance(mod, nn.LayerNorm) or any(re.search(p, full.lower()) for p in patterns):
                out.add(full)
    names = {n for n, _ in model.named_parameters()}
    return out & names


def _grad_sink(opt: StoreAdamW, worker: UpdateWorker, norms: dict[str, torch.Tensor], step: int,
               hyper: AdamWHyper, clip: float | None, j: int, last: bool) -> Any:
    """The engine's gradient sink for micro-batch ``j`` of optimizer step ``step`` (1-based)."""

    def sink(g: int, grads: dict[str, torch.Tensor]) -> None:
        if last and clip is None:
            # The final sums go straight to the optimizer, not through the store.
            final = grads if j == 0 else opt.add_accumulated(grads)
        else:
            final = opt.accumulate(grads, first=j == 0)
        if last:
            for name, t in final.items():
                norms[name] = torch.linalg.vector_norm(t, 2.0)
            if clip is None:  # no global norm to wait for: update this group now, on the worker
                worker.submit(g, step, hyper, None, final, hold=True)

    return sink


@dataclass(slots=True)
class TrainerState:
    """Progress of a run, saved in every checkpoint."""

    global_step: int = 0
    log_history: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.log_history is None:
            self.log_history = []


@dataclass(frozen=True, slots=True)
class TrainOutput:
    """What ``train`` returns (transformers' field names)."""

    global_step: int
    training_loss: float
    metrics: dict[str, Any]


class Trainer:
    """Layer-streaming trainer for a Hugging Face causal LM; weights and state live in a Store.

    A model with real weights hands them to the store when training starts and is left as a
    meta-device skeleton (the store holds the only copy; ``save_model`` writes them out).
    """

    def __init__(self, model: nn.Module, train_dataset: Any, args: Any = None, pad_token_id: int = 0) -> None:
        self.model = model
        self.train_dataset = train_dataset
        self.args = from_hf_args(args) if args is not None else TrainingArguments()
        self.pad_token_id = pad_token_id
        self.parts: ModelParts = decompose(model)
        self.state = TrainerState()
        self._store = getattr(model, "_trainer_store", None)
        self._lock = threading.RLock()

    @property
    def store(self) -> Any:
        """The tierstore Store this run uses (opened on first use)."""
        if self._store is None:
            self._store = open_store(_session.offload_dir or os.path.join(self.args.output_dir, "store"))
        return self._store

    def close(self) -> None:
        """Close the store (a later Trainer on the same folder reopens it)."""
        if self._store is not None:
            close_store(self._store)
            self._store = None

    # -- setup -----------------------------------------------------------------------------
    def _take_weights(self) -> None:
        # A model with real weights hands them to the store and becomes a meta skeleton.
        store = self.store
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if p.device.type == "meta":
                    continue
                store.put(name, p.detach().to(torch.float32).contiguous(), codec="raw")
        model_mod.to_meta_(self.model)
        self.model._trainer_store = store

    def _check_weights(self) -> None:
        have = set(self.store.keys())
        missing = [n for n in self.parts.all_params() if n not in have]
        if missing:
            raise ValueError(f"the store at hand lacks {len(missing)} weights of this model, e.g. {missing[:3]}: "
                             "pass a model with weights, or one from trainer.load_model")

    def _save_state(self, step: int) -> None:
        blob = json.dumps({"global_step": step, "log_history": self.state.log_history}).encode()
        self.store.put(STATE_KEY, torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone(), codec="raw")
        self.store.put(RNG_KEY, torch.get_rng_state(), codec="raw")

    def _load_state(self) -> int:
        versions = self.store.versions()
        if not versions:
            raise ValueError(f"resume_from_checkpoint: the store has no commit to resume from ({self.store!r})")
        blob = bytes(self.store.get(STATE_KEY).numpy().tobytes())
        state = json.loads(blob)
        self.state.global_step = int(state["global_step"])
        self.state.log_history = list(state["log_history"])
        torch.set_rng_state(self.store.get(RNG_KEY).to(torch.uint8))
        return self.state.global_step

    # -- the loop --------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: bool | str | None = None, stop_at_step: int | None = None) -> TrainOutput:
        """Train to max_steps/num_train_epochs; ``stop_at_step`` ends early after a checkpoint.

        ``resume_from_checkpoint``: True resumes from the run's store (offload_dir or
        <output_dir>/store); a path names the store folder to resume from.
        """
        from tqdm.auto import tqdm

        args = self.args
        if isinstance(resume_from_checkpoint, (str, os.PathLike)) and self._store is None:
            self._store = open_store(os.fspath(resume_from_checkpoint))
        store = self.store
        if resume_from_checkpoint:
            self._check_weights()
            start = self._load_state()
        else:
            torch.manual_seed(args.seed)
            self._take_weights()
            self._check_weights()
            self.state = TrainerState()
            start = 0
        n_items = len(self.train_dataset)
        total = args.total_steps(steps_per_epoch(n_items, args.per_device_train_batch_size,
                                                 args.gradient_accumulation_steps))
        end = total if stop_at_step is None else min(total, stop_at_step)
        groups = [names for _, names in self.parts.groups()]
        opt = StoreAdamW(store, groups, _no_decay_names(self.model), _session.optimizer_compression, self._lock)
        worker = UpdateWorker(opt.update_group)
        engine = StreamingEngine(self.parts, store, _device(), bf16=args.bf16, store_lock=self._lock,
                                 before_fetch=worker.wait_group, window_bytes=store.stats().get("device_budget"))
        clip = args.clip_norm
        all_params = self.parts.all_params()
        bar = tqdm(total=total, initial=start, disable=args.disable_tqdm, desc="train", dynamic_ncols=True)
        window: list[tuple[float, float, float, float, int]] = []
        last_loss = float("nan")
        try:
            batches = step_batches(self.train_dataset, args.per_device_train_batch_size,
                                   args.gradient_accumulation_steps, args.seed, start, self.pad_token_id)
            for step, _epoch, micro in batches:
                if step >= end:
                    break
                t0 = time.perf_counter()
                stall0 = float(store.stats().get("stall_s", 0.0))
                upd0 = opt.busy_s
                lr = learning_rate_at(args, step, total)
                hyper = AdamWHyper(lr, args.adam_beta1, args.adam_beta2, args.adam_epsilon, args.weight_decay)
                num_items = sum(count_loss_tokens(b["labels"]) for b in micro)
                if num_items == 0:
                    raise ValueError(f"step {step + 1}: every label is -100; there is no loss to train on")
                tokens = sum(int(b["attention_mask"].sum()) for b in micro)
                norms: dict[str, torch.Tensor] = {}
                loss_sum = 0.0
                for j, batch in enumerate(micro):
                    sink = _grad_sink(opt, worker, norms, step + 1, hyper, clip, j, j == len(micro) - 1)
                    loss_sum += engine.forward_backward(batch, num_items, sink)
                grad_norm = float(torch.linalg.vector_norm(torch.stack([norms[n] for n in all_params]), 2.0))
                if clip is not None:
                    # torch.nn.utils.clip_grad_norm_'s coefficient, computed in fp32 as it does.
                    total_norm = torch.tensor(grad_norm, dtype=torch.float32)
                    coef = float(torch.clamp(clip / (total_norm + 1e-6), max=1.0))
                    for g in range(len(groups)):
                        worker.submit(g, step + 1, hyper, coef)
                done = step + 1
                last_loss = loss_sum / num_items
                saving = (args.save_steps and done % args.save_steps == 0) or done == end
                if saving:
                    worker.wait_all()
                step_s = time.perf_counter() - t0
                stall = float(store.stats().get("stall_s", 0.0)) - stall0
                window.append((last_loss, lr, grad_norm, stall, tokens))
                self.state.global_step = done
                if done % args.logging_steps == 0 or done == 1 or done == end:
                    self._log(done, window, step_s, opt.busy_s - upd0)
                    window = []
                if saving:
                    self._save_state(done)
                    with self._lock:
                        store.commit(step=done, message=f"trainer step {done}")
                bar.update(1)
                bar.set_postfix(loss=f"{last_loss:.4f}", tok_s=f"{tokens / step_s:.0f}", stall=f"{stall:.2f}s")
        finally:
            bar.close()
            try:
                worker.wait_all()
            finally:
                worker.close()
        return TrainOutput(self.state.global_step, last_loss, {"train_loss": last_loss})

    def _log(self, step: int, window: list[tuple[float, float, float, float, int]], step_s: float,
             update_s: float) -> None:
        n = len(window)
        entry = {
            "step": step,
            "loss": sum(w[0] for w in window) / n,
            "learning_rate": window[-1][1],
            "grad_norm": window[-1][2],
            "tokens_per_s": window[-1][4] / step_s if step_s > 0 else math.inf,
            "stall_s": window[-1][3],
            "step_s": step_s,
            "optimizer_s": update_s,
        }
        self.state.log_history.append(entry)

    # -- export ----------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, max_shard_bytes: int = 1 << 30) -> str:
        """Write config.json + safetensors shards that AutoModelForCausalLM.from_pretrained loads."""
        out = output_dir or self.args.output_dir
        os.makedirs(out, exist_ok=True)
        self.model.config.save_pretrained(out)
        with self._lock:  # streamed from the store piece by piece, as ``tierstore export`` does
            infos = [self.store.info(name) for name in self.parts.all_params()]
            write_safetensors(self.store, infos, out, max_shard_bytes, quiet=self.args.disable_tqdm)
        return out
