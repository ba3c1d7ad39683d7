"""CPU AdamW over store-resident fp32 master weights, gradients and (possibly compressed) moments.

The update is ``torch.optim.AdamW``'s single-tensor formula, step for step (decoupled weight
decay, bias correction, eps after the corrected square root), so that with raw codecs the
trajectory equals plain PyTorch training. Store keys: the weight under its HF name, the
accumulated gradient under ``grad/<name>``, the moments under ``opt/exp_avg/<name>`` and
``opt/exp_avg_sq/<name>``.

Overlap: the update runs per parameter group (the prelude, each layer, the head) on a worker
thread. Global-norm clipping needs every gradient before any update, so with clipping on the
updates are queued after backward in forward order and the next step's forward waits only for
the group it is about to read; with clipping off each group is queued as soon as its final
gradient leaves backward. Either way every update reads exactly the values a sequential step
would, so overlap never changes the numbers.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import tierstore

GRAD = "grad/"
EXP_AVG = "opt/exp_avg/"
EXP_AVG_SQ = "opt/exp_avg_sq/"


#: per lossy moment codec: (worst measured mean gap of the final training loss to fp32 AdamW over
#: ``tools.bench_convergence``'s grid, the goal it must meet to be a default). Only a codec
#: within its goal is picked by ``optimizer_compression=True``; the others stay usable by name,
#: with a warning that names the gap. The README's "Codecs: measured numbers" has the runs.
MOMENT_CODEC_GAPS: dict[str, tuple[float, float]] = {
    "q8": (-0.0025, 0.01),  # 1.1M params, lr 1e-3, 3 seeds (README)
    "q4": (-0.0306, 0.01),  # 1.1M params, lr 3e-3, seed 0 (-0.48% at lr 1e-3)
    "q3": (-0.0552, 0.03),  # 1.1M params, lr 3e-3, seed 0 (-2.18% at lr 1e-3)
    "q2": (-0.0907, 0.03),  # 1.1M params, lr 3e-3, seed 0 (-6.78% at 4.33M, lr 1e-3)
}
#: where MOMENT_CODEC_GAPS was measured, for the warning
GAPS_MEASURED = "tools.bench_convergence, byte-level Llama, 300 steps, paired with fp32"


def moment_codec_name(compression: bool | str | None) -> str:
    """The codec asked for the Adam moments: True means q8, False/None raw; CodecError if unknown.

    True picks q8, the one lossy codec whose measured loss gap met its goal; one that misses its
    goal (``MOMENT_CODEC_GAPS``) is opt-in: named explicitly it is used, with a warning naming the gap.
    """
    name = "q8" if compression is True else (compression or "raw")
    tierstore.codecs.get(name)  # raises CodecError naming the registered codecs
    gap, goal = MOMENT_CODEC_GAPS.get(name, (0.0, 1.0))
    if abs(gap) > goal:
        warnings.warn(
            f"moment codec {name!r} changes AdamW's dynamics: its training loss differed from fp32 "
            f"AdamW's by {gap:+.2%} ({GAPS_MEASURED}), outside the {goal:.0%} goal; tuned "
            "hyper-parameters may not transfer. q8 met its 1% goal where measured.",
            UserWarning, stacklevel=2)
    return name


@dataclass(frozen=True, slots=True)
class AdamWHyper:
    """Hyper-parameters of one update."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def _fused_kernel() -> Callable[..., Any] | None:
    """torch.optim.AdamW's fused CPU kernel (torch >= 2.4), or None where this build lacks it."""
    fn = getattr(torch, "_fused_adamw_", None)
    if fn is None:
        return None
    x = torch.zeros(2)
    try:
        fn([x], [x.clone()], [x.clone()], [x.clone()], [], [torch.ones(())], lr=0.1, beta1=0.9, beta2=0.99,
           weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return fn


_FUSED = _fused_kernel()


def adamw_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  step: int, h: AdamWHyper, weight_decay: float) -> None:
    """One in-place AdamW update, as torch.optim.AdamW computes it.

    On CPU fp32 tensors: the kernel of ``torch.optim.AdamW(fused=True)``, one vectorized,
    multi-threaded pass (about 17x the single-tensor formula on 2 cores). Its moments are
    bit-equal to the single-tensor path's and its weights within an ulp; the exactness tests
    hold either way. Elsewhere: the single-tensor formula, op for op.
    """
    if _FUSED is not None and param.device.type == "cpu" and param.dtype == torch.float32 \
            and grad.dtype == exp_avg.dtype == exp_avg_sq.dtype == torch.float32:
        _FUSED([param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step))], lr=h.lr,
               beta1=h.beta1, beta2=h.beta2, weight_decay=weight_decay, eps=h.eps, amsgrad=False, maximize=False)
        return
    if weight_decay != 0:
        param.mul_(1 - h.lr * weight_decay)
    exp_avg.lerp_(grad, 1 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
    bias_correction1 = 1 - h.beta1**step
    bias_correction2 = 1 - h.beta2**step
    step_size = h.lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(h.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


class StoreAdamW:
    """AdamW whose every state tensor lives in a tierstore Store; one group updated at a time."""

    def __init__(self, store: Any, groups: list[list[str]], no_decay: set[str], compression: bool | str | None,
                 lock: contextlib.AbstractContextManager[Any]) -> None:
        self.store = store
        self.groups = groups
        self.no_decay = no_decay
        self.moment_codec = moment_codec_name(compression)
        self.lock = lock
        self.update_s = 0.0
        """Seconds of AdamW arithmetic."""
        self.busy_s = 0.0
        """Seconds of whole group updates: store reads and writes plus the arithmetic."""

    def _codecs(self, t: torch.Tensor) -> tuple[Any, Any]:
        # one policy for the whole project: small and 1-D tensors stay raw, v is unsigned,
        # moments get stochastic rounding (tierstore.codecs.policy says why)
        shape = tuple(t.shape)
        return (tierstore.codecs.choose_codec(self.moment_codec, shape, "exp_avg"),
                tierstore.codecs.choose_codec(self.moment_codec, shape, "exp_avg_sq"))

    def accumulate(self, grads: dict[str, torch.Tensor], first: bool) -> dict[str, torch.Tensor]:
        """Add one micro-batch's gradients to ``grad/<name>``; returns the running sums."""
        out = {}
        with self.lock:
            for name, g in grads.items():
                total = g if first else self.store.get(GRAD + name) + g
                self.store.put(GRAD + name, total, codec="raw")
                out[name] = total
        return out

    def add_accumulated(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The running sums plus this micro-batch's gradients, without writing them back."""
        with self.lock:
            return {name: self.store.get(GRAD + name) + g for name, g in grads.items()}

    def update_group(self, g: int, step: int, h: AdamWHyper, clip_coef: float | None,
                     grads: dict[str, torch.Tensor] | None = None) -> None:
        """Update group ``g`` at 1-based ``step``; gradients from ``grads`` or from the store."""
        start = time.perf_counter()
        for name in self.groups[g]:
            with self.lock:
                # host gets are private copies (test_host_gets_are_private_copies), so the
                # update runs in place on them
                param = self.store.get(name)
                grad = grads[name] if grads is not None else self.store.get(GRAD + name)
                if step == 1:  # a fresh run: moments start at zero whatever an old store holds
                    m = torch.zeros_like(param)
                    v = torch.zeros_like(param)
                else:
                    m = self.store.get(EXP_AVG + name).to(torch.float32)
                    v = self.store.get(EXP_AVG_SQ + name).to(torch.float32)
            t0 = time.perf_counter()
            if clip_coef is not None:
                grad = grad * clip_coef  # torch multiplies by the clamped coefficient, 1.0 included
            wd = 0.0 if name in self.no_decay else h.weight_decay
            adamw_update_(param, grad.to(torch.float32), m, v, step, h, wd)
            self.update_s += time.perf_counter() - t0
            mc, vc = self._codecs(param)
            with self.lock:
                # param, m and v are this update's own tensors (private gets or fresh zeros),
                # dropped right after: the store takes their memory instead of a copy
                self.store.put(name, param, codec="raw", copy=False)
                self.store.put(EXP_AVG + name, m, codec=mc, copy=False)
                self.store.put(EXP_AVG_SQ + name, v, codec=vc, copy=False)
        end = time.perf_counter()
        self.busy_s += end - start
        trace = getattr(self.store, "trace_span", None)
        if trace is not None:
            trace(f"adamw {g}", "optimizer", start, end)


class UpdateWorker:
    """A named thread that runs queued group updates; readers wait per group (``wait_group``).

    Updates that carry their gradients (``hold=True``) are bounded: at most ``max_queued`` wait
    while one runs, and ``submit`` blocks backward until there is room. Unbounded, a worker
    slower than backward would collect the whole model's gradients in RAM.
    """

    def __init__(self, run: Callable[..., None], max_queued: int | None = None) -> None:
        from trainer.memory import max_queued_default

        self._run = run
        self.max_queued = max_queued_default() if max_queued is None else max_queued
        if self.max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {self.max_queued}")
        self._slots = threading.Semaphore(self.max_queued + 1)
        self.wait_s = 0.0
        """Seconds ``submit`` blocked on a full queue (backward waiting for the optimizer)."""
        self._q: queue.Queue[tuple[int, bool, tuple[Any, ...]] | None] = queue.Queue()
        self._pending: dict[int, threading.Event] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="trainer-adamw", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            g, hold, args = item
            try:
                if self._error is None:
                    self._run(g, *args)
            except BaseException as e:  # handed to the training thread at its next wait
                self._error = e
            finally:
                del args, item  # the gradients go before the slot is given back
                if hold:
                    self._slots.release()
                self._pending[g].set()

    def submit(self, g: int, *args: Any, hold: bool = False) -> None:
        """Queue the update of group ``g``; ``hold``: its arguments hold gradients (bounded queue)."""
        self.wait_group(g)
        if hold:
            t0 = time.perf_counter()
            while not self._slots.acquire(timeout=0.5):
                if self._error is not None:
                    raise RuntimeError("the optimizer thread failed") from self._error
            self.wait_s += time.perf_counter() - t0
        self._pending[g] = threading.Event()
        self._q.put((g, hold, args))

    def wait_group(self, g: int) -> None:
        """Block until group ``g`` has no queued or running update."""
        ev = self._pending.get(g)
        if ev is not None:
            ev.wait()
            self._pending.pop(g, None)
        if self._error is not None:
            raise RuntimeError("the optimizer thread failed") from self._error

    def wait_all(self) -> None:
        """Block until every queued update is done."""
        for g in list(self._pending):
            self.wait_group(g)

    def close(self) -> None:
        """Finish queued work and stop the thread."""
        self._q.put(None)
        self._thread.join()
