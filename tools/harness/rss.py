"""rss: a memory-leak harness; runs a long loop and checks that the resident set stays flat.

    python -m tools.harness.rss trainer --steps 50000 [--sample-every 500] [--budgets fit]
    python -m tools.harness.rss store --gets 10000000 [--sample-every 100000] [--api sync]

``trainer`` trains a tiny Llama (2 layers, hidden 32, vocab 256) through the project's trainer on
the CPU, with budgets under the weights and the training state so that the device window, the
RAM tier and the disk all take part, and a commit every ``--save-steps`` steps. ``store`` runs
a loop of ``get`` on a small store of a few keys (one of them sharded), mixing copies,
``copy=False`` loans, dim-0 slices and window reads the way callers do, and drops each result;
with ``--api async`` (the default) as ``AsyncStore`` coroutines on the harness's own event loop,
with ``--api sync`` through the blocking ``Store``, a hop to its loop thread per get.

Either samples this process's RSS (``VmRSS`` in ``/proc/self/status``) every ``--sample-every``
iterations and prints it after the warm-up (``--warmup``, a fraction of the iterations, during
which caches, allocator arenas, the RAM tier and the store's trace fill, and the quantizing
codecs' kernels get compiled) and at the end, and the growth between the two. ``--max-minutes``
stops the loop early (a run that must fit a time slot) and reports the iterations done. The exit code is 1 when the growth exceeds ``--max-growth-mb``: every byte a loop iteration
holds for good shows up there, multiplied by the iterations left after the warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

_MIB = 1 << 20


def rss_bytes() -> int:
    """This process's resident set size, from ``/proc/self/status``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS line in /proc/self/status")


