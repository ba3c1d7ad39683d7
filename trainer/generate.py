"""Generation on the trainer's machinery: layers stream through the device window, the KV cache lives in the store.

``generate`` runs the same ``StreamingEngine`` pieces as training and evaluation (prelude, each
decoder layer, norm + head) once per new token, for the whole batch at once: every token costs one
pass over the weights whatever the batch size (FlexGen's schedule), and while a piece computes,
the next one's weights (and KV blocks) are prefetched from the known plan, wrapping around from
the head to the next token's prelude.

The KV cache is a ``transformers`` ``Cache`` whose layers keep their keys and values in the store:
each layer's positions are cut into blocks of ``kv_block_tokens``; a full block is ``put`` under
``generate/<run>/kv/<layer>/<block>`` (keys and values stacked: one tensor, one read) and read back
into the device window when the layer runs (with its weights, in one store hop, when they fit
beside; else one block at a time), so it sits in the window, the RAM tier or on disk as the budgets
allow, and a long context spills like any tensor. Every other KV byte is one window tensor taken
at the start (``Store.window_empty``): the running layer's keys and values for attention, and each
layer's unfilled last block. So all of generation's memory is in the budgets; a window without room
for a layer, the workspace and one block raises ``BudgetError`` before any weight is read
(``kv_workspace_bytes`` says how much). The blocks are deleted when ``generate`` returns.

The contract with transformers' in-memory ``model.generate``: the same position ids (from the
attention mask, left padding allowed), the same mask handling (an all-ones mask is dropped, as
transformers does), the same logits warpers (its own ``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``, in its order), the same EOS/padding rule, and the same
keys and values in every attention: greedy tokens are equal, and sampling with the same torch
seed draws the same tokens (one ``torch.multinomial`` per step over the batch, as transformers).

Threads: everything runs on the caller's thread; store calls go through the store's sync facade,
one hop per piece (``Store.get_many`` reads its weights and starts the next piece's prefetch).

On the CPU the window would be a second copy of bytes the RAM tier already holds (raw fp32 or
bf16 chunks): there the weights and KV blocks are read with ``copy=False``, which lends the RAM
tier's own buffers (counted in the RAM budget, read-only here, unchanged by later puts) and
prefetch hints warm the RAM tier instead of the window. Tensors that cannot be lent (a compressed
codec, several chunks) are copied into the window as before; the window check below stays the same.
The pieces run with the window tensors swapped into the skeleton's parameters in place (what
``functional_call`` does, without its walk over every named tensor per call).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from trainer import memory, session
from trainer.grad_drain import GradDrain
from trainer.model import ModelParts, decompose
from trainer.streaming import StreamingEngine, capture_first_layer

KV_PREFIX = "generate/"


class StoreKV:
    """Per-layer keys and values in store blocks of ``block`` positions; the layer running now in a window workspace.

    Every byte is in a budget: full blocks are store tensors (window, RAM tier or disk); the
    workspace is one device-window tensor (``Store.window_empty``) that holds the running layer's
    keys and values for attention (``2 x batch x kv_heads x positions x head_dim``, sized for the
    longest context once) and every layer's unfilled last block (``layers x 2 x batch x kv_heads x
    kv_block_tokens x head_dim``). When the layer's blocks do not fit the window beside its weights
    and the workspace, they are read one at a time into the workspace.
    """

    def __init__(self, store: Any, n_layers: int, device: torch.device, block: int,
                 layer_bytes: list[int] | None = None, max_positions: int = 0) -> None:
        if block < 1:
            raise ValueError(f"kv_block_tokens must be >= 1, got {block}")
        self.store = store
        self.device = device
        self.block = block
        self.prefix = f"{KV_PREFIX}{uuid.uuid4().hex[:12]}/kv/"
        self.blocks = [0] * n_layers
        self.length = [0] * n_layers
        self.tail_len = [0] * n_layers
        self.window_bytes = store.stats().get("device_budget")
        self.one_block_bytes = 0
        self.layer_bytes = layer_bytes or [0] * n_layers
        """Bytes of each layer's weights, held in the window while its KV blocks are read."""
        self.max_positions = max_positions
        self.workspace: torch.Tensor | None = None
        """One window tensor: the running layer's keys and values, then each layer's unfilled block."""
        self.workspace_bytes = 0
        self.lend = device.type == "cpu"
        """Read blocks with ``copy=False`` (a CPU window lends the RAM tier's buffers)."""
        self.fetched: dict[int, list[torch.Tensor]] = {}
        """Blocks read together with a layer's weights (one store hop), consumed by ``update``."""
        self.single_reads = 0
        """Blocks read one at a time because the layer's did not fit the window beside its weights."""

    def key(self, layer: int, block: int) -> str:
        """The store key of one block of one layer."""
        return f"{self.prefix}{layer}/{block}"

    def keys(self, layer: int) -> list[str]:
        """The store keys of the layer's full blocks, in position order."""
        return [self.key(layer, b) for b in range(self.blocks[layer])]

    def block_bytes(self, layer: int) -> int:
        """Bytes of the layer's blocks in the store."""
        return self.blocks[layer] * self.one_block_bytes

    def fits(self, layer: int) -> bool:
        """Whether the layer's blocks fit the window at once beside its weights and the workspace."""
        w = self.window_bytes
        return w is None or self.layer_bytes[layer] + self.workspace_bytes + self.block_bytes(layer) <= w

    def allocate(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """Take the workspace from the window (before any weight is read: a window too small fails at once)."""
        n_layers = len(self.blocks)
        self._full_numel = 2 * batch * heads * self.max_positions * head_dim
        # a tail never holds a whole block (it leaves for the store), nor more than the context
        cap = min(self.block, self.max_positions)
        self._tail_shape = (2, batch, heads, cap, head_dim)
        tail_numel = 2 * batch * heads * cap * head_dim
        numel = self._full_numel + n_layers * tail_numel
        self.workspace_bytes = numel * torch.empty((), dtype=dtype).element_size()
        from tierstore.errors import BudgetError

        biggest = max(self.layer_bytes, default=0)
        one_read = self.one_block_bytes_for(batch, heads, head_dim, dtype)
        if self.window_bytes is not None and self.workspace_bytes + one_read + biggest > self.window_bytes:
            raise BudgetError(
                f"generation's KV workspace ({self.workspace_bytes} B: keys and values of {self.max_positions} "
                f"positions x batch {batch} x {heads} heads x {head_dim} for the running layer, and {n_layers} "
                f"unfilled blocks of {self.block} positions), one block read ({one_read} B) and a layer's "
                f"weights ({biggest} B) do not fit the device window ({self.window_bytes} B): raise "
                "max_vram_gb, or lower the batch, max_new_tokens or kv_block_tokens"
            )
        self.workspace = self.store.window_empty((numel,), dtype)
        self._tails = [self.workspace[self._full_numel + i * tail_numel: self._full_numel + (i + 1) * tail_numel]
                       .view(self._tail_shape) for i in range(n_layers)]
        self.one_block_bytes = 2 * batch * heads * self.block * head_dim * self.workspace.element_size()

    def one_block_bytes_for(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Window room to read one block back (0 when the context never fills a block)."""
        if self.max_positions < self.block:
            return 0
        return 2 * batch * heads * self.block * head_dim * torch.empty((), dtype=dtype).element_size()

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions; return every position's keys and values (transformers' DynamicLayer.update)."""
        if self.workspace is None:
            self.allocate(k.shape[0], k.shape[1], k.shape[3], k.dtype)
        assert self.workspace is not None
        b, h, t_new, d = k.shape
        if (b, h, d) != (self._tail_shape[1], self._tail_shape[2], self._tail_shape[4]) \
                or k.dtype != self.workspace.dtype:
            raise ValueError(f"layer {layer}'s keys {tuple(k.shape)} {k.dtype} differ from the first layer's "
                             f"{self._tail_shape[1:3]} {self.workspace.dtype}: per-layer KV shapes are not supported")
        n = self.length[layer]
        total = n + t_new
        if total > self.max_positions:
            raise ValueError(f"{total} positions exceed the KV workspace's {self.max_positions}")
        # contiguous [2, batch, heads, total, head_dim] at the workspace's start: the layout of
        # transformers' torch.cat, so attention sees the same strides (and gives the same numbers)
        full = self.workspace[: 2 * b * h * total * d].view(2, b, h, total, d)
        blocks = self.fetched.pop(layer, None)
        nb = self.blocks[layer]
        if blocks is None and nb and self.fits(layer):
            blocks = self.store.get_many(self.keys(layer), device=self.device, copy=not self.lend)
        if blocks is not None:
            for i, blk in enumerate(blocks):
                full[:, :, :, i * self.block:(i + 1) * self.block].copy_(blk)
            del blocks
        else:
            for i in range(nb):  # the window holds one block at a time beside the workspace
                self.single_reads += 1
                full[:, :, :, i * self.block:(i + 1) * self.block].copy_(
                    self.store.get(self.key(layer, i), device=self.device, copy=not self.lend))
        lo = nb * self.block
        tl = self.tail_len[layer]
        tail = self._tails[layer]
        if tl:
            full[:, :, :, lo:lo + tl].copy_(tail[:, :, :, :tl])
        full[0, :, :, n:total].copy_(k)
        full[1, :, :, n:total].copy_(v)
        # full blocks leave for the store (through the tail buffer: contiguous, in the window)
        while total - lo >= self.block:
            tail.copy_(full[:, :, :, lo:lo + self.block])
            self.store.put(self.key(layer, self.blocks[layer]), tail)
            self.blocks[layer] += 1
            lo += self.block
        self.tail_len[layer] = total - lo
        if total > lo:
            tail[:, :, :, : total - lo].copy_(full[:, :, :, lo:total])
        self.length[layer] = total
        return full[0], full[1]

    def delete(self) -> None:
        """Delete every block this cache put, and free the workspace."""
        for layer in range(len(self.blocks)):
            for key in self.keys(layer):
                self.store.delete(key)
            self.blocks[layer] = 0
        self.fetched.clear()
        self.workspace = None
        self._tails = []


def _cache(kv: StoreKV) -> Any:
    """A transformers ``Cache`` whose layers are ``kv``'s (so the model's masks and attention use it)."""
    from transformers.cache_utils import Cache, DynamicLayer

    class StoreKVLayer(DynamicLayer):
        """One layer of the cache: its keys and values live in the store (``StoreKV``)."""

        def __init__(self, idx: int) -> None:
            super().__init__()
            self.idx = idx

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device = key_states.device
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            return kv.update(self.idx, key_states, value_states)

        def get_seq_length(self) -> int:
            return kv.length[self.idx]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return kv.length[self.idx] + query_length, 0

    return Cache(layers=[StoreKVLayer(i) for i in range(len(kv.blocks))])


def kv_shape(config: Any) -> tuple[int, int] | None:
    """(kv heads, head dim) of a transformers config's attention, or None when it does not say."""
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not heads:
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden else None)
    return (int(kv_heads), int(head_dim)) if head_dim else None


def kv_workspace_bytes(config: Any, batch: int, positions: int, kv_block_tokens: int = 64,
                       dtype: torch.dtype = torch.float32) -> int:
    """Window bytes ``generate`` needs beside one layer's weights: its KV workspace and room to read one block."""
    shape = kv_shape(config)
    if shape is None:
        raise ValueError(f"{type(config).__name__} does not name its attention heads and head size")
    heads, dim = shape
    per_position = 2 * batch * heads * dim * torch.empty((), dtype=dtype).element_size()
    one_read = kv_block_tokens if positions >= kv_block_tokens else 0
    return per_position * (positions + config.num_hidden_layers * min(kv_block_tokens, positions) + one_read)


def _warpers(do_sample: bool, temperature: float | None, top_k: int | None, top_p: float | None) -> list[Any]:
    """transformers' own logits warpers, in the order its ``generate`` applies them."""
    if not do_sample:
        return []
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    out: list[Any] = []
    if temperature is not None and temperature != 1.0:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 when do_sample=True, got {temperature} "
                             "(top_k=1 or do_sample=False pick the most likely token)")
        out.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        out.append(TopKLogitsWarper(top_k=top_k))
    if top_p is not None and top_p < 1.0:
        if not 0.0 <= top_p:
            raise ValueError(f"top_p must be in [0, 1], got {top_p}")
        out.append(TopPLogitsWarper(top_p=top_p))
    return out


