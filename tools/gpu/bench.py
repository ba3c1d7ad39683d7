"""The GPU check's benchmark: copies, and the streaming trainer against plain PyTorch, time-boxed.

    python -m tools.gpu.bench [--device cuda|cpu] [--out DIR] [--budget-s 400] [--stages copy,...]

Stages, each in its own process with its own timeout (so a slow or hung stage costs only its
share of the budget, and peak VRAM / RSS are per stage), results written after every stage and
every measured step (``gpu_bench.json``, ``gpu_bench.txt``, each stage's log in ``gpu_bench.log``):

- ``env``: torch, CUDA device, CPU count, RAM;
- ``copy``: the store's H2D (``get(device=)`` from the RAM tier) and D2H (``put`` of a device
  tensor) GB/s against a raw copy from/to pinned memory and from pageable memory;
- ``plain_1b``: plain PyTorch training (bf16 autocast, fp32 weights, fused AdamW) of a ~1B
  Llama-style model with random weights, fully on the GPU;
- ``stream_1b``: the streaming trainer on the same model and batch with a window that holds it;
- ``stream_7b``: the streaming trainer at 7B with a window smaller than the model, q4 moments.

Figures: tokens/s (padded tokens included), TFLOPS as 6 x N x tokens/s (MegaTrain's count) and
as executed work (8N per token plus attention, 12 L h s, or 16 L h s with the recompute of the
streaming engine's layer checkpointing), stall share (store stall / step time), peak VRAM, peak
host RSS and RSS per parameter. ``--device cpu`` runs everything at tiny sizes (the dry run the
test suite does); CUDA is never needed for that.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

STAGES = ("env", "copy", "plain_1b", "stream_1b", "stream_7b")
#: each stage's share of the budget (the rest of the budget carries over to later stages)
SHARE = {"env": 0.04, "copy": 0.12, "plain_1b": 0.16, "stream_1b": 0.26, "stream_7b": 0.42}
_GIB = 1 << 30

MODELS = {
    # TinyLlama-1.1B's shape with a 32k vocabulary (1.1B parameters), and Llama-2-7B's (6.7B)
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
}

SIZES = {
    "cuda": {"copy_tensor": 256 << 20, "copy_count": 8, "batch": 8, "seq": 2048, "steps": 3,
             "batch_7b": 8, "seq_7b": 2048, "steps_7b": 2, "vram_7b": 16 * _GIB, "ram_7b": 64 * _GIB,
             "ram_1b": 48 * _GIB, "model_1b": "1b", "model_7b": "7b"},
    "cpu": {"copy_tensor": 1 << 20, "copy_count": 4, "batch": 2, "seq": 32, "steps": 1,
            "batch_7b": 2, "seq_7b": 32, "steps_7b": 1, "vram_7b": None, "ram_7b": 64 << 20,
            "ram_1b": 64 << 20, "model_1b": "tiny", "model_7b": "tiny"},
}


# ------------------------------------------------------------------------------ measurements

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _memory(device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"peak_rss_gib": peak_rss_bytes() / _GIB}
    if device.type == "cuda":
        out["peak_vram_gib"] = torch.cuda.max_memory_allocated(device) / _GIB
        out["peak_vram_reserved_gib"] = torch.cuda.max_memory_reserved(device) / _GIB
    return out


def llama_config(name: str, seq: int) -> Any:
    """A Llama-style config of one of ``MODELS`` (random weights are drawn later)."""
    from transformers import LlamaConfig

    return LlamaConfig(**MODELS[name], max_position_embeddings=max(seq, 64), bos_token_id=0, eos_token_id=1,
                       tie_word_embeddings=False)


def n_params(config: Any) -> int:
    """Parameters of a Llama config, counted as the model does (no tied weights)."""
    h, i, n, v = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    kv = h * config.num_key_value_heads // config.num_attention_heads
    layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return n * layer + 2 * v * h + h


def flops_per_token(config: Any, seq: int, recompute: bool) -> tuple[float, float]:
    """(6N, executed): executed adds attention (12 L h s) and the recompute (2N + 4 L h s)."""
    n = n_params(config)
    attn = 12 * config.num_hidden_layers * config.hidden_size * seq
    if recompute:
        return 6.0 * n, 8.0 * n + attn * 4 / 3
    return 6.0 * n, 6.0 * n + attn


def random_batches(vocab: int, batch: int, seq: int, count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of uniform random token ids, no padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(2, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


def _rates(step_s: list[float], tokens: int, fpt: tuple[float, float]) -> dict[str, Any]:
    mean = sum(step_s) / len(step_s) if step_s else float("nan")
    tps = tokens / mean if step_s else float("nan")
    return {"step_s": step_s, "mean_step_s": mean, "tokens_per_s": tps,
            "tflops_6n": fpt[0] * tps / 1e12, "tflops_executed": fpt[1] * tps / 1e12}


# ------------------------------------------------------------------------------ stages

def stage_env(device: torch.device, sizes: dict[str, Any], work: str, report: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Versions and the machine."""
    import platform

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count(),
                           "ram_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / _GIB}
    from importlib import metadata

    for pkg in ("transformers", "numpy", "zarr", "numcodecs", "lmdb", "crc32c"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "missing"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out.update(gpu=p.name, vram_gib=p.total_memory / _GIB, capability=f"{p.major}.{p.minor}",
                   cuda=torch.version.cuda, bf16=torch.cuda.is_bf16_supported())
    return out


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def stage_copy(device: torch.device, sizes: dict[str, Any], work: str, report: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Store H2D/D2H GB/s against raw pinned and pageable copies."""
    import tierstore

    n, count = sizes["copy_tensor"], sizes["copy_count"]
    total = n * count
    out: dict[str, Any] = {"tensor_bytes": n, "tensors": count}
    cuda = device.type == "cuda"
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    for pin in ((True, False) if cuda else (False,)):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=pin).fill_(1)
        dev.copy_(host, non_blocking=pin)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(count):
            dev.copy_(host, non_blocking=pin)
        _sync(device)
        h2d = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(count):
            host.copy_(dev, non_blocking=pin)
        _sync(device)
        d2h = time.perf_counter() - t0
        kind = "pinned" if pin else "pageable"
        out[f"raw_{kind}_h2d_gbps"], out[f"raw_{kind}_d2h_gbps"] = _gbps(total, h2d), _gbps(total, d2h)
        del host
    report(out)
    del dev
    # The store: every get a window miss (the window holds two tensors), served from the RAM tier.
    with tierstore.open(os.path.join(work, "copy_store"), mode="w", ram_budget=4 * total + (256 << 20),
                        device_budget=2 * n + (1 << 20), device=str(device)) as s:
        xs = [torch.randn(n // 4) for _ in range(count)]
        for i, x in enumerate(xs):
            s.put(f"x{i}", x)
        del xs
        t = s.get("x0", device=device)  # warm-up
        del t
        _sync(device)
        t0 = time.perf_counter()
        for i in range(1, count):
            t = s.get(f"x{i}", device=device)
            del t
        _sync(device)
        out["store_h2d_gbps"] = _gbps((count - 1) * n, time.perf_counter() - t0)
        src = torch.randn(n // 4, device=device)
        s.put("d0", src)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        for i in range(1, count):
            s.put(f"d{i}", src)
        out["store_d2h_gbps"] = _gbps((count - 1) * n, time.perf_counter() - t0)
        st = s.stats()
        pool = s.async_store._window.staging
        out["staging"] = None if pool is None else {"buffers": pool.count, "buffer_bytes": pool.buffer_bytes,
                                                    "pinned": pool.pinned, "acquired": pool.acquired,
                                                    "waits": pool.waits}
        out["store_peak_host_bytes"] = st["peak_host_bytes"]
        out["store_peak_device_bytes"] = st["peak_device_bytes"]
    out.update(_memory(device))
    return out


def stage_plain_1b(device: torch.device, sizes: dict[str, Any], work: str, report: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Plain PyTorch: the whole model, bf16 autocast, fp32 fused AdamW, on one device."""
    from transformers import AutoModelForCausalLM

    batch, seq, steps = sizes["batch"], sizes["seq"], sizes["steps"]
    config = llama_config(sizes["model_1b"], seq)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).float()  # fp32 master weights, as the trainer keeps
    model.to(device)  # in case from_config ignored the default device
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=device.type == "cuda")
    fpt = flops_per_token(config, seq, recompute=False)
    out: dict[str, Any] = {"params": n_params(config), "batch": batch, "seq": seq, "losses": []}
    times: list[float] = []
    for j, b in enumerate(random_batches(config.vocab_size, batch, seq, steps + 1)):
        b = {k: v.to(device) for k, v in b.items()}
        _sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        out["losses"].append(float(loss.detach()))
        if j > 0:  # the first step is a warm-up
            times.append(time.perf_counter() - t0)
            out.update(_rates(times, batch * seq, fpt), **_memory(device))
            report(out)
    return out


