"""Generation on the trainer's machinery: ``generate`` streams the layers through the device window, the KV cache lives in the store.

``generate`` runs one ``trainer.decode.Generator`` step per new token, for the whole batch at
once: every token costs one pass over the weights whatever the batch size, and the keys and values
of every position sit in store blocks (``trainer.kv_cache``), so all of generation's memory is in
the budgets. ``trainer.sampling`` picks each token. The blocks are deleted when ``generate`` returns.

The contract with transformers' in-memory ``model.generate``: the same position ids (from the
attention mask, left padding allowed), the same mask handling (an all-ones mask is dropped, as
transformers does), the same logits warpers (its own ``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``, in its order), the same EOS/padding rule, and the same
keys and values in every attention: greedy tokens are equal, and sampling with the same torch
seed draws the same tokens (one ``torch.multinomial`` per step over the batch, as transformers).

Threads: everything runs on the caller's thread; store calls go through the store's sync facade.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from trainer import memory, session
from trainer.decode import Generator, cache_kwarg
from trainer.kv_cache import KV_PREFIX, StoreKV, kv_shape, kv_workspace_bytes, store_cache
from trainer.sampling import eos_list, from_generation_config, logits_warpers, next_tokens

# names callers import from here (tools, tests, docs), kept where they were
__all__ = ["KV_PREFIX", "Generator", "StoreKV", "cache_kwarg", "generate", "kv_shape", "kv_workspace_bytes",
           "skeleton_from_store"]


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
    eos = eos_list(eos_token_id)
    if pad_token_id is None and gen_cfg is not None:
        pad_token_id = gen_cfg.pad_token_id
    if pad_token_id is None and eos:
        pad_token_id = eos[0]  # transformers does the same (with a warning)
    # unset in the generation config: transformers' global defaults
    temperature = from_generation_config(temperature, gen_cfg, "temperature", 1.0)
    top_k = from_generation_config(top_k, gen_cfg, "top_k", 50)
    top_p = from_generation_config(top_p, gen_cfg, "top_p", 1.0)
    warpers = logits_warpers(do_sample, temperature, top_k, top_p)
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
    cache = store_cache(kv)
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=dev)
    eos_t = torch.tensor(eos, device=dev) if eos else None
    step_ids, step_pos = ids, position_ids
    try:
        with _eval_mode(skeleton), torch.no_grad(), memory.reuse_freed_buffers():
            for _ in range(max_new_tokens):
                logits = gen.step(step_ids, mask if keep_mask else None, step_pos, kv, cache)
                store.mark_step()  # a token's reads repeat the last one's: the predictor prefetches them
                nxt = next_tokens(ids, logits, warpers, do_sample, generator,
                                  unfinished if eos_t is not None else None, pad_token_id)
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
