"""The table of bad inputs: each gets its documented exception (or exit code) and message."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

import pytest
import torch

import tierstore
from tierstore.safetensors import read_header
from tools import cli
from tools.cli.errors import MalformedInput


@pytest.fixture
def store(tmp_path):
    s = tierstore.open(tmp_path / "s", ram_budget="1MiB", device_budget="64KiB", device="cpu")
    s.put("w", torch.arange(100.0))
    s.commit()
    yield s
    s.close()


def _open(tmp_path, **kw) -> Callable[[], object]:
    return lambda: tierstore.open(tmp_path / "o", **kw)


def _ro_put(tmp_path, store) -> None:
    with tierstore.open(tmp_path / "s", mode="r") as r:
        r.put("x", torch.ones(1))


def _bad_header(tmp_path) -> None:
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    read_header(str(p))


def _truncated(tmp_path, store) -> None:
    rec = store.async_store._head["w"]
    os.truncate(os.path.join(store.zarr_path("w"), rec.grid.zarr_key(0)), 3)
    with tierstore.open(tmp_path / "s", mode="r") as r:
        r.get("w")


API = [
    ("mode", lambda t, s: _open(t, mode="x")(), tierstore.StoreError, "mode must be"),
    ("zero budget", lambda t, s: _open(t, ram_budget=0)(), tierstore.BudgetError, "positive"),
    ("unparsable budget", lambda t, s: _open(t, ram_budget="lots")(), tierstore.StoreError, "cannot parse"),
    ("budget < chunk", lambda t, s: _open(t, ram_budget=1000)(), tierstore.BudgetError, "smaller than one chunk"),
    ("keep_last 0", lambda t, s: _open(t, keep_last=0)(), tierstore.StoreError, "keep_last"),
    ("io_threads 0", lambda t, s: _open(t, io_threads=0)(), tierstore.StoreError, "io_threads"),
    ("inline_bytes -1", lambda t, s: _open(t, inline_bytes=-1)(), tierstore.StoreError, "inline_bytes must be an int >= 0"),
    ("version on a writer", lambda t, s: _open(t, version=1)(), tierstore.StoreError, "read-only"),
    ("no store", lambda t, s: _open(t, mode="r")(), tierstore.StoreNotFound, "no tierstore"),
    ("second writer", lambda t, s: tierstore.open(t / "s"), tierstore.StoreLocked, "LOCK is held"),
    ("'..' key", lambda t, s: s.put("a/../b", torch.ones(1)), tierstore.InvalidKey, r"'\.\.' segment"),
    ("empty segment", lambda t, s: s.put("a//b", torch.ones(1)), tierstore.InvalidKey, "empty segment"),
    ("absolute key", lambda t, s: s.put("/etc/passwd", torch.ones(1)), tierstore.InvalidKey, "empty segment"),
    ("NUL in key", lambda t, s: s.put("a\x00b", torch.ones(1)), tierstore.InvalidKey, "holds"),
    ("long key", lambda t, s: s.put("k" * 513, torch.ones(1)), tierstore.InvalidKey, "limit is 512"),
    ("not a tensor", lambda t, s: s.put("x", [1.0]), tierstore.StoreError, "torch.Tensor"),
    ("complex dtype", lambda t, s: s.put("x", torch.ones(2, dtype=torch.complex64)), tierstore.CodecError, "not supported"),
    ("unknown codec", lambda t, s: s.put("x", torch.ones(2), codec="nope"), tierstore.CodecError, "unknown codec"),
    ("bad codec param", lambda t, s: tierstore.codecs.get("zstd", level="x"), tierstore.CodecError, "level"),
    ("unknown key", lambda t, s: s.get("nope"), tierstore.KeyNotFound, "'nope'"),
    ("row out of range", lambda t, s: s.get("w", index=[100]), tierstore.InvalidIndex, "out of range"),
    ("slice step", lambda t, s: s.get("w", index=slice(0, 10, 2)), tierstore.InvalidIndex, "step 1"),
    ("float rows", lambda t, s: s.get("w", index=torch.tensor([1.5])), tierstore.InvalidIndex, "integers"),
    ("window too small", lambda t, s: (s.put("big", torch.ones(20000)), s.get("big", device="cpu")),
     tierstore.BudgetError, "larger than the device window"),
    ("foreign device", lambda t, s: s.get("w", device="meta"), tierstore.StoreError, "device window"),
    ("prefetch target", lambda t, s: s.prefetch(["w"], to="gpu"), tierstore.StoreError, "'host' or 'device'"),
    ("commit step", lambda t, s: s.commit(step="10"), tierstore.StoreError, "step must be an int"),
    ("delete unknown", lambda t, s: s.delete("nope"), tierstore.KeyNotFound, "'nope'"),
    ("read-only put", _ro_put, tierstore.ReadOnlyError, "read-only"),
    ("truncated chunk", _truncated, tierstore.CorruptData, r"'w' chunk 0 has 3 bytes"),
    ("safetensors length", lambda t, s: _bad_header(t), MalformedInput, "header"),
]


@pytest.mark.parametrize("name, call, exc, match", API, ids=[row[0] for row in API])
def test_bad_api_input(tmp_path, store, name, call, exc, match) -> None:
    with pytest.raises(exc, match=match):
        call(tmp_path, store)
    if name not in ("truncated chunk",):  # the store stays usable after the error
        assert torch.equal(store.get("w"), torch.arange(100.0))


CLI = [
    ("no command", [], 2, "usage"),
    ("unknown command", ["frobnicate"], 2, "invalid choice"),
    ("missing store", ["inspect", "{tmp}/none"], 2, "no tierstore"),
    ("bad format", ["export", "{tmp}/s", "{tmp}/out", "--format", "onnx"], 2, "invalid choice"),
    ("missing import source", ["import", "{tmp}/none.safetensors", "{tmp}/t"], 2, "none.safetensors"),
]


@pytest.mark.parametrize("name, argv, code, match", CLI, ids=[row[0] for row in CLI])
def test_bad_cli_input(tmp_path, store, capsys, name, argv, code, match) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
