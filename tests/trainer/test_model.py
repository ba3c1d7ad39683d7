"""Model decomposition by structure, meta skeletons, and safetensors streaming into the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from plain_reference import build, gpt2_config, llama_config, weight_bytes
from torch import nn
from transformers import MistralConfig, Qwen2Config

import trainer as mt
from trainer.args import TrainingArguments
from trainer.model import UnsupportedModelError, decompose

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _qwen2() -> Qwen2Config:
    return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)


def _mistral() -> MistralConfig:
    return MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)


@pytest.mark.parametrize(("make", "body", "layers", "norm", "tied", "prelude"), [
    (lambda: llama_config(3), "model", "model.layers", "model.norm", False, ["model.embed_tokens.weight"]),
    (_qwen2, "model", "model.layers", "model.norm", False, ["model.embed_tokens.weight"]),
    (_mistral, "model", "model.layers", "model.norm", False, ["model.embed_tokens.weight"]),
    (lambda: gpt2_config(3), "transformer", "transformer.h", "transformer.ln_f", True,
     ["transformer.wte.weight", "transformer.wpe.weight"]),
])
def test_decompose_finds_the_pieces(make: Any, body: str, layers: str, norm: str, tied: bool,
                                    prelude: list[str]) -> None:
    model = build(make())
    parts = decompose(model)
    assert (parts.body_name, parts.layers_name, parts.norm_name, parts.head_name) == (body, layers, norm, "lm_head")
    assert parts.tied is tied
    assert parts.prelude_params == prelude
    assert len(parts.layer_params) == 3
    # Every parameter is in exactly one group.
    names = [n for _, g in parts.groups() for n in g]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_unsupported_model_says_what_is_missing() -> None:
    class NoLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10)

        def get_input_embeddings(self) -> nn.Module:
            return self.emb

        def get_output_embeddings(self) -> nn.Module:
            return self.out

    with pytest.raises(UnsupportedModelError, match="ModuleList of identical decoder layers"):
        decompose(NoLayers())
    with pytest.raises(UnsupportedModelError, match="get_input_embeddings"):
        decompose(nn.Linear(3, 3))


def test_load_model_from_a_checkpoint_equals_its_weights_and_trains(dataset: Any, tmp_path: Any) -> None:
    src = build(llama_config(2))
    src.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
    assert os.path.exists(tmp_path / "ckpt" / "model.safetensors.index.json")
    mt.init(offload_dir=str(tmp_path / "store"), max_vram_gb="1MiB", max_ram_gb="1MiB", optimizer_compression=False)
    model = mt.load_model(str(tmp_path / "ckpt"))
    assert all(p.device.type == "meta" for p in model.parameters())
    # Rotary tables are buffers: they stay real so the prelude can run.
    assert all(b.device.type == "cpu" for b in model.buffers())
    tr = mt.Trainer(model=model, train_dataset=dataset,
                    args=TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, logging_steps=1,
                                           per_device_train_batch_size=2, disable_tqdm=True))
    try:
        for name, p in src.named_parameters():
            assert torch.equal(tr.store.get(name), p.detach()), name
        tr.train(resume_from_checkpoint=None)
        assert len([e for e in tr.state.log_history if "loss" in e]) == 2
        assert not torch.equal(tr.store.get("model.norm.weight"), src.model.norm.weight.detach())
    finally:
        tr.close()


_CHILD = textwrap.dedent("""
    import json, sys, psutil
    import trainer as mt
    from transformers import AutoConfig, AutoModelForCausalLM
    from trainer.model import params_on_meta
    # Warm up the lazy imports of transformers with a skeleton, so they are not counted below.
    with params_on_meta():
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))
    mt.init(offload_dir=sys.argv[2], max_vram_gb="64MiB", max_ram_gb="32MiB", optimizer_compression=False)
    before = psutil.Process().memory_info().rss
    model = mt.load_model(sys.argv[1])
    # VmHWM, not ru_maxrss: the latter carries the forking parent's peak across exec.
    peak = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM"))) * 1024
    store = model._trainer_store
    keys = store.keys()
    probe = store.get("model.layers.3.mlp.up_proj.weight")
    from trainer.session import close_store
    close_store(store)
    print(json.dumps({"before": before, "peak": peak, "keys": len(keys), "probe_sum": float(probe.double().sum())}))
""")


def test_load_model_streams_a_sharded_checkpoint_in_little_ram(tmp_path: Any) -> None:
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                      num_key_value_heads=16, vocab_size=256, max_position_embeddings=64)
    src = build(cfg)
    size = weight_bytes(src)
    assert size > 400e6
    src.save_pretrained(tmp_path / "ckpt", max_shard_size="100MB")
    with open(tmp_path / "ckpt" / "model.safetensors.index.json") as f:
        assert len(set(json.load(f)["weight_map"].values())) >= 4
    want = float(src.model.layers[3].mlp.up_proj.weight.detach().double().sum())
    n_params = len(list(src.named_parameters()))
    del src
    # glibc keeps freed blocks of its per-thread arenas mapped; returning them at once makes the
    # RSS show what the code holds, not how the allocator caches (about 100 MB of noise otherwise).
    env = dict(os.environ, PYTHONPATH=ROOT, MALLOC_TRIM_THRESHOLD_="0", MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "ckpt"), str(tmp_path / "store")],
                         capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["keys"] == n_params
    assert r["probe_sum"] == pytest.approx(want, rel=0, abs=1e-9)
    growth = r["peak"] - r["before"]
    # The store's RAM budget is 32 MiB; the rest is one tensor in flight and the store's buffers.
    assert growth < size / 4, f"RSS grew by {growth / 1e6:.0f} MB while loading a {size / 1e6:.0f} MB model"


def test_load_model_into_a_run_store_keeps_the_trained_weights_for_resume(dataset: Any, tmp_path: Any) -> None:
    from trainer.session import close_store

    src = build(llama_config(2))
    src.save_pretrained(tmp_path / "ckpt")
    mt.init(offload_dir=str(tmp_path / "store"), max_vram_gb="1MiB", max_ram_gb="1MiB", optimizer_compression=False)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, logging_steps=1, save_steps=2,
                             per_device_train_batch_size=2, disable_tqdm=True)
    tr = mt.Trainer(model=mt.load_model(str(tmp_path / "ckpt")), train_dataset=dataset, args=args)
    tr.train(stop_at_step=2)
    trained = tr.store.get("model.norm.weight")
    tr.close()
    with pytest.warns(UserWarning, match="holds a training run"):
        model = mt.load_model(str(tmp_path / "ckpt"))
    store = model._trainer_store
    try:
        assert torch.equal(store.get("model.norm.weight"), trained)
        assert not torch.equal(trained, src.model.norm.weight.detach())
        tr = mt.Trainer(model=model, train_dataset=dataset, args=args)
        tr.train(resume_from_checkpoint=True)
        assert [e["step"] for e in tr.state.log_history if "loss" in e] == [1, 2, 3, 4]
    finally:
        close_store(store)
