"""The layer-streaming engine: one micro-batch forward and backward with weights from the store.

The model's own modules are the stateless templates: their parameters stay on the meta device and
``torch.func.functional_call`` binds the tensors fetched from the store's device window (on the
CPU, the RAM tier's own buffers, lent) just before each piece runs, while the next piece's
weights are prefetched. Only the layer-boundary
activations are kept (activation checkpointing at layer boundaries); backward walks the layers
in reverse, re-fetches each layer's weights, recomputes it with autograd on, and hands the
parameter gradients to a sink on the host at once.

The prelude (embeddings, position tables, attention masks) is the body's own forward up to the
first layer: the first layer is swapped for a module that raises with the arguments it was
called with, so each layer gets exactly the arguments the model itself would pass it.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from trainer.data import IGNORE_INDEX
from trainer.grad_drain import GradDrain
from trainer.model import ModelParts

GradSink = Callable[[int, dict[str, torch.Tensor]], None]
"""Receives (group index, {store key: fp32 host gradient}) for each parameter group."""


class _Captured(Exception):  # noqa: N818  (a control-flow signal, not an error)
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("first layer reached")
        self.args = args
        self.kwargs = kwargs


class _CaptureFirstLayer(nn.Module):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(args, kwargs)


def capture_first_layer(body: nn.Module, layers: nn.ModuleList, run: Callable[[], Any]) -> _Captured:
    """Run ``run`` (a forward of ``body``) until it calls ``layers[0]``; that call's arguments."""
    first = layers[0]
    layers[0] = _CaptureFirstLayer()
    try:
        run()
    except _Captured as c:
        c.__traceback__ = None  # its frames would keep the bound weights alive
        return c
    finally:
        layers[0] = first
    raise RuntimeError(f"{type(body).__name__}.forward never called its first layer")