def _eos_list(eos: int | list[int] | None) -> list[int]:
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _default(value: Any, gen_cfg: Any, name: str, fallback: Any) -> Any:
    if value is not None:
        return value
    got = getattr(gen_cfg, name, None)
    return fallback if got is None else got


def _source(model: Any) -> tuple[nn.Module, Any, bool]:
    """(meta skeleton, store, whether we opened the store) for a load_model result, a store or a store folder."""
    store = getattr(model, "_trainer_store", None)
    if isinstance(model, nn.Module):
        if store is None:
            raise TypeError("generate streams a model whose weights live in a store: pass the result of "
                            "trainer.load_model(...), a trainer's model, a tierstore Store or a store folder "
                            "(an in-memory model generates with its own model.generate)")
        return model, store, False
    opened = False
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isdir(os.path.join(path, "catalog")):
            raise ValueError(f"{path}: not a tierstore store (no catalog/ in it)")
        opened = not session.is_open(path)  # a store the session already has open stays open
        store = session.open_store(path)
    elif hasattr(model, "get") and hasattr(model, "keys"):
        store = model
    else:
        raise TypeError(f"generate takes a model from trainer.load_model, a Store or a store folder, "
                        f"got {type(model).__name__}")
    return skeleton_from_store(store), store, opened


