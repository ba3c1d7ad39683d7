"""One decode step of streaming generation: ``Generator`` runs the new positions through every streamed piece.

``Generator.step`` runs the same ``StreamingEngine`` pieces as training and evaluation (prelude,
each decoder layer, norm + head) once per new token, for the whole batch at once: every token
costs one pass over the weights whatever the batch size (FlexGen's schedule), and while a piece
computes, the next one's weights (and KV blocks, ``trainer.kv_cache``) are prefetched from the
known plan, wrapping around from the head to the next token's prelude.

Threads: everything runs on the caller's thread; store calls go through the store's sync facade,
one hop per piece (``Store.get_many`` reads its weights and starts the next piece's prefetch).

On the CPU the window would be a second copy of bytes the RAM tier already holds (raw fp32 or
bf16 chunks): there the weights are read with ``copy=False``, which lends the RAM tier's own
buffers (counted in the RAM budget, read-only here, unchanged by later puts) and prefetch hints
warm the RAM tier instead of the window. Tensors that cannot be lent (a compressed codec, several
chunks) are copied into the window as before. The pieces run with the window tensors swapped into
the skeleton's parameters in place (what ``functional_call`` does, without its walk over every
named tensor per call).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from trainer import session
from trainer.grad_drain import GradDrain
from trainer.kv_cache import StoreKV
from trainer.model import ModelParts, decompose
from trainer.streaming import StreamingEngine, capture_first_layer


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    # The skeleton's buffers (rotary tables) stay where they were made: on the CPU.
    for mod in model.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None and b.device != device:
                mod._buffers[name] = b.to(device)


def cache_kwarg(body: nn.Module) -> str:
    """The name the body's forward takes its KV cache by: ``cache`` (transformers 5.2x) or ``past_key_values``.

    An unknown keyword is swallowed by the model's ``**kwargs``: passed by the wrong name, the
    cache is silently unused and every decode step attends to its own position only.
    """
    params = inspect.signature(body.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise ValueError(f"{type(body).__name__}.forward takes neither cache= nor past_key_values=: "
                     "it has no KV cache to stream")


class Generator:
    """One model's streaming generation: the engine, the plan of reads, and the per-call KV cache."""

    def __init__(self, model: nn.Module, store: Any, device: torch.device | str | None = None) -> None:
        if device is None:
            device = session.compute_device()
        self.device = torch.device(device)
        self.model = model
        self.store = store
        self.parts: ModelParts = decompose(model)
        have = set(store.keys())
        missing = [n for n in self.parts.all_params() if n not in have]
        if missing:
            raise ValueError(f"the store at {getattr(store, 'path', '?')} lacks {len(missing)} weights of "
                             f"{type(model).__name__}, e.g. {missing[:3]}")
        if self.device.type != "cpu":
            _buffers_to(model, self.device)
        self.engine = StreamingEngine(self.parts, store, self.device, window_bytes=store.stats().get("device_budget"),
                                      drain=GradDrain(self.device, None, threaded=False))
        self.n_layers = len(self.parts.layers)
        self.n_groups = self.n_layers + 2
        # a CPU window lends the RAM tier's buffers: a copy into it would be pure overhead
        # (measured: the copy of 89 MiB of weights a token cost more than the compute)
        self.lend = self.engine.lend
        self.binds = self._bindings()
        self.cache_kwarg = cache_kwarg(self.parts.body)

    def _bindings(self) -> list[list[tuple[nn.Module, str, str]]]:
        """Per piece: (module, attribute, store key) of each weight it runs with."""
        root = self.parts.model

        def at(mod: nn.Module, local: str, key: str) -> tuple[nn.Module, str, str]:
            owner, _, attr = local.rpartition(".")
            return (mod.get_submodule(owner) if owner else mod), attr, key

        out = [[at(root, n, n) for n in names] for _, names in self.engine.groups[:-1]]
        head = [at(root, n, n) for n in self.parts.norm_params]
        head += [at(self.parts.head, ln, full) for ln, full in self.parts.head_params.items()]
        out.append(head)
        return out

    @contextlib.contextmanager
    def _bound(self, g: int, w: dict[str, torch.Tensor]) -> Iterator[None]:
        # The skeleton's meta parameters swapped for the window tensors in place: what
        # functional_call does, without its per-call walk over every named tensor.
        saved = []
        try:
            for mod, attr, key in self.binds[g]:
                saved.append((mod, attr, mod._parameters[attr]))
                mod._parameters[attr] = w[key]  # type: ignore[assignment]
            yield
        finally:
            for mod, attr, p in saved:
                mod._parameters[attr] = p

    def _fetch(self, g: int, kv: StoreKV) -> dict[str, torch.Tensor]:
        """Piece ``g``'s weights (and its layer's KV blocks when they fit beside), then the next piece's hints: one hop."""
        names = self.engine.reads[g]
        layer = g - 1
        extra = kv.keys(layer) if 0 <= layer < self.n_layers and kv.blocks[layer] and kv.fits(layer) else []
        got = self.store.get_many(names + extra, device=self.device, then_prefetch=self._hints(g, kv),
                                  copy=not self.lend)
        if extra:
            kv.fetched[layer] = got[len(names):]
        return dict(zip(names, got[: len(names)], strict=True))

    def _hints(self, g: int, kv: StoreKV) -> list[tuple[list[str], str]]:
        """What to prefetch while piece ``g`` runs: the next piece (wrapping to the next token's prelude) and its KV blocks."""
        nxt = (g + 1) % self.n_groups
        eng = self.engine
        w = kv.window_bytes
        both = eng.read_bytes[nxt] + eng.read_bytes[g] + kv.workspace_bytes
        # a window too small for two pieces beside the workspace, or a borrower of the RAM
        # tier's buffers: warm the RAM tier instead
        to = "device" if not self.lend and (w is None or both <= w) else "host"
        out = [(list(eng.reads[nxt]), to)]
        layer = nxt - 1
        if 0 <= layer < self.n_layers and kv.blocks[layer]:
            up = to == "device" and (w is None or both + kv.block_bytes(layer) <= w)
            out.append((kv.keys(layer), "device" if up else "host"))
        return out

    def _prelude(self, w: dict[str, torch.Tensor], input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor, cache: Any) -> Any:
        """The body's forward up to its first layer (embeddings, masks, rotary): its arguments, captured."""
        def run() -> None:
            with self._bound(0, w):
                self.parts.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                                position_ids=position_ids, **{self.cache_kwarg: cache})
        return capture_first_layer(self.parts.body, self.parts.layers, run)

    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
             kv: StoreKV, cache: Any) -> torch.Tensor:
        """One forward of the new positions through every piece; the last position's fp32 logits."""
        w = self._fetch(0, kv)
        cap = self._prelude(w, input_ids, attention_mask, position_ids, cache)
        del w
        h = cap.args[0]
        cap.args = (None, *cap.args[1:])
        layers = self.parts.layers
        for i in range(self.n_layers):
            w = self._fetch(i + 1, kv)
            with self._bound(i + 1, w):
                out = layers[i](h, *cap.args[1:], **cap.kwargs)
            h = out[0] if isinstance(out, (tuple, list)) else out
            del w, out
        g = self.n_layers + 1
        w = self._fetch(g, kv)
        with self._bound(g, w):
            logits = self.parts.head(self.parts.norm(h[:, -1:, :]))
        del w
        return logits[:, -1, :].to(torch.float32)
