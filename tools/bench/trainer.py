"""Benchmark: the streaming trainer vs plain in-memory PyTorch training of the same model and batch.

    python -m tools.bench.trainer [--steps 4] [--rounds 2] [--batch 8] [--seq 256] [--dir DIR]
                                  [--timeline PNG]

Plain PyTorch runs twice (with ``gradient_checkpointing_enable`` and without); the streaming
trainer runs with its device window at a quarter of the weights and its RAM budget below the
training state (16 B a parameter), so weights stream through the window and state spills to
disk; then once more with a RAM budget that holds the whole state (the same window), which
parts the store's own cost from the cost of spilling. The first step of each run is a warm-up
and is not timed. ``vs ckpt``: the step time over plain PyTorch's with checkpointing (the
streaming trainer checkpoints too). ``--timeline PNG`` draws the last
round's streaming step ``--steps`` (the next to last: the last one also holds the final commit) as
``tierstore trace RUN_DIR --step N`` would, and keeps its Chrome trace next to it. ``core-s``
and ``idle``: the process's CPU seconds a step and the share of the cores it left unused (on
two cores each core-second the store's threads take costs the step more than its own length).
``blocks``: the times a step the training thread blocked (voluntary context switches: a wait
for a lock, a future, or its OpenMP team's workers); below the table, each streaming run's CPU
seconds a step by thread (Linux).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from tools.bench.cputime import delta, thread_times

RUNS = ("plain PyTorch", "plain PyTorch + gradient checkpointing", "streaming trainer (tierstore)",
        "streaming trainer, state in RAM")


def _config(a: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                       num_attention_heads=a.heads, num_key_value_heads=a.heads, vocab_size=256,
                       max_position_embeddings=a.seq, bos_token_id=0, eos_token_id=1)


def _plain(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], checkpointing: bool
           ) -> list[tuple[float, float, int]]:
    """(wall, process CPU, training thread's blocks) of each plain PyTorch step (forward, backward, clip, AdamW)."""
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # the fused kernel, as the streaming trainer's CPU AdamW uses (the stronger baseline)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    times = []
    # the streaming run's mt.init tunes malloc for the whole process (large buffers go back to
    # the OS on free); plain PyTorch gets glibc's own reuse of freed buffers, as in a process of its own
    from trainer import memory

    with memory.reuse_freed_buffers():
        for b in batches:
            times.append(_plain_step(model, opt, b))
    return times[1:]


def _plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, b: dict[str, torch.Tensor]
                ) -> tuple[float, float, int]:
    """One plain step's (wall s, process CPU s, training thread's blocks): forward, backward, clip, AdamW."""
    before = thread_times()
    t0, c0 = time.perf_counter(), time.process_time()
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"])
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, delta(before, thread_times()).get("MainThread", (0.0, 0))[1]


def _step_clock() -> Any:
    """A trainer callback noting wall and process CPU time at each step's end."""
    from trainer.callbacks import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = [time.process_time()]
            self.threads = [thread_times()]

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.marks.append(time.process_time())
            self.threads.append(thread_times())

        def cpu(self) -> list[float]:
            """Process CPU seconds of each step (the first one's from the run's start)."""
            return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]

        def per_thread(self) -> list[dict[str, tuple[float, int]]]:
            """Each step's CPU seconds and blocks by thread name (as ``cpu``)."""
            return [delta(a, b) for a, b in zip(self.threads, self.threads[1:], strict=False)]

    return StepClock()