def _detach_tree(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if x.requires_grad:
            raise RuntimeError(
                "a layer argument other than the hidden states depends on trained weights; "
                "this model's structure is not supported by the streaming engine"
            )
        return x
    if isinstance(x, tuple):
        return tuple(_detach_tree(v) for v in x)
    if isinstance(x, list):
        return [_detach_tree(v) for v in x]
    if isinstance(x, dict):
        return {k: _detach_tree(v) for k, v in x.items()}
    return x


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy over non -100 labels (transformers' ForCausalLMLoss)."""
    logits = logits.float()
    shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), shift.view(-1).to(logits.device),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def count_loss_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry a loss after the shift: the divisor of the token-mean loss."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


class StreamingEngine:
    """Runs forward and backward of one micro-batch piece by piece with weights from a store.

    All calls happen on the caller's thread; store calls go through ``store_lock`` so that an
    optimizer thread may share the store.
    """

    def __init__(self, parts: ModelParts, store: Any, device: torch.device, bf16: bool = False,
                 store_lock: contextlib.AbstractContextManager[Any] | None = None,
                 before_fetch: Callable[[int], None] | None = None, window_bytes: int | None = None,
                 drain: GradDrain | None = None, lend: bool | None = None,
                 updating: Callable[[int], bool] | None = None) -> None:
        self.parts = parts
        self.store = store
        self.device = device
        self.bf16 = bf16
        self.lock = store_lock or contextlib.nullcontext()
        self.before_fetch = before_fetch
        #: whether a group's update is under way: its weights are not read ahead then (the
        #: update leaves them in RAM itself), and the fetch before it does not wait for it
        self.updating = updating
        self.groups = parts.groups()
        # What each piece reads: its own group, plus the tied embedding for the head.
        self.reads = [list(names) for _, names in self.groups]
        if parts.tied:
            self.reads[-1].append(parts.head_params["weight"])
        self.body_prefix = f"{parts.body_name}." if parts.body_name else ""
        self.window_bytes = window_bytes
        # On the CPU the window is host memory too: a layer computes on the RAM tier's own
        # buffers (``get(copy=False)``: read-only loans, no copy into the window), and weights
        # are read ahead into the RAM tier. A tensor the store cannot lend is still copied.
        self.lend = device.type == "cpu" if lend is None else lend
        #: set while each group's update follows its backward at once (no clipping, the last
        #: micro-batch): a group's lent weights are handed to it after backward, and held until
        #: its update begins (``StoreAdamW.keep_for_update``): read again otherwise, when the
        #: RAM tier had evicted them in between
        self.keep_for_update: Callable[[int, list[torch.Tensor]], None] | None = None
        self.read_bytes = [sum(int(store.info(n).nbytes) for n in names) for names in self.reads]
        biggest = max(range(len(self.reads)), key=self.read_bytes.__getitem__)
        if window_bytes is not None and self.read_bytes[biggest] > window_bytes:
            raise ValueError(
                f"the device window ({window_bytes} B) is smaller than one piece of the model "
                f"({self.groups[biggest][0]}: {self.read_bytes[biggest]} B); each piece must fit: "
                "raise max_vram_gb"
            )
        # layer gradients leave the device on a D2H stream as each backward ends (grad_drain.py)
        self.drain = drain or GradDrain.for_groups(device, self.read_bytes, store=store)
        weakref.finalize(self, self.drain.close_soon)

    # -- weights ---------------------------------------------------------------------------
    def _hint(self, g: int, current: int) -> tuple[list[str], str] | None:
        """The prefetch of group ``g`` while group ``current`` is held: to the device when both fit the window."""
        if not 0 <= g < len(self.groups):
            return None
        if self.updating is not None and self.updating(g):
            return None
        if self.before_fetch is not None:
            self.before_fetch(g)  # never prefetch weights an update has yet to write
        both = self.read_bytes[g] + self.read_bytes[current]
        # A window too small for two pieces gets no double buffering: warm the RAM tier instead.
        fits = self.window_bytes is None or both <= self.window_bytes
        to = "device" if fits and not self.lend else "host"
        return self.reads[g], to

    def _fetch(self, g: int, grad: bool, ahead: int | None = None
               ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """Group ``g``'s weights from the device window (on the CPU: lent by the RAM tier), and
        the tensors to hold meanwhile.

        ``ahead``: the group to prefetch next, started in the same hop to the store's loop once
        ``g``'s reads are done (one hop a group, not one a tensor: each hop wakes the loop thread,
        which on busy cores is scheduled late). The window counts a tensor's bytes while the
        object it handed out is alive, so the originals are held as long as their autograd leaves
        (aliases of the same memory) are.
        """
        t0 = time.perf_counter()
        if self.before_fetch is not None:
            self.before_fetch(g)
        hint = None if ahead is None else self._hint(ahead, g)
        with self.lock:
            held = self.store.get_many(self.reads[g], device=self.device,
                                       then_prefetch=[hint] if hint is not None else (), copy=not self.lend)
        # Read-only: detach() shares the memory, and autograd never writes its leaves.
        out = {name: t.detach().requires_grad_(grad) if grad else t
               for name, t in zip(self.reads[g], held, strict=True)}
        self._span(f"fetch {g}", "wait", t0)
        return out, held

    def _keep(self, g: int, held: list[torch.Tensor]) -> None:
        """Hand group ``g``'s lent weights to its update (``keep_for_update``), if one is set."""
        if self.lend and self.keep_for_update is not None:
            self.keep_for_update(g, held)

    def _span(self, name: str, cat: str, t0: float) -> None:
        """Trace ``name`` from ``t0`` to now on this thread (``tierstore trace`` draws it)."""
        trace = getattr(self.store, "trace_span", None)
        if trace is not None:
            trace(name, cat, t0, time.perf_counter())

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    @contextlib.contextmanager
    def _rng(self, state: tuple[torch.Tensor, torch.Tensor | None] | None) -> Iterator[None]:
        # Recompute with the RNG state of the original forward, so dropout masks match.
        if state is None:
            yield
            return
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.set_rng_state(state[0])
            if state[1] is not None:
                torch.cuda.set_rng_state(state[1], self.device)
            yield

    def _rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    # -- pieces ----------------------------------------------------------------------------
    def _prelude(self, w: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> _Captured:
        """The body's forward up to its first layer (embeddings, masks, rotary): its arguments."""
        local = {n[len(self.body_prefix):]: t for n, t in w.items()}

        def run() -> None:
            with self._autocast():
                functional_call(self.parts.body, local, args=(),
                                kwargs={"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                                        "use_cache": False})
        return capture_first_layer(self.parts.body, self.parts.layers, run)

    def _layer(self, i: int, w: dict[str, torch.Tensor], h: torch.Tensor, cap: _Captured) -> torch.Tensor:
        prefix = f"{self.parts.layers_name}.{i}."
        local = {n[len(prefix):]: t for n, t in w.items()}
        with self._autocast():
            out = functional_call(self.parts.layers[i], local, args=(h, *cap.args[1:]), kwargs=cap.kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out

    def _head(self, w: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        norm_prefix = self.parts.norm_name + "."
        norm_w = {n[len(norm_prefix):]: t for n, t in w.items() if n.startswith(norm_prefix)}
        head_w = {ln: w[full] for ln, full in self.parts.head_params.items()}
        with self._autocast():
            x = functional_call(self.parts.norm, norm_w, args=(h,))
            return functional_call(self.parts.head, head_w, args=(x,))

    # -- one micro-batch -------------------------------------------------------------------
    def forward_backward(self, batch: dict[str, torch.Tensor], num_items: int, sink: GradSink) -> float:
        """Forward and backward of one micro-batch; returns its summed token loss.

        The loss that is differentiated is ``sum / num_items`` (``num_items``: loss tokens of the
        whole accumulation window), which gives transformers' gradient-accumulation semantics.
        """
        batch = {k: v.to(self.device) for k, v in batch.items()}
        n_layers = len(self.parts.layers)
        head_g = n_layers + 1
        rng: list[Any] = []
        # Forward without autograd, keeping only the layer-boundary activations.
        with torch.no_grad():
            w, held = self._fetch(0, grad=False, ahead=1)
            rng.append(self._rng_state())
            t0 = time.perf_counter()
            cap = self._prelude(w, batch)
            self._span("forward 0", "compute", t0)
            del w, held
            h = cap.args[0]
            cap.args = (None, *cap.args[1:])
            boundary: list[torch.Tensor] = []
            boundary.append(h)
            for i in range(n_layers):
                w, held = self._fetch(i + 1, grad=False, ahead=i + 2)
                rng.append(self._rng_state())
                t0 = time.perf_counter()
                h = self._layer(i, w, h, cap)
                self._span(f"forward {i + 1}", "compute", t0)
                del w, held
                boundary.append(h)
        # Norm + head + loss with autograd; their backward runs right away.
        w, held = self._fetch(head_g, grad=True, ahead=n_layers)
        x = boundary.pop().detach().requires_grad_()
        t0 = time.perf_counter()
        logits = self._head(w, x)
        loss_sum = causal_lm_loss_sum(logits, batch["labels"])
        grads = torch.autograd.grad(loss_sum / num_items, [x, *w.values()], allow_unused=True)
        loss_sum = loss_sum.detach()  # its graph holds the head's weights (as leaves) while alive
        dh = grads[0]
        head_grads = self._host_grads(w, grads[1:])
        self._span(f"head {head_g}", "compute", t0)
        self._keep(head_g, held)
        del logits, w, held, grads
        tied_key = self.parts.head_params.get("weight") if self.parts.tied else None
        tied_grad = head_grads.pop(tied_key) if tied_key is not None and tied_key in head_grads else None
        sink(head_g, head_grads)
        # Layers in reverse: re-fetch, recompute with autograd, backprop the boundary gradient.
        for i in reversed(range(n_layers)):
            w, held = self._fetch(i + 1, grad=True, ahead=i)  # group i is layer i-1, or the prelude when i == 0
            x = boundary.pop().detach().requires_grad_()
            t0 = time.perf_counter()
            with torch.enable_grad(), self._rng(rng[i + 1]):
                out = self._layer(i, w, x, cap)
            grads = torch.autograd.grad(out, [x, *w.values()], dh, allow_unused=True)
            dh = grads[0]
            self._span(f"backward {i + 1}", "compute", t0)
            layer_grads = self._device_grads(w, grads[1:])
            self._keep(i + 1, held)
            # nothing here may still hold the weights once the sink can start their update:
            # a loan alive then makes the update copy them (copy-on-write)
            del out, w, held, grads
            self.drain.submit(i + 1, layer_grads, sink)
            del layer_grads
        # The prelude: recompute the embeddings with autograd and backprop into them.
        w, held = self._fetch(0, grad=True)
        t0 = time.perf_counter()
        with torch.enable_grad(), self._rng(rng[0]):
            c = self._prelude(w, batch)
        _detach_tree((c.args[1:], c.kwargs))  # raises if a layer argument depends on weights
        grads = torch.autograd.grad(c.args[0], list(w.values()), dh, allow_unused=True)
        pre = self._host_grads(w, grads)
        self._span("backward 0", "compute", t0)
        self._keep(0, held)
        del w, held, c, grads
        self.drain.flush()  # every layer's sink has run: the prelude's comes last, as before
        if tied_grad is not None:
            pre[tied_key] = pre[tied_key] + tied_grad  # type: ignore[index]
        sink(0, pre)
        return float(loss_sum.detach())

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[float, int]:
        """Forward only (no autograd, nothing kept): the summed token loss and its token count."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        n_layers = len(self.parts.layers)
        with torch.no_grad():
            w, held = self._fetch(0, grad=False, ahead=1)
            cap = self._prelude(w, batch)
            del w, held
            h = cap.args[0]
            cap.args = (None, *cap.args[1:])
            for i in range(n_layers):
                w, held = self._fetch(i + 1, grad=False, ahead=i + 2)
                h = self._layer(i, w, h, cap)
                del w, held
            w, held = self._fetch(n_layers + 1, grad=False, ahead=0)  # the next batch starts at the prelude again
            loss_sum = causal_lm_loss_sum(self._head(w, h), batch["labels"])
            del w, held
        return float(loss_sum), count_loss_tokens(batch["labels"])

    @staticmethod
    def _device_grads(w: dict[str, torch.Tensor], grads: tuple[torch.Tensor | None, ...]) -> dict[str, torch.Tensor]:
        # An unused parameter gets a zero gradient (on the host: nothing to copy down).
        return {name: g if g is not None else torch.zeros(t.shape, dtype=torch.float32)
                for (name, t), g in zip(w.items(), grads, strict=True)}

    @staticmethod
    def _host_grads(w: dict[str, torch.Tensor], grads: tuple[torch.Tensor | None, ...]) -> dict[str, torch.Tensor]:
        # Gradients leave the device at once, as fp32 on the host.
        out: dict[str, torch.Tensor] = {}
        for (name, t), g in zip(w.items(), grads, strict=True):
            if g is None:  # an unused parameter gets a zero gradient, as autograd + zero_grad would
                g = torch.zeros(t.shape, dtype=torch.float32)
            out[name] = g.detach().to("cpu", torch.float32)
        return out