STORE_STATS = ("peak_host_bytes", "peak_device_bytes", "bytes_h2d", "bytes_d2h", "bytes_written_disk",
               "bytes_read_disk", "stall_s")


def _stream(device: torch.device, name: str, batch: int, seq: int, steps: int, vram: int | None, ram: int,
            compression: bool | str, work: str, report: Callable[[dict[str, Any]], None],
            sizes_fast_exit: bool = False) -> dict[str, Any]:
    """The streaming trainer on a Llama-style model with random weights put straight into its store."""
    import trainer as mt
    from trainer import model as model_mod
    from trainer.session import open_store

    config = llama_config(name, seq)
    params = n_params(config)
    folder = os.path.join(work, f"stream_{name}")
    mt.init(offload_dir=os.path.join(folder, "store"), max_vram_gb=f"{vram}B" if vram else None,
            max_ram_gb=f"{ram}B", optimizer_compression=compression, device=str(device))
    out: dict[str, Any] = {"params": params, "batch": batch, "seq": seq, "window_bytes": vram,
                           "ram_budget": ram, "fp32_weight_bytes": 4 * params, "moments": str(compression)}
    t0 = time.perf_counter()
    model = model_mod.skeleton_for(config)
    store = open_store(os.path.join(folder, "store"), mode="w")
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                w = torch.ones(p.shape, device=device)
            else:  # drawn on the device: 7B of randn on the host would take minutes
                w = torch.randn(p.shape, device=device, generator=g).mul_(0.02)
            store.put(pname, w, codec="raw")
            del w
    model._trainer_store = store
    out["init_s"] = time.perf_counter() - t0
    report(out)
    fpt = flops_per_token(config, seq, recompute=True)
    dataset = [{"input_ids": b["input_ids"][r]} for b in random_batches(config.vocab_size, batch, seq, steps + 1)
               for r in range(batch)]
    args = mt.TrainingArguments(output_dir=folder, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                                learning_rate=1e-4, weight_decay=0.01, max_steps=steps + 1, logging_steps=1,
                                save_steps=0, max_grad_norm=0.0, bf16=True, disable_tqdm=True)

    def on_log(history: list[dict[str, Any]]) -> None:
        steps_logged = [e for e in history if "step_s" in e]  # not the run's closing summary entry
        timed = steps_logged[1:]  # the first step is a warm-up
        out["losses"] = [e.get("loss") for e in steps_logged]
        if not timed:
            return
        step_s = [float(e["step_s"]) for e in timed]
        stall = sum(float(e.get("stall_s", 0.0)) for e in timed)
        out.update(_rates(step_s, batch * seq, fpt), stall_share=stall / sum(step_s),
                   optimizer_s=[e.get("optimizer_s") for e in timed],
                   optimizer_math_s=[e.get("optimizer_math_s") for e in timed], **_memory(device))
        out["rss_bytes_per_param"] = peak_rss_bytes() / params
        report(out)

    class ReportingTrainer(mt.Trainer):
        def _log(self, *a: Any, **k: Any) -> None:  # the trainer's per-step log: report as we go
            super()._log(*a, **k)
            on_log(self.state.log_history)
            if sizes_fast_exit and sum("step_s" in e for e in self.state.log_history) >= steps + 1:
                # the figures are in; the final checkpoint (an fsync of every weight and moment,
                # tens of GB at 7B) is not what this stage measures: skip it, device time is short
                st = self.store.stats()
                out["store"] = {k: st.get(k) for k in STORE_STATS}
                out["exit"] = "after the last step, without the final commit"
                report(out)
                os._exit(0)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tr = ReportingTrainer(model=model, train_dataset=dataset, args=args)
    try:
        tr.train()
        on_log(tr.state.log_history)
        st = tr.store.stats()
        out["store"] = {k: st.get(k) for k in STORE_STATS}
    finally:
        tr.close()
    out.update(_memory(device))
    out["rss_bytes_per_param"] = peak_rss_bytes() / params
    return out


