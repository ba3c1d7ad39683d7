"""Codec benchmark: compression ratio, error on real Adam moments, v zeroing, throughput.

Run ``python -m tools.bench.codecs [--steps N] [--chunk-mib M] [--repeats R]``. Moments come
from a short AdamW run of a tiny byte-level Llama (``tools.bench.moments``); the parameters the
trainer's policy would quantize (2-D, >= 4096 elements) are each encoded in their own shape, as
the store encodes a chunk. Each quantized codec stores m signed and v unsigned, as the policy
chooses; "q4 signed v" shows what a signed map does to v. torchao's 8-bit and 4-bit optimizer
states (block 128, its AdamW8bit/AdamW4bit subclasses; eager, and the 4-bit one also under
``torch.compile`` as its optimizers run it) run side by side when torchao imports.

Columns: ratio = fp32 bytes / stored bytes (scales included) over m and v; m err, v err =
relative L2 error over all captured tensors; v+ -> 0 = fraction of positive v decoded to zero;
upd err = relative L2 error of Adam's update m / (sqrt(v) + 1e-8) from decoded states; syn m,
syn v = relative L2 error on ``tools.bench.moments.synthetic_moments`` (heavy-tailed, many decades)
as a (rows, 256) matrix; GB/s = fp32 bytes of m and v encoded and decoded per second (median
of --repeats runs) on one --chunk-mib chunk each, the captured matrices tiled by rows.

Allocator note: glibc hands chunks over 32 MiB (and, after trimming, smaller ones) back to the
OS, so every new output tensor page-faults in again; in a VM that costs more than the codec
itself and varies 10x run to run. ``--keep-heap`` (default on) raises glibc's mmap and trim
thresholds with ``mallopt`` so the numbers measure the codecs, not the page faults; run with
``--no-keep-heap`` to see the difference.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from tierstore import codecs
from tierstore.codecs import quant
from tools.bench.moments import captured_moments, synthetic_moments

RoundTrip = Callable[[torch.Tensor], torch.Tensor]


def codec_round_trip(codec: codecs.Codec) -> tuple[RoundTrip, Callable[[torch.Tensor], int]]:
    """(decode∘encode, stored byte count) of a tierstore codec on one chunk."""
    def rt(x: torch.Tensor) -> torch.Tensor:
        data = codec.encode(x)
        mv = memoryview(data.numpy()) if isinstance(data, torch.Tensor) else memoryview(data)
        return codec.decode(mv, tuple(x.shape), x.dtype)

    def size(x: torch.Tensor) -> int:
        data = codec.encode(x)
        return data.numel() if isinstance(data, torch.Tensor) else len(data)
    return rt, size


def torchao_round_trip(bits: int, signed: bool, block: int = 128, compiled: bool = False
                       ) -> tuple[RoundTrip, Callable[[torch.Tensor], int]] | None:
    """torchao's optimizer-state quantization as (round trip, stored bytes), or None.

    ``compiled`` runs the whole round trip under ``torch.compile``, as torchao's optimizers do.
    """
    try:
        if bits == 4:
            from torchao.optim.subclass_4bit import OptimState4bit as State
        else:
            from torchao.optim.subclass_8bit import OptimState8bit as State
    except ImportError:
        return None

    def rt(x: torch.Tensor) -> torch.Tensor:
        # torchao needs whole blocks; pad with zeros, which move no absmax
        flat = x.reshape(-1)
        padded = torch.nn.functional.pad(flat, (0, (-flat.numel()) % block))
        st = State.zeros(padded.shape, signed=signed, block_size=block)
        st.copy_(padded)
        return st.dequantize()[: flat.numel()].view(x.shape)

    if compiled:
        # one graph per shape: torchao's tensor subclass does not take symbolic sizes
        rt = torch.compile(rt, dynamic=False)

    def size(x: torch.Tensor) -> int:
        return -(-x.numel() * bits // 8) + 4 * -(-x.numel() // block)
    return rt, size


def keep_heap() -> bool:
    """Ask glibc to keep freed memory mapped (see the allocator note); False if not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, (1 << 31) - 1))


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel_err(y: torch.Tensor, x: torch.Tensor) -> float:
    """Relative L2 error in float64."""
    return float((y.double() - x.double()).norm() / x.double().norm())


def _flat(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in xs])


