"""Train a Llama-style model larger than RAM on this machine; report memory, disk, bytes and time.

    python -m tools.bench.scale --params 4B [--steps 3] [--seq 128] [--ram-gb 4] [--vram-gb 2]

Builds a Llama-style config of about ``--params`` parameters (hidden size from a table, the
layer count to reach the target, vocabulary 32000, untied head), initializes it directly in the
store (``mt.load_model(config)``: one module at a time, never the whole model in RAM) and trains
``--steps`` optimizer steps (batch 1 x ``--seq`` tokens of the embedded corpus, q4 moments, no
gradient clipping so that no gradient is ever stored, one retained commit) in a child process.
Then it trains the same run again in a fresh store, SIGKILLs it in the middle of the step after
``--kill-after`` and resumes it in a new process: every loss must equal the uninterrupted run's.

Reported: parameters; fp32 AdamW state (16 B a parameter) and the stored state against RAM;
peak RSS (VmHWM) against the plan from the budgets (``trainer.memory.rss_plan``); the store's
disk bytes at their peak (copy-on-write generations included); bytes read and written per step
against the minimum for the budgets; time per step split into compute, I/O wait, optimizer and
codec; tokens/s; the step time against the floor set by those bytes at the disk bandwidth and by
the compute at the FLOP rate, both measured in the same invocation.

Before anything is written it checks the free disk space and refuses, naming the bytes it needs.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

_GIB = 1 << 30
_MIB = 1 << 20
VOCAB = 32000
#: (up to this many parameters: hidden, intermediate, heads)
SHAPES = [(60e6, 384, 1024, 6), (400e6, 1024, 2816, 8), (2e9, 2048, 5504, 16), (7e9, 3072, 8192, 24),
          (math.inf, 4096, 11008, 32)]


class BenchError(Exception):
    """The benchmark cannot run as asked (disk too small, bad size)."""


# -------------------------------------------------------------------------------- the model


def parse_params(text: str) -> int:
    """Parameters from ``"4B"``, ``"300M"``, ``"30M"`` or a plain number."""
    t = text.strip().upper()
    mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(t[-1:], 1)
    try:
        n = float(t[:-1] if t[-1:] in "KMBGT" else t) * mult
    except ValueError:
        raise BenchError(f"--params: cannot parse {text!r}; use e.g. 30M, 1B, 4B") from None
    if n < 1e6:
        raise BenchError(f"--params {text}: at least 1M parameters")
    return int(n)


@dataclass(frozen=True, slots=True)
class Shape:
    """A Llama-style model's dimensions and its sizes."""

    hidden: int
    intermediate: int
    heads: int
    layers: int
    vocab: int = VOCAB

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (q, k, v, o; gate, up, down; two norms)."""
        h = self.hidden
        return 4 * h * h + 3 * h * self.intermediate + 2 * h

    @property
    def params(self) -> int:
        """All parameters: embedding, layers, final norm, untied head."""
        return 2 * self.vocab * self.hidden + self.layers * self.layer_params + self.hidden

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest tensor (the embedding or an MLP matrix)."""
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)

    def tensor_elements(self) -> list[int]:
        """Elements of each weight tensor: embedding, each layer's seven matrices and two norms, final norm, head."""
        h, i = self.hidden, self.intermediate
        layer = [h * h] * 4 + [h * i] * 3 + [h] * 2
        return [self.vocab * h, *layer * self.layers, h, self.vocab * h]

    @property
    def matrix_elements(self) -> int:
        """Elements of 2-D tensors (the ones whose moments are quantized)."""
        return self.params - self.layers * 2 * self.hidden - self.hidden

    def config(self, seq: int) -> Any:
        """The transformers LlamaConfig."""
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.heads, vocab_size=self.vocab,
                           max_position_embeddings=max(seq, 128), tie_word_embeddings=False,
                           bos_token_id=256, eos_token_id=257, pad_token_id=None)


