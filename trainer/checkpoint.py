"""Checkpoints are store commits: where the run's store is, what resume means, what a commit holds.

Besides the weights and the optimizer's moments, a commit holds the trainer's state
(``trainer/state``: transformers' ``TrainerState`` as JSON; ``trainer/rng``: torch's RNG state)
and the files that make the store a Hugging Face model: ``meta/hf/config.json``,
``generation_config.json`` and, when the Trainer has a ``processing_class``, the tokenizer's
files. ``tierstore export --format hf`` writes every ``meta/hf/`` file into the folder it makes
(the layout is ``tools/cli/hf_meta.py``'s), so that folder loads with ``from_pretrained`` and
``AutoTokenizer.from_pretrained``. A commit never holds ``grad/*``: commits are made at step
boundaries, where no gradient is accumulating, so they are deleted first (4 B a parameter).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from typing import Any

import torch

STATE_KEY = "trainer/state"
RNG_KEY = "trainer/rng"
HF_META = "meta/hf/"
GRAD_PREFIX = "grad/"
NO_CHECKPOINT = "No valid checkpoint found in output directory"


def is_store(path: str) -> bool:
    """Whether ``path`` is a tierstore folder (it has a catalog)."""
    return os.path.isdir(os.path.join(path, "catalog"))


def has_checkpoint(store: Any) -> bool:
    """Whether an open store holds a committed trainer state."""
    return bool(store.versions()) and STATE_KEY in store.keys(prefix="trainer/")


def resolve_resume(resume: bool | str | os.PathLike[str], default_store: str,
                   output_dir: str) -> tuple[str, int | None]:
    """The store folder to resume from (and the step asked for), as transformers means it.

    True: the run's own store (``default_store``), which must hold a checkpoint; a path: a store
    folder, or a run folder holding ``store/``; an HF-style ``<dir>/checkpoint-N`` names the
    commit at step N of the store in ``<dir>/store`` (or the run's store). Never is a new, empty
    store created.
    """
    if resume is True:
        if not is_store(default_store):
            raise ValueError(f"{NO_CHECKPOINT} ({output_dir}): there is no store at {default_store}")
        return default_store, None
    path = os.fspath(resume)  # type: ignore[arg-type]
    if is_store(path):
        return path, None
    if is_store(os.path.join(path, "store")):
        return os.path.join(path, "store"), None
    m = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(os.path.normpath(path)))
    if m:
        beside = os.path.join(os.path.dirname(os.path.normpath(path)), "store")
        for candidate in (beside, default_store):
            if is_store(candidate):
                return candidate, int(m.group(1))
    raise ValueError(f"resume_from_checkpoint={path!r}: not a tierstore store (no catalog/ in it) nor a run "
                     "folder holding store/; nothing is created there")


def put_bytes(store: Any, key: str, raw: bytes) -> None:
    """Keep bytes as a uint8 tensor under ``key``."""
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone() if raw else torch.empty(0, dtype=torch.uint8)
    store.put(key, t, codec="raw")


def get_bytes(store: Any, key: str) -> bytes:
    """The bytes kept under ``key``."""
    return bytes(store.get(key).numpy().tobytes())


def save_hf_files(store: Any, model: Any, processing_class: Any = None) -> list[str]:
    """Put the model's config (+ generation config) and the tokenizer's files under ``meta/hf/``."""
    names = []
    with tempfile.TemporaryDirectory(prefix="trainer-hf-meta-") as tmp:
        config = getattr(model, "config", None)
        if config is not None:
            config.save_pretrained(tmp)
        gen = getattr(model, "generation_config", None)
        if gen is not None and hasattr(gen, "save_pretrained"):
            try:
                gen.save_pretrained(tmp)
            except ValueError:  # transformers refuses to save an invalid generation config
                pass
        if processing_class is not None and hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(tmp)
        for name in sorted(os.listdir(tmp)):
            full = os.path.join(tmp, name)
            if os.path.isfile(full):
                with open(full, "rb") as f:
                    put_bytes(store, HF_META + name, f.read())
                names.append(name)
    return names


def save_state(store: Any, state: Any) -> None:
    """Put transformers' TrainerState (JSON) and torch's RNG state into the store."""
    put_bytes(store, STATE_KEY, json.dumps(dataclasses.asdict(state), sort_keys=True).encode())  # as save_to_json
    store.put(RNG_KEY, torch.get_rng_state(), codec="raw")


def load_state(store: Any) -> Any:
    """The TrainerState of the store's head; torch's RNG state is restored from it too."""
    from trainer.callbacks import TrainerState

    d = json.loads(get_bytes(store, STATE_KEY))
    known = {f.name for f in dataclasses.fields(TrainerState)}
    state = TrainerState(**{k: v for k, v in d.items() if k in known and k != "stateful_callbacks"})
    torch.set_rng_state(store.get(RNG_KEY).to(torch.uint8))
    return state


def drop_gradients(store: Any) -> int:
    """Delete every ``grad/*`` key (before a commit at a step boundary); returns how many."""
    keys = store.keys(prefix=GRAD_PREFIX)
    for k in keys:
        store.delete(k)
    return len(keys)
