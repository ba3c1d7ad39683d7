"""Fixtures of the command-line tool tests: run ``tierstore`` in-process and small stores."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import tierstore
from tools.cli import main

Cli = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    """Run ``tierstore ARGS...`` in this process; returns (exit code, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["--quiet", *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _make_store(path: str, tensors: dict[str, torch.Tensor], codec: str = "raw",
                **options: object) -> str:
    opts = {"ram_budget": "8MiB", "chunk_bytes": "64KiB", "device": "cpu", **options}
    with tierstore.open(path, mode="w", **opts) as s:  # type: ignore[arg-type]
        for k, t in tensors.items():
            s.put(k, t, codec=codec)
        s.commit(step=1, message="fixture")
    return str(path)


@pytest.fixture
def make_store() -> Callable[..., str]:
    """``make_store(path, {key: tensor}, codec="raw", **options)``: a store committed once."""
    return _make_store
