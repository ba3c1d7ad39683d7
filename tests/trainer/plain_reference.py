"""Tiny model configs, the plain PyTorch reference run and a streaming run, for the trainer tests."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

import trainer as mt
from trainer.args import TrainingArguments, learning_rate_at
from trainer.data import step_batches, steps_per_epoch
from trainer.loop import no_decay_names
from trainer.streaming import count_loss_tokens


def llama_config(layers: int = 4) -> LlamaConfig:
    """A Llama-style model of about 0.2M parameters (hidden 64, vocab 256)."""
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                       bos_token_id=0, eos_token_id=1, pad_token_id=None)


def gpt2_config(layers: int = 4) -> GPT2Config:
    """A GPT-2 model with tied embeddings and no dropout (hidden 64, vocab 256)."""
    return GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)


def build(config: Any, seed: int = 0) -> torch.nn.Module:
    """A model with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's fp32 parameters (tied ones once)."""
    return sum(p.numel() * 4 for p in model.parameters())


def reference_train(model: torch.nn.Module, dataset: Any, args: TrainingArguments, steps: int) -> list[float]:
    """Plain in-memory training with torch.optim.AdamW; returns the per-step token-mean losses."""
    model = model.train()
    no_decay = no_decay_names(model)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for n, p in params.items() if n not in no_decay], "weight_decay": args.weight_decay},
         {"params": [p for n, p in params.items() if n in no_decay], "weight_decay": 0.0}],
        lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    per_epoch = steps_per_epoch(len(dataset), args.per_device_train_batch_size, args.gradient_accumulation_steps)
    total = args.total_steps(per_epoch)
    losses = []
    batches = step_batches(dataset, args.per_device_train_batch_size, args.gradient_accumulation_steps, args.seed)
    for step, _, micro in batches:
        if step >= steps:
            break
        for group in opt.param_groups:
            group["lr"] = learning_rate_at(args, step, total)
        n_items = sum(count_loss_tokens(b["labels"]) for b in micro)
        loss = 0.0
        for b in micro:
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"],
                        num_items_in_batch=n_items)
            out.loss.backward()
            loss += float(out.loss.detach())
        if args.clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return losses


def train_streaming(model: torch.nn.Module, dataset: Any, args: TrainingArguments, *, vram: str, ram: str,
                    resume: bool = False, stop_at_step: int | None = None) -> mt.Trainer:
    """Train with the streaming trainer under the given budgets (raw codecs, fp32)."""
    mt.init(offload_dir=None, max_vram_gb=vram, max_ram_gb=ram, optimizer_compression=False, device="cpu")
    tr = mt.Trainer(model=model, train_dataset=dataset, args=args)
    tr.train(resume_from_checkpoint=resume or None, stop_at_step=stop_at_step)
    return tr


def clone(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy of a model with real weights."""
    return copy.deepcopy(model)
