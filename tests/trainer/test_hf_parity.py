"""One script, two trainers: transformers.Trainer and mt.Trainer give the same run.

Tiny Llama, a local BPE tokenizer, datasets.Dataset splits, DataCollatorForLanguageModeling
(mlm=False), an eval set evaluated every few steps, a cosine schedule with warm-up, clipping,
gradient accumulation, save_total_limit=2, report_to="tensorboard", a recording callback. With
raw codecs the streaming run must log the same train and eval losses at every logged step, call
the same callback events in the same order, keep as many checkpoints, and write TensorBoard
events that tensorboard's own reader reads.
"""

from __future__ import annotations

import copy
import glob
import os
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
pytest.importorskip("datasets")
pytest.importorskip("tensorboard")

from hf_fixtures import bpe_tokenizer, text_splits, tiny_llama  # noqa: E402
from transformers import DataCollatorForLanguageModeling, TrainerCallback  # noqa: E402
from transformers import Trainer as HFTrainer  # noqa: E402
from transformers import TrainingArguments as HFArgs  # noqa: E402

import trainer as mt  # noqa: E402


class Recorder(TrainerCallback):
    """Records every event's name, with the step it happened at."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_"):
            events = object.__getattribute__(self, "events")
            return lambda args, state, control, **kw: events.append((name, state.global_step))
        return object.__getattribute__(self, name)


def _args(out: str) -> HFArgs:
    return HFArgs(output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                  gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.01, lr_scheduler_type="cosine",
                  warmup_steps=2, max_steps=8, logging_steps=2, eval_strategy="steps", eval_steps=3, save_steps=2,
                  save_total_limit=2, report_to="tensorboard", seed=7, max_grad_norm=0.5, disable_tqdm=True,
                  use_cpu=True)


def _scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dirs = glob.glob(os.path.join(run_dir, "runs", "*"))
    assert len(dirs) == 1 and glob.glob(os.path.join(dirs[0], "events.out.tfevents.*")), dirs
    acc = EventAccumulator(dirs[0])  # all event files of the run folder (evaluate() after train adds one)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("parity")
    tok = bpe_tokenizer()
    train_ds, eval_ds = text_splits(tok)
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    model = tiny_llama(tok)
    twin = copy.deepcopy(model)
    out: dict[str, Any] = {}

    rec = Recorder()
    hf = HFTrainer(model=model, args=_args(str(tmp / "hf")), data_collator=collator, train_dataset=train_ds,
                   eval_dataset=eval_ds, processing_class=tok, callbacks=[rec])
    hf_result = hf.train()
    out["hf"] = dict(log=hf.state.log_history, events=rec.events, result=hf_result, eval=hf.evaluate(),
                     ckpts=sorted(glob.glob(str(tmp / "hf" / "checkpoint-*"))), tb=_scalars(str(tmp / "hf")))

    mt.init(offload_dir=None, max_vram_gb="96KiB", max_ram_gb="64MiB", optimizer_compression="raw", device="cpu")
    rec = Recorder()
    ours = mt.Trainer(twin, _args(str(tmp / "mt")), collator, train_ds, eval_ds, tok, callbacks=[rec])
    try:
        mt_result = ours.train()
        out["mt"] = dict(log=ours.state.log_history, events=rec.events, result=mt_result, eval=ours.evaluate(),
                         ckpts=[v.step for v in ours.store.versions()], tb=_scalars(str(tmp / "mt")),
                         store=ours.store.path, window=ours.store.stats()["peak_device_bytes"])
    finally:
        ours.close()
    out["model"], out["tmp"] = twin, tmp
    return out


def _series(log: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(e["step"], e[key]) for e in log if key in e]


def test_train_and_eval_losses_match_per_logged_step(runs: dict[str, Any]) -> None:
    hf, ours = runs["hf"]["log"], runs["mt"]["log"]
    for key in ("loss", "eval_loss", "learning_rate", "epoch"):
        a, b = _series(hf, key), _series(ours, key)
        assert [s for s, _ in a] == [s for s, _ in b] and a, key
        for (step, x), (_, y) in zip(a, b, strict=True):
            assert y == pytest.approx(x, rel=1e-5, abs=1e-7), (key, step, x, y)
    assert [s for s, _ in _series(hf, "loss")] == [2, 4, 6, 8]
    assert [s for s, _ in _series(hf, "eval_loss")] == [3, 6, 8, 8]  # every 3 steps, at the end, then evaluate()
    for (_, x), (_, y) in zip(_series(hf, "grad_norm"), _series(ours, "grad_norm"), strict=True):
        assert y == pytest.approx(x, rel=1e-4)
    r_hf, r_mt = runs["hf"]["result"], runs["mt"]["result"]
    assert r_mt.global_step == r_hf.global_step == 8
    assert r_mt.training_loss == pytest.approx(r_hf.training_loss, rel=1e-5)  # the run's mean, not the last
    assert runs["mt"]["eval"]["eval_loss"] == pytest.approx(runs["hf"]["eval"]["eval_loss"], rel=1e-5)
    assert runs["mt"]["eval"]["eval_perplexity"] == pytest.approx(torch.tensor(runs["mt"]["eval"]["eval_loss"]).exp().item())
    # the streaming run really streamed: its device window held under all of the weights
    n_bytes = 4 * sum(p.numel() for p in runs["model"].parameters())
    assert runs["mt"]["window"] < n_bytes


def test_same_callback_sequence(runs: dict[str, Any]) -> None:
    hf, ours = runs["hf"]["events"], runs["mt"]["events"]
    assert ours == hf
    names = {n for n, _ in hf}
    assert {"on_train_begin", "on_step_begin", "on_substep_end", "on_step_end", "on_log", "on_evaluate",
            "on_save", "on_prediction_step", "on_epoch_begin", "on_epoch_end", "on_train_end"} <= names


def test_same_checkpoint_count(runs: dict[str, Any]) -> None:
    assert len(runs["hf"]["ckpts"]) == 2 and [p.rsplit("-", 1)[1] for p in runs["hf"]["ckpts"]] == ["6", "8"]
    assert runs["mt"]["ckpts"] == [6, 8]  # save_total_limit=2 is the store's retention


def test_tensorboard_events_readable_and_equal(runs: dict[str, Any]) -> None:
    hf, ours = runs["hf"]["tb"], runs["mt"]["tb"]
    for tag in ("train/loss", "train/learning_rate", "train/epoch", "eval/loss", "train/train_loss"):
        assert tag in hf and tag in ours, tag
        assert [s for s, _ in ours[tag]] == [s for s, _ in hf[tag]], tag
        for (_, x), (_, y) in zip(hf[tag], ours[tag], strict=True):
            assert y == pytest.approx(x, rel=1e-5, abs=1e-7), tag


def test_jsonl_log_and_trace_in_output_dir(runs: dict[str, Any]) -> None:
    import json

    out = runs["tmp"] / "mt"
    lines = [json.loads(ln) for ln in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines if "loss" in e] == [2, 4, 6, 8]
    assert any("eval_loss" in e for e in lines) and "train_loss" in lines[-2]
    trace = json.loads((out / "trace.json").read_text())
    cats = {e.get("cat") for e in trace["traceEvents"]}
    assert "compute" in cats and "disk" in cats
    assert runs["mt"]["store"] == str(out / "store")


def test_epochs_partial_batches_and_epoch_strategies_match(tmp_path: Any) -> None:
    """num_train_epochs instead of max_steps, a partial last batch and accumulation window,
    evaluation and checkpoints once an epoch, every step logged."""
    tok = bpe_tokenizer()
    train_ds, eval_ds = text_splits(tok, n_train=22, n_eval=6)
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    model = tiny_llama(tok, seed=3)
    twin = copy.deepcopy(model)

    def args(out: str) -> HFArgs:
        return HFArgs(output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                      gradient_accumulation_steps=2, num_train_epochs=2, learning_rate=3e-3, logging_steps=1,
                      eval_strategy="epoch", save_strategy="epoch", report_to=[], seed=11, disable_tqdm=True,
                      use_cpu=True, lr_scheduler_type="linear", warmup_steps=1)

    rec_hf, rec_mt = Recorder(), Recorder()
    hf = HFTrainer(model=model, args=args(str(tmp_path / "hf")), data_collator=collator, train_dataset=train_ds,
                   eval_dataset=eval_ds, callbacks=[rec_hf])
    hf.train()
    mt.init(offload_dir=None, max_vram_gb="96KiB", max_ram_gb="64MiB", optimizer_compression="raw", device="cpu")
    ours = mt.Trainer(twin, args(str(tmp_path / "mt")), collator, train_ds, eval_ds, tok, callbacks=[rec_mt])
    try:
        ours.train()
        commits = [v.step for v in ours.store.versions()]
    finally:
        ours.close()
    for key in ("loss", "eval_loss", "epoch", "learning_rate"):
        a, b = _series(hf.state.log_history, key), _series(ours.state.log_history, key)
        assert [s for s, _ in a] == [s for s, _ in b] and a, key
        for (step, x), (_, y) in zip(a, b, strict=True):
            assert y == pytest.approx(x, rel=1e-5, abs=1e-7), (key, step, x, y)
    assert [s for s, _ in _series(hf.state.log_history, "loss")] == [1, 2, 3, 4, 5, 6]  # 3 steps an epoch
    assert rec_mt.events == rec_hf.events
    assert commits == [3, 6] and len(glob.glob(str(tmp_path / "hf" / "checkpoint-*"))) == 2
