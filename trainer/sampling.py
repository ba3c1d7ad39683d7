"""How ``generate`` picks each new token: transformers' logits warpers, sampling or argmax, and EOS padding.

The same rules and order as transformers' ``generate``: temperature, top-k, top-p (its own warper
classes), then one ``torch.multinomial`` over the batch (or ``argmax``); a sequence that has
emitted an EOS id gets ``pad_token_id`` from then on.
"""

from __future__ import annotations

from typing import Any

import torch


def logits_warpers(do_sample: bool, temperature: float | None, top_k: int | None, top_p: float | None) -> list[Any]:
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


def eos_list(eos: int | list[int] | None) -> list[int]:
    """The end-of-sequence ids as a list (none, one or several)."""
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def from_generation_config(value: Any, gen_cfg: Any, name: str, fallback: Any) -> Any:
    """``value`` if given, else the generation config's ``name``, else transformers' global default."""
    if value is not None:
        return value
    got = getattr(gen_cfg, name, None)
    return fallback if got is None else got


def next_tokens(ids: torch.Tensor, logits: torch.Tensor, warpers: list[Any], do_sample: bool,
                generator: torch.Generator | None, unfinished: torch.Tensor | None, pad_token_id: int | None
                ) -> torch.Tensor:
    """The ``[batch]`` next ids from the last position's ``logits``: warped, then sampled or argmax.

    With ``unfinished`` (EOS ids given) a finished sequence gets ``pad_token_id``.
    """
    scores = logits
    for warp in warpers:
        scores = warp(ids, scores)
    if do_sample:
        probs = torch.softmax(scores, dim=-1)
        nxt = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
    else:
        nxt = torch.argmax(scores, dim=-1)
    if unfinished is not None:
        nxt = torch.where(unfinished, nxt, torch.full_like(nxt, int(pad_token_id)))  # type: ignore[arg-type]
    return nxt
