"""Data-parallel checkpoints (2 gloo processes, q8 moments): every interrupted run resumes bit for bit.

The reference is the same two-rank run without interruption. A run killed between the two
phases of a checkpoint (a rank's store committed, the manifest not yet written) is rolled back
on resume, with every ``save_total_limit`` the trainer accepts; a run resumed from an explicit
store path with another ``output_dir`` keeps its manifest beside its rank stores.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
import torch
from test_data_parallel import _launch, _results

from trainer.distributed import MANIFEST

Q8 = ("--batch", "2", "--compression", "q8")


def _with_moments(tmp: Any, tag: str, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for rank, r in enumerate(results):
        r["moments"] = torch.load(str(tmp / f"{tag}-rank{rank}.json") + ".opt.pt")
    return results


def _same_run(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """Bit for bit: losses, grad norms, weights and each rank's moments (q8: their stored values)."""
    for g, w in zip(got, want, strict=True):
        assert g["step"] == w["step"] == 4
        assert g["losses"] == w["losses"] and g["grad_norms"] == w["grad_norms"]
        for name, t in w["weights"].items():
            assert torch.equal(g["weights"][name], t), name
        assert sorted(g["moments"]) == sorted(w["moments"])
        for name, t in w["moments"].items():
            assert torch.equal(g["moments"][name], t), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory: Any) -> list[dict[str, Any]]:
    """Two ranks, q8 moments, four steps without interruption."""
    tmp = tmp_path_factory.mktemp("reference")
    return _with_moments(tmp, "ref", _results(tmp, "ref", 2, *Q8))


def _kill_between_phases(tmp: Any, *extra: str) -> None:
    """Rank 1 dies after its store committed step 3, before the manifest names it; rank 0 fails."""
    procs = _launch(tmp, "k", 2, *Q8, "--kill-before-manifest", "3", *extra)
    (p0, _), (p1, _) = procs
    deadline = time.monotonic() + 240
    rc1 = p1.wait(240)
    rc0 = p0.wait(max(1.0, deadline - time.monotonic()))
    log0 = (tmp / "k-rank0.log").read_text()
    assert rc1 == -9 and rc0 not in (0, None), (rc0, rc1, log0[-3000:])
    assert "DistributedError" in log0, log0[-3000:]


@pytest.mark.parametrize("limit", [None, 1, 2])
def test_a_rank_killed_between_the_checkpoint_phases_resumes_bit_for_bit(
        tmp_path: Any, reference: list[dict[str, Any]], limit: int | None) -> None:
    extra = () if limit is None else ("--save-total-limit", str(limit))
    _kill_between_phases(tmp_path, *extra)
    manifest = json.loads((tmp_path / "run" / "store" / MANIFEST).read_text())
    assert manifest["step"] == 2  # both ranks committed step 3: both roll back to the manifest
    got = _with_moments(tmp_path, "r", _results(tmp_path, "r", 2, *Q8, "--resume", *extra))
    _same_run(got, reference)
    for r in got:  # the limit, or the manifest's version and the next one (at least 2)
        assert len(r["versions"]) <= max(2, limit or 99)


def test_a_second_kill_right_after_a_rolled_back_resume_resumes_bit_for_bit(
        tmp_path: Any, reference: list[dict[str, Any]]) -> None:
    # the resumed run dies between the phases of its first checkpoint: the manifest must name
    # versions the ranks still hold (the rolled-back ones), not the ones retention dropped since
    _kill_between_phases(tmp_path, "--save-total-limit", "1")
    _kill_between_phases(tmp_path, "--save-total-limit", "1", "--resume")
    got = _with_moments(tmp_path, "r", _results(tmp_path, "r", 2, *Q8, "--resume", "--save-total-limit", "1"))
    _same_run(got, reference)


def test_rollback_of_q8_moments_restores_the_stored_bytes(tmp_path: Any, reference: list[dict[str, Any]]) -> None:
    # the rolled-back ranks' moments are the step-2 commit's bytes: the run goes on as if never killed
    _kill_between_phases(tmp_path)
    got = _with_moments(tmp_path, "r", _results(tmp_path, "r", 2, *Q8, "--resume"))
    _same_run(got, reference)
    assert any(t.dtype == torch.float32 and t.dim() == 2 for t in got[0]["moments"].values())


def test_resume_from_a_store_path_with_another_output_dir(tmp_path_factory: Any,
                                                          reference: list[dict[str, Any]]) -> None:
    first, second = tmp_path_factory.mktemp("first"), tmp_path_factory.mktemp("second")
    _results(first, "a", 2, *Q8, "--stop", "2")
    root = first / "run" / "store"
    # the new output_dir does not exist yet: the checkpoints still go to the stores resumed from
    got = _with_moments(second, "b", _results(second, "b", 2, *Q8, "--resume-from", str(root)))
    _same_run(got, reference)
    assert [r["store"] for r in got] == [os.path.realpath(root / f"rank-{r}") for r in range(2)]
    assert json.loads((root / MANIFEST).read_text())["step"] == 4
    assert not (second / "run" / "store").exists()
    # a later resume from the same stores starts at step 4: no rank is rolled back past it
    again = _results(second, "c", 2, *Q8, "--resume-from", str(root))
    assert [r["step"] for r in again] == [4, 4]
    for name, t in reference[0]["weights"].items():
        assert torch.equal(again[0]["weights"][name], t), name
