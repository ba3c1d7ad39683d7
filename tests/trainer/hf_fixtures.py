"""What a Hugging Face user brings: a local BPE tokenizer, datasets.Dataset splits, a tiny Llama."""

from __future__ import annotations

from typing import Any

import torch

from trainer.data import default_corpus_bytes


def corpus_lines(n: int, skip: int = 0) -> list[str]:
    """``n`` non-trivial lines of the embedded stdlib corpus (after ``skip`` of them)."""
    lines = [ln.strip() for ln in default_corpus_bytes(400_000).decode("utf-8", "replace").splitlines()]
    lines = [ln for ln in lines if len(ln) > 20]
    return lines[skip: skip + n]


def bpe_tokenizer() -> Any:
    """A byte-level BPE tokenizer trained here on the corpus (no download), as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bpe = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<unk>", "<s>", "</s>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_lines(2000, skip=500), trainer=bpe)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def text_splits(tokenizer: Any, n_train: int = 48, n_eval: int = 12, max_length: int = 24) -> tuple[Any, Any]:
    """Tokenized datasets.Dataset train/eval splits of corpus lines (of varied lengths: padding happens)."""
    import datasets

    def tokenize(batch: dict[str, list[str]]) -> Any:
        return tokenizer(batch["text"], truncation=True, max_length=max_length)

    train = datasets.Dataset.from_dict({"text": corpus_lines(n_train)})
    evals = datasets.Dataset.from_dict({"text": corpus_lines(n_eval, skip=n_train)})
    return (train.map(tokenize, batched=True, remove_columns=["text"]),
            evals.map(tokenize, batched=True, remove_columns=["text"]))


def tiny_llama(tokenizer: Any, seed: int = 0) -> torch.nn.Module:
    """A 2-layer Llama for the tokenizer's vocabulary, with weights drawn from ``seed``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)
