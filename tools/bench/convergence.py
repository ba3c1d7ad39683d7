"""Convergence benchmark: AdamW whose moments round-trip through a codec every step vs fp32.

Run ``python -m tools.bench.convergence [--steps N] [--seeds S] [--codecs q8,q4,q3,q2]``. A
byte-level Llama (transformers ``LlamaConfig``, about 1.1M parameters at the defaults) trains on
the Python standard library's sources with ``torch.optim.AdamW``; after every ``step()`` each
parameter's ``exp_avg`` and ``exp_avg_sq`` are replaced by ``decode(encode(.))`` with the codec
the trainer's policy picks for it (``tierstore.codecs.policy.choose_codec``: m signed, v
unsigned, stochastic rounding, except q4's m: subtractive dither on its own map; small and 1-D
tensors raw; ``q4:stochastic`` overrides the rounding), which is exactly "encode after the update, decode before the next".

Runs are paired: for each of ``--seeds`` seeds (initial weights and batch order) fp32 and every
codec train from the same start on the same batches. Reported per codec: the final training
loss (mean of the last 10% of steps) and the held-out loss on fixed batches from a text region
never trained on, each as the mean over seeds of the relative difference to the same seed's
fp32 run, with the smallest and largest of those differences. One seed is not enough: single
paired runs of the same codec differ by 1-3% from seed to seed at the defaults. Goals: within
1% for q8/q4, 3% for q3/q2.

Grid: ``--sizes 128x4,256x4,384x6,512x8`` (``HIDDENxLAYERS`` each: 1.1M, 4.3M, 14.4M and 33.8M
parameters) and ``--lrs 1e-3,3e-3`` run every cell with the same seeds and print one table per
cell, then the worst cell of each codec; ``--png FILE`` draws every cell's loss curves (the
mean over seeds, smoothed) of each codec against fp32 (needs matplotlib). ``--runs-jsonl FILE``
appends every finished run (its cell, seed, losses and curve) to FILE as it ends, and
``--from-jsonl FILE`` prints the tables (and ``--png``) of the runs in FILE without training:
a grid cut short, or split over several processes, still reports what finished.

The record: ``--runs-jsonl FILE`` also skips every run FILE already holds (same codec specs,
size, lr, seed, steps, batch; ``tools.bench.convergence_runs``), so a grid grows run by run across
invocations. ``--grid`` is the standing one, recorded in ``docs/convergence/runs.jsonl``:
1.1M, 4.33M and 14.4M params x lr 1e-3, 3e-3 x seeds 0, 1 x fp32, q8, q4 (as the policy
codes them), 300 steps, smallest first; ``--max-minutes M`` starts no run that would end after M minutes (by the time the same
size and codec took before). ``--from-jsonl docs/convergence/runs.jsonl --markdown
docs/convergence/README.md --png docs/convergence_grid.png`` regenerates the table and the
curves from the record.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch

from tierstore.errors import CodecError
from tools.bench import convergence_runs
from tools.bench.moments import byte_batches, lm_loss, moment_codec_pair, stdlib_bytes, tiny_model


def round_trip_states(opt: torch.optim.Optimizer, requested: str) -> tuple[int, int]:
    """Replace every AdamW moment by its codec round trip; (quantized, total) element counts.

    ``requested`` is a codec request in ``tools.bench.moments.moment_codec_pair``'s grammar: a codec
    name, optionally with a rounding suffix (``"q2:stochastic"``, or m's and v's apart:
    ``"q4:calibrated/stochastic"``) and parameters of m's codec (``"q4+signed_map=de"``).
    """
    quantized = total = 0
    pairs = _PAIRS.setdefault(requested, {})
    for st in opt.state.values():
        m = st["exp_avg"]
        shape = tuple(m.shape)
        if shape not in pairs:
            pairs[shape] = moment_codec_pair(requested, shape)
        pair = pairs[shape]
        total += 2 * m.numel()
        if pair is None:
            continue
        for role, codec in zip(("exp_avg", "exp_avg_sq"), pair, strict=True):
            t = st[role]
            if codec.lossless:
                continue
            data = codec.encode(t)
            t.copy_(codec.decode(memoryview(data.numpy()), shape, t.dtype))
            quantized += t.numel()
    return quantized, total


#: requested codec -> shape -> (m codec, v codec): resolved once, not per step
_PAIRS: dict[str, dict[tuple[int, ...], Any]] = {}


def train(requested: str | None, steps: int, hidden: int, layers: int, batch: int, seq: int,
          lr: float, seed: int) -> dict[str, Any]:
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
    losses: list[float] = []
    share = (0, 1)
    t0, c0 = time.perf_counter(), time.process_time()
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
            "quantized": share[0] / share[1], "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0,
            "curve": losses}


def _gap(run: dict[str, Any], base: dict[str, Any], key: str) -> float:
    return (run[key] - base[key]) / base[key]


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``"128x4,256x4"`` -> [(128, 4), (256, 4)]; ValueError naming a bad entry."""
    out = []
    for item in text.split(","):
        hidden, sep, layers = item.strip().partition("x")
        if not (sep and hidden.isdigit() and layers.isdigit() and int(hidden) > 0 and int(layers) > 0):
            raise ValueError(f"size {item!r} is not HIDDENxLAYERS, e.g. 256x4")
        out.append((int(hidden), int(layers)))
    return out


