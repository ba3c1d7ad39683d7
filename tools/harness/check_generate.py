"""Check: mt.generate's greedy tokens against transformers' on one device, and why they differ if they do.

    python -m tools.harness.check_generate [--device cuda] [--batch 1] [--new 16] [--sync]

A Llama-style model (``tools.bench.generate``'s default shape, random weights) generates greedily
in memory (transformers) and streamed (mt.generate, a window of two layers). Where the tokens
first differ, the in-memory model re-reads the streamed sequence (teacher forcing) and reports the
logit margin there: how far the streamed token's logit is below the in-memory maximum, against the
gap between the two best in-memory logits. A near-tie (margins of float-noise size) is a rounding
difference between kernels; a clear margin means the streamed run computed something else (a
bug, such as a copy read before it landed). ``--sync`` makes every window upload synchronous: if
the tokens then agree, the asynchronous copies were the cause.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import torch


def _synchronous_uploads() -> None:
    """Patch the device window so every upload has landed before the tensor is handed out."""
    from tierstore.tiers.device import DeviceWindow

    for name in ("admit", "finish_upload"):
        real = getattr(DeviceWindow, name)

        def wrapped(self: Any, *a: Any, _real: Any = real, **k: Any) -> torch.Tensor:
            t = _real(self, *a, **k)
            if self.is_cuda:
                torch.cuda.synchronize(self.device)
            return t

        setattr(DeviceWindow, name, wrapped)


def first_difference(out: torch.Tensor, ref: torch.Tensor, start: int) -> list[int | None]:
    """Per row, the first position >= ``start`` where the two sequences differ (None if none)."""
    diff = (out[:, start:] != ref[:, start:]).cpu()
    return [int(d.nonzero()[0]) + start if d.any() else None for d in diff]


def margins(model: Any, seq: torch.Tensor, row: int, pos: int) -> dict[str, float]:
    """In-memory logits at ``pos`` of ``seq[row]``: the top-2 gap and the streamed token's shortfall."""
    with torch.no_grad():
        logits = model(seq[row:row + 1, :pos]).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return {"top2_gap": float(top[0] - top[1]), "streamed_shortfall": float(top[0] - logits[seq[row, pos]]),
            "logit_scale": float(logits.abs().max())}


def main(argv: Sequence[str] | None = None) -> int:
    """Generate both ways, print where and by how much they differ; exit 1 on a clear (non-tie) difference."""
    from transformers import AutoModelForCausalLM

    import trainer as mt
    from tools.bench.generate import _config, add_model_args
    from trainer.generate import kv_workspace_bytes

    p = argparse.ArgumentParser(prog="tools.harness.check_generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=1)
    add_model_args(p)
    p.add_argument("--sync", action="store_true", help="make every window upload synchronous")
    p.add_argument("--tie", type=float, default=1e-3, help="a shortfall below this is a near-tie (float noise)")
    a = p.parse_args(argv)
    if a.sync:
        _synchronous_uploads()
    dev = torch.device(a.device)
    folder = tempfile.mkdtemp(prefix="check_generate_")
    try:
        config = _config(a)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        model.save_pretrained(os.path.join(folder, "hf"))
        model.to(dev)
        layer = sum(q.numel() * 4 for q in model.model.layers[0].parameters())
        ws = kv_workspace_bytes(config, a.batch, a.prompt + a.new, 64)
        weights = sum(q.numel() * 4 for q in model.parameters())
        mt.init(offload_dir=os.path.join(folder, "store"), max_vram_gb=f"{2 * layer + ws}B",
                max_ram_gb=f"{weights + ws}B", device=str(dev))
        streamed = mt.load_model(os.path.join(folder, "hf"))
        ids = torch.randint(2, 256, (a.batch, a.prompt), generator=torch.Generator().manual_seed(1)).to(dev)
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, max_new_tokens=a.new,
                                 do_sample=False, eos_token_id=None).cpu()
        out = mt.generate(streamed, ids, max_new_tokens=a.new, do_sample=False, eos_token_id=None).cpu()
        firsts = first_difference(out, ref, a.prompt)
        print(f"device {dev}, batch {a.batch}, {a.new} new tokens, sync uploads {a.sync}: "
              f"{sum(f is None for f in firsts)} of {a.batch} rows equal")
        clear = 0
        for row, pos in enumerate(firsts):
            if pos is None:
                continue
            m = margins(model, out.to(dev), row, pos)
            tie = m["streamed_shortfall"] <= a.tie
            clear += not tie
            print(f"row {row}: first difference at new token {pos - a.prompt}: streamed {int(out[row, pos])}, "
                  f"in memory {int(ref[row, pos])}; in-memory top-2 gap {m['top2_gap']:.3g}, streamed token "
                  f"{m['streamed_shortfall']:.3g} below the max (logits up to {m['logit_scale']:.3g}): "
                  f"{'near-tie (float noise)' if tie else 'CLEAR difference'}")
        return 1 if clear else 0
    finally:
        store = locals().get("streamed")
        if store is not None:
            from trainer.session import close_store

            close_store(store._trainer_store)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
