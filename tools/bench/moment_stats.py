"""Where coded Adam moments change the update: per-step statistics against fp32 AdamW.

Run ``python -m tools.bench.moment_stats [--steps N] [--hidden H] [--codecs q8,q4,q3,q2]
[--roundings policy,nearest,stochastic]``. The model, data and AdamW settings are those of
``tools.bench.convergence``; AdamW runs with fp32 moments, and on the *same* clipped gradients
of every step each codec keeps a shadow pair of coded moments, updated as a coded run updates
them (``m = beta1 * dec(enc(m)) + (1 - beta1) * g``, the update taken, then encoded again), so
the shadow sees exactly the error a coded run accumulates, without the coded run's different
trajectory. Per codec and rounding, over the tensors the trainer's policy quantizes:

* ``ratio``: ||u_coded|| / ||u_fp32|| per tensor, the mean over tensors and steps (1 = the
  same update size); ``cos``: their cosine, the same mean; ``1step`` columns: the same from one
  round trip of the fp32 moments (no accumulation);
* ``m gain``: <m_coded, m> / <m, m> (the bias of m along itself; 1 = none), ``m err``: the
  relative L2 error of m;
* ``isqrt``: the mean over elements of sqrt(v / v_coded) - 1, the bias of 1/sqrt(v) that the
  update divides by, and ``v gain``: mean(v_coded) / mean(v) - 1;
* ``drift``: ``ratio`` over the last fifth of the steps minus over the first fifth;
* ``bits``: stored bits per parameter of the moments (m + v + the residual of error feedback,
  scales counted as the codecs' ``bits``: block view), of a tensor the policy quantizes.

Error feedback (``+ef=CODEC``, e.g. ``q4+ef=q2``): the shadow also keeps m's quantization
residual e, stored with CODEC (``raw``: exact). Each step ``est = beta1 * (dec(m) + dec(e)) +
(1 - beta1) * g``, ``m = enc(est)``, ``e = enc_e(est - dec(m))``, and the update reads the
stored ``dec(m)`` (``+ef_update=sum``: ``dec(m) + dec(e)``, a two-stage code of m), so unlike
the rows without it, whose update reads the step's m before it is encoded, it carries this
step's rounding noise and not the earlier steps'; its ``1step`` columns code fp32's own m the
same way, with no residual carried.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from tierstore import codecs
from tierstore.codecs import quant
from tierstore.errors import CodecError
from tools.bench.moments import (
    byte_batches,
    lm_loss,
    moment_codec_pair,
    request_bits,
    stdlib_bytes,
    tiny_model,
)

STAT_KEYS = ("ratio", "cos", "ratio1", "cos1", "m_gain", "m_err", "isqrt", "v_gain")


def round_trip(codec: codecs.Codec, t: torch.Tensor) -> torch.Tensor:
    """decode(encode(t)) with ``codec``."""
    if codec.lossless:
        return t.clone()
    data = codec.encode(t)
    return codec.decode(memoryview(data.numpy()), tuple(t.shape), t.dtype)


def moment_codecs(requested: str, shape: tuple[int, ...]
                  ) -> tuple[codecs.Codec, codecs.Codec, tuple[codecs.Codec, str] | None] | None:
    """(m codec, v codec, error feedback) for ``requested`` (``tools.bench.moments.
    moment_codec_pair``'s grammar); error feedback is (residual codec, what the update reads) or
    None."""
    return moment_codec_pair(requested, shape, with_ef=True)


def _update(m: torch.Tensor, v: torch.Tensor, bc1: float, bc2: float, eps: float) -> torch.Tensor:
    # torch.optim.AdamW's step direction without lr: (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)
    return (m / bc1) / (v.sqrt() / bc2**0.5 + eps)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-30))


def collect(configs: Sequence[str], steps: int, hidden: int, layers: int, batch: int, seq: int,
            lr: float, seed: int, beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-8
            ) -> dict[str, list[dict[str, float]]]:
    """Per config, one dict of ``STAT_KEYS`` (means over quantized tensors) per step."""
    text = stdlib_bytes(3_000_000)
    train_text = text[: int(text.numel() * 0.9)]
    model = tiny_model(hidden, layers, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=0.1)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    batches = byte_batches(train_text, batch, seq, seed)
    params = [p for p in model.parameters()]
    pcodecs = {c: {i: moment_codecs(c, tuple(p.shape)) for i, p in enumerate(params)} for c in configs}
    shadow: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {c: {} for c in configs}
    ef_state: dict[str, dict[int, torch.Tensor]] = {c: {} for c in configs}
    prev: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    out: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    for step in range(1, steps + 1):
        x, y = next(batches)
        opt.zero_grad(set_to_none=True)
        lm_loss(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        bc1, bc2 = 1 - beta1**step, 1 - beta2**step
        sums = {c: dict.fromkeys(STAT_KEYS, 0.0) for c in configs}
        count = 0
        for i, p in enumerate(params):
            if pcodecs[configs[0]][i] is None:
                continue
            g = p.grad.detach()
            st = opt.state[p]
            m, v = st["exp_avg"], st["exp_avg_sq"]
            u = _update(m, v, bc1, bc2, eps)
            pm, pv = prev.get(i, (torch.zeros_like(m), torch.zeros_like(v)))
            count += 1
            for c in configs:
                mc_codec, vc_codec, ef = pcodecs[c][i]
                sm, sv = shadow[c].get(i, (torch.zeros_like(m), torch.zeros_like(v)))
                v2 = sv * beta2 + g * g * (1 - beta2)
                v1 = (round_trip(vc_codec, pv) if step > 1 else pv) * beta2 + g * g * (1 - beta2)
                if ef is None:
                    # the coded run: decoded state, this step's gradient, the update, then encode
                    m2 = sm * beta1 + g * (1 - beta1)
                    # one round trip of fp32's previous state: the error of a single step
                    m1 = (round_trip(mc_codec, pm) if step > 1 else pm) * beta1 + g * (1 - beta1)
                    new_m = round_trip(mc_codec, m2)
                else:
                    # error feedback: the residual of the last encode is added back before the
                    # average, m is encoded and the new residual encoded; the update reads the
                    # stored m (ef_update "m") or the stored m plus the stored residual ("sum")
                    ef_codec, reads = ef
                    se = ef_state[c].get(i, torch.zeros_like(m))
                    est = (sm + se) * beta1 + g * (1 - beta1)
                    new_m = round_trip(mc_codec, est)
                    se = round_trip(ef_codec, est - new_m)
                    ef_state[c][i] = se
                    m2 = new_m + se if reads == "sum" else new_m
                    # a single step: the same coding of fp32's own m, no residual carried
                    m1 = round_trip(mc_codec, m)
                    if reads == "sum":
                        m1 = m1 + round_trip(ef_codec, m - m1)
                uc = _update(m2, v2, bc1, bc2, eps)
                u1 = _update(m1, v1, bc1, bc2, eps)
                s = sums[c]
                un = u.norm().clamp_min(1e-30)
                s["ratio"] += float(uc.norm() / un)
                s["cos"] += _cos(uc, u)
                s["ratio1"] += float(u1.norm() / un)
                s["cos1"] += _cos(u1, u)
                s["m_gain"] += float((m2 * m).sum() / (m * m).sum().clamp_min(1e-30))
                s["m_err"] += float((m2 - m).norm() / m.norm().clamp_min(1e-30))
                pos = v > 0
                s["isqrt"] += float((v[pos] / v2[pos].clamp_min(1e-38)).sqrt().mean() - 1)
                s["v_gain"] += float(v2.mean() / v.mean().clamp_min(1e-38) - 1)
                shadow[c][i] = (new_m, round_trip(vc_codec, v2))
            prev[i] = (m.clone(), v.clone())
        for c in configs:
            out[c].append({k: val / max(1, count) for k, val in sums[c].items()})
    return out


def summarize(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Means over steps (step 1 left out: no state was coded yet) plus ``drift``."""
    rows = per_step[1:] or per_step
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in STAT_KEYS}
    fifth = max(1, len(rows) // 5)
    first = sum(r["ratio"] for r in rows[:fifth]) / fifth
    last = sum(r["ratio"] for r in rows[-fifth:]) / fifth
    mean["drift"] = last - first
    return mean


def main(argv: Sequence[str] | None = None) -> int:
    """Run fp32 AdamW with coded shadow moments and print the table of update statistics."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="training steps")
    ap.add_argument("--codecs", default="q8,q4,q3,q2",
                    help="comma-separated codec names, each optionally with +KEY=VALUE parameters of "
                         "m's codec, +m=NAME or +ef=NAME (error feedback on m, the residual stored "
                         "with NAME) (tools.bench.moments.moment_codec_pair)")
    ap.add_argument("--roundings", default="policy,nearest,stochastic",
                    help="comma-separated roundings, each tried with every codec; policy: the "
                         "rounding the trainer's policy gives each moment (tierstore.codecs.policy)")
    ap.add_argument("--parts", default="mv",
                    help="comma-separated: mv (both moments coded), m or v (only that one)")
    ap.add_argument("--hidden", type=int, default=128, help="model width")
    ap.add_argument("--layers", type=int, default=4, help="model depth")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq", type=int, default=128, help="bytes per sequence")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights and data order")
    ap.add_argument("--beta2", type=float, default=0.95,
                    help="AdamW beta2 (bench_convergence's 0.95; the trainer defaults to 0.999)")
    ap.add_argument("--v-target", choices=("log2", "value", "rsqrt"), default="log2",
                    help="ablation: what v's stochastic rounding is unbiased in (the codecs: log2)")
    args = ap.parse_args(argv)
    # NAME+PARAMS with each rounding and part: NAME:ROUNDING[:PART]+PARAMS
    configs = [c.partition("+")[0] + ("" if r == "policy" and part == "mv" else
                                      ":" + ("" if r == "policy" else r))
               + ("" if part == "mv" else f":{part}")
               + "".join(c.partition("+")[1:])
               for c in args.codecs.split(",") if c for r in args.roundings.split(",") if r
               for part in args.parts.split(",") if part]
    for c in configs:
        try:
            moment_codec_pair(c, (256, 256), with_ef=True)  # fail fast on a bad name or parameter
        except (ValueError, CodecError) as e:
            ap.error(str(e))
    if args.steps < 2:
        ap.error("--steps must be at least 2")
    params = sum(p.numel() for p in tiny_model(args.hidden, args.layers, args.seed).parameters())
    print(f"model: {params / 1e6:.2f}M params, {args.steps} steps, lr {args.lr}, beta2 {args.beta2}, "
          f"seed {args.seed}, v rounding unbiased in {args.v_target}")
    saved, quant.V_STOCHASTIC_TARGET = quant.V_STOCHASTIC_TARGET, args.v_target
    try:  # set before any kernel of this process is compiled (compiled ones keep their value)
        stats = collect(configs, args.steps, args.hidden, args.layers, args.batch, args.seq,
                        args.lr, args.seed, beta2=args.beta2)
    finally:
        quant.V_STOCHASTIC_TARGET = saved
    cols = ("ratio", "cos", "ratio1", "cos1", "m_gain", "m_err", "isqrt", "v_gain", "drift")
    width = max(18, *(len(c) for c in configs))
    print(f"{'codec':>{width}} " + " ".join(f"{k:>7}" for k in (*cols, "bits")))
    for c in configs:
        s = summarize(stats[c])
        print(f"{c:>{width}} " + " ".join(f"{s[k]:>7.4f}" for k in cols) + f" {request_bits(c):>7.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
