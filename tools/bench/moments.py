"""Adam moments to measure codecs on: synthetic heavy-tailed ones, and real ones captured from a
short AdamW run of a tiny Llama-style model (or an MLP when transformers is missing) on bytes of
the Python standard library's own sources."""

from __future__ import annotations

import os
import pathlib

import torch


def stdlib_bytes(limit: int = 2_000_000) -> torch.Tensor:
    """Up to ``limit`` bytes of the stdlib's ``.py`` files beside ``os``, as a uint8 tensor."""
    root = pathlib.Path(os.__file__).parent
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):  # sorted: the same text on every run
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8)


def byte_batches(text: torch.Tensor, batch: int, seq: int, seed: int):  # noqa: ANN201
    """An endless iterator of (inputs, targets) int64 windows cut at random offsets."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, text.numel() - seq - 1, (batch,), generator=g)
        idx = starts[:, None] + torch.arange(seq + 1)
        window = text[idx].long()
        yield window[:, :-1], window[:, 1:]


def tiny_model(hidden: int = 128, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A byte-level Llama (transformers) of about 0.5-2M parameters, or an MLP without it."""
    torch.manual_seed(seed)
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return _ByteMLP(hidden)
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=hidden * 4,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=512, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


class _ByteMLP(torch.nn.Module):
    """Fallback next-byte model: embedding, two hidden layers, a head."""

    def __init__(self, hidden: int):
        super().__init__()
        self.emb = torch.nn.Embedding(256, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, hidden * 4), torch.nn.GELU(),
                                       torch.nn.Linear(hidden * 4, hidden))
        self.head = torch.nn.Linear(hidden, 256)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):  # noqa: ANN201
        """Logits and, with labels, the mean cross-entropy, like a transformers output."""
        logits = self.head(self.mlp(self.emb(input_ids)))
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), labels.reshape(-1))
        return type("Out", (), {"logits": logits, "loss": loss})()


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy of ``model`` on inputs ``x`` and targets ``y``."""
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def captured_moments(steps: int = 30, hidden: int = 128, layers: int = 2, batch: int = 8,
                     seq: int = 128, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Parameter name -> (exp_avg, exp_avg_sq) after ``steps`` steps of torch AdamW."""
    model = tiny_model(hidden, layers, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    batches = byte_batches(stdlib_bytes(), batch, seq, seed)
    for _ in range(steps):
        x, y = next(batches)
        opt.zero_grad(set_to_none=True)
        lm_loss(model, x, y).backward()
        opt.step()
    out = {}
    for name, p in model.named_parameters():
        st = opt.state[p]
        out[name] = (st["exp_avg"].detach().clone(), st["exp_avg_sq"].detach().clone())
    return out


def synthetic_moments(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, v) shaped like Adam's: m Student-t (df 3, heavy tails) times a per-256-element scale
    spanning four decades; v = m**2 times log-normal noise plus a small floor, spanning many
    decades, with 0.1% exact zeros (entries whose gradient was always zero)."""
    g = torch.Generator().manual_seed(seed)
    rows = -(-n // 256)
    scale = (10 ** (torch.rand(rows, 1, generator=g) * 4 - 6)).expand(rows, 256).reshape(-1)[:n]
    chi2 = (torch.randn(3, n, generator=g) ** 2).sum(0)
    m = torch.randn(n, generator=g) / torch.sqrt(chi2 / 3) * scale
    v = m * m * torch.exp(torch.randn(n, generator=g)) + scale**2 * 1e-3 * torch.rand(n, generator=g)
    v[torch.rand(n, generator=g) < 0.001] = 0.0
    return m, v


def _param_value(text: str) -> object:
    """``"128"`` -> 128, ``"true"`` -> True, anything else the string itself."""
    if text.lstrip("-").isdigit():
        return int(text)
    return {"true": True, "false": False}.get(text, text)


def moment_codec_pair(requested: str, shape: tuple[int, ...]):  # noqa: ANN201
    """(m codec, v codec) that a coded run stores a parameter of ``shape``'s moments with, or None
    where the trainer's policy keeps them raw (small and 1-D tensors).

    ``requested`` is ``NAME[:ROUNDING[/V_ROUNDING][:PART]][+KEY=VALUE...]``: NAME the codec the
    policy (``tierstore.codecs.policy.choose_codec``) picks from; ROUNDING overrides the rounding
    of both moments, or m's and v's apart (``q4:calibrated/stochastic``); PART ``m`` or ``v``
    codes only that moment, the other stays raw (which one costs); each ``+KEY=VALUE`` sets a
    parameter of m's codec only (``q4+signed_map=de``), and ``+m=NAME`` stores m with codec NAME
    instead (``q4+m=q5``: one more bit for m).
    """
    from tierstore import codecs
    from tierstore.codecs.policy import choose_codec

    head, *extras = requested.split("+")
    name, rounding, part = (head.split(":") + ["", ""])[:3]
    m_round, _, v_round = rounding.partition("/")
    m_params: dict[str, object] = {}
    m_name = name
    for item in extras:
        key, sep, value = item.partition("=")
        if not (sep and key and value):
            raise ValueError(f"{item!r} in codec request {requested!r} is not KEY=VALUE")
        if key == "m":
            m_name = value
        else:
            m_params[key] = _param_value(value)
    if part not in ("", "m", "v"):
        raise ValueError(f"part {part!r} of codec request {requested!r} is not m or v")
    pair = []
    for role, n, r in (("exp_avg", m_name, m_round), ("exp_avg_sq", name, v_round or m_round)):
        codec = choose_codec(n, shape, role)
        if codec.lossless:
            return None
        params = {**codec.params(), **({"rounding": r} if r else {})}
        if role == "exp_avg":
            params.update(m_params)
        if params != codec.params():
            codec = codecs.get(n, **params)
        if part and part != ("m" if role == "exp_avg" else "v"):
            codec = codecs.get("raw")
        pair.append(codec)
    return pair[0], pair[1]