def skeleton_from_store(store: Any) -> nn.Module:
    """The meta-device skeleton of the model whose config the store keeps under ``meta/hf/config.json``."""
    import json

    from transformers import AutoConfig

    from trainer.checkpoint import HF_META, get_bytes
    from trainer.model import skeleton_for

    key = HF_META + "config.json"
    if key not in store:
        raise ValueError(f"the store at {getattr(store, 'path', '?')} has no {key}: it was not written by the "
                         "trainer nor imported from a Hugging Face folder, so its model is unknown")
    d = json.loads(get_bytes(store, key))
    config = AutoConfig.for_model(**d)
    model = skeleton_for(config)
    gen_key = HF_META + "generation_config.json"
    if gen_key in store:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_dict(json.loads(get_bytes(store, gen_key)))
    return model


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was = model.training
    model.eval()  # no dropout (GPT-2 has some), as transformers' generate on a from_pretrained model
    try:
        yield
    finally:
        model.train(was)


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
        self.lend = self.device.type == "cpu"
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


def generate(model: Any, input_ids: torch.Tensor, max_new_tokens: int = 32, do_sample: bool = False,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             attention_mask: torch.Tensor | None = None, eos_token_id: int | list[int] | None = None,
             pad_token_id: int | None = None, generator: torch.Generator | None = None, seed: int | None = None,
             device: torch.device | str | None = None, kv_block_tokens: int = 64,
             on_token: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Token ids ``[batch, prompt + new]`` as transformers' ``generate``, streaming the layers from the store.

    ``model``: a ``trainer.load_model`` result (or a trainer's model), a ``tierstore.Store`` or a
    store folder the trainer wrote (or ``tierstore import`` filled from a Hugging Face folder).
    ``eos_token_id``, ``pad_token_id``, ``temperature``, ``top_k`` and ``top_p`` default to the
    model's generation config, as in transformers (whose defaults are 1.0, 50 and 1.0: pass
    ``top_k=0`` for no top-k filter). Sampling draws from ``generator`` (or a new one seeded with ``seed``; neither: torch's global
    RNG, as transformers). ``on_token(new_ids)`` is called after each step with the ``[batch]`` ids.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    skeleton, store, opened = _source(model)
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, prompt_length] with a prompt, got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} differs from input_ids "
                         f"{tuple(input_ids.shape)}")
    gen_cfg = getattr(skeleton, "generation_config", None)
    if eos_token_id is None and gen_cfg is not None:
        eos_token_id = gen_cfg.eos_token_id
    eos = _eos_list(eos_token_id)
    if pad_token_id is None and gen_cfg is not None:
        pad_token_id = gen_cfg.pad_token_id
    if pad_token_id is None and eos:
        pad_token_id = eos[0]  # transformers does the same (with a warning)
    # unset in the generation config: transformers' global defaults
    temperature = _default(temperature, gen_cfg, "temperature", 1.0)
    top_k = _default(top_k, gen_cfg, "top_k", 50)
    top_p = _default(top_p, gen_cfg, "top_p", 1.0)
    warpers = _warpers(do_sample, temperature, top_k, top_p)
    gen = Generator(skeleton, store, device)
    dev = gen.device
    if do_sample and generator is None and seed is not None:
        generator = torch.Generator(device=dev)
        generator.manual_seed(seed)
    ids = input_ids.to(dev)
    mask = attention_mask.to(dev).long() if attention_mask is not None else torch.ones_like(ids)
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    # transformers drops an all-ones mask (no padding): the attention takes its causal path
    keep_mask = not bool((mask == 1).all())
    kv = StoreKV(store, gen.n_layers, dev, kv_block_tokens, gen.engine.read_bytes[1:-1],
                 max_positions=ids.shape[1] + max_new_tokens)
    shape = kv_shape(skeleton.config)
    if shape is not None:
        kv.allocate(ids.shape[0], shape[0], shape[1], store.info(gen.engine.reads[1][0]).dtype)
    cache = _cache(kv)
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=dev)
    eos_t = torch.tensor(eos, device=dev) if eos else None
    step_ids, step_pos = ids, position_ids
    try:
        with _eval_mode(skeleton), torch.no_grad(), memory.reuse_freed_buffers():
            for _ in range(max_new_tokens):
                logits = gen.step(step_ids, mask if keep_mask else None, step_pos, kv, cache)
                store.mark_step()  # a token's reads repeat the last one's: the predictor prefetches them
                scores = logits
                for warp in warpers:
                    scores = warp(ids, scores)
                if do_sample:
                    probs = torch.softmax(scores, dim=-1)
                    nxt = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
                else:
                    nxt = torch.argmax(scores, dim=-1)
                if eos_t is not None:
                    nxt = torch.where(unfinished, nxt, torch.full_like(nxt, int(pad_token_id)))  # type: ignore[arg-type]
                ids = torch.cat([ids, nxt[:, None]], dim=-1)
                if on_token is not None:
                    on_token(nxt)
                if eos_t is not None:
                    unfinished &= ~torch.isin(nxt, eos_t)
                    if not bool(unfinished.any()):
                        break
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
                step_pos = step_pos[:, -1:] + 1
                step_ids = nxt[:, None]
    finally:
        kv.delete()
        if opened:
            session.close_store(store)
    return ids
