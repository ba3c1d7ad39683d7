"""Shared fixtures: Adam moments captured once per session from a short real AdamW run."""

from __future__ import annotations

import pytest
import torch

from tools.moments import captured_moments


@pytest.fixture(scope="session")
def real_moments() -> tuple[torch.Tensor, torch.Tensor]:
    """(m, v) of the 2-D parameters after 5 AdamW steps of a tiny byte-level model (~5 s)."""
    moments = captured_moments(steps=5, hidden=64, layers=1, batch=4, seq=64)
    big = [mv for mv in moments.values() if mv[0].dim() >= 2]
    m = torch.cat([a.reshape(-1) for a, _ in big])
    v = torch.cat([b.reshape(-1) for _, b in big])
    return m, v
