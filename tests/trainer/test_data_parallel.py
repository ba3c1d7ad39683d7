"""Data parallel on torch.distributed (gloo, 2 processes on localhost) against one process with the doubled batch.

The ranks are plain subprocesses given torchrun's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``), so that a rank's own exit (not a launcher's SIGTERM) is seen.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

import trainer as mt
from trainer.distributed import MANIFEST, DistributedError, check_world, local_rows

WORKER = os.path.join(os.path.dirname(__file__), "dp_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(tmp: Any, tag: str, world: int, *extra: str) -> list[tuple[subprocess.Popen[bytes], str]]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        if world == 1:
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
                env.pop(k)
        out = str(tmp / f"{tag}-rank{rank}.json")
        log = open(str(tmp / f"{tag}-rank{rank}.log"), "wb")  # noqa: SIM115  (closed with the process)
        procs.append((subprocess.Popen([sys.executable, WORKER, out, str(tmp / "run"), *extra], env=env,
                                       stdout=log, stderr=subprocess.STDOUT), out))
    return procs


def _results(tmp: Any, tag: str, world: int, *extra: str, timeout: float = 240) -> list[dict[str, Any]]:
    procs = _launch(tmp, tag, world, *extra)
    for rank, (p, _) in enumerate(procs):
        rc = p.wait(timeout)
        log = (tmp / f"{tag}-rank{rank}.log").read_text()
        assert rc == 0, f"rank {rank} exited {rc}:\n{log[-3000:]}"
    out = []
    for _, path in procs:
        with open(path) as f:
            r = json.load(f)
        r["weights"] = torch.load(path + ".pt")
        out.append(r)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: Any) -> dict[str, Any]:
    """One process with batch 4 (here); two ranks of batch 2, rank 1 killed in step 3, then resumed."""
    from dp_worker import run

    single = run(str(tmp_path_factory.mktemp("single")), batch=4)
    killed = tmp_path_factory.mktemp("killed")
    # rank 1 SIGKILLs itself between the micro-batches of step 3 (checkpoints at steps 1 and 2)
    procs = _launch(killed, "k", 2, "--batch", "2", "--kill-at", "3")
    (p0, _), (p1, _) = procs
    deadline = time.monotonic() + 240
    while p1.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    died = time.monotonic()
    rc0 = p0.wait(max(1.0, deadline - time.monotonic()))
    out: dict[str, Any] = {"single": single, "killed_rcs": [rc0, p1.returncode], "after_kill_s": time.monotonic() - died,
                           "killed_log": (killed / "k-rank0.log").read_text(),
                           "manifest": json.loads((killed / "run" / "store" / MANIFEST).read_text()),
                           "killed_dir": killed}
    out["two"] = _results(killed, "r", 2, "--batch", "2", "--resume")
    return out


def test_losses_and_weights_equal_one_process_with_the_doubled_batch(runs: dict[str, Any]) -> None:
    # the two ranks' steps 1-2 ran before the kill, 3-4 after the resume from the step-2 checkpoint
    single, (r0, r1) = runs["single"], runs["two"]
    assert len(single["losses"]) == 4 and single["losses"][-1] < single["losses"][0]
    assert r0["step"] == r1["step"] == 4
    for got in (r0, r1):  # every rank logs the global step's loss and norm
        for a, b in zip(got["losses"], single["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], single["losses"])
        for a, b in zip(got["grad_norms"], single["grad_norms"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b)
    for name, want in single["weights"].items():
        torch.testing.assert_close(r0["weights"][name], want, atol=1e-5, rtol=0, msg=name)
        assert torch.equal(r0["weights"][name], r1["weights"][name]), name  # the ranks hold the same weights


def test_each_rank_store_holds_half_the_moments(runs: dict[str, Any]) -> None:
    single, (r0, r1) = runs["single"], runs["two"]
    assert r0["store"] != r1["store"] and r0["store"].endswith("rank-0") and r1["store"].endswith("rank-1")
    assert r0["moment_bytes"] + r1["moment_bytes"] == single["moment_bytes"]
    for r in (r0, r1):
        assert abs(r["moment_bytes"] / single["moment_bytes"] - 0.5) < 0.05


def test_a_killed_rank_fails_the_other_with_a_clear_error(runs: dict[str, Any]) -> None:
    assert runs["killed_rcs"][1] == -9
    assert runs["killed_rcs"][0] not in (0, None)
    assert runs["after_kill_s"] < 60, runs["after_kill_s"]
    assert "DistributedError" in runs["killed_log"] and "rank 0 of 2" in runs["killed_log"], runs["killed_log"][-3000:]
    # the last complete checkpoint is step 2 on both ranks (the test above resumed from it)
    assert runs["manifest"] == {"step": 2, "versions": runs["manifest"]["versions"], "world_size": 2}


def test_another_world_size_is_refused_naming_both(runs: dict[str, Any]) -> None:
    root = str(runs["killed_dir"] / "run" / "store")
    with pytest.raises(DistributedError, match=r"written by 2 rank\(s\) and this run has 1"):
        check_world(root, 1)
    with pytest.raises(DistributedError, match=r"written by 2 rank\(s\) and this run has 3"):
        check_world(root, 3)
    # a single process resuming that run says so too (no torchrun in this process)
    from plain_reference import build, llama_config

    from trainer.data import default_dataset

    mt.init(offload_dir=None, max_vram_gb="1MiB", max_ram_gb="8MiB", optimizer_compression=False, device="cpu")
    args = mt.TrainingArguments(output_dir=str(runs["killed_dir"] / "run"), max_steps=4, disable_tqdm=True)
    tr = mt.Trainer(model=build(llama_config(2)), train_dataset=default_dataset(32, 4096), args=args)
    try:
        with pytest.raises(DistributedError, match="torchrun --nproc-per-node 2"):
            tr.train(resume_from_checkpoint=True)
    finally:
        tr.close()


def test_local_rows_split_each_micro_batch() -> None:
    micro = [{"input_ids": torch.arange(8).view(4, 2), "labels": torch.arange(8).view(4, 2)}]
    assert local_rows(micro, 1, 2)[0]["input_ids"].tolist() == [[4, 5], [6, 7]]
    with pytest.raises(DistributedError, match="dataloader_drop_last"):
        local_rows([{"input_ids": torch.zeros(1, 2)}], 0, 2)


def test_rollback_makes_the_head_an_older_commit_again(tmp_path: Any) -> None:
    import tierstore
    from trainer.distributed import rollback

    with tierstore.open(str(tmp_path / "s")) as s:
        s.put("w", torch.ones(4), codec="raw")
        s.put("opt/m", torch.full((4,), 0.5), codec="raw")
        v1 = s.commit(step=1)
        s.put("w", torch.zeros(4), codec="raw")  # a commit past the manifest: changed, added, deleted keys
        s.put("extra", torch.ones(2), codec="raw")
        s.delete("opt/m")
        s.commit(step=2)
        rollback(s, v1, 1)
        assert s.versions()[-1].step == 1
        assert sorted(s.keys()) == ["opt/m", "w"]
        assert torch.equal(s.get("w"), torch.ones(4)) and torch.equal(s.get("opt/m"), torch.full((4,), 0.5))
        with pytest.raises(DistributedError, match="no longer holds version 999"):
            rollback(s, 999, 1)
