"""Store.verify(keys=...) checks only the named keys; tierstore.validate_key is public."""

from __future__ import annotations

import os

import pytest
import torch

import tierstore


def test_verify_named_keys_only(tmp_path) -> None:
    with tierstore.open(tmp_path, ram_budget="1MiB", chunk_bytes="4KiB") as s:
        s.put("a", torch.arange(3000.0))
        s.put("b", torch.arange(3000.0))
        s.commit()
        bad = os.path.join(s.zarr_path("a"), "c", "1")
    with open(bad, "r+b") as f:
        f.write(b"\xff")
    with tierstore.open(tmp_path, mode="r") as r:
        assert r.verify(["b"]) == []
        faults = r.verify(["a"])
        assert [(f.key, f.chunk) for f in faults] == [("a", 1)]
        assert [(f.key, f.chunk) for f in r.verify()] == [("a", 1)]
        with pytest.raises(tierstore.KeyNotFound):
            r.verify(["nope"])


def test_validate_key_public() -> None:
    assert tierstore.validate_key("model.layers.0.weight") == "model.layers.0.weight"
    with pytest.raises(tierstore.InvalidKey, match="'..' segment"):
        tierstore.validate_key("a/../b")
