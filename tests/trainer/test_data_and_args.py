"""Data collation, the embedded corpus, TrainingArguments and the LR schedules vs transformers."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch

from trainer.args import TrainingArguments, learning_rate_at
from trainer.data import (
    ByteTokenizer,
    collate,
    default_corpus_bytes,
    default_dataset,
    stdlib_source_files,
    step_batches,
)
from trainer.hf_args import from_hf_args


def test_corpus_is_the_stdlib_read_deterministically() -> None:
    files = stdlib_source_files()
    assert any(f.endswith(os.sep + "os.py") for f in files)
    assert files == sorted(files)
    a = default_corpus_bytes(100_000)
    assert a == default_corpus_bytes(100_000) and len(a) == 100_000
    with open(files[0], "rb") as f:
        assert a.startswith(f.read()[:1000])
    ds = default_dataset(block_size=64, max_bytes=100_000)
    assert len(ds) == 100_000 // 64
    assert ds[0]["input_ids"].shape == (64,) and int(ds[0]["input_ids"].max()) < 256


def test_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id and tok.vocab_size == 259
    assert tok.decode(ids) == "héllo"


def test_collate_pads_and_masks_labels() -> None:
    items: list[dict[str, Any]] = [
        {"input_ids": [5, 6, 7]},
        {"input_ids": torch.tensor([8, 9]), "labels": [-100, 9]},
        {"input_ids": [1, 2, 3], "attention_mask": [1, 1, 0]},
    ]
    b = collate(items, pad_token_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0], [1, 2, 3]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 0]]
    assert b["labels"].tolist() == [[5, 6, 7], [-100, 9, -100], [1, 2, -100]]
    with pytest.raises(ValueError, match="differ in length"):
        collate([{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(TypeError, match="input_ids"):
        collate([{"text": "x"}])


def test_step_batches_resume_where_they_left_off() -> None:
    ds = [{"input_ids": [i, i + 1]} for i in range(20)]  # a datasets.Dataset-like list of dicts
    full = [b for _, (_, _, b) in zip(range(7), step_batches(ds, 2, 2, seed=3), strict=False)]
    later = [b for _, (_, _, b) in zip(range(3), step_batches(ds, 2, 2, seed=3, start_step=4), strict=False)]
    for x, y in zip(full[4:], later, strict=True):
        assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(x, y, strict=True))
    # An epoch (5 steps of 2 x 2 items) sees every item once; the next epoch is another order.
    first = [int(r[0]) for m in full[:5] for b in m for r in b["input_ids"]]
    assert sorted(first) == list(range(20))
    second = [int(r[0]) for m in full[5:7] for b in m for r in b["input_ids"]]
    assert second != first[:8]


def test_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        TrainingArguments(gradient_accumulation_steps=0)
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        TrainingArguments(lr_scheduler_type="polynomialish")
    with pytest.raises(ValueError, match="adam_beta2"):
        TrainingArguments(adam_beta2=1.0)


def test_reads_fields_of_a_transformers_like_object() -> None:
    from types import SimpleNamespace

    from transformers.trainer_utils import SchedulerType

    hf = SimpleNamespace(output_dir="o", per_device_train_batch_size=3, lr_scheduler_type=SchedulerType.COSINE,
                         warmup_steps=0.1, max_steps=50, fp16=False, push_to_hub=False)
    a = from_hf_args(hf)
    assert (a.per_device_train_batch_size, a.lr_scheduler_type, a.warmup_for(50)) == (3, "cosine", 5)
    with pytest.raises(ValueError, match="fp16"):
        from_hf_args(SimpleNamespace(fp16=True))


def test_reads_transformers_training_arguments(tmp_path: Any) -> None:
    pytest.importorskip("accelerate", reason="transformers.TrainingArguments needs accelerate")
    from transformers import TrainingArguments as HFArgs

    hf = HFArgs(output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=4,
                learning_rate=3e-4, lr_scheduler_type="cosine", warmup_steps=7, max_steps=50, weight_decay=0.1,
                max_grad_norm=0.7, seed=11, report_to=[])
    a = from_hf_args(hf)
    assert (a.per_device_train_batch_size, a.gradient_accumulation_steps, a.learning_rate) == (3, 4, 3e-4)
    assert (a.lr_scheduler_type, a.warmup_steps, a.max_steps, a.max_grad_norm, a.seed) == ("cosine", 7, 50, 0.7, 11)
    assert a.warmup_for(50) == hf.get_warmup_steps(50)


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
@pytest.mark.parametrize("warmup", [0, 4, 0.25])
def test_schedules_match_transformers(kind: str, warmup: float) -> None:
    from transformers import get_scheduler

    total = 20
    args = TrainingArguments(learning_rate=1e-3, lr_scheduler_type=kind, warmup_steps=warmup, max_steps=total)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1e-3)
    sched = get_scheduler(kind, opt, num_warmup_steps=args.warmup_for(total), num_training_steps=total)
    for step in range(total):
        assert learning_rate_at(args, step, total) == opt.param_groups[0]["lr"], (kind, step)
        opt.step()
        sched.step()


def test_moment_codec_policy_warns_off_goal_codecs() -> None:
    """Codecs whose measured loss gap or update length misses its goal are opt-in with a warning naming it."""
    import warnings

    from trainer.optimizer import MOMENT_CODEC_GAPS, MOMENT_UPDATE_LENGTH, moment_codec_name

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # raw and the in-goal codec stay silent
        assert moment_codec_name(None) == "raw"
        assert moment_codec_name("q8") == "q8"
        assert moment_codec_name(True) == "q8"  # the default: the codec that met its goal
    for name, goal_text in (("q2", "3% goal"), ("q3", "3% goal")):
        gap, goal = MOMENT_CODEC_GAPS[name]
        assert abs(gap) > goal
        with pytest.warns(UserWarning, match=rf"'{name}'.*{re.escape(f'{gap * 100:+.2f}')}%.*{goal_text}"):
            assert moment_codec_name(name) == name
    # q4's loss met its goal, its update's length did not: the warning says which
    gap, goal = MOMENT_CODEC_GAPS["q4"]
    length, length_goal = MOMENT_UPDATE_LENGTH["q4"]
    assert abs(gap) <= goal and abs(length - 1) > length_goal
    with pytest.warns(UserWarning, match=rf"'q4'.*{length:.3f}x as long.*2% goal.*within 1%.*{re.escape(f'{gap * 100:+.2f}')}%"):
        assert moment_codec_name("q4") == "q4"
