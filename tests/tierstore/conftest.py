"""Shared fixtures: Adam moments captured once per session from a short real AdamW run."""

from __future__ import annotations

import pytest
import torch

from tools.bench.moments import captured_moments


@pytest.fixture(scope="session")
def real_moments() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(m, v) of each 2-D parameter after 5 AdamW steps of a tiny byte-level model (~5 s).

    Kept in their shapes: the quantized codecs scale by rows and columns, so a flattened
    moment would measure a different (the block) view.
    """
    moments = captured_moments(steps=5, hidden=64, layers=1, batch=4, seq=64)
    return [mv for mv in moments.values() if mv[0].dim() >= 2]
