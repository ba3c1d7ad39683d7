"""The run's session: what ``init`` configured, the compute device, the stores this process opened, ``load_model``.

``init`` replaces the process-wide ``SessionConfig``; everything else reads it through
``current()`` at the moment it needs it, so a later ``init`` applies to the next store opened and
the next run started. Stores are opened once per folder and process (``open_store``), with the
configured budgets, and closed without a commit (``close_store``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import tierstore
import tierstore.config
from trainer import distributed, memory
from trainer import model as model_mod
from trainer.args import TrainingArguments
from trainer.checkpoint import STATE_KEY
from trainer.model import decompose
from trainer.optimizer import requested_moment_codec

_GIB = 1 << 30


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
    """True: q8 Adam moments (the codec that met its goal); a codec name; False/"raw": raw."""
    device: str | None = None
    """The compute device; None: cuda if available, else cpu."""
    keep_last: int | None = None
    """Commits the store retains (None: tierstore's default); 1 keeps one copy of the state on disk."""
    chunk_bytes: int | None = None
    """The store's chunk size. None: on the CPU the Trainer stores each decoder-layer weight in
    one chunk (``memory.layer_chunk_bytes``), which the window lends to the layers instead of
    copying it; elsewhere tierstore's default, 16 MiB or a quarter of the RAM budget."""


_session = SessionConfig()
_open_stores: dict[str, Any] = {}


def current() -> SessionConfig:
    """The configuration the last ``init`` set (the defaults before any)."""
    return _session


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
         keep_last: int | None = None, chunk_bytes: int | str | None = None) -> SessionConfig:
    """Configure where the store lives, its budgets (GB as numbers, or size strings like "64MiB") and chunk size (bytes or a size string)."""
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
        chunk_bytes=tierstore.config.parse_size(chunk_bytes, "chunk_bytes"),
    )
    return _session


def background_kernel_threads(device: torch.device, compression: bool | str | None) -> int | None:
    """Kernel threads of the store's and the optimizer's threads: 1 on the CPU with raw moments, else None.

    With the layers on the CPU the training thread's OpenMP team has the cores, and a second
    team makes it sleep and wake between kernels (``tierstore.kernel_threads``); with raw
    moments the other threads' kernels are short (AdamW, copies), and one thread each gave the
    23.4M streaming step 1.23x plain PyTorch instead of 1.27x. Coded moments keep torch's
    default (None): the codecs' kernels then fill the cores beside the compute, and a team that
    spins instead of sleeping took their time (a 1B step with q4 moments, 26-29 s before, took
    33-35 s). On a GPU the host's cores are the optimizer's and the codecs' (None).
    """
    return 1 if device.type == "cpu" and requested_moment_codec(compression) == "raw" else None


def compute_device(cfg: TrainingArguments | None = None) -> torch.device:
    """The device the layers run on: ``init(device=)``, else cpu when ``use_cpu``, else cuda if available."""
    if _session.device is not None:
        dev = torch.device(_session.device)
    elif cfg is not None and cfg.use_cpu:
        dev = torch.device("cpu")
    else:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _, world, local = distributed.env_world()
    if dev.type == "cuda" and dev.index is None and world > 1:
        dev = torch.device("cuda", local)  # torchrun: one GPU per local rank
    return dev


def open_store(path: str, mode: str = "a", chunk_bytes: int | None = None) -> Any:
    """The session's store at ``path``: opened once per process with the configured budgets.

    ``chunk_bytes``: the chunk size a model asks for (``memory.layer_chunk_bytes``), used
    unless ``init(chunk_bytes=)`` set one.
    """
    path = os.path.abspath(path)
    store = _open_stores.get(path)
    if store is not None and not store.closed:
        return store
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    extra: dict[str, Any] = {} if _session.keep_last is None else {"keep_last": _session.keep_last}
    chunk_bytes = _session.chunk_bytes if _session.chunk_bytes is not None else chunk_bytes
    if chunk_bytes is not None:
        extra["chunk_bytes"] = chunk_bytes
    device = compute_device()
    store = tierstore.open(path, mode=mode, ram_budget=_session.ram_budget, device_budget=_session.device_budget,
                           device=str(device),
                           kernel_threads=background_kernel_threads(device, _session.optimizer_compression), **extra)
    # a store left open by a failed run is closed at exit, without a commit, by tierstore itself
    _open_stores[path] = store
    return store


def model_chunk_bytes(model: nn.Module, device: torch.device) -> int | None:
    """The chunk size a store for ``model`` computed on ``device`` asks for (None: the store's default).

    On the CPU, chunks that hold each decoder-layer weight whole (``memory.layer_chunk_bytes``),
    so that the window lends the weights to the layers; a GPU window copies them either way.
    """
    if device.type != "cpu":
        return None
    largest = max((p.numel() for p in decompose(model).layers.parameters()), default=0)
    return memory.layer_chunk_bytes(4 * largest, _session.ram_budget)  # the store keeps fp32 weights


def is_open(path: str) -> bool:
    """Whether this process holds an open store at ``path`` (opened by ``open_store``)."""
    known = _open_stores.get(os.path.abspath(path))
    return known is not None and not known.closed


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

    path = (distributed.rank_store_path(_session.offload_dir) if _session.offload_dir
            else tempfile.mkdtemp(prefix="trainer-store-"))
    model = model_mod.skeleton_for(path_or_config)
    store = open_store(path, chunk_bytes=model_chunk_bytes(model, compute_device()))
    if STATE_KEY in store.keys(prefix="trainer/") and store.versions():
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