def measure(name: str, m_rt: tuple[RoundTrip, Callable], v_rt: tuple[RoundTrip, Callable],
            ms: list[torch.Tensor], vs: list[torch.Tensor], synthetic: tuple[torch.Tensor, torch.Tensor],
            timing: tuple[torch.Tensor, torch.Tensor], repeats: int) -> dict[str, object]:
    """One table row for a (m codec, v codec) pair."""
    (rt_m, size_m), (rt_v, size_v) = m_rt, v_rt
    m, v = _flat(ms), _flat(vs)
    m2 = _flat([rt_m(x) for x in ms])
    v2 = _flat([rt_v(x) for x in vs])
    stored = sum(size_m(x) for x in ms) + sum(size_v(x) for x in vs)
    upd = m / (v.sqrt() + 1e-8)
    upd2 = m2 / (v2.clamp_min(0).sqrt() + 1e-8)
    sm, sv = synthetic
    tm, tv = timing

    def both() -> None:
        rt_m(tm)
        rt_v(tv)
    secs = median_seconds(both, repeats)
    return {
        "codec": name,
        "ratio": (m.nbytes + v.nbytes) / stored,
        "m err": rel_err(m2, m),
        "v err": rel_err(v2, v),
        "v+ -> 0": float(((v > 0) & (v2 <= 0)).sum()) / max(1, int((v > 0).sum())),
        "upd err": rel_err(upd2, upd),
        "syn m": rel_err(rt_m(sm), sm),
        "syn v": rel_err(rt_v(sv), sv),
        "GB/s": (tm.nbytes + tv.nbytes) / secs / 1e9,
    }


def print_table(rows: list[dict[str, object]]) -> None:
    """A plain-text table, one row per codec."""
    cols = list(rows[0])
    fmt = {"ratio": "{:.2f}", "m err": "{:.4f}", "v err": "{:.4f}", "v+ -> 0": "{:.4f}",
           "upd err": "{:.4f}", "syn m": "{:.4f}", "syn v": "{:.4f}", "GB/s": "{:.3f}"}
    cells = [[fmt.get(c, "{}").format(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)))


def main(argv: Sequence[str] | None = None) -> int:
    """Capture moments, measure every codec, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50, help="AdamW steps before capturing moments")
    ap.add_argument("--hidden", type=int, default=128, help="model width")
    ap.add_argument("--layers", type=int, default=2, help="model depth")
    ap.add_argument("--chunk-mib", type=float, default=16, help="chunk size in MiB of fp32")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per codec (median)")
    ap.add_argument("--keep-heap", action=argparse.BooleanOptionalAction, default=True,
                    help="keep freed memory mapped so timings exclude page faults")
    ap.add_argument("--compile", choices=["auto", "always", "never"], default="auto",
                    help="quantization kernels: inductor-compiled for big chunks (auto) or not")
    args = ap.parse_args(argv)
    quant.set_compile(args.compile)
    heap = keep_heap() if args.keep_heap else False
    torch.manual_seed(0)
    moments = captured_moments(steps=args.steps, hidden=args.hidden, layers=args.layers)
    big = [mv for mv in moments.values() if mv[0].dim() >= 2 and mv[0].numel() >= 4096]
    ms, vs = [a for a, _ in big], [b for _, b in big]
    synthetic = tuple(x.view(-1, 256) for x in synthetic_moments(1 << 18, seed=0))
    # timing chunks: the captured matrices' rows (all as wide as the model), tiled to one chunk
    width = args.hidden
    rows_m = torch.cat([a.reshape(-1, width) for a in ms])
    rows_v = torch.cat([b.reshape(-1, width) for b in vs])
    chunk_rows = max(1, int(args.chunk_mib * 2**20 / 4) // width)
    reps = -(-chunk_rows // rows_m.shape[0])
    timing = (rows_m.repeat(reps, 1)[:chunk_rows].contiguous(),
              rows_v.repeat(reps, 1)[:chunk_rows].contiguous())
    print(f"moments: {sum(a.numel() for a in ms)} values in {len(ms)} matrices after "
          f"{args.steps} AdamW steps, v > 0: {float((_flat(vs) > 0).float().mean()):.3f}; "
          f"timing chunk {tuple(timing[0].shape)}, kernels: {args.compile}, "
          f"threads: {torch.get_num_threads()}, keep-heap: {heap}")
    rows = []
    data = (ms, vs, synthetic, timing, args.repeats)
    for name in ("raw", "zstd", "blosc"):
        c = codec_round_trip(codecs.get(name))
        rows.append(measure(name, c, c, *data))
    for name in ("q8", "q4", "q3", "q2"):
        rows.append(measure(f"{name} (m signed, v unsigned)",
                            codec_round_trip(codecs.get(name, signed=True)),
                            codec_round_trip(codecs.get(name, signed=False)), *data))
    for name in ("q4", "q2"):  # as the trainer stores moments (codecs.policy)
        rows.append(measure(f"{name} stochastic rounding",
                            codec_round_trip(codecs.get(name, signed=True, rounding="stochastic")),
                            codec_round_trip(codecs.get(name, signed=False, rounding="stochastic")),
                            *data))
    q4s = codec_round_trip(codecs.get("q4", signed=True))
    rows.append(measure("q4 signed v (ablation)", q4s, q4s, *data))
    for bits, compiled in ((8, False), (4, False), (4, True)):
        pair = (torchao_round_trip(bits, True, compiled=compiled),
                torchao_round_trip(bits, False, compiled=compiled))
        if pair[0] is None or pair[1] is None:
            print("torchao not installed")
            break
        label = f"torchao {bits}-bit (block 128{', compiled' if compiled else ''})"
        rows.append(measure(label, pair[0], pair[1], *data))
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