def timed_methods() -> list[tuple[type, str, str]]:
    """(class, method, timer label) of what the training child times on its training thread.

    Forward/backward, and inside it the waits for weights (a fetch includes the wait for the
    update of the weights it prefetches, ``StreamingEngine._hint``) and for optimizer room.
    """
    import trainer.optimizer as opt_mod
    import trainer.streaming as eng_mod

    return [(eng_mod.StreamingEngine, "forward_backward", "fb"), (eng_mod.StreamingEngine, "_fetch", "fetch"),
            (opt_mod.UpdateWorker, "submit", "submit"), (opt_mod.UpdateWorker, "wait_all", "wait_all")]


def shape_for(target: int) -> Shape:
    """The Llama-style shape with at least ``target`` parameters (fewest layers that reach it)."""
    _, h, inter, heads = next(row for row in SHAPES if target <= row[0])
    base = Shape(h, inter, heads, 1)
    layers = max(2, math.ceil((target - (base.params - base.layer_params)) / base.layer_params))
    return Shape(h, inter, heads, layers)


def moment_bytes_estimate(s: Shape) -> int:
    """Stored bytes of both moments: q4 (half a byte an element, 2% for scales) on matrices, raw on vectors."""
    vectors = s.params - s.matrix_elements
    return int(2 * (s.matrix_elements * 0.5 * 1.02 + vectors * 4))


def disk_needed(s: Shape) -> int:
    """Peak store bytes of the run: two generations (the retained commit and the step being written)."""
    one = 4 * s.params + moment_bytes_estimate(s)
    return int(2 * one * 1.03) + 256 * _MIB  # 3% for chunk trailers, zarr.json, the catalog


# -------------------------------------------------------------------------------- machine floors


