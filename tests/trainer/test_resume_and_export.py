"""Checkpoints are store commits: resuming continues exactly; save_model loads in transformers."""

from __future__ import annotations

from typing import Any

import torch
from plain_reference import build, clone, llama_config, train_streaming, weight_bytes
from transformers import AutoModelForCausalLM

from trainer.args import TrainingArguments


def _args(out: str) -> TrainingArguments:
    return TrainingArguments(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             learning_rate=2e-3, weight_decay=0.1, max_steps=10, warmup_steps=3,
                             lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=1, save_steps=5,
                             disable_tqdm=True)


def test_resume_gives_the_same_run(dataset: Any, tmp_path: Any) -> None:
    model = build(llama_config(2))
    wb = weight_bytes(model)
    budgets = {"vram": f"{wb * 45 // 100}B", "ram": f"{wb * 2}B"}
    second = clone(model)

    straight = train_streaming(model, dataset, _args(str(tmp_path / "a")), **budgets)
    a_weights = {n: straight.store.get(n) for n in straight.parts.all_params()}
    a_log = [e for e in straight.state.log_history if "loss" in e]
    straight.close()

    first = train_streaming(second, dataset, _args(str(tmp_path / "b")), stop_at_step=5, **budgets)
    assert first.state.global_step == 5
    assert [c.step for c in first.store.versions()][-1] == 5
    first.close()
    # A fresh skeleton (random weights that must be ignored) and a reopened store.
    resumed = train_streaming(build(llama_config(2), seed=123), dataset, _args(str(tmp_path / "b")),
                              resume=True, **budgets)
    try:
        b_log = [e for e in resumed.state.log_history if "loss" in e]
        assert [e["step"] for e in b_log] == list(range(1, 11))
        assert [e["loss"] for e in b_log] == [e["loss"] for e in a_log]
        assert [e["learning_rate"] for e in b_log] == [e["learning_rate"] for e in a_log]
        for name, w in a_weights.items():
            assert torch.equal(resumed.store.get(name), w), name
    finally:
        resumed.close()


def test_save_model_loads_in_transformers(dataset: Any, tmp_path: Any) -> None:
    model = build(llama_config(2))
    wb = weight_bytes(model)
    args = _args(str(tmp_path / "run"))
    args.max_steps = 3
    tr = train_streaming(model, dataset, args, vram=f"{wb * 45 // 100}B", ram=f"{wb * 2}B")
    try:
        out = tr.save_model(str(tmp_path / "final"), max_shard_bytes=wb // 3)  # several shards
        trained = {n: tr.store.get(n) for n in tr.parts.all_params()}
    finally:
        tr.close()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    expect = build(llama_config(2), seed=99).eval()
    expect.load_state_dict(trained, strict=True)
    ids = dataset[0]["input_ids"][None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expect(input_ids=ids).logits, atol=0, rtol=0)
    # The trained weights differ from the initial ones, so the comparison above is not trivial.
    init = build(llama_config(2))
    assert not torch.equal(init.model.embed_tokens.weight, loaded.model.embed_tokens.weight)