class RssLog:
    """RSS samples taken every ``every`` iterations; the baseline is the first sample after ``warmup``."""

    def __init__(self, total: int, every: int, warmup: int, quiet: bool, unit: str,
                 deadline: float | None = None) -> None:
        from tqdm import tqdm

        self.every, self.warmup = every, warmup
        self.samples: list[tuple[int, int]] = []
        self.baseline: tuple[int, int] | None = None
        #: ``time.monotonic()`` past which the loop stops early (``--max-minutes``), and where it did
        self.deadline = deadline
        self.stopped_at: int | None = None
        self._bar = tqdm(total=total, unit=unit, disable=quiet, file=sys.stderr, mininterval=1.0)
        self._done = 0

    def tick(self, i: int) -> bool:
        """Count iteration ``i`` (1-based) done; sample RSS on every ``every``-th.

        True when the deadline has passed: the loop stops after this iteration, sampled last.
        """
        late = self.deadline is not None and time.monotonic() >= self.deadline
        if late:
            self.stopped_at = i
        elif i % self.every and i != self._bar.total:
            return False
        self._bar.update(i - self._done)
        self._done = i
        rss = rss_bytes()
        self.samples.append((i, rss))
        if self.baseline is None and i >= self.warmup:
            self.baseline = (i, rss)
        self._bar.set_postfix_str(f"rss {rss / _MIB:.1f} MiB", refresh=False)
        return late

    def report(self, what: str, max_growth_mb: float) -> int:
        """Print RSS after the warm-up, at the end and the growth; 1 if it exceeds the limit."""
        self._bar.close()
        if self.baseline is None or not self.samples:
            print(f"{what}: no sample after the warm-up; lower --warmup", flush=True)
            return 1
        (i0, r0), (i1, r1) = self.baseline, self.samples[-1]
        peak = max(r for i, r in self.samples if i >= i0)
        growth = (r1 - r0) / _MIB
        per = (r1 - r0) / max(1, i1 - i0)
        print(f"{what}: rss after warm-up (iteration {i0}) {r0 / _MIB:.1f} MiB; at the end (iteration {i1}) "
              f"{r1 / _MIB:.1f} MiB; peak after warm-up {peak / _MIB:.1f} MiB", flush=True)
        step = max(1, len(self.samples) // 20)  # the curve, thinned to about 20 points
        curve = " ".join(f"{i}:{r / _MIB:.1f}" for i, r in self.samples[::step])
        print(f"rss curve (iteration:MiB): {curve}", flush=True)
        if self.stopped_at is not None:
            print(f"stopped by --max-minutes after iteration {self.stopped_at} of {self._bar.total}", flush=True)
        ok = growth <= max_growth_mb
        print(f"growth {growth:+.2f} MiB ({per:+.1f} B an iteration) over {i1 - i0} iterations: "
              + ("flat" if ok else f"GROWS (limit {max_growth_mb} MiB)"), flush=True)
        return 0 if ok else 1


def run_trainer(steps: int, log: RssLog, folder: str, save_steps: int, budgets: str = "under") -> None:
    """Train a tiny Llama for ``steps`` optimizer steps, sampling RSS at each step's end.

    ``budgets``: "under" (the window holds under half the weights, the RAM tier a third of the
    state: every step streams through the disk) or "fit" (both hold everything: the disk sees
    only the commits, and a step is about 8x shorter, for runs long enough to show slow leaks).
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    import trainer as mt
    from trainer.data import default_dataset

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=32,
                         bos_token_id=0, eos_token_id=1, pad_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    if budgets == "under":  # under half the weights (4 B a parameter), a third of the state (16 B)
        vram, ram = 4 * n_params * 45 // 100, 16 * n_params // 3
    else:  # room for the weights and the state twice over (a commit keeps the last version)
        vram, ram = 8 * n_params, 64 * n_params
    mt.init(offload_dir=os.path.join(folder, "store"), max_vram_gb=f"{vram}B", max_ram_gb=f"{ram}B",
            optimizer_compression=True, device="cpu", keep_last=2)
    # logging_steps bounds log_history, which the trainer keeps by design (transformers does too)
    args = mt.TrainingArguments(output_dir=folder, per_device_train_batch_size=2, learning_rate=2e-3,
                                weight_decay=0.1, max_steps=steps, warmup_steps=3, max_grad_norm=1.0,
                                logging_steps=max(1, steps // 20), save_steps=save_steps,
                                disable_tqdm=True, report_to="none")

    class Sampler(mt.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if log.tick(state.global_step):
                control.should_training_stop = True

    tr = mt.Trainer(model=model, train_dataset=default_dataset(block_size=32, max_bytes=64 * 1024), args=args,
                    callbacks=[Sampler()])
    try:
        tr.train()
    finally:
        tr.close()


#: the mix of gets the ``store`` mode cycles through: (key, keyword arguments of ``get``)
GET_MIX: list[tuple[str, dict[str, Any]]] = [
    ("w/a", {}),
    ("w/a", {"copy": False}),  # several chunks: a copy after all
    ("w/b", {"copy": False}),  # a loan of the RAM tier's buffer (or the window's copy)
    ("w/b", {}),
    ("w/c", {"copy": False}),
    ("w/q", {}),  # decoded at each get
    ("w/a", {"index": slice(10, 20)}),
    ("w/sharded", {"index": [3, 77, 200, 511]}),  # served from the page cache once committed
    ("w/sharded", {"copy": False}),
    ("w/c", {"device": "cpu"}),  # through the device window
]


def _store_puts() -> list[tuple[str, torch.Tensor, dict[str, Any]]]:
    """What the ``store`` mode puts before its loop: (key, tensor, keyword arguments of ``put``)."""
    g = torch.Generator().manual_seed(0)
    return [
        ("w/a", torch.randn(256, 256, generator=g), {}),  # 256 KiB: several chunks
        ("w/b", torch.randn(1000, generator=g).to(torch.bfloat16), {}),
        ("w/c", torch.randint(0, 100, (64, 33), generator=g, dtype=torch.int64), {}),
        ("w/q", torch.randn(128, 64, generator=g), {"codec": "q8"}),
        ("w/sharded", torch.randn(512, 16, generator=g), {"chunk_rows": 8, "shard_rows": 64}),
    ]


def store_get_ops(s: Any) -> list[Callable[[], Any]]:
    """``GET_MIX`` as calls of a sync store ``s``, which it fills and commits first."""
    for key, t, kw in _store_puts():
        s.put(key, t, **kw)
    s.commit(step=0)
    return [functools.partial(s.get, key, **kw) for key, kw in GET_MIX]


_STORE_OPTIONS: dict[str, Any] = {"ram_budget": "8MiB", "device_budget": "4MiB", "chunk_bytes": "64KiB",
                                  "device": "cpu"}


def run_store(gets: int, log: RssLog, folder: str) -> None:
    """Run ``gets`` gets through the sync facade, cycling through ``GET_MIX``, sampling RSS."""
    import tierstore

    with tierstore.open(os.path.join(folder, "store"), **_STORE_OPTIONS) as s:
        ops = store_get_ops(s)
        n = len(ops)
        for i in range(gets):
            t = ops[i % n]()
            del t  # a caller drops each result: a loan goes back to the RAM tier here
            if log.tick(i + 1):
                break


async def _run_store_async(gets: int, log: RssLog, folder: str) -> None:
    import tierstore

    s = await tierstore.open_async(os.path.join(folder, "store"), **_STORE_OPTIONS)
    try:
        for key, t, kw in _store_puts():
            await s.put(key, t, **kw)
        await s.commit(step=0)
        n = len(GET_MIX)
        for i in range(gets):
            key, kw = GET_MIX[i % n]
            index = kw.get("index")
            # what ``Store.get`` does: a row gather tries the page cache before the store's loop
            t = s.mapped_get(key, index) if index is not None and "device" not in kw else None
            if t is None:
                t = await s.get(key, **kw)
            del t  # a caller drops each result: a loan goes back to the RAM tier here
            if log.tick(i + 1):
                break
    finally:
        await s.close()


def run_store_async(gets: int, log: RssLog, folder: str) -> None:
    """Run ``gets`` gets of ``GET_MIX`` as coroutines of an ``AsyncStore`` on this thread's loop.

    The same reads as ``run_store`` without the hop of each call to the facade's loop thread,
    which costs 50-150 us of thread wake-ups on two busy cores: what a long run checks is what
    the store keeps, and this way ten million gets fit in well under an hour.
    """
    asyncio.run(_run_store_async(gets, log, folder))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m tools.harness.rss", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    tr = sub.add_parser("trainer", help="train a tiny Llama, sampling RSS every N steps")
    tr.add_argument("--steps", type=int, default=50_000, help="optimizer steps (default 50000)")
    tr.add_argument("--save-steps", type=int, default=500, help="a commit every this many steps (default 500)")
    tr.add_argument("--budgets", choices=("under", "fit"), default="under",
                    help="under: budgets under the weights and the state, every step streams through "
                         "the disk (default); fit: both fit, the disk sees the commits only (faster)")
    st = sub.add_parser("store", help="a loop of gets on a small store, sampling RSS every N gets")
    st.add_argument("--gets", type=int, default=10_000_000, help="gets (default 10000000)")
    st.add_argument("--api", choices=("async", "sync"), default="async",
                    help="async: AsyncStore coroutines on this thread (default); sync: the blocking "
                         "Store, a hop to its loop thread per get")
    for sp in (tr, st):
        sp.add_argument("--sample-every", type=int, default=0,
                        help="iterations between RSS samples (default: 1/100 of the iterations)")
        sp.add_argument("--warmup", type=float, default=0.1,
                        help="fraction of the iterations before the baseline sample (default 0.1)")
        sp.add_argument("--max-growth-mb", type=float, default=5.0,
                        help="growth after the warm-up that fails the run (MiB, default 5)")
        sp.add_argument("--max-minutes", type=float, default=0,
                        help="stop after this many minutes and report the iterations done (default: no limit)")
        sp.add_argument("--dir", default=None, help="where to make the store (default: a temp dir, removed)")
        sp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    args.total = args.steps if args.mode == "trainer" else args.gets
    if args.total < 1:
        p.error("the iteration count must be >= 1")
    if not 0 <= args.warmup < 1:
        p.error("--warmup is a fraction in [0, 1)")
    if args.sample_every < 0:
        p.error("--sample-every must be >= 0")
    args.sample_every = args.sample_every or max(1, args.total // 100)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the chosen loop, print the RSS figures; exit 1 if RSS grew past the limit."""
    args = parse_args(argv)
    folder = tempfile.mkdtemp(prefix="tierstore-rss-", dir=args.dir)
    unit = "step" if args.mode == "trainer" else "get"
    deadline = time.monotonic() + 60 * args.max_minutes if args.max_minutes > 0 else None
    log = RssLog(args.total, args.sample_every, int(args.warmup * args.total), args.quiet, unit, deadline)
    t0 = time.perf_counter()
    try:
        if args.mode == "trainer":
            run_trainer(args.steps, log, folder, args.save_steps, args.budgets)
        else:
            (run_store_async if args.api == "async" else run_store)(args.gets, log, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    done = log.samples[-1][0] if log.samples else 0
    code = log.report(f"{args.mode} {args.total} {unit}s", args.max_growth_mb)
    print(f"{elapsed:.0f} s, {done / elapsed:.1f} {unit}s/s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
