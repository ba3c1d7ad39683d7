"""Benchmark: mt.generate vs transformers in memory and accelerate's ``disk_offload``, same model.

    python -m tools.bench.generate [--quick] [--rounds 3] [--new 16] [--big-batch 32] [--dir DIR] [--device cpu]

A Llama-style model is built from a config (no downloads; about 23.4M parameters by default, the size
of the figures in docs/benchmarks.md). Greedy generation of ``--new`` tokens after a ``--prompt``-token prompt runs

- in memory: transformers' ``model.generate`` (batch 1 and ``--big-batch``);
- accelerate: ``accelerate.disk_offload`` of the same weights (batch 1): every weight is read from
  its offload folder's memory maps at each forward;
- mt.generate: the weights in a store whose RAM budget is ``--ram-fraction`` of the weights (1: all
  of them, as the page cache holds accelerate's memory maps; below 1 the rest is read from disk per
  token) plus the KV workspace, and whose device window holds two decoder layers beside the KV
  workspace (batch 1 and ``--big-batch``).

The runs alternate for ``--rounds`` rounds after one untimed warm-up each; the table shows the
median. Every run's tokens are compared with the in-memory run of the same batch, token for token.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tools.table import render_table


def _config(a: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                       num_attention_heads=a.heads, num_key_value_heads=a.heads, vocab_size=256,
                       max_position_embeddings=a.prompt + a.new + 8, bos_token_id=0, eos_token_id=1)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model and prompt options this benchmark and ``tools.harness.check_generate`` share."""
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--new", type=int, default=16, help="new tokens")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1200)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)