def _streaming(model: torch.nn.Module, dataset: Any, a: argparse.Namespace, vram: int, ram: int,
               folder: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import trainer as mt

    mt.init(offload_dir=os.path.join(folder, "store"), max_vram_gb=f"{vram}B", max_ram_gb=f"{ram}B",
            optimizer_compression=False)
    args = mt.TrainingArguments(output_dir=folder, per_device_train_batch_size=a.batch, gradient_accumulation_steps=1,
                                learning_rate=1e-4, weight_decay=0.01, max_steps=a.steps + 1, logging_steps=1,
                                save_steps=0, max_grad_norm=1.0, disable_tqdm=True)
    clock = _step_clock()
    tr = mt.Trainer(model=model, train_dataset=dataset, args=args, callbacks=[clock])
    try:
        tr.train()
        stats = tr.store.stats()
    finally:
        tr.close()
    log = [e for e in tr.state.log_history if "loss" in e]
    for e, cpu, threads in zip(log, clock.cpu(), clock.per_thread(), strict=False):
        e["cpu_s"] = cpu
        e["threads"] = threads
    return log[1:], stats


def _draw_step(run_dir: str, step: int, out: str) -> None:
    """``tierstore trace run_dir --step step --out out``, printing its lanes."""
    from tools.cli import trace_cmd

    trace_cmd.run(argparse.Namespace(run_dir=run_dir, out=out, step=step))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the three trainings and print tokens/s, the ratio, stall time and the optimizer's share."""
    from transformers import AutoModelForCausalLM

    from trainer.data import collate, default_dataset

    p = argparse.ArgumentParser(prog="tools.bench.trainer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="timed steps per run (after one warm-up step)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1472)
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of the three runs")
    p.add_argument("--dir", default=None, help="where the store goes (default: a temporary folder)")
    p.add_argument("--timeline", default=None, metavar="PNG",
                   help="draw one streaming step's I/O and compute timeline to this PNG")
    a = p.parse_args(argv)
    folder = a.dir or tempfile.mkdtemp(prefix="bench-trainer-")
    torch.manual_seed(0)
    config = _config(a)
    model = AutoModelForCausalLM.from_config(config)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    n = sum(p.numel() for p in model.parameters())
    weights, state = 4 * n, 16 * n
    vram, ram = weights // 4, state // 2
    dataset = default_dataset(block_size=a.seq, max_bytes=(a.steps + 1) * a.batch * a.seq * 4)
    batches = [collate([dataset[i * a.batch + j] for j in range(a.batch)]) for i in range(a.steps + 1)]
    tokens = a.batch * a.seq
    print(f"model: Llama-style, {n / 1e6:.1f}M parameters ({weights / 2**20:.0f} MiB fp32 weights, "
          f"{state / 2**20:.0f} MiB training state); batch {a.batch} x {a.seq} tokens; "
          f"{torch.get_num_threads()} threads")
    print(f"streaming budgets: device window {vram / 2**20:.1f} MiB (1/4 of the weights), "
          f"RAM {ram / 2**20:.1f} MiB (1/2 of the training state)")
    # Rounds alternate the three runs, so that load from other processes falls on all of them.
    times: dict[str, list[float]] = {name: [] for name in RUNS}
    cpus: dict[str, list[float]] = {name: [] for name in RUNS}
    blocks: dict[str, list[int]] = {name: [] for name in RUNS}
    by_thread: dict[str, dict[str, list[float]]] = {name: collections.defaultdict(list) for name in RUNS[2:]}
    stalls: dict[str, list[float]] = {name: [] for name in RUNS[2:]}
    busy = dict.fromkeys(RUNS[2:], 0.0)
    stats: dict[str, Any] = {}
    load0 = os.getloadavg()[0]
    for r in range(a.rounds):
        for name, ckpt in ((RUNS[0], False), (RUNS[1], True)):
            m = AutoModelForCausalLM.from_config(config)
            m.load_state_dict(init)
            for wall, cpu, blocked in _plain(m, batches, ckpt):
                times[name].append(wall)
                cpus[name].append(cpu)
                blocks[name].append(blocked)
            del m
        for name, budget in ((RUNS[2], ram), (RUNS[3], 2 * state)):
            m = AutoModelForCausalLM.from_config(config)
            m.load_state_dict(init)
            sub = os.path.join(folder, f"round{r}")
            try:
                log, run_stats = _streaming(m, dataset, a, vram, budget, sub)
                if a.timeline and r == a.rounds - 1 and name == RUNS[2]:
                    _draw_step(sub, a.steps, a.timeline)
            finally:
                shutil.rmtree(sub, ignore_errors=True)
            if name == RUNS[2]:
                stats = run_stats
            times[name] += [e["step_s"] for e in log]
            cpus[name] += [e["cpu_s"] for e in log if "cpu_s" in e]
            for e in log:
                for thread, (cpu, blocked) in e.get("threads", {}).items():
                    by_thread[name][thread].append(cpu)
                    if thread == "MainThread":
                        blocks[name].append(blocked)
            stalls[name] += [e["stall_s"] for e in log]
            busy[name] += sum(e["optimizer_s"] for e in log)
    if a.dir is None:
        shutil.rmtree(folder, ignore_errors=True)
    rows = [(RUNS[0], statistics.median(times[RUNS[0]]), None, None),
            (RUNS[1], statistics.median(times[RUNS[1]]), None, None)]
    rows += [(name, statistics.median(times[name]), statistics.median(stalls[name]), busy[name] / sum(times[name]))
             for name in RUNS[2:]]
    base, ckpt = rows[0][1], rows[1][1]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    print(f"{'run':42s} {'step s':>8s} {'tokens/s':>9s} {'vs plain':>9s} {'vs ckpt':>8s} {'core-s':>7s} "
          f"{'idle':>5s} {'blocks':>7s} {'stall s':>8s} {'optimizer':>9s}")
    for name, s, st, share in rows:
        cpu = statistics.median(cpus[name]) if cpus[name] else float("nan")
        blocked = f"{statistics.median(blocks[name]):.0f}" if blocks[name] else "n/a"
        print(f"{name:42s} {s:8.3f} {tokens / s:9.0f} {base / s:8.2f}x {s / ckpt:7.2f}x {cpu:7.2f} "
              f"{1 - cpu / (cores * s):5.0%} {blocked:>7s} {'' if st is None else f'{st:.3f}':>8s} "
              f"{'' if share is None else f'{share:.0%}':>9s}")
    for name in RUNS[2:]:
        medians = sorted(((statistics.median(v), k) for k, v in by_thread[name].items()), reverse=True)
        if medians:
            print(f"{name}: core-s a step by thread: "
                  + ", ".join(f"{k} {v:.2f}" for v, k in medians if v >= 0.005)
                  + " (native: OpenMP workers and torch's own threads)")
    print(f"streaming store (RAM 1/2 of the state): peak device {stats['peak_device_bytes'] / 2**20:.1f} MiB, peak host "
          f"{stats['peak_host_bytes'] / 2**20:.1f} MiB, disk read {stats['bytes_read_disk'] / 2**20:.0f} MiB, "
          f"written {stats['bytes_written_disk'] / 2**20:.0f} MiB, h2d {stats['bytes_h2d'] / 2**20:.0f} MiB, "
          f"weights lent from the RAM tier {stats['bytes_lent'] / 2**20:.0f} MiB (a CPU window copies none)")
    print(f"load average (1 min) before/after: {load0:.2f}/{os.getloadavg()[0]:.2f}; "
          f"{a.rounds} rounds x {a.steps} timed steps per run; medians")
    print("vs plain: tokens/s over plain PyTorch's; vs ckpt: step time over plain PyTorch's with checkpointing")
    print("optimizer = share of the streaming step spent in the CPU AdamW update (worker thread, overlapped)")
    print(f"core-s = the process's CPU seconds a step (all threads); idle = the share of the {cores} cores' "
          "time in the step that no thread of the process used")
    print("blocks = the times a step the training thread blocked (voluntary context switches: locks, futures, "
          "its OpenMP team)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
