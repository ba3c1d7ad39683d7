"""The demo: train a small Llama-style model on the embedded corpus with every tier in use.

The device window is smaller than the model's weights and the RAM budget smaller than the
training state (16 B a parameter), so weights stream through the window, state spills to disk,
and ``store.stats()`` shows where the bytes went.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence

import trainer as mt
from trainer.data import default_dataset


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def main(argv: Sequence[str] | None = None) -> int:
    """Train the demo model and print the losses and the store's per-tier statistics."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    p = argparse.ArgumentParser(prog="trainer.demo", description=__doc__)
    p.add_argument("--output-dir", default=None, help="run folder (default: a temporary folder)")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--block-size", type=int, default=128)
    a = p.parse_args(argv)
    out = a.output_dir or tempfile.mkdtemp(prefix="trainer-demo-")
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=256, max_position_embeddings=a.block_size,
                         bos_token_id=0, eos_token_id=1)
    model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    weights = 4 * n_params
    state = 16 * n_params
    layer = 4 * sum(p.numel() for p in model.model.layers[0].parameters())
    # Two layers fit the window (double buffering), the whole model does not; RAM holds a third of the state.
    vram = max(2 * layer + 4 * 2 * 256 * 256, weights // 2)
    ram = state // 3
    mt.init(offload_dir=os.path.join(out, "store"), max_vram_gb=f"{vram}B", max_ram_gb=f"{ram}B",
            optimizer_compression=True)
    args = mt.TrainingArguments(output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                                learning_rate=1e-3, warmup_steps=5, max_steps=a.max_steps, logging_steps=5,
                                save_steps=10, max_grad_norm=1.0, weight_decay=0.01)
    tr = mt.Trainer(model=model, train_dataset=default_dataset(block_size=a.block_size), args=args)
    try:
        tr.train()
        final = tr.save_model(os.path.join(out, "final"))
        s = tr.store.stats()
    finally:
        tr.close()
    print(f"model: {n_params / 1e6:.2f}M parameters, {_mib(weights)} of fp32 weights, {_mib(state)} of training state")
    print(f"budgets: device window {_mib(vram)}, RAM {_mib(ram)}")
    for e in (e for e in tr.state.log_history if "loss" in e):
        print(f"step {e['step']:4d}  loss {e['loss']:.4f}  lr {e['learning_rate']:.2e}  grad_norm {e['grad_norm']:.3f}"
              f"  {e['tokens_per_s']:.0f} tok/s  stall {e['stall_s']:.3f}s")
    print("where the bytes went:")
    print(f"  device window: peak {_mib(s['peak_device_bytes'])} of {_mib(vram)}; {s['hits_device']} hits; "
          f"{_mib(s['bytes_h2d'])} host->device, {_mib(s['bytes_d2h'])} device->host")
    print(f"  RAM cache:     peak {_mib(s['peak_host_bytes'])} of {_mib(ram)}; {s['hits_host']} hits")
    print(f"  disk:          {s['reads_disk']} reads, {_mib(s['bytes_read_disk'])} read, "
          f"{_mib(s['bytes_written_disk'])} written")
    print(f"  stall: {s['stall_s']:.3f}s; saved model: {final}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
