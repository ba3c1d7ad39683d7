"""Generation's KV cache in the store: ``StoreKV`` (blocks and the window workspace) and the transformers ``Cache`` over it.

Each layer's positions are cut into blocks of ``kv_block_tokens``; a full block is ``put`` under
``generate/<run>/kv/<layer>/<block>`` (keys and values stacked: one tensor, one read) and read back
into the device window when the layer runs (with its weights, in one store hop, when they fit
beside; else one block at a time), so it sits in the window, the RAM tier or on disk as the budgets
allow, and a long context spills like any tensor. Every other KV byte is one window tensor taken
at the start (``Store.window_empty``): the running layer's keys and values for attention, and each
layer's unfilled last block. So all of generation's memory is in the budgets; a window without room
for a layer, the workspace and one block raises ``BudgetError`` before any weight is read
(``kv_workspace_bytes`` says how much). ``generate`` deletes the blocks when it returns.

On the CPU the blocks are read with ``copy=False``: the RAM tier lends its own buffers (read-only
here) instead of a second copy in the window.

Threads: the caller's, as ``trainer.generate``; the store is reached through its sync facade.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch

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


def store_cache(kv: StoreKV) -> Any:
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