def measure_disk(folder: str, nbytes: int = 1 * _GIB, block: int = 16 * _MIB) -> tuple[float, float]:
    """Sequential (write, read) bytes/s of ``folder``'s disk with O_DIRECT (the page cache bypassed)."""
    path = os.path.join(folder, "bench_scale.ddtest")
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
    buf.write(os.urandom(1 << 20) * (block >> 20))
    n = max(1, nbytes // block)
    flags = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
        t0 = time.perf_counter()
        try:
            for _ in range(n):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        write_bw = n * block / (time.perf_counter() - t0)
        fd = os.open(path, os.O_RDONLY | flags)
        t0 = time.perf_counter()
        try:
            while os.readv(fd, [buf]) > 0:
                pass
        finally:
            os.close(fd)
        read_bw = n * block / (time.perf_counter() - t0)
    finally:
        buf.close()
        if os.path.exists(path):
            os.unlink(path)
    return write_bw, read_bw


def measure_flops(s: Shape, seq: int, seconds: float = 2.0) -> float:
    """fp32 FLOP/s of torch on the model's largest matmul: (seq x hidden) @ (hidden x max(intermediate, vocab))."""
    import torch

    a = torch.randn(seq, s.hidden)
    b = torch.randn(s.hidden, max(s.intermediate, s.vocab))
    a @ b
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return 2 * seq * s.hidden * b.shape[1] * n / (time.perf_counter() - t0)


# -------------------------------------------------------------------------------- the child


@dataclass
class ChildSpec:
    """What a child process trains."""

    store: str
    out: str
    hidden: int
    intermediate: int
    heads: int
    layers: int
    seq: int
    steps: int
    ram: int
    vram: int
    lr: float
    seed: int
    threads: int
    resume: bool = False
    chunk: int | None = None


def _emit(kind: str, **fields: Any) -> None:
    print("BENCH " + json.dumps({"event": kind, **fields}), flush=True)


class _Timer:
    """Seconds summed over calls of wrapped functions, from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.total: dict[str, float] = {}

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                with self.lock:
                    self.total[name] = self.total.get(name, 0.0) + dt

        return timed

    def snapshot(self) -> dict[str, float]:
        with self.lock:
            return dict(self.total)


def child(spec: ChildSpec) -> None:
    """Train (or resume) the run in ``spec.store``, printing BENCH lines for the parent."""
    import torch

    torch.set_num_threads(spec.threads)  # the same thread count in every process: the same sums
    from trainer import memory

    memory.tune_malloc()
    import tierstore.reads
    import tierstore.store
    import trainer as mt
    import trainer.optimizer as opt_mod
    from trainer.data import default_dataset

    _emit("imported", rss=memory.rss_bytes())
    timer = _Timer()
    # codec time: every encode (puts) and decode (gets), on whichever thread runs it
    tierstore.writes.encode_chunk = timer.wrap("codec", tierstore.writes.encode_chunk)  # type: ignore[attr-defined]
    tierstore.reads.decode_into = timer.wrap("codec", tierstore.reads.decode_into)  # type: ignore[attr-defined]
    for owner, name, label in timed_methods():
        setattr(owner, name, timer.wrap(label, getattr(owner, name)))
    opts: list[Any] = []
    orig_init = opt_mod.StoreAdamW.__init__

    def opt_init(self: Any, *a: Any, **k: Any) -> None:
        orig_init(self, *a, **k)
        opts.append(self)

    opt_mod.StoreAdamW.__init__ = opt_init  # type: ignore[method-assign]
    import trainer.loop

    trainer.loop.StoreAdamW = opt_mod.StoreAdamW  # type: ignore[attr-defined]

    shape = Shape(spec.hidden, spec.intermediate, spec.heads, spec.layers)
    mt.init(offload_dir=spec.store, max_vram_gb=f"{spec.vram}B", max_ram_gb=f"{spec.ram}B",
            optimizer_compression="q4", device="cpu", keep_last=1, chunk_bytes=spec.chunk)
    torch.manual_seed(spec.seed)  # the random init: the same weights in every run
    t0 = time.perf_counter()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the resume's "the store holds a run" warning
        model = mt.load_model(shape.config(spec.seq))
    store = model._trainer_store
    if not spec.resume:
        store.commit(step=0, message="init")
    memory.trim()
    s = store.stats()
    _emit("opened" if spec.resume else "init", seconds=time.perf_counter() - t0, rss=memory.rss_bytes(), peak_rss=memory.peak_rss_bytes(),
          bytes_written=s["bytes_written_disk"])
    ds = default_dataset(block_size=spec.seq, max_bytes=max(256 * 1024, 4 * spec.seq * (spec.steps + 2)))
    args = mt.TrainingArguments(output_dir=spec.out, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                                learning_rate=spec.lr, lr_scheduler_type="constant", weight_decay=0.0,
                                max_steps=spec.steps, max_grad_norm=None, logging_steps=1, save_steps=1,
                                seed=spec.seed, disable_tqdm=True)
    tr = mt.Trainer(model=model, train_dataset=ds, args=args)
    commit = store.commit
    last = {"t": time.perf_counter(), "stats": store.stats(), "timer": timer.snapshot(), "upd": 0.0, "busy": 0.0}

    def reporting_commit(step: int | None = None, message: str = "") -> int:
        version = commit(step=step, message=message)
        now = time.perf_counter()
        st = store.stats()
        tm = timer.snapshot()
        o = opts[-1] if opts else None
        upd = o.update_s if o else 0.0
        busy = o.busy_s if o else 0.0
        d = {k: tm.get(k, 0.0) - last["timer"].get(k, 0.0) for k in set(tm) | set(last["timer"])}
        entry = tr.state.log_history[-1] if tr.state.log_history else {}
        _emit("step", step=step, loss=entry.get("loss"), grad_norm=entry.get("grad_norm"),
              learning_rate=entry.get("learning_rate"), wall_s=now - last["t"], step_s=entry.get("step_s"),
              read=st["bytes_read_disk"] - last["stats"]["bytes_read_disk"],
              written=st["bytes_written_disk"] - last["stats"]["bytes_written_disk"],
              stall_s=st["stall_s"] - last["stats"]["stall_s"], timer=d, update_s=upd - last["upd"],
              busy_s=busy - last["busy"], rss=memory.rss_bytes(), peak_rss=memory.peak_rss_bytes(),
              peak_host=st["peak_host_bytes"], peak_window=st["peak_device_bytes"])
        last.update(t=now, stats=st, timer=tm, upd=upd, busy=busy)
        # no malloc_trim here: at 4B it held the training thread for over a minute between steps
        return version

    store.commit = reporting_commit
    try:
        tr.train(resume_from_checkpoint=True if spec.resume else None)
        stored = {"weights": 0, "moments": 0}
        for k in store.keys():
            info = store.info(k)
            if k.startswith("opt/"):
                stored["moments"] += info.stored_nbytes
            elif not k.startswith("trainer/"):
                stored["weights"] += info.stored_nbytes
        _emit("done", peak_rss=memory.peak_rss_bytes(), stored=stored)
    finally:
        tr.close()


# -------------------------------------------------------------------------------- the parent


@dataclass
class RunResult:
    """What the parent saw of one child process."""

    events: list[dict[str, Any]] = field(default_factory=list)
    returncode: int | None = None
    killed: bool = False
    peak_rss: int = 0
    stderr_tail: str = ""

    def steps(self) -> list[dict[str, Any]]:
        """Step events with a step number > 0 (the init commit has step 0)."""
        return [e for e in self.events if e["event"] == "step" and (e.get("step") or 0) > 0]


class DiskWatch:
    """Samples the store folder's allocated bytes every ``period`` seconds; keeps the peak."""

    def __init__(self, folder: str, period: float = 2.0) -> None:
        self.folder = folder
        self.period = period
        self.peak = 0
        self.fs = folder
        while not os.path.isdir(self.fs):
            self.fs = os.path.dirname(self.fs) or "."
        self.min_free = shutil.disk_usage(self.fs).free
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-diskwatch", daemon=True)

    def __enter__(self) -> DiskWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def sample(self) -> None:
        """One reading of the folder's allocated bytes (st_blocks) and the filesystem's free bytes."""
        total = 0
        for root, _dirs, files in os.walk(self.folder):
            for f in files:
                try:
                    total += os.lstat(os.path.join(root, f)).st_blocks * 512
                except OSError:
                    pass  # deleted meanwhile (a retired generation)
        self.peak = max(self.peak, total)
        try:
            self.min_free = min(self.min_free, shutil.disk_usage(self.fs).free)
        except OSError:
            pass

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()


def _status_hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_child(spec: ChildSpec, kill_after_commit: int | None = None, kill_delay: float = 0.0,
              nice: int = 0) -> RunResult:
    """Run one child; with ``kill_after_commit``, SIGKILL it ``kill_delay`` s after that step's commit."""
    cmd = [sys.executable, "-m", "tools.bench.scale", "--child", json.dumps(asdict(spec))]
    if nice:
        cmd = ["nice", "-n", str(nice), *cmd]
    env = dict(os.environ)
    env.setdefault("MALLOC_ARENA_MAX", "2")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    res = RunResult()
    err_lines: list[str] = []
    err_thread = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    err_thread.start()
    kill_at: float | None = None
    pid = proc.pid
    # the parent samples the child's VmHWM so that a killed child's peak is known too
    hwm_stop = threading.Event()

    def hwm_loop() -> None:
        while not hwm_stop.wait(0.5):
            res.peak_rss = max(res.peak_rss, _status_hwm(pid))

    hwm_thread = threading.Thread(target=hwm_loop, daemon=True)
    hwm_thread.start()
    assert proc.stdout is not None
    killer: threading.Timer | None = None
    for line in proc.stdout:
        if not line.startswith("BENCH "):
            continue
        ev = json.loads(line[6:])
        res.events.append(ev)
        print(f"  [{time.strftime('%H:%M:%S')}] {_brief(ev)}", flush=True)
        if kill_after_commit is not None and ev["event"] == "step" and ev.get("step") == kill_after_commit:
            kill_at = time.time() + kill_delay

            def kill() -> None:
                res.peak_rss = max(res.peak_rss, _status_hwm(pid))
                res.killed = True
                proc.send_signal(signal.SIGKILL)

            killer = threading.Timer(kill_delay, kill)
            killer.start()
    proc.wait()
    if killer is not None:
        killer.cancel()
    hwm_stop.set()
    hwm_thread.join()
    err_thread.join(timeout=5)
    res.returncode = proc.returncode
    res.killed = res.killed and proc.returncode == -signal.SIGKILL
    res.stderr_tail = "".join(err_lines[-20:])
    for ev in res.events:
        res.peak_rss = max(res.peak_rss, int(ev.get("peak_rss") or 0))
    if proc.returncode != 0 and not res.killed:
        raise BenchError(f"the training child failed (exit {proc.returncode}):\n{res.stderr_tail}")
    del kill_at
    return res


def _brief(ev: dict[str, Any]) -> str:
    if ev["event"] == "step":
        return (f"step {ev['step']}: loss {ev['loss']}, {ev['wall_s']:.1f} s, read {ev['read'] / 1e9:.2f} GB, "
                f"written {ev['written'] / 1e9:.2f} GB, peak RSS {ev['peak_rss'] / _GIB:.2f} GiB")
    if ev["event"] == "init":
        return (f"initialized in the store: {ev['seconds']:.1f} s, {ev['bytes_written'] / 1e9:.2f} GB written, "
                f"peak RSS {ev['peak_rss'] / _GIB:.2f} GiB")
    return json.dumps(ev)[:200]


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB ({n / _GIB:.2f} GiB)"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the report."""
    p = argparse.ArgumentParser(prog="tools.bench.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", default="30M", help="model size: 30M, 1B, 4B, ... (default 30M)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    p.add_argument("--seq", type=int, default=128, help="tokens per step (batch 1 x seq; default 128)")
    p.add_argument("--ram-gb", type=float, default=None, help="RAM tier budget (default: 1/6 of RAM)")
    p.add_argument("--vram-gb", type=float, default=None,
                   help="device window (on the CPU: RAM too; default: 6 layers, at least 2 largest tensors)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--chunk-mib", type=int, default=None,
                   help="the store's chunk size (default: the Trainer's, which holds each layer weight in one "
                        "chunk, so that the CPU window lends it to the layers instead of copying it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--kill-after", type=int, default=1, help="SIGKILL during the step after this commit (0: no kill run)")
    p.add_argument("--kill-run-steps", type=int, default=None,
                   help="steps of the killed+resumed run (default --steps; fewer saves time, compares fewer)")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temporary folder under /work or /tmp)")
    p.add_argument("--nice", type=int, default=0, help="nice level of the training children")
    p.add_argument("--kill-delay", type=float, default=None,
                   help="seconds after the commit of --kill-after to SIGKILL (default: 0.35 x run A's median step)")
    p.add_argument("--reference-losses", default=None,
                   help="comma-separated losses of an earlier uninterrupted run: skip run A, only kill and resume")
    p.add_argument("--events", default=None, help="also write every event of every run to this JSON file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        child(ChildSpec(**json.loads(a.child)))
        return 0
    try:
        return _bench(a)
    except BenchError as e:
        print(f"bench_scale: {e}", file=sys.stderr)
        return 2


def _bench(a: argparse.Namespace) -> int:
    from trainer import memory

    if a.steps < 1:
        raise BenchError("--steps must be >= 1")
    if a.kill_after and not 0 < a.kill_after < a.steps:
        raise BenchError(f"--kill-after {a.kill_after} must be between 1 and --steps - 1 ({a.steps - 1})")
    shape = shape_for(parse_params(a.params))
    info = memory.meminfo()
    ram_total = info["MemTotal"]
    fp32 = 4
    ram = int(a.ram_gb * _GIB) if a.ram_gb else ram_total // 6
    layer_bytes = fp32 * shape.layer_params
    # six layers: the one backward computes, the one prefetched, and the weights of the groups the
    # optimizer has queued and is updating, which it then reads from the window instead of the disk
    vram = int(a.vram_gb * _GIB) if a.vram_gb else max(6 * layer_bytes, 2 * fp32 * shape.largest_tensor + layer_bytes)
    base = a.dir or ("/work" if os.path.isdir("/work") and os.access("/work", os.W_OK) else tempfile.gettempdir())
    os.makedirs(base, exist_ok=True)
    folder = tempfile.mkdtemp(prefix=f"bench-scale-{a.params}-", dir=base)
    need = disk_needed(shape)
    free = shutil.disk_usage(folder).free
    n = shape.params
    print(f"bench_scale --params {a.params}: Llama-style, hidden {shape.hidden}, intermediate {shape.intermediate}, "
          f"{shape.layers} layers, {shape.heads} heads, vocab {shape.vocab}, untied head")
    print(f"  parameters: {n:,} ({n / 1e9:.3f} B)")
    print(f"  fp32 AdamW state (16 B/param: weights, grads, m, v): {_gb(16 * n)} = "
          f"{16 * n / ram_total:.2f}x RAM ({_gb(ram_total)})")
    print(f"  budgets: RAM tier {_gb(ram)}, device window (CPU, in RAM) {_gb(vram)}")
    print(f"  disk: {_gb(need)} needed at peak (2 generations of fp32 weights + q4 moments, no stored "
          f"gradients, keep_last=1), {_gb(free)} free at {folder}")
    if need > free:
        shutil.rmtree(folder, ignore_errors=True)
        raise BenchError(f"not enough disk space for --params {a.params}: the run needs {_gb(need)} at its peak "
                         f"and {base} has {_gb(free)} free; free space or pass a smaller --params / another --dir")
    write_bw, read_bw = measure_disk(folder)
    flops = measure_flops(shape, a.seq)
    print(f"  measured: disk write {write_bw / 1e9:.2f} GB/s, read {read_bw / 1e9:.2f} GB/s (O_DIRECT, 1 GiB); "
          f"fp32 matmul {flops / 1e9:.1f} GFLOP/s ({a.threads} threads)", flush=True)
    spec = ChildSpec(store=os.path.join(folder, "a", "store"), out=os.path.join(folder, "a"), hidden=shape.hidden,
                     intermediate=shape.intermediate, heads=shape.heads, layers=shape.layers, seq=a.seq,
                     steps=a.steps, ram=ram, vram=vram, lr=a.lr, seed=a.seed, threads=a.threads,
                     chunk=_chunk_bytes(a))
    runs: dict[str, RunResult] = {}
    try:
        if a.reference_losses:
            # run A's losses from an earlier invocation: only the kill-and-resume run
            ref = RunResult(events=[{"event": "step", "step": i + 1, "loss": float(x), "grad_norm": None}
                                    for i, x in enumerate(a.reference_losses.split(","))])
        else:
            print("run A: uninterrupted", flush=True)
            with DiskWatch(spec.store) as watch:
                ref = runs["uninterrupted"] = run_child(spec, nice=a.nice)
            # again after the run: other load on the machine lowers a reading, so the floors use the best
            w2, r2 = measure_disk(folder)
            f2 = measure_flops(shape, a.seq)
            print(f"  measured again after run A: disk write {w2 / 1e9:.2f} GB/s, read {r2 / 1e9:.2f} GB/s; "
                  f"fp32 matmul {f2 / 1e9:.1f} GFLOP/s (the floors use the higher readings)", flush=True)
            report(a, shape, ram_total, ram, vram, ref, watch, max(write_bw, w2), max(read_bw, r2), max(flops, f2))
        ok = True
        if a.kill_after:
            shutil.rmtree(os.path.join(folder, "a"), ignore_errors=True)
            b_steps = min(a.steps, a.kill_run_steps or a.steps)
            if b_steps <= a.kill_after:
                raise BenchError(f"--kill-run-steps {b_steps} must exceed --kill-after {a.kill_after}")
            spec_b = ChildSpec(**{**asdict(spec), "store": os.path.join(folder, "b", "store"),
                                  "out": os.path.join(folder, "b"), "steps": b_steps})
            step_s = [e["wall_s"] for e in ref.steps() if "wall_s" in e]
            # a third into the next step: late enough to be past its forward, early enough that a
            # faster machine than run A's does not finish the step first
            delay = a.kill_delay or 0.35 * (sorted(step_s)[len(step_s) // 2] if step_s else 60.0)
            print(f"run B: SIGKILL {delay:.1f} s after the commit of step {a.kill_after}, then resume", flush=True)
            killed = runs["killed"] = run_child(spec_b, kill_after_commit=a.kill_after, kill_delay=delay, nice=a.nice)
            if not killed.killed:
                raise BenchError("run B finished before the kill: raise --steps or lower --kill-after / --kill-delay")
            done = [e["step"] for e in killed.steps()]
            resumed = runs["resumed"] = run_child(ChildSpec(**{**asdict(spec_b), "resume": True}), nice=a.nice)
            ok = compare(ref, killed, resumed, a.kill_after, done, losses_only=bool(a.reference_losses))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if a.events:
            with open(a.events, "w") as f:
                json.dump({name: r.events for name, r in runs.items()}, f)
    return 0 if ok else 1


def compare(ref: RunResult, killed: RunResult, resumed: RunResult, kill_after: int, killed_steps: list[int],
            losses_only: bool = False) -> bool:
    """Print the killed+resumed losses against the reference's; True when every one is equal."""
    def key(e: dict[str, Any]) -> tuple[Any, Any]:
        return (e["loss"], None if losses_only else e["grad_norm"])

    got = {e["step"]: key(e) for e in killed.steps()}
    got.update({e["step"]: key(e) for e in resumed.steps()})
    want = {e["step"]: key(e) for e in ref.steps() if e["step"] <= max(got, default=0)}
    print(f"kill: the first process committed steps {killed_steps} and was SIGKILLed mid-step "
          f"{max(killed_steps, default=0) + 1} (peak RSS {killed.peak_rss / _GIB:.2f} GiB); "
          f"the resumed one trained steps {[e['step'] for e in resumed.steps()]} "
          f"(peak RSS {resumed.peak_rss / _GIB:.2f} GiB)")
    ok = True
    for step in sorted(want):
        same = got.get(step) == want[step]
        ok &= same
        print(f"  step {step}: uninterrupted loss {want[step][0]!r} grad_norm {want[step][1]!r}; "
              f"killed+resumed loss {got.get(step, (None,))[0]!r} -> {'equal' if same else 'DIFFERENT'}")
    print(f"resume after SIGKILL matches the uninterrupted run: {'yes' if ok else 'NO'}")
    return ok


def _chunk_bytes(a: argparse.Namespace) -> int | None:
    """``--chunk-mib`` in bytes; None: the Trainer's choice."""
    return None if a.chunk_mib is None else a.chunk_mib * _MIB


def report(a: argparse.Namespace, s: Shape, ram_total: int, ram: int, vram: int, run: RunResult, watch: DiskWatch,
           write_bw: float, read_bw: float, flops: float) -> None:
    """Print the figures of the uninterrupted run."""
    from trainer import io_account, memory

    steps = run.steps()
    done = next((e for e in run.events if e["event"] == "done"), {})
    imported = next((e["rss"] for e in run.events if e["event"] == "imported"), 0)
    stored = done.get("stored", {})
    W = 4 * s.params
    M = stored.get("moments", moment_bytes_estimate(s))
    n = s.params
    print(f"results (run A, {a.steps} steps of 1 x {a.seq} tokens):")
    print(f"  stored state: weights {_gb(stored.get('weights', W))} + q4 moments {_gb(M)} = "
          f"{_gb(stored.get('weights', W) + M)} on disk (no stored gradients) vs RAM {_gb(ram_total)}")
    layer = 4 * s.layer_params
    groups = [4 * s.vocab * s.hidden] + [layer] * s.layers + [4 * (s.vocab * s.hidden + s.hidden)]
    import tierstore.config

    # the chunk size the run's store got: --chunk-mib, else the Trainer's choice for this model on
    # the CPU, else the store's own rule (16 MiB, at most a quarter of the RAM tier)
    asked = _chunk_bytes(a)
    if asked is None:
        asked = memory.layer_chunk_bytes(4 * s.hidden * s.intermediate, ram)
    chunk = tierstore.config.StoreConfig(ram_budget=ram, device="cpu", chunk_bytes=asked).chunk_bytes
    assert chunk is not None
    act = s.layers * a.seq * s.hidden * 4 + 16 * a.seq * max(s.intermediate, s.vocab) * 4
    plan = memory.rss_plan(baseline=imported, ram_budget=ram, device_budget=vram, cpu_window=True,
                           group_bytes=groups, largest_tensor_bytes=4 * s.largest_tensor, chunk_bytes=chunk,
                           read_slots=8, activation_bytes=act, queued_groups=memory.max_queued_default())
    print(f"  peak RSS: {run.peak_rss / _GIB:.2f} GiB = {100 * run.peak_rss / ram_total:.1f}% of RAM "
          f"(plan from the budgets: {plan.total / _GIB:.2f} GiB; import baseline {imported / _GIB:.2f} GiB)")
    for line in plan.lines():
        print(f"    plan {line}")
    print(f"  disk at peak: store {_gb(watch.peak)} (copy-on-write generations included); "
          f"lowest free on the filesystem {_gb(watch.min_free)}")
    losses = [e["loss"] for e in steps]
    print(f"  losses: {', '.join(f'{x:.4f}' for x in losses)}  "
          f"(finite: {all(math.isfinite(x) for x in losses)}, decreasing: "
          f"{all(b < a_ for a_, b in zip(losses, losses[1:], strict=False))})")
    # the CPU window lends a weight in one chunk from the RAM tier: it holds only the ones it copies
    window = io_account.cpu_window_capacity(vram, sum(4 * e for e in s.tensor_elements() if 4 * e > chunk))
    min_read, min_write = io_account.minimum(W, M, ram, window)
    print("  per step (min read = 2 x weights (forward, backward) + moments - 2 x (RAM + the weights the window")
    print(f"  copies, {_gb(window)}): what the budgets can carry into each pass; min write = weights + moments,")
    print("  all updated each step):")
    print(f"    {'step':>4} {'loss':>9} {'wall s':>8} {'read GB':>8} {'write GB':>9} {'x min':>6} "
          f"{'compute':>8} {'I/O wait':>8} {'optim':>7} {'codec':>7} {'tok/s':>7}")
    floor_io = min_read / read_bw + min_write / write_bw
    for e in steps:
        t = e["timer"]
        wait = t.get("fetch", 0.0) + t.get("prefetch", 0.0) + t.get("submit", 0.0)
        compute = max(0.0, t.get("fb", 0.0) - wait)
        io_wait = e["wall_s"] - compute
        moved = e["read"] + e["written"]
        mn = sum(io_account.minimum(W, M, ram, window, first_step=e["step"] == 1))  # step 1 reads no moments
        print(f"    {e['step']:>4} {e['loss']:>9.4f} {e['wall_s']:>8.1f} {e['read'] / 1e9:>8.2f} "
              f"{e['written'] / 1e9:>9.2f} {moved / max(1, mn):>6.2f} {compute:>8.1f} {io_wait:>8.1f} "
              f"{e['update_s']:>7.1f} {t.get('codec', 0.0):>7.1f} {a.seq / e['wall_s']:>7.2f}")
    for e in steps:
        t = e["timer"]
        print(f"    step {e['step']} waits of the training thread: weights {t.get('fetch', 0.0) + t.get('prefetch', 0.0):.1f} s, "
              f"optimizer room {t.get('submit', 0.0):.1f} s, optimizer drain before the commit "
              f"{t.get('wait_all', 0.0):.1f} s; store stall (all threads) {e['stall_s']:.1f} s")
    print("    (compute: forward/backward minus its waits for weights and for optimizer room; I/O wait: the rest of")
    print("     the step's wall time; optim: AdamW arithmetic on the worker thread, overlapped; codec: encode+decode")
    print("     seconds summed over threads, overlapped)")
    floor_c6, floor_c8 = 6 * n * a.seq / flops, 8 * n * a.seq / flops
    later = [e["wall_s"] for e in steps if e["step"] > 1] or [e["wall_s"] for e in steps]
    mean = sum(later) / len(later)
    print(f"  floors: bytes {_gb(min_read)} read + {_gb(min_write)} written at {read_bw / 1e9:.2f}/"
          f"{write_bw / 1e9:.2f} GB/s = {floor_io:.1f} s; compute 8 x params x tokens (forward, recompute, "
          f"backward) at {flops / 1e9:.1f} GFLOP/s = {floor_c8:.1f} s (6 x: {floor_c6:.1f} s)")
    print(f"  step time (steps 2..): {mean:.1f} s = {mean / max(floor_io, floor_c8):.2f}x the larger floor, "
          f"{mean / (floor_io + floor_c8):.2f}x their sum; {a.seq / mean:.2f} tokens/s")


if __name__ == "__main__":
    raise SystemExit(main())
