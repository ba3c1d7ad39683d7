"""A writer killed with SIGKILL at random moments: reopening yields the last commit, verified."""

from __future__ import annotations

import os
import random

import pytest

from tools.harness import crash_store


@pytest.mark.slow
def test_sigkill_trials(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    rng = random.Random(1)
    path = str(tmp_path / "store")
    steps = []
    for _ in range(5):
        step, problems = crash_store.trial(path, seed=3, delay=rng.uniform(0.0, 1.0))
        assert problems == []
        steps.append(step)
    assert all(s is not None for s in steps)  # every kill came after a commit
