"""One rank of a data-parallel test run (launched by test_data_parallel.py with torchrun's env vars).

python dp_worker.py OUT_JSON OUTPUT_DIR [--resume] [--resume-from PATH] [--stop N] [--kill-at STEP]
                   [--kill-before-manifest STEP] [--save-total-limit N] [--compression q8] [--clip C] [--batch B]
``run`` is the same run in this process (the single-process reference).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from plain_reference import build, llama_config  # noqa: E402

import trainer as mt  # noqa: E402
from trainer.data import default_dataset  # noqa: E402

STEPS = 4


class KillMidStep(mt.TrainerCallback):
    """SIGKILL this process between the micro-batches of step ``at`` (1-based)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_substep_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201, D102
        if state.global_step + 1 == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_before_manifest(at: int) -> None:
    """SIGKILL this process between the two phases of the checkpoint at step ``at``: its store has
    committed, the manifest does not name the step yet."""
    from trainer.distributed import DataParallel

    phase_two = DataParallel.commit_manifest

    def commit_manifest(self, root: str, step: int, version: int) -> None:  # noqa: ANN001
        if step == at:
            os.kill(os.getpid(), signal.SIGKILL)
        phase_two(self, root, step, version)

    DataParallel.commit_manifest = commit_manifest  # type: ignore[method-assign]


def run(output_dir: str, batch: int, resume: bool | str = False, stop: int | None = None, kill_at: int | None = None,
        clip: float = 0.5, save_total_limit: int | None = None, compression: bool | str = False) -> dict[str, Any]:
    """Train the tiny Llama (fp32; raw codecs unless ``compression``) on this rank; what the test
    compares, weights and moments included. ``resume``: True or a path for resume_from_checkpoint."""
    rank = int(os.environ.get("RANK", "0"))
    dataset = default_dataset(block_size=32, max_bytes=64 * 1024)
    mt.init(offload_dir=None, max_vram_gb="1MiB", max_ram_gb="8MiB", optimizer_compression=compression, device="cpu")
    args = mt.TrainingArguments(output_dir=output_dir, per_device_train_batch_size=batch,
                                gradient_accumulation_steps=2, learning_rate=2e-3, weight_decay=0.1,
                                max_steps=STEPS, warmup_steps=1, lr_scheduler_type="cosine", max_grad_norm=clip,
                                logging_steps=1, save_steps=1, disable_tqdm=True, ddp_timeout=30,
                                save_total_limit=save_total_limit)
    # rank 1 starts from other weights: the run must begin from rank 0's, as DDP does
    model = build(llama_config(2), seed=rank)
    callbacks = [KillMidStep(kill_at)] if kill_at and rank == 1 else []
    tr = mt.Trainer(model=model, train_dataset=dataset, args=args, callbacks=callbacks)
    try:
        tr.train(resume_from_checkpoint=resume or None, stop_at_step=stop)
        store = tr.store
        return {"losses": [e["loss"] for e in tr.state.log_history if "loss" in e],
                "grad_norms": [e["grad_norm"] for e in tr.state.log_history if "grad_norm" in e],
                "moment_bytes": sum(store.info(k).nbytes for k in store.keys(prefix="opt/")),
                "step": tr.state.global_step, "store": store.path,
                "versions": [c.version for c in store.versions()],
                "weights": {n: store.get(n) for n in tr.parts.all_params()},
                "moments": {k: store.get(k) for k in store.keys(prefix="opt/")}}
    finally:
        tr.close()


def main() -> None:
    """Run one rank from the command line; the result goes to OUT_JSON (weights to OUT_JSON.pt)."""
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("output_dir")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--resume-from", default=None)
    p.add_argument("--kill-before-manifest", type=int, default=None)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--compression", default=None)
    p.add_argument("--stop", type=int, default=None)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--batch", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.kill_before_manifest and int(os.environ.get("RANK", "0")) == 1:
        kill_before_manifest(a.kill_before_manifest)
    out = run(a.output_dir, a.batch, a.resume_from or a.resume, a.stop, a.kill_at, a.clip, a.save_total_limit,
              a.compression or False)
    torch.save(out.pop("weights"), a.out + ".pt")
    torch.save(out.pop("moments"), a.out + ".opt.pt")
    with open(a.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
