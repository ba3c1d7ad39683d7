"""Codec benchmark: compression ratio, error on real Adam moments, v zeroing, throughput.

Run ``python -m tools.bench_codecs [--steps N] [--chunk-mib M] [--repeats R]``. Moments come
from a short AdamW run of a tiny byte-level Llama (``tools.moments``); the parameters the
trainer's policy would quantize (2-D, >= 4096 elements) are concatenated into one m and one v.
Each quantized codec stores m signed and v unsigned, as the policy chooses; "q4 signed v" shows
what a signed map does to v. torchao's 8-bit and 4-bit optimizer states (block 128, its
AdamW8bit/AdamW4bit subclasses, eager) run side by side when torchao imports.

Columns: ratio = fp32 bytes / stored bytes (scales included) over m and v; m err, v err =
relative L2 error; v+ -> 0 = fraction of positive v decoded to zero; upd err = relative L2
error of Adam's update m / (sqrt(v) + 1e-8) from decoded states; GB/s = fp32 bytes of m and v
encoded and decoded per second (median of --repeats runs) on --chunk-mib chunks.

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
from tools.moments import captured_moments

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


def torchao_round_trip(bits: int, signed: bool,
                       block: int = 128) -> tuple[RoundTrip, Callable[[torch.Tensor], int]] | None:
    """torchao's optimizer-state quantization as (round trip, stored bytes), or None."""
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


def measure(name: str, m_rt: tuple[RoundTrip, Callable], v_rt: tuple[RoundTrip, Callable],
            m: torch.Tensor, v: torch.Tensor, chunk: int, repeats: int) -> dict[str, object]:
    """One table row for a (m codec, v codec) pair."""
    (rt_m, size_m), (rt_v, size_v) = m_rt, v_rt
    chunks_m, chunks_v = m.split(chunk), v.split(chunk)
    m2 = torch.cat([rt_m(c) for c in chunks_m])
    v2 = torch.cat([rt_v(c) for c in chunks_v])
    stored = sum(size_m(c) for c in chunks_m) + sum(size_v(c) for c in chunks_v)
    upd = m / (v.sqrt() + 1e-8)
    upd2 = m2 / (v2.clamp_min(0).sqrt() + 1e-8)

    def both() -> None:
        for c in chunks_m:
            rt_m(c)
        for c in chunks_v:
            rt_v(c)
    secs = median_seconds(both, repeats)
    return {
        "codec": name,
        "ratio": (m.nbytes + v.nbytes) / stored,
        "m err": rel_err(m2, m),
        "v err": rel_err(v2, v),
        "v+ -> 0": float(((v > 0) & (v2 <= 0)).sum()) / max(1, int((v > 0).sum())),
        "upd err": rel_err(upd2, upd),
        "GB/s": (m.nbytes + v.nbytes) / secs / 1e9,
    }


def print_table(rows: list[dict[str, object]]) -> None:
    """A plain-text table, one row per codec."""
    cols = list(rows[0])
    fmt = {"ratio": "{:.2f}", "m err": "{:.4f}", "v err": "{:.4f}", "v+ -> 0": "{:.4f}",
           "upd err": "{:.4f}", "GB/s": "{:.3f}"}
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
    m = torch.cat([a.reshape(-1) for a, _ in big])
    v = torch.cat([b.reshape(-1) for _, b in big])
    # tile to at least one chunk so throughput is measured on chunk-sized work
    chunk = max(1024, int(args.chunk_mib * 2**20 / 4))
    reps = max(1, -(-chunk // m.numel()))
    m, v = m.repeat(reps), v.repeat(reps)
    print(f"moments: {m.numel() // reps} values after {args.steps} AdamW steps "
          f"(tiled x{reps} to {m.numel()}), v > 0: {float((v > 0).float().mean()):.3f}, "
          f"chunk {chunk} values, kernels: {args.compile}, threads: {torch.get_num_threads()}, "
          f"keep-heap: {heap}")
    rows = []
    for name in ("raw", "zstd", "blosc"):
        c = codec_round_trip(codecs.get(name))
        rows.append(measure(name, c, c, m, v, chunk, args.repeats))
    for name in ("q8", "q4", "q3", "q2"):
        rows.append(measure(f"{name} (m signed, v unsigned)",
                            codec_round_trip(codecs.get(name, signed=True)),
                            codec_round_trip(codecs.get(name, signed=False)),
                            m, v, chunk, args.repeats))
    q4s = codec_round_trip(codecs.get("q4", signed=True))
    rows.append(measure("q4 signed v (ablation)", q4s, q4s, m, v, chunk, args.repeats))
    for bits in (8, 4):
        pair = (torchao_round_trip(bits, True), torchao_round_trip(bits, False))
        if pair[0] is None or pair[1] is None:
            print("torchao not installed")
            break
        rows.append(measure(f"torchao {bits}-bit (block 128)", pair[0], pair[1], m, v,
                            chunk, args.repeats))
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
