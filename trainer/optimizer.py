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

import concurrent.futures
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
from tierstore.kernel_threads import limit_this_thread

GRAD = "grad/"
EXP_AVG = "opt/exp_avg/"
EXP_AVG_SQ = "opt/exp_avg_sq/"


#: per lossy moment codec: (worst measured mean gap of the final training loss to fp32 AdamW over
#: ``tools.bench.convergence``'s grid, the goal it must meet to be a default). Only a codec
#: within its goal is picked by ``optimizer_compression=True``; the others stay usable by name,
#: with a warning that names the gap. docs/codecs.md has the runs.
MOMENT_CODEC_GAPS: dict[str, tuple[float, float]] = {
    # q8: 1.1M params, lr 1e-3, 3 seeds (docs/codecs.md). The grid record (docs/convergence) has
    # q8 within 1% at lr 1e-3 (1.1M +0.35%, 4.33M -0.35%, 14.4M +0.09%, 2 seeds each); at lr 3e-3
    # -0.64% at 1.1M (12 seeds) and -0.07% at 4.33M (8 seeds) (-0.80% at 14.4M, 4 seeds): lower
    # loss than fp32, with single seeds spread over -3.5%..+2.4% (standard errors 0.3-0.6 points)
    "q8": (-0.0025, 0.01),
    # q4 (m: subtractive dither, sqrt map): the grid's worst cell, 14.4M params, lr 3e-3, 4 seeds;
    # the others -0.61% (1.1M, lr 3e-3, 12 seeds, standard error 0.51 points), -0.60% (1.1M,
    # lr 1e-3), +0.23% / -0.23% (4.33M, lr 1e-3 / 3e-3, 2 / 8 seeds), +0.67% (14.4M, lr 1e-3):
    # every cell within 1% on average, at lr 3e-3 by less than one standard error
    "q4": (0.0096, 0.01),
    # q3: 4.33M params, lr 3e-3, 2 seeds (1.1M: -1.00% at lr 1e-3, -4.83% at 3e-3; 4.33M lr 1e-3:
    # -3.38%); q2: 1.1M params, lr 3e-3 (lr 1e-3: -0.86%; 4.33M: -6.06% at lr 1e-3, -5.03% at 3e-3)
    "q3": (-0.0569, 0.03),
    "q2": (-0.1007, 0.03),
}
#: where MOMENT_CODEC_GAPS was measured, for the warning
GAPS_MEASURED = "tools.bench.convergence, byte-level Llama, 300 steps, paired with fp32"
#: per lossy moment codec whose loss met its goal: (the coded AdamW update's length over fp32's,
#: the goal for its distance from 1). q4: ``tools.bench.moment_stats --steps 100 --lr 3e-3``
#: (1.1M params; 1.073 at lr 1e-3): the re-quantized ``m`` keeps each step's rounding noise
#: (docs/codecs.md). q8: 1.0002 at lr 1e-3, within the goal.
MOMENT_UPDATE_LENGTH: dict[str, tuple[float, float]] = {"q8": (1.0002, 0.02), "q4": (1.1032, 0.02)}


def requested_moment_codec(compression: bool | str | None) -> str:
    """The codec name ``compression`` asks for (True: q8, False/None: raw), not yet checked."""
    return "q8" if compression is True else (compression or "raw")


def moment_codec_name(compression: bool | str | None) -> str:
    """The codec asked for the Adam moments: True means q8, False/None raw; CodecError if unknown.

    True picks q8, the one lossy codec that met its goals (loss, ``MOMENT_CODEC_GAPS``; update
    length, ``MOMENT_UPDATE_LENGTH``); one that misses either is opt-in: named explicitly it is
    used, with a warning naming what it missed and by how much.
    """
    name = requested_moment_codec(compression)
    tierstore.codecs.get(name)  # raises CodecError naming the registered codecs
    gap, goal = MOMENT_CODEC_GAPS.get(name, (0.0, 1.0))
    length, length_goal = MOMENT_UPDATE_LENGTH.get(name, (1.0, 1.0))
    if abs(gap) > goal:
        warnings.warn(
            f"moment codec {name!r} changes AdamW's dynamics: its training loss differed from fp32 "
            f"AdamW's by {gap:+.2%} ({GAPS_MEASURED}), outside the {goal:.0%} goal; tuned "
            "hyper-parameters may not transfer. q8 met its goals where measured.",
            UserWarning, stacklevel=2)
    elif abs(length - 1) > length_goal:
        warnings.warn(
            f"moment codec {name!r} changes AdamW's update: it is {length:.3f}x as long as fp32 "
            f"AdamW's (tools.bench.moment_stats), outside the {length_goal:.0%} goal, though the "
            f"training loss stayed within {goal:.0%} of fp32's (worst {gap:+.2%}; {GAPS_MEASURED}); "
            "tuned hyper-parameters may not transfer. q8 met its goals where measured.",
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


def adamw_update_many_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                       exp_avg_sqs: list[torch.Tensor], step: int, h: AdamWHyper, weight_decay: float) -> None:
    """``adamw_update_`` of every ``(param, grad, exp_avg, exp_avg_sq)``: one fused call for fp32 CPU lists."""
    if _FUSED is not None and all(t.device.type == "cpu" and t.dtype == torch.float32
                                  for ts in (params, grads, exp_avgs, exp_avg_sqs) for t in ts):
        steps = [torch.tensor(float(step))] * len(params)  # read by the kernel, never written
        _FUSED(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=h.lr, beta1=h.beta1, beta2=h.beta2,
               weight_decay=weight_decay, eps=h.eps, amsgrad=False, maximize=False)
        return
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        adamw_update_(p, g, m, v, step, h, weight_decay)


