"""The streaming trainer on CUDA follows plain PyTorch (skipped without CUDA)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from plain_reference import build, clone, llama_config, reference_train, weight_bytes

import trainer as mt
import trainer.streaming as streaming
from trainer.args import TrainingArguments

pytestmark = pytest.mark.cuda


def test_cuda_streaming_training_matches_plain_pytorch(dataset: Any, tmp_path: Any, monkeypatch: Any) -> None:
    drains: list[Any] = []
    real = streaming.GradDrain.for_groups

    def spy(*a: Any, **k: Any) -> Any:
        drains.append(real(*a, **k))
        return drains[-1]

    monkeypatch.setattr(streaming.GradDrain, "for_groups", staticmethod(spy))
    model = build(llama_config(3))
    ref = clone(model)
    vram = weight_bytes(model) * 45 // 100  # weights stream through a window under half the model
    mt.init(offload_dir=str(tmp_path / "store"), max_vram_gb=f"{vram}B", max_ram_gb="64MiB",
            optimizer_compression=False, device="cuda")
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                             learning_rate=2e-3, weight_decay=0.1, max_steps=4, max_grad_norm=0.0,
                             logging_steps=1, save_steps=0, disable_tqdm=True)
    tr = mt.Trainer(model=model, train_dataset=dataset, args=args)
    try:
        tr.train()
        ref_losses = reference_train(ref, dataset, args, 4)  # fp32 on the CPU
        weights = {n: tr.store.get(n) for n, _ in ref.named_parameters()}
        stats = tr.store.stats()
        staging = tr.store.async_store._window.staging
    finally:
        tr.close()
    assert drains and drains[0].threaded and drains[0].staged_bytes > 0  # grads left on the D2H stream
    assert staging is not None and staging.acquired > 0  # weights went up through the pinned pool
    assert 0 < stats["peak_device_bytes"] <= vram
    losses = [e["loss"] for e in tr.state.log_history if "loss" in e]
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (losses, ref_losses)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), atol=1e-3, rtol=0, msg=name)  # Adam steps of 2e-3: loose on purpose