def _timed(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    out = fn().cpu()  # waits for the device's queued work too
    return time.perf_counter() - t0, out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the generations, print tokens/s, the ratios, whether the tokens agree and the goals."""
    from transformers import AutoModelForCausalLM

    import trainer as mt
    from trainer.generate import kv_workspace_bytes

    p = argparse.ArgumentParser(prog="tools.bench.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short run: 4 new tokens, big batch 8, 3 rounds")
    p.add_argument("--rounds", type=int, default=3, help="alternating timed rounds (the median is shown)")
    add_model_args(p)
    p.add_argument("--big-batch", type=int, default=32)
    p.add_argument("--kv-block-tokens", type=int, default=64)
    p.add_argument("--ram-fraction", type=float, default=1.0,
                   help="mt's RAM budget as a fraction of the weights (below 1: the rest is read from disk per token)")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temporary folder)")
    p.add_argument("--device", default="cpu", help="where every run computes (cpu, cuda): in-memory weights, "
                   "accelerate's execution device and mt's window all live there")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if a.quick:
        a.new, a.big_batch = 4, 8
    if a.rounds < 1 or a.new < 1 or a.big_batch < 1:
        p.error("--rounds, --new and --big-batch must be >= 1")
    folder = a.dir or tempfile.mkdtemp(prefix="bench_generate_")
    os.makedirs(folder, exist_ok=True)
    try:
        config = _config(a)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        offloaded = AutoModelForCausalLM.from_config(config).eval()
        offloaded.load_state_dict(model.state_dict())
        n = sum(q.numel() for q in model.parameters())
        weights = n * 4
        layer = sum(q.numel() * 4 for q in model.model.layers[0].parameters())
        model.save_pretrained(os.path.join(folder, "hf"))
        positions = a.prompt + a.new
        ws = kv_workspace_bytes(config, a.big_batch, positions, a.kv_block_tokens)
        window, ram = 2 * layer + ws, int(weights * a.ram_fraction) + ws
        mt.init(offload_dir=os.path.join(folder, "store"), max_vram_gb=f"{window}B", max_ram_gb=f"{ram}B",
                device=str(dev))
        streamed = mt.load_model(os.path.join(folder, "hf"))

        from accelerate import disk_offload

        offloaded = disk_offload(offloaded, os.path.join(folder, "accelerate"), execution_device=dev)
        model.to(dev)

        g = torch.Generator().manual_seed(1)
        prompts = {1: torch.randint(2, 256, (1, a.prompt), generator=g).to(dev),
                   a.big_batch: torch.randint(2, 256, (a.big_batch, a.prompt), generator=g).to(dev)}
        kw: dict[str, Any] = dict(max_new_tokens=a.new, do_sample=False, eos_token_id=None)

        def hf(m: Any, b: int) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                with torch.no_grad():
                    return m.generate(prompts[b], attention_mask=torch.ones_like(prompts[b]), pad_token_id=0, **kw)
            return run

        def streaming(b: int) -> Callable[[], torch.Tensor]:
            return lambda: mt.generate(streamed, prompts[b], kv_block_tokens=a.kv_block_tokens, **kw)

        runs: list[tuple[str, int, Callable[[], torch.Tensor]]] = [
            ("transformers in memory", 1, hf(model, 1)),
            ("accelerate disk_offload", 1, hf(offloaded, 1)),
            ("mt.generate, window 2 layers", 1, streaming(1)),
            ("transformers in memory", a.big_batch, hf(model, a.big_batch)),
            ("mt.generate, window 2 layers", a.big_batch, streaming(a.big_batch)),
        ]
        print(f"model: Llama-style, {n / 1e6:.1f}M parameters ({weights / 2**20:.1f} MiB fp32), "
              f"{a.layers} layers; prompt {a.prompt} tokens, {a.new} new tokens, greedy")
        print(f"mt.generate budgets: device window {window / 2**20:.2f} MiB (2 layers of {layer / 2**20:.2f} MiB "
              f"+ KV workspace {ws / 2**20:.2f} MiB), RAM {ram / 2**20:.1f} MiB ({a.ram_fraction:g} x the weights "
              "+ the KV workspace; accelerate's memory maps use the page cache, unbounded)")
        print(f"device {dev}, torch threads {torch.get_num_threads()}, cpu count {os.cpu_count()}, "
              f"load average (1 min) {os.getloadavg()[0]:.2f}")
        outs: dict[int, torch.Tensor] = {}
        times: list[list[float]] = [[] for _ in runs]
        for _, _, fn in runs:  # warm-up
            fn()
        for _ in range(a.rounds):
            for i, (_, _b, fn) in enumerate(runs):
                s, out = _timed(fn)
                times[i].append(s)
                outs.setdefault(i, out)
        med = [statistics.median(t) for t in times]
        tps = [b * a.new / m for (_, b, _), m in zip(runs, med, strict=True)]
        ref_of = {1: 0, a.big_batch: 3}
        rows = []
        for i, (name, b, _) in enumerate(runs):
            mem = ref_of[b]
            same = torch.equal(outs[i], outs[mem])
            rows.append([name, b, f"{med[i]:.3f}", f"{tps[i]:.1f}", f"{med[i] / med[mem]:.2f}x",
                         f"{med[1] / med[i]:.2f}x" if b == 1 else "", "yes" if same else "NO"])
        print(render_table(["run", "batch", "median s", "tokens/s", "time vs in-memory", "speed vs accelerate",
                            "tokens equal"], rows,
                           right=["batch", "median s", "tokens/s", "time vs in-memory", "speed vs accelerate"]))
        st = streamed._trainer_store.stats()
        print(f"mt store: peak device {st['peak_device_bytes'] / 2**20:.2f} MiB of {window / 2**20:.2f}, "
              f"peak host {st['peak_host_bytes'] / 2**20:.1f} MiB of {ram / 2**20:.1f}, "
              f"disk reads {st['bytes_read_disk'] / 2**20:.0f} MiB; load average after {os.getloadavg()[0]:.2f}")
        goals = [
            (">= 2x accelerate at batch 1", med[1] / med[2], 2.0, True),
            ("within 1.5x of in-memory at batch 1 (window 2 layers)", med[2] / med[0], 1.5, False),
            (f"within 1.5x of in-memory at batch {a.big_batch} (window 2 layers)", med[4] / med[3], 1.5, False),
            (f"batch {a.big_batch} >= 10x batch 1 throughput", tps[4] / tps[2], 10.0, True),
        ]
        for name, got, want, higher in goals:
            met = got >= want if higher else got <= want
            print(f"goal {name}: {got:.2f}x ({'met' if met else 'MISSED'})")
        all_equal = all(r[-1] == "yes" for r in rows)
        return 0 if all_equal else 1
    finally:
        store = locals().get("streamed")
        if store is not None:
            from trainer.session import close_store

            close_store(store._trainer_store)
        if a.dir is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
