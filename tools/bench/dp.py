"""Benchmark: data parallel on N gloo ranks vs one process, same per-rank batch (tokens/s, bytes per rank).

    python -m tools.bench.dp [--ranks 2] [--steps 6] [--batch 4] [--seq 128] [--hidden 256] [--layers 4]

Each configuration runs as separate processes on localhost with torchrun's environment variables
(``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``), so the same training script runs in
both. A rank trains ``--batch`` sequences a micro-batch, so N ranks train N times the tokens of a
step. Torch threads: the single process gets every core, each of N ranks cores / N, so both use
the whole machine; on a machine with two cores, two ranks share them and can at best match the
single process's tokens/s (what grows with the ranks is the capacity: each rank keeps 1/N of the
moments). The load average is printed, since other work on the machine skews the times. Reported
per rank: tokens/s of the global step (steps after the first), step time, the moments' bytes in
its store, its store's bytes on disk and its peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def _rank_main(a: argparse.Namespace) -> None:
    """One rank: train, then write this rank's figures to ``a.out``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import trainer as mt
    from trainer.data import default_dataset

    torch.set_num_threads(a.threads)
    config = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.hidden * 4, num_hidden_layers=a.layers,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                         max_position_embeddings=a.seq, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    mt.init(max_vram_gb="64MiB", max_ram_gb="512MiB", optimizer_compression=False, device="cpu")
    args = mt.TrainingArguments(output_dir=a.run_dir, per_device_train_batch_size=a.batch, max_steps=a.steps,
                                logging_steps=1, save_steps=0, learning_rate=1e-4, disable_tqdm=True)
    ds = default_dataset(block_size=a.seq, max_bytes=1 << 20)
    tr = mt.Trainer(model=model, train_dataset=ds, args=args)
    try:
        tr.train()
        logs = [e for e in tr.state.log_history if "tokens_per_s" in e][1:]  # the first step warms up
        store = tr.store
        out = {"tokens_per_s": statistics.median(e["tokens_per_s"] for e in logs),
               "step_s": statistics.median(e["step_s"] for e in logs),
               "moment_bytes": sum(store.info(k).nbytes for k in store.keys(prefix="opt/")),
               "weight_bytes": sum(store.info(k).nbytes for k in tr.parts.all_params()),
               "store_disk_bytes": _dir_bytes(store.path), "loss": logs[-1]["loss"] if logs else None,
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    finally:
        tr.close()
    with open(a.out, "w") as f:
        json.dump(out, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(world: int, a: argparse.Namespace, folder: str) -> tuple[float, list[dict[str, Any]]]:
    cores = os.cpu_count() or 1
    threads = max(1, cores // world)
    port = _free_port()
    procs = []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": str(threads)}
        if world > 1:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        out = os.path.join(folder, f"rank{rank}.json")
        cmd = [sys.executable, "-m", "tools.bench.dp", "--_rank", "--out", out, "--run-dir", os.path.join(folder, "run"),
               "--threads", str(threads), "--steps", str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq),
               "--hidden", str(a.hidden), "--layers", str(a.layers)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), out))
    t0 = time.perf_counter()
    results = []
    for p, out in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"a rank of the {world}-rank run failed:\n{err.decode()[-3000:]}")
        with open(out) as f:
            results.append(json.load(f))
    return time.perf_counter() - t0, results


def main(argv: Sequence[str] | None = None) -> None:
    """Run 1 process, then N ranks, and print one table."""
    p = argparse.ArgumentParser(prog="tools.bench.dp", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--_rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._rank:
        _rank_main(a)
        return
    load0 = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} cores, load average {load0:.2f} at the start; tiny Llama hidden {a.hidden}, "
          f"{a.layers} layers, seq {a.seq}, {a.batch} sequences per rank per step, {a.steps} steps (first not timed), "
          "raw codecs, fp32, CPU, gloo")
    print(f"{'ranks':>5} {'rank':>4} {'tok/s (global)':>15} {'step s':>7} {'moments B':>10} {'weights B':>10} "
          f"{'store disk B':>12} {'peak RSS MB':>11} {'wall s':>7}")
    folder = tempfile.mkdtemp(prefix="bench-dp-")
    try:
        for world in (1, a.ranks):
            sub = os.path.join(folder, f"w{world}")
            os.makedirs(sub)
            wall, results = _launch(world, a, sub)
            for r, res in enumerate(results):
                print(f"{world:>5} {r:>4} {res['tokens_per_s']:>15.0f} {res['step_s']:>7.3f} {res['moment_bytes']:>10} "
                      f"{res['weight_bytes']:>10} {res['store_disk_bytes']:>12} {res['peak_rss_bytes'] / 1e6:>11.0f} "
                      f"{wall:>7.1f}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