def stage_stream_1b(device: torch.device, sizes: dict[str, Any], work: str, report: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The streaming trainer at 1B, the whole model fitting the window (vs plain_1b)."""
    return _stream(device, sizes["model_1b"], sizes["batch"], sizes["seq"], sizes["steps"], None, sizes["ram_1b"],
                   False, work, report, bool(sizes.get("fast_exit")))


def stage_stream_7b(device: torch.device, sizes: dict[str, Any], work: str, report: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The streaming trainer at 7B with a window smaller than the model and q4 moments."""
    vram = sizes["vram_7b"]
    if vram is None:  # the dry run: a window of about two layers of the tiny model
        cfg = llama_config(sizes["model_7b"], sizes["seq_7b"])
        vram = 4 * n_params(cfg) // 2
    return _stream(device, sizes["model_7b"], sizes["batch_7b"], sizes["seq_7b"], sizes["steps_7b"], vram,
                   sizes["ram_7b"], True, work, report, bool(sizes.get("fast_exit")))


def stage_hang(device: torch.device, sizes: dict[str, Any], work: str, report: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Reports, then never ends: the test of the time box (not in the default stages)."""
    report({"started": True})
    while True:
        time.sleep(1)


SHARE["hang"] = 0.1
STAGE_FNS = {"hang": stage_hang, "env": stage_env, "copy": stage_copy, "plain_1b": stage_plain_1b, "stream_1b": stage_stream_1b,
             "stream_7b": stage_stream_7b}


# ------------------------------------------------------------------------------ driver

def _write_json(path: str, data: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)  # a reader (or a kill) never sees half a file


def _fmt(v: Any, spec: str = ".1f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def summary(results: dict[str, Any]) -> str:
    """A short text summary of the JSON results."""
    lines = []
    env = results.get("env", {}).get("result", {})
    lines.append(f"device: {env.get('gpu', 'cpu')}  torch {env.get('torch')}  transformers {env.get('transformers')}")
    for name in [n for n in STAGE_FNS if n != "env"]:
        st = results.get(name)
        if st is None:
            continue
        r = st.get("result", {})
        head = f"{name}: {st.get('status')} ({_fmt(st.get('wall_s'))} s)"
        if name == "copy":
            lines.append(f"{head}  H2D store {_fmt(r.get('store_h2d_gbps'))} vs raw pinned "
                         f"{_fmt(r.get('raw_pinned_h2d_gbps'))} / pageable {_fmt(r.get('raw_pageable_h2d_gbps'))} GB/s; "
                         f"D2H store {_fmt(r.get('store_d2h_gbps'))} vs raw pinned {_fmt(r.get('raw_pinned_d2h_gbps'))} / "
                         f"pageable {_fmt(r.get('raw_pageable_d2h_gbps'))} GB/s")
        else:
            lines.append(f"{head}  N={_fmt(r.get('params', 0) / 1e9, '.2f')}B  tok/s {_fmt(r.get('tokens_per_s'), '.0f')}  "
                         f"TFLOPS 6N {_fmt(r.get('tflops_6n'))} executed {_fmt(r.get('tflops_executed'))}  "
                         f"stall {_fmt(r.get('stall_share', 0) * 100 if 'stall_share' in r else None)}%  "
                         f"VRAM {_fmt(r.get('peak_vram_gib'))} GiB  RSS {_fmt(r.get('peak_rss_gib'))} GiB "
                         f"({_fmt(r.get('rss_bytes_per_param'))} B/param)")
    p, s = results.get("plain_1b", {}).get("result", {}), results.get("stream_1b", {}).get("result", {})
    if p.get("mean_step_s") and s.get("mean_step_s"):
        lines.append(f"stream_1b / plain_1b step time: {s['mean_step_s'] / p['mean_step_s']:.2f}x (goal <= 1.15x)")
    return "\n".join(lines) + "\n"


def _fs_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts; "" if unknown)."""
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and os.path.realpath(path).startswith(parts[1]) and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def pick_work_dir() -> str:
    """A scratch folder on the disk with the most free space, never on tmpfs (a 7B store is ~35 GB)."""
    options = []
    for base in (tempfile.gettempdir(), os.getcwd()):
        try:
            st = os.statvfs(base)
        except OSError:
            continue
        options.append((_fs_type(base) not in ("tmpfs", "ramfs"), st.f_bavail * st.f_frsize, base))
    base = max(options)[2] if options else tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="gpu-bench-", dir=base)


def _clean_work(work: str) -> None:
    """Delete the stores a finished (or killed) stage left behind: the disk holds one at a time."""
    for entry in os.listdir(work):
        path = os.path.join(work, entry)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


def run_stage(name: str, device: str, sizes_json: str, work: str, result_path: str) -> None:
    """Run one stage in this process, writing its (partial) result to ``result_path``."""
    dev = torch.device(device)
    sizes = json.loads(sizes_json)

    def report(partial: dict[str, Any]) -> None:
        _write_json(result_path, partial)

    out = STAGE_FNS[name](dev, sizes, work, report)
    _write_json(result_path, out)


def _run_inline(name: str, device: str, sizes: dict[str, Any], work: str, result_path: str, log: Any) -> dict[str, Any]:
    """One stage in this process (no time box): its status and result."""
    import traceback

    t0 = time.monotonic()
    try:
        run_stage(name, device, json.dumps(sizes), work, result_path)
        status = "ok"
    except Exception:
        log.write(traceback.format_exc())
        status = "failed (exception)"
    res: dict[str, Any] = {}
    if os.path.exists(result_path):
        with open(result_path) as f:
            res = json.load(f)
    return {"status": status, "wall_s": time.monotonic() - t0, "result": res}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the stages within the budget; write gpu_bench.json, gpu_bench.txt and gpu_bench.log to --out."""
    p = argparse.ArgumentParser(prog="tools.gpu.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    default_dev = os.environ.get("DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--device", default=default_dev, choices=["cuda", "cpu"])
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_out")
    p.add_argument("--work", default=None, help="scratch folder for the stores (default: a temp folder)")
    p.add_argument("--budget-s", type=float, default=400.0, help="wall-clock budget of all stages together")
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a size, e.g. --set batch_7b=16 (ints, or 'none')")
    p.add_argument("--inline", action="store_true",
                   help="run the stages in this process, without time boxes (the test suite's dry run)")
    p.add_argument("--stage", help=argparse.SUPPRESS)
    p.add_argument("--sizes-json", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.stage:  # a child process running one stage
        run_stage(a.stage, a.device, a.sizes_json, a.work, a.result)
        return 0
    stages = [s for s in a.stages.split(",") if s]
    unknown = [s for s in stages if s not in STAGE_FNS]
    if unknown:
        p.error(f"unknown stages {unknown}; known: {', '.join(STAGES)}")
    sizes = dict(SIZES[a.device])
    for kv in a.set:
        k, _, v = kv.partition("=")
        if k not in sizes:
            p.error(f"--set {kv}: unknown size {k!r}; known: {', '.join(sizes)}")
        sizes[k] = None if v.lower() == "none" else (v if k.startswith("model") else int(v))
    sizes["fast_exit"] = int(not a.inline)  # a stage process may end without the final commit
    os.makedirs(a.out, exist_ok=True)
    work = a.work or pick_work_dir()
    os.makedirs(work, exist_ok=True)
    json_path, txt_path = os.path.join(a.out, "gpu_bench.json"), os.path.join(a.out, "gpu_bench.txt")
    st = os.statvfs(work)
    results: dict[str, Any] = {"device": a.device, "sizes": sizes, "budget_s": a.budget_s, "work": work,
                               "work_fs": _fs_type(work), "work_free_gib": st.f_bavail * st.f_frsize / _GIB}
    deadline = time.monotonic() + a.budget_s
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(os.path.join(a.out, "gpu_bench.log"), "a") as log:
        for i, name in enumerate(stages):
            left = deadline - time.monotonic()
            later = sum(SHARE[s] for s in stages[i + 1:])
            # this stage's share of what is left: time a fast stage leaves goes to the later ones
            timeout = min(left, max(left * SHARE[name] / (SHARE[name] + later), 20.0))
            if timeout < 3:
                results[name] = {"status": "skipped: no time left", "result": {}}
                continue
            result_path = os.path.join(work, f"{name}.json")
            log.write(f"=== {name} (timeout {timeout:.0f} s)\n")
            log.flush()
            if a.inline:
                results[name] = _run_inline(name, a.device, sizes, work, result_path, log)
                _clean_work(work)
                _write_json(json_path, results)
                continue
            cmd = [sys.executable, "-m", "tools.gpu.bench", "--stage", name, "--device", a.device,
                   "--sizes-json", json.dumps(sizes), "--work", work, "--result", result_path]
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
                status = "ok" if rc == 0 else f"failed (rc {rc})"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)  # the stage and anything it started
                proc.wait()
                status = "timeout (partial results)"
            res: dict[str, Any] = {}
            if os.path.exists(result_path):
                with open(result_path) as f:
                    res = json.load(f)
            results[name] = {"status": status, "wall_s": time.monotonic() - t0, "timeout_s": timeout, "result": res}
            _clean_work(work)
            _write_json(json_path, results)
            with open(txt_path, "w") as f:
                f.write(summary(results))
    _write_json(json_path, results)
    with open(txt_path, "w") as f:
        f.write(summary(results))
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)  # the scratch folder this run picked
    sys.stdout.write(summary(results))
    return 0 if all(results[s]["status"] == "ok" for s in stages) else 1


if __name__ == "__main__":
    raise SystemExit(main())
