"""Adam moments to measure codecs on: synthetic heavy-tailed ones, and real ones captured from a
short AdamW run of a tiny Llama-style model (or an MLP when transformers is missing) on bytes of
the Python standard library's own sources."""

from __future__ import annotations

import os
import pathlib

import torch

from tierstore.errors import CodecError


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


#: what the update of an error-feedback shadow reads (``+ef_update=``): ``m`` the stored m alone
#: (what a reader of the coded m gets), ``sum`` the stored m plus the stored residual
EF_UPDATES = ("m", "sum")


def moment_codec_pair(requested: str, shape: tuple[int, ...], *, with_ef: bool = False):  # noqa: ANN201
    """(m codec, v codec) that a coded run stores a parameter of ``shape``'s moments with, or None
    where the trainer's policy keeps them raw (small and 1-D tensors).

    ``requested`` is ``NAME[:ROUNDING[/V_ROUNDING][:PART]][+KEY=VALUE...]``: NAME the codec the
    policy (``tierstore.codecs.policy.choose_codec``) picks from; ROUNDING overrides the rounding
    of both moments, or m's and v's apart (``q4:calibrated/stochastic``); PART ``m`` or ``v``
    codes only that moment, the other stays raw (which one costs); each ``+KEY=VALUE`` sets a
    parameter of m's codec only (``q4+signed_map=de``), and ``+m=NAME`` stores m with codec NAME
    instead (``q4+m=q5``: one more bit for m).

    ``+ef=NAME[:ROUNDING]`` asks for error feedback on m (``q4+ef=q2``; ``raw``: the residual
    exact): a second state, m's quantization residual, stored with codec NAME as the policy codes
    an ``exp_avg`` (or with ROUNDING) and added back before the next step's average;
    ``+ef_update=m|sum`` says whether the update reads the stored m alone (the default) or m plus
    the residual. Only ``tools.bench.moment_stats`` simulates it: with ``with_ef`` the result is
    (m codec, v codec, (residual codec, ef_update) or None); without it a request with ``ef``
    raises ValueError, so a caller that cannot run error feedback never drops it silently.
    """
    from tierstore import codecs
    from tierstore.codecs.policy import choose_codec

    head, *extras = requested.split("+")
    name, rounding, part = (head.split(":") + ["", ""])[:3]
    m_round, _, v_round = rounding.partition("/")
    m_params: dict[str, object] = {}
    m_name = name
    ef_name = ef_update = None
    for item in extras:
        key, sep, value = item.partition("=")
        if not (sep and key and value):
            raise ValueError(f"{item!r} in codec request {requested!r} is not KEY=VALUE")
        if key == "m":
            m_name = value
        elif key == "ef":
            ef_name = value
        elif key == "ef_update":
            if value not in EF_UPDATES:
                raise ValueError(f"ef_update {value!r} in codec request {requested!r} is not one "
                                 f"of {EF_UPDATES}")
            ef_update = value
        else:
            m_params[key] = _param_value(value)
    if part not in ("", "m", "v"):
        raise ValueError(f"part {part!r} of codec request {requested!r} is not m or v")
    if ef_update is not None and ef_name is None:
        raise ValueError(f"codec request {requested!r} sets ef_update without ef=CODEC")
    if ef_name is not None and not with_ef:
        raise ValueError(f"codec request {requested!r} asks for error feedback (ef={ef_name}), "
                         "which only tools.bench.moment_stats simulates")
    ef = None
    if ef_name is not None:
        if part == "v":
            raise ValueError(f"codec request {requested!r}: error feedback needs m coded, not part v")
        ef_codec_name, _, ef_round = ef_name.partition(":")
        try:
            ef_codec = choose_codec(ef_codec_name, shape, "exp_avg")
            if ef_round and not ef_codec.lossless:
                ef_codec = codecs.get(ef_codec_name, **{**ef_codec.params(), "rounding": ef_round})
        except (ValueError, TypeError, CodecError) as e:
            raise ValueError(f"ef codec {ef_name!r} in codec request {requested!r}: {e}") from e
        if ef_codec.lossless and ef_codec.name != "raw":
            raise ValueError(f"ef codec {ef_name!r} in codec request {requested!r} is lossless "
                             "but not raw: its size depends on the data; use raw or a q-codec")
        ef = (ef_codec, ef_update or "m")
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
    return (pair[0], pair[1], ef) if with_ef else (pair[0], pair[1])


def codec_bits(codec) -> float:  # noqa: ANN001
    """Stored bits per float32 element of ``codec`` (its ``bits``, scales counted in the block
    view; 32 for a codec that stores the float32 as it is)."""
    bits = codec.bits
    if bits is None:
        if not codec.raw_layout:
            raise ValueError(f"codec {codec.name!r} has no fixed size per element")
        return 32.0
    return float(bits)


def request_bits(requested: str, shape: tuple[int, ...] = (256, 256)) -> float:
    """Bits per parameter of the moments a request stores a ``shape`` tensor's moments with:
    m's codes plus v's plus, with ``+ef=``, the residual's (scales included)."""
    codecs_ = moment_codec_pair(requested, shape, with_ef=True)
    if codecs_ is None:
        return 64.0
    m, v, ef = codecs_
    return codec_bits(m) + codec_bits(v) + (codec_bits(ef[0]) if ef else 0.0)