class StoreAdamW:
    """AdamW whose every state tensor lives in a tierstore Store; one group updated at a time."""

    def __init__(self, store: Any, groups: list[list[str]], no_decay: set[str], compression: bool | str | None,
                 lock: contextlib.AbstractContextManager[Any], backward_order: bool = False) -> None:
        """``backward_order``: the groups are updated last first, as backward hands over their
        gradients (no clipping); else in the order given (after backward, with clipping)."""
        self.store = store
        self.groups = groups
        self.no_decay = no_decay
        self.moment_codec = moment_codec_name(compression)
        self.lock = lock
        self.update_s = 0.0
        """Seconds of AdamW arithmetic."""
        self._clip_scratch: torch.Tensor | None = None
        #: each group's parameters in the batches lent at once (``_batches``), worked out once
        self._batch_plan: list[list[list[str]]] = []
        #: parameters whose moments this optimizer put or found: asked of the store once, not
        #: every step (each question is a hop to the store's loop thread)
        self._has_moments: set[str] = set()
        # the order of updates is known: the store evicts and writes back what comes last and
        # reads ahead what comes next (state larger than the RAM budget moves the fewest bytes);
        # the weights are read three times a step (forward, backward, update): kept first.
        # The plan runs in the order of the updates: the reverse order would rank the group
        # updated next as needed last, and read ahead the one just updated
        plan = getattr(store, "plan", None)
        if plan is not None:
            weights = [n for names in (groups[::-1] if backward_order else groups) for n in names]
            plan([k for n in weights for k in (n, EXP_AVG + n, EXP_AVG_SQ + n)], hot=weights)
        self.busy_s = 0.0
        """Seconds of whole group updates: store reads and writes plus the arithmetic."""
        #: group -> its weights as backward's loans, held until its update begins (set on the
        #: training thread, taken on the update's; a dict's set and pop are atomic)
        self._kept: dict[int, list[torch.Tensor]] = {}
        #: gradient puts started and not yet waited for (``accumulate``, ``settle_puts``)
        self._puts: list[concurrent.futures.Future[None]] = []
        self._puts_lock = threading.Lock()

    def keep_for_update(self, g: int, loans: list[torch.Tensor]) -> None:
        """Hold group ``g``'s weights (backward's read-only loans) until its update begins.

        A loan keeps the RAM tier from evicting the weights between the group's backward and
        its update, which would otherwise read them again; the update lets go of it before it
        borrows them writable (a loan still held would make it copy them).
        """
        self._kept[g] = list(loans)

    def drop_kept(self) -> None:
        """Let go of every weight still held for an update (a step that ends without them)."""
        self._kept.clear()

    def _codecs(self, t: torch.Tensor) -> tuple[Any, Any]:
        # one policy for the whole project: small and 1-D tensors stay raw, v is unsigned,
        # moments get stochastic rounding but q4's m, dithered (tierstore.codecs.policy says why)
        shape = tuple(t.shape)
        return (tierstore.codecs.choose_codec(self.moment_codec, shape, "exp_avg"),
                tierstore.codecs.choose_codec(self.moment_codec, shape, "exp_avg_sq"))

    def accumulate(self, grads: dict[str, torch.Tensor], first: bool) -> dict[str, torch.Tensor]:
        """Add one micro-batch's gradients to ``grad/<name>`` in place; returns the running sums.

        The sums returned are the store's own buffers only for the first micro-batch (the
        caller's tensors, handed over: read them, never write them); later ones are copies,
        read after the in-place add. Gradients stay in RAM (counted in its budget) and reach
        the disk only if the budget needs their room before the update consumes them.
        """
        if first:
            # one hop to the store's loop for the group, not waited for: backward goes on while
            # the loop takes them in (and, in a full budget, waits for room); every later call
            # on these keys settles the puts first (``settle_puts``). One group at most is under
            # way: its gradients are not in the RAM budget until put (the plan counts it as the
            # optimizer queue's slot, which is empty while gradients go through the store)
            self.settle_puts()
            with self.lock:
                future = self.store.put_many([(GRAD + name, g) for name, g in grads.items()], codec="raw",
                                             copy=False, lazy=True, wait=False)
            with self._puts_lock:
                self._puts.append(future)
            return dict(grads)
        self.settle_puts()
        out = {}
        for name, g in grads.items():
            with self.lock:
                with self.store.update(GRAD + name) as total:
                    total.add_(g)
                out[name] = self.store.get(GRAD + name)
        return out

    def settle_puts(self) -> None:
        """Wait for the gradient puts under way (any thread); raise the first one's error."""
        with self._puts_lock:
            puts, self._puts = self._puts, []
        failure: BaseException | None = None
        for f in puts:
            try:
                f.result()
            except BaseException as e:  # every put is waited for, the first error raised
                failure = failure or e
        if failure is not None:
            raise failure

    def add_accumulated(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The running sums plus this micro-batch's gradients, without writing them back."""
        self.settle_puts()
        with self.lock:
            return {name: self.store.get(GRAD + name) + g for name, g in grads.items()}

    def _scaled(self, grads: list[torch.Tensor], clip_coef: float) -> list[torch.Tensor]:
        """``g * clip_coef`` of each (as torch's clipping computes it) in one scratch reused across calls."""
        n = sum(g.numel() for g in grads)
        if self._clip_scratch is None or self._clip_scratch.numel() < n:
            self._clip_scratch = torch.empty(n, dtype=torch.float32)
        out, at = [], 0
        for g in grads:
            o = self._clip_scratch[at : at + g.numel()].view(g.shape)
            torch.mul(g, clip_coef, out=o)
            out.append(o)
            at += g.numel()
        return out

    def _batches(self, g: int) -> list[list[str]]:
        """Group ``g``'s parameters in the batches lent at once (one hop to the store's loop each way).

        The whole group when the whole optimizer state fits half the RAM budget (nothing
        streams); else consecutive parameters whose weights, moments and gradients (fp32) add
        up to at most 1/16 of the budget, one parameter alone when it is larger: a group lent
        whole would crowd out the weights the next pass streams, and one parameter a batch took
        9 hops a layer of a Llama where 4 or 5 do. Worked out once, for every group.
        """
        if not self._batch_plan:
            budget = getattr(getattr(self.store, "config", None), "ram_budget", None)
            nbytes = {} if budget is None else {
                n: int(self.store.info(n).nbytes) for group in self.groups for n in group}
            # the state (weights and both moments) fits half the budget: whole groups
            cap = None if budget is None or 3 * sum(nbytes.values()) <= budget // 2 else budget // 16
            for names in self.groups:
                if cap is None:
                    self._batch_plan.append([list(names)])
                    continue
                batches: list[list[str]] = []
                used = cap  # the first parameter opens a batch
                for n in names:
                    size = 4 * nbytes[n]  # weight, both moments, gradient
                    if used + size > cap:
                        batches.append([])
                        used = 0
                    batches[-1].append(n)
                    used += size
                self._batch_plan.append(batches)
        return self._batch_plan[g]

    def update_group(self, g: int, step: int, h: AdamWHyper, clip_coef: float | None,
                     grads: dict[str, torch.Tensor] | None = None) -> None:
        """Update group ``g`` at 1-based ``step``; gradients from ``grads`` or from the store.

        Weights and moments are updated where they live in the store (``Store.update_many``,
        one flat view per chunk): no copy and no fresh page for raw state in the RAM budget, and
        no disk write until the budget or a commit needs one. Coded moments are decoded into
        a scratch buffer and encoded back at the end of the update.
        """
        start = time.perf_counter()
        self.settle_puts()  # the gradients it reads are in the store
        self._kept.pop(g, None)  # backward's loans go before the update borrows the weights
        for names in self._batches(g):
            self._update(names, step, h, clip_coef, grads)
        end = time.perf_counter()
        self.busy_s += end - start
        trace = getattr(self.store, "trace_span", None)
        if trace is not None:
            trace(f"adamw {g}", "optimizer", start, end)

    def _update(self, names: list[str], step: int, h: AdamWHyper, clip_coef: float | None,
                grads: dict[str, torch.Tensor] | None) -> None:
        """One AdamW step of ``names``, their weights and moments lent by the store together.

        Gradients not passed in are lent writable with them (clipped in place, as torch clips
        ``.grad``) and deleted after the step: consumed, they never need to reach the disk.
        """
        from_store = grads is None
        gs: list[Any] = [] if from_store else [grads[n].to(torch.float32) for n in names]
        if clip_coef is not None and not from_store:
            gs = self._scaled(gs, clip_coef)  # torch multiplies by the clamped coefficient, 1.0 included
        per = 4 if from_store else 3
        keys = [k for n in names for k in (n, EXP_AVG + n, EXP_AVG_SQ + n)
                + ((GRAD + n,) if from_store else ())]
        with contextlib.ExitStack() as stack:
            with self.lock:
                for n in names:
                    if step > 1 and n in self._has_moments:
                        continue
                    if step == 1 or EXP_AVG + n not in self.store:
                        # a fresh run: moments start at zero whatever an old store holds
                        info = self.store.info(n)
                        zeros = torch.zeros(info.shape, dtype=torch.float32)
                        mc, vc = self._codecs(zeros)
                        self.store.put(EXP_AVG + n, zeros, codec=mc)
                        self.store.put(EXP_AVG_SQ + n, zeros, codec=vc)
                    self._has_moments.add(n)
                # one hop to the store's loop each way; the gradients, consumed, go in the second
                gone = [GRAD + n for n in names] if from_store else []
                lent = stack.enter_context(self.store.update_many(keys, chunked=True, then_delete=gone))
            t0 = time.perf_counter()
            by_wd: dict[float, tuple[list[torch.Tensor], ...]] = {}
            for j, n in enumerate(names):
                params, ms, vs = lent[per * j : per * j + 3]
                if from_store:
                    grad = lent[per * j + 3]
                    if clip_coef is not None:
                        torch._foreach_mul_(grad, clip_coef)
                else:
                    grad = [gs[j].reshape(-1)]
                wd = 0.0 if n in self.no_decay else h.weight_decay
                lists = by_wd.setdefault(wd, ([], [], [], []))
                if len(params) == len(ms) == len(vs) == len(grad) == 1:  # one chunk each: as lent
                    for dst, src in zip(lists, (params, grad, ms, vs), strict=True):
                        dst.append(src[0])
                    continue
                # weights and moments of one shape usually share their chunks; where they do
                # not (bf16 weights) each is cut where any of them has a chunk end: views only
                bounds = _bounds(params, ms, vs, grad)
                for dst, src in zip(lists, (params, grad, ms, vs), strict=True):
                    dst.extend(_cut(src, bounds))
            for wd, (ps, gl, ml, vl) in by_wd.items():
                adamw_update_many_(ps, gl, ml, vl, step, h, wd)
            self.update_s += time.perf_counter() - t0


def _cut(parts: list[torch.Tensor], bounds: list[int]) -> list[torch.Tensor]:
    """Views of consecutive flat ``parts`` cut at every offset in ``bounds`` (sorted, ending at the total)."""
    out: list[torch.Tensor] = []
    it = iter(parts)
    cur = next(it)
    base = 0  # offset of ``cur`` in the whole
    lo = 0
    for hi in bounds:
        while hi > base + cur.numel():  # pieces never straddle: every part end is a bound
            base += cur.numel()
            cur = next(it)
        out.append(cur[lo - base : hi - base])
        lo = hi
    return out


def _bounds(*lists: list[torch.Tensor]) -> list[int]:
    """Every offset where a part of any of ``lists`` ends (the common refinement of their chunks)."""
    ends: set[int] = set()
    for parts in lists:
        at = 0
        for p in parts:
            at += p.numel()
            ends.add(at)
    return sorted(ends)


class UpdateWorker:
    """A named thread that runs queued group updates; readers wait per group (``wait_group``).

    Updates that carry their gradients (``hold=True``) are bounded: at most ``max_queued`` wait
    while one runs, and ``submit`` blocks backward until there is room. Unbounded, a worker
    slower than backward would collect the whole model's gradients in RAM.
    """

    def __init__(self, run: Callable[..., None], max_queued: int | None = None,
                 kernel_threads: int | None = None) -> None:
        from trainer.memory import max_queued_default

        self._run = run
        self._kernel_threads = kernel_threads  # OpenMP threads of its kernels (None: torch's default)
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
        if self._kernel_threads is not None:
            limit_this_thread(self._kernel_threads)
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

    def updating(self, g: int) -> bool:
        """Whether group ``g`` has an update queued or running (never blocks)."""
        ev = self._pending.get(g)
        return ev is not None and not ev.is_set()

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