def gap_table(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, tuple[float, float, float, int]]]:
    """codec -> key -> (mean gap, min gap, max gap, index of the worst seed) against fp32.

    Runs pair with the fp32 run of the same ``seed`` (by position when they carry none).
    """
    base = {r.get("seed", i): r for i, r in enumerate(runs["fp32"])}
    out: dict[str, dict[str, tuple[float, float, float, int]]] = {}
    for name, rs in runs.items():
        for key in ("train", "held-out"):
            gaps = [_gap(r, base[r.get("seed", i)], key) for i, r in enumerate(rs)]
            worst = max(range(len(gaps)), key=lambda i: abs(gaps[i]))
            out.setdefault(name, {})[key] = (sum(gaps) / len(gaps), min(gaps), max(gaps), worst)
    return out


def print_cell(runs: dict[str, list[dict[str, Any]]]) -> None:
    """One table: per codec, mean losses and the mean (min..max) paired gap to fp32."""
    table = gap_table(runs)
    print(f"{'codec':>12} {'quantized':>9} {'train':>7} {'vs fp32 (min..max)':>24} "
          f"{'held-out':>8} {'vs fp32 (min..max)':>24}")
    for name, rs in runs.items():
        row = [f"{name:>12} {rs[0]['quantized']:>9.3f}"]
        for key in ("train", "held-out"):
            mean, lo, hi, _ = table[name][key]
            mean_loss = sum(r[key] for r in rs) / len(rs)
            spread = f"{mean:+.2%} ({lo:+.2%}..{hi:+.2%})"
            row.append(f"{mean_loss:>{7 if key == 'train' else 8}.4f} {spread:>24}")
        print(" ".join(row))


