"""Where a Hugging Face folder's JSON files live in a store: uint8 tensors under ``meta/hf/``."""

from __future__ import annotations

import torch

import tierstore

HF_META = "meta/hf/"
HF_FILES = ("config.json", "generation_config.json")


def read_meta_file(store: tierstore.Store, name: str) -> bytes | None:
    """The bytes of a file kept under ``meta/hf/``, None if the store has none."""
    key = HF_META + name
    if key not in store:
        return None
    return store.get(key).numpy().tobytes()


def put_meta_file(store: tierstore.Store, name: str, raw: bytes) -> None:
    """Keep a file's bytes under ``meta/hf/<name>``."""
    store.put(HF_META + name, torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
              if raw else torch.empty(0, dtype=torch.uint8))
