"""A training run killed with SIGKILL and resumed matches the uninterrupted run bit for bit."""

from __future__ import annotations

import random

import pytest

from tools.harness import crash_train

STEPS = 6


@pytest.mark.slow
def test_killed_and_resumed_runs_match_the_reference(tmp_path) -> None:
    ref = crash_train.reference(str(tmp_path), STEPS)
    assert sorted(ref.logs) == list(range(1, STEPS + 1))
    assert any(k.startswith("trainer/") for k in ref.tensors) and len(ref.tensors) > 10
    # One run killed up to three times: every start costs seconds of imports on a loaded machine.
    res = crash_train.trial(str(tmp_path / "run"), ref, STEPS, random.Random(2), max_kills=3,
                            span=0.3 * ref.seconds)  # early kills: some surely land before the end
    assert res.corrupted == [] and res.differing == [] and res.errors == []
    kills = res.kills
    assert kills >= 1  # at least one kill happened, so a resume was compared


def test_a_different_run_is_reported(tmp_path) -> None:
    """The comparison catches a trajectory that is not the reference's (a harness that cannot fail)."""
    ref = crash_train.Reference(logs={1: {"step": 1, "loss": 1.0, "learning_rate": 0.1, "grad_norm": 2.0}},
                                tensors={}, seconds=1.0)
    same = [{"step": 1, "loss": 1.0, "learning_rate": 0.1, "grad_norm": 2.0}]
    other = [{"step": 1, "loss": 1.0000001, "learning_rate": 0.1, "grad_norm": 2.0}]
    assert crash_train.first_log_difference(same, ref) is None
    assert "step 1" in (crash_train.first_log_difference(other, ref) or "")