def _smooth(xs: list[float], width: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= width:
            acc -= xs[i - width]
        out.append(acc / min(i + 1, width))
    return out


def plot_grid(cells: dict[tuple[str, float], dict[str, list[dict[str, Any]]]], path: str) -> None:
    """Loss curves (mean over seeds, smoothed) of every codec vs fp32, one panel per cell."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--png needs matplotlib, which does not import: {e}") from e
    sizes = list(dict.fromkeys(k[0] for k in cells))
    lrs = list(dict.fromkeys(k[1] for k in cells))
    fig, axes = plt.subplots(len(sizes), len(lrs), figsize=(5 * len(lrs), 3.2 * len(sizes)),
                             squeeze=False)
    for (size, lr), runs in cells.items():
        ax = axes[sizes.index(size)][lrs.index(lr)]
        for name, rs in runs.items():
            n = len(rs[0]["curve"])
            mean = [sum(r["curve"][i] for r in rs) / len(rs) for i in range(n)]
            ax.plot(_smooth(mean, max(1, n // 30)), label=name,
                    lw=2.0 if name == "fp32" else 1.0, color="black" if name == "fp32" else None)
        ax.set_title(f"{size}, lr {lr:g}, {len(next(iter(runs.values())))} seeds", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.set_ylim(top=min(3.5, ax.get_ylim()[1]))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


def cells_from_jsonl(path: str) -> dict[tuple[str, float], dict[str, list[dict[str, Any]]]]:
    """The grid cells of the runs in a ``--runs-jsonl`` file; seeds without an fp32 run are dropped."""
    by_seed: dict[tuple[str, float], dict[int, dict[str, dict[str, Any]]]] = {}
    records = convergence_runs.load(path)
    for r, name in zip(records, convergence_runs.labels(records), strict=True):
        by_seed.setdefault((r["size"], r["lr"]), {}).setdefault(r["seed"], {})[name] = r
    cells: dict[tuple[str, float], dict[str, list[dict[str, Any]]]] = {}
    for key, seeds in by_seed.items():
        paired = {s: rs for s, rs in sorted(seeds.items()) if "fp32" in rs}
        names = list(dict.fromkeys(c for rs in paired.values() for c in rs))
        # a codec is reported over the seeds where it ran, against the same seeds' fp32
        for name in names:
            for rs in paired.values():
                if name in rs:
                    cell = cells.setdefault(key, {})
                    cell.setdefault(name, []).append(rs[name])
    return cells


def report(cells: dict[tuple[str, float], dict[str, list[dict[str, Any]]]], first_seed: int) -> None:
    """The worst cell of each codec over the grid, with its worst seed."""
    names = list(dict.fromkeys(n for runs in cells.values() for n in runs if n != "fp32"))
    print("worst cell per codec (mean gap over seeds; worst seed's gap):")
    for name in names:
        for key in ("train", "held-out"):
            (label, lr), (mean, lo, hi, worst) = max(
                ((k, gap_table(r)[name][key]) for k, r in cells.items() if name in r),
                key=lambda kv: abs(kv[1][0]))
            w = lo if abs(lo) > abs(hi) else hi
            seeds = cells[(label, lr)][name]
            print(f"  {name:>12} {key:>8}: {mean:+.2%} at {label}, lr {lr:g} ({len(seeds)} seeds); "
                  f"worst seed {seeds[worst].get('seed', first_seed + worst)} {w:+.2%}")


#: the grid of ``--grid``: sizes (1.1M, 4.33M, 14.4M params) x learning rates x seeds x runs
GRID_SIZES = "128x4,256x4,384x6"
GRID_LRS = "1e-3,3e-3"
GRID_SEEDS = 2
GRID_CODECS = "q8,q4"
GRID_STEPS = 300
DEFAULT_CODECS = "q8,q4,q3,q2,q4:nearest,q2:nearest"


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps per run")
    ap.add_argument("--codecs", default=None,
                    help=f"default {DEFAULT_CODECS} ({GRID_CODECS} with --grid): "
                         "comma-separated codec requests, each NAME[:ROUNDING][+KEY=VALUE...] "
                         "(tools.bench.moments.moment_codec_pair)")
    ap.add_argument("--seeds", type=int, default=3,
                    help="paired seeds (weights and data order) per codec; gaps are averaged")
    ap.add_argument("--hidden", type=int, default=128, help="model width (without --sizes)")
    ap.add_argument("--layers", type=int, default=4, help="model depth (without --sizes)")
    ap.add_argument("--sizes", default=None,
                    help="comma-separated HIDDENxLAYERS model sizes of the grid, e.g. 128x4,256x4")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq", type=int, default=128, help="bytes per sequence")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (without --lrs)")
    ap.add_argument("--lrs", default=None, help="comma-separated peak learning rates of the grid")
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--grid", action="store_true",
                    help=f"the standing grid: sizes {GRID_SIZES}, lrs {GRID_LRS}, {GRID_SEEDS} "
                         f"seeds, fp32 and --codecs (default {GRID_CODECS}), {GRID_STEPS} steps, "
                         "smallest first, "
                         f"recorded in {convergence_runs.DEFAULT_PATH} (or --runs-jsonl)")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="start no run that would end (by the last run of its size and codec in "
                         "the record) more than this many minutes after the start")
    ap.add_argument("--png", default=None, help="write the loss curves of every cell to this PNG")
    ap.add_argument("--runs-jsonl", default=None,
                    help="append every finished run to this file, and skip the runs it already "
                         "holds (tools.bench.convergence_runs)")
    ap.add_argument("--skip-fp32", action="store_true",
                    help="with --runs-jsonl: run only the codecs (the fp32 runs come from another "
                         "process writing the same file; fp32 runs are deterministic per seed)")
    ap.add_argument("--from-jsonl", default=None,
                    help="report (and plot) the runs of a --runs-jsonl file instead of training")
    ap.add_argument("--markdown", default=None,
                    help="with --from-jsonl: write the table of its --steps runs to this file")
    args = ap.parse_args(argv)
    if args.grid:
        args.sizes, args.lrs, args.seeds = GRID_SIZES, GRID_LRS, GRID_SEEDS
        args.codecs, args.steps = args.codecs or GRID_CODECS, GRID_STEPS
        args.runs_jsonl = args.runs_jsonl or convergence_runs.DEFAULT_PATH
    args.codecs = args.codecs or DEFAULT_CODECS
    if args.skip_fp32 and not args.runs_jsonl:
        ap.error("--skip-fp32 needs --runs-jsonl: the gaps are reported from the file")
    if args.markdown and not args.from_jsonl:
        ap.error("--markdown needs --from-jsonl: the table is made from a record")
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    try:
        args.size_list = parse_sizes(args.sizes) if args.sizes else [(args.hidden, args.layers)]
        args.lr_list = [float(x) for x in args.lrs.split(",")] if args.lrs else [args.lr]
        args.names = [c for c in args.codecs.split(",") if c]
        for c in args.names:
            convergence_runs.codec_specs(c)  # fail fast on a bad request
    except (ValueError, CodecError) as e:
        ap.error(str(e))
    return args


def report_jsonl(args: argparse.Namespace) -> int:
    """Print (and plot, and write as markdown) the runs of a record without training."""
    cells = cells_from_jsonl(args.from_jsonl)
    for (label, lr), runs in cells.items():
        seeds = {n: [r["seed"] for r in rs] for n, rs in runs.items()}
        print(f"model: {label}, lr {lr:g}, seeds per run: {seeds}")
        print_cell(runs)
    report(cells, args.seed)
    if args.png:
        plot_grid(cells, args.png)
    if args.markdown:
        records = convergence_runs.load(args.from_jsonl)
        table = convergence_runs.markdown(records, args.steps)
        with open(args.markdown, "w") as f:
            f.write(MARKDOWN_HEAD.format(steps=args.steps, record=args.from_jsonl) + table)
        print(f"wrote {args.markdown}")
    return 0


MARKDOWN_HEAD = """# Convergence record

Generated from `{record}` by `python -m tools.bench.convergence --from-jsonl {record}
--markdown docs/convergence/README.md --png docs/convergence_grid.png` (do not edit by hand).
Every row: runs of {steps} steps of `tools.bench.convergence` (byte-level Llama, AdamW betas
(0.9, 0.95), weight decay 0.1, clipping 1.0, 5% warm-up, batch 8x128 bytes); `vs fp32` is the
mean over seeds of the gap to the same seed's fp32 run, from three seeds on ± the standard
error of that mean (sample standard deviation of the gaps over the square root of their count,
in percentage points), and (min..max over seeds); CPU seconds of one run on the machine each
line of the record names (its torch threads included). Codec specs, commits and loss curves
are in the record.

![loss curves](../convergence_grid.png)

"""


def main(argv: Sequence[str] | None = None) -> int:
    """Train fp32 and one run per codec for each seed (and grid cell); print the paired gaps."""
    args = _args(argv)
    if args.from_jsonl:
        return report_jsonl(args)
    records = convergence_runs.load(args.runs_jsonl) if args.runs_jsonl else []
    by_key = {convergence_runs.run_key(r): r for r in records}
    start = time.perf_counter()
    commit = convergence_runs.source_commit()  # the code this process imported, not later edits
    cells: dict[tuple[str, float], dict[str, list[dict[str, Any]]]] = {}
    for hidden, layers in args.size_list:
        params = sum(p.numel() for p in tiny_model(hidden, layers, args.seed).parameters())
        label = f"{params / 1e6:.2f}M ({hidden}x{layers})"
        for lr in args.lr_list:
            print(f"model: {params / 1e6:.2f}M params ({hidden}x{layers}), {args.steps} steps, "
                  f"batch {args.batch}x{args.seq} bytes, lr {lr}, "
                  f"seeds {args.seed}..{args.seed + args.seeds - 1}", flush=True)
            runs: dict[str, list[dict[str, Any]]] = {}
            for seed in range(args.seed, args.seed + args.seeds):
                for c in args.names if args.skip_fp32 else [None, *args.names]:
                    codec = c or "fp32"
                    head = {"codec": codec, "codec_specs": convergence_runs.codec_specs(c),
                            "hidden": hidden, "layers": layers, "lr": lr, "seed": seed,
                            "steps": args.steps, "batch": args.batch, "seq": args.seq}
                    key = convergence_runs.run_key(head)
                    if key in by_key:
                        r = by_key[key]
                        print(f"  seed {seed} {codec}: in {args.runs_jsonl} ({r.get('commit')})")
                    else:
                        if args.max_minutes is not None:
                            guess = convergence_runs.estimate_seconds(records, hidden, layers,
                                                                      codec, args.steps) or 0.0
                            if time.perf_counter() - start + guess > args.max_minutes * 60:
                                print(f"--max-minutes {args.max_minutes:g}: stopping before "
                                      f"seed {seed} {codec} at {label}, lr {lr:g}", flush=True)
                                return _finish(args, cells)
                        r = train(c, args.steps, hidden, layers, args.batch, args.seq, lr, seed)
                        r.update(head, size=label, params=params,
                                 commit=commit,
                                 machine=convergence_runs.machine(),
                                 curve=convergence_runs.rounded_curve(r["curve"]))
                        if args.runs_jsonl:
                            convergence_runs.append(args.runs_jsonl, r)
                            records.append(r)
                            by_key[key] = r
                        print(f"  seed {seed} {codec}: train {r['train']:.4f}, held-out "
                              f"{r['held-out']:.4f} ({r['seconds']:.0f}s, "
                              f"{r['cpu_seconds']:.0f} CPU s)", flush=True)
                    runs.setdefault(codec, []).append(r)
            if not args.skip_fp32:
                print_cell(runs)
                cells[(label, lr)] = runs
    return _finish(args, cells)


def _finish(args: argparse.Namespace, cells: dict[tuple[str, float], dict[str, list[dict[str, Any]]]]
            ) -> int:
    if len(cells) > 1:
        report(cells, args.seed)
    if args.png and cells:
        plot_grid(cells, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
