"""Convergence benchmark: AdamW whose moments round-trip through a codec every step vs fp32.

Run ``python -m tools.bench_convergence [--steps N] [--seeds S] [--codecs q8,q4,q3,q2]``. A
byte-level Llama (transformers ``LlamaConfig``, about 1.1M parameters at the defaults) trains on
the Python standard library's sources with ``torch.optim.AdamW``; after every ``step()`` each
parameter's ``exp_avg`` and ``exp_avg_sq`` are replaced by ``decode(encode(.))`` with the codec
the trainer's policy picks for it (``tierstore.codecs.policy.choose_codec``: m signed, v
unsigned, stochastic rounding, small and 1-D tensors raw; ``q4:nearest`` overrides the
rounding), which is exactly "encode after the update, decode before the next".

Runs are paired: for each of ``--seeds`` seeds (initial weights and batch order) fp32 and every
codec train from the same start on the same batches. Reported per codec: the final training
loss (mean of the last 10% of steps) and the held-out loss on fixed batches from a text region
never trained on, each as the mean over seeds of the relative difference to the same seed's
fp32 run, with the smallest and largest of those differences. One seed is not enough: single
paired runs of the same codec differ by 1-3% from seed to seed at the defaults. Goals: within
1% for q8/q4, 3% for q2.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

from tierstore import codecs
from tierstore.codecs.policy import choose_codec
from tools.moments import byte_batches, lm_loss, stdlib_bytes, tiny_model


def round_trip_states(opt: torch.optim.Optimizer, requested: str) -> tuple[int, int]:
    """Replace every AdamW moment by its codec round trip; (quantized, total) element counts.

    ``requested`` is a codec name, optionally with a rounding suffix: ``"q2:stochastic"``.
    """
    name, _, rounding = requested.partition(":")
    quantized = total = 0
    for st in opt.state.values():
        for role in ("exp_avg", "exp_avg_sq"):
            t = st[role]
            codec = choose_codec(name, tuple(t.shape), role)
            total += t.numel()
            if codec.lossless:
                continue
            if rounding:
                codec = codecs.get(name, **{**codec.params(), "rounding": rounding})
            data = codec.encode(t)
            st[role].copy_(codec.decode(memoryview(data.numpy()), tuple(t.shape), t.dtype))
            quantized += t.numel()
    return quantized, total


def train(requested: str | None, steps: int, hidden: int, layers: int, batch: int, seq: int,
          lr: float, seed: int) -> dict[str, float]:
    """One run; ``requested`` None means plain fp32 AdamW."""
    text = stdlib_bytes(3_000_000)
    split = int(text.numel() * 0.9)
    train_text, eval_text = text[:split], text[split:]
    model = tiny_model(hidden, layers, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    batches = byte_batches(train_text, batch, seq, seed)
    # a fixed held-out set, the same for every seed, so runs compare on identical text
    held = byte_batches(eval_text, batch, seq, seed=12345)
    eval_batches = [next(held) for _ in range(8)]
    losses, share = [], (0, 1)
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = next(batches)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if requested is not None:
            share = round_trip_states(opt, requested)
        losses.append(loss.item())
    with torch.no_grad():
        held_out = sum(float(lm_loss(model, x, y)) for x, y in eval_batches) / len(eval_batches)
    tail = losses[-max(1, steps // 10):]
    return {"train": sum(tail) / len(tail), "held-out": held_out,
            "quantized": share[0] / share[1], "seconds": time.perf_counter() - t0}


def _gap(run: dict[str, float], base: dict[str, float], key: str) -> float:
    return (run[key] - base[key]) / base[key]


def main(argv: Sequence[str] | None = None) -> int:
    """Train fp32 and one run per codec for each seed; print the paired gaps to fp32."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps per run")
    ap.add_argument("--codecs", default="q8,q4,q3,q2,q4:nearest,q2:nearest",
                    help="comma-separated codec names, each optionally NAME:ROUNDING")
    ap.add_argument("--seeds", type=int, default=3,
                    help="paired seeds (weights and data order) per codec; gaps are averaged")
    ap.add_argument("--hidden", type=int, default=128, help="model width")
    ap.add_argument("--layers", type=int, default=4, help="model depth")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq", type=int, default=128, help="bytes per sequence")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    args = ap.parse_args(argv)
    names = [c for c in args.codecs.split(",") if c]
    for c in names:
        name, _, rounding = c.partition(":")
        codecs.get(name, **({"rounding": rounding} if rounding else {}))  # fail fast
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    params = sum(p.numel() for p in tiny_model(args.hidden, args.layers, args.seed).parameters())
    print(f"model: {params / 1e6:.2f}M params, {args.steps} steps, batch {args.batch}x{args.seq} "
          f"bytes, lr {args.lr}, seeds {args.seed}..{args.seed + args.seeds - 1}")
    runs: dict[str, list[dict[str, float]]] = {}
    for seed in range(args.seed, args.seed + args.seeds):
        for c in [None, *names]:
            r = train(c, args.steps, args.hidden, args.layers, args.batch, args.seq, args.lr, seed)
            runs.setdefault(c or "fp32", []).append(r)
            print(f"  seed {seed} {c or 'fp32'}: train {r['train']:.4f}, held-out "
                  f"{r['held-out']:.4f} ({r['seconds']:.0f}s)", flush=True)
    base = runs["fp32"]
    print(f"{'codec':>12} {'quantized':>9} {'train':>7} {'vs fp32 (min..max)':>24} "
          f"{'held-out':>8} {'vs fp32 (min..max)':>24}")
    for name, rs in runs.items():
        row = [f"{name:>12} {rs[0]['quantized']:>9.3f}"]
        for key in ("train", "held-out"):
            gaps = [_gap(r, b, key) for r, b in zip(rs, base, strict=True)]
            mean_loss = sum(r[key] for r in rs) / len(rs)
            spread = f"{sum(gaps) / len(gaps):+.2%} ({min(gaps):+.2%}..{max(gaps):+.2%})"
            row.append(f"{mean_loss:>{7 if key == 'train' else 8}.4f} {spread:>24}")
        print(" ".join(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
