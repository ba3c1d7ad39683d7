"""What a transformers user does around train(): resume, export, the CLI, arguments, odd datasets."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import tempfile
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hf_fixtures import bpe_tokenizer, text_splits, tiny_llama
from plain_reference import build, llama_config

import tierstore
import trainer as mt
from tools.cli import main as cli_main
from trainer.args import TrainingArguments
from trainer.hf_args import POLICY, REFUSED, WARNED, from_hf_args


def _init(vram: str = "1MiB") -> None:
    mt.init(offload_dir=None, max_vram_gb=vram, max_ram_gb="64MiB", optimizer_compression="raw", device="cpu")


def _args(out: Any, **kw: Any) -> TrainingArguments:
    base = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
                logging_steps=1, save_steps=2, learning_rate=2e-3, disable_tqdm=True)
    return TrainingArguments(**{**base, **kw})


@pytest.fixture(scope="module")
def tok() -> Any:
    return bpe_tokenizer()


def test_resume_true_without_checkpoint_says_so_and_creates_nothing(dataset: Any, tmp_path: Any) -> None:
    _init()
    tr = mt.Trainer(build(llama_config(2)), _args(tmp_path / "out"), train_dataset=dataset)
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        tr.train(resume_from_checkpoint=True)
    with pytest.raises(ValueError, match="checkpoint-4.*not a tierstore store"):
        tr.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    assert not os.path.exists(tmp_path / "out" / "store") and not os.path.exists(tmp_path / "out" / "checkpoint-4")
    tr.close()


def test_resume_from_a_store_path_and_checkpoints_hold_no_gradients(dataset: Any, tmp_path: Any) -> None:
    _init()
    model = build(llama_config(2))
    straight = mt.Trainer(build(llama_config(2)), _args(tmp_path / "a", max_grad_norm=1.0), train_dataset=dataset)
    straight.train()
    want = [e["loss"] for e in straight.state.log_history if "loss" in e]
    straight.close()
    first = mt.Trainer(model, _args(tmp_path / "b", max_grad_norm=1.0), train_dataset=dataset)
    first.train(stop_at_step=2)
    store_path = first.store.path
    first.close()
    # clipping + accumulation routes gradients through grad/* in the store; no commit keeps them
    with tierstore.open(store_path, mode="r", device="cpu") as ro:
        assert ro.keys(prefix="grad/") == [] and "meta/hf/config.json" in ro.keys(prefix="meta/")
    early = mt.Trainer(build(llama_config(2)), _args(tmp_path / "b", max_grad_norm=1.0), train_dataset=dataset)
    with pytest.raises(ValueError, match=r"checkpoint-1: .* last commit only \(step 2"):
        early.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-1"))
    early.close()
    resumed = mt.Trainer(build(llama_config(2), seed=5), _args(tmp_path / "elsewhere", max_grad_norm=1.0),
                         train_dataset=dataset)
    try:
        resumed.train(resume_from_checkpoint=store_path)  # a path to the store, HF-style
        assert resumed.store.path == store_path
        assert [e["loss"] for e in resumed.state.log_history if "loss" in e] == want
        for v in resumed.store.versions():
            with tierstore.open(store_path, mode="r", version=v.version, device="cpu") as ro:
                assert ro.keys(prefix="grad/") == [], v
    finally:
        resumed.close()
    # HF's own spelling of the last checkpoint: <output_dir>/checkpoint-N
    first = mt.Trainer(build(llama_config(2)), _args(tmp_path / "c", max_grad_norm=1.0), train_dataset=dataset)
    first.train(stop_at_step=2)
    first.close()
    hf_style = mt.Trainer(build(llama_config(2), seed=9), _args(tmp_path / "c", max_grad_norm=1.0),
                          train_dataset=dataset)
    try:
        hf_style.train(resume_from_checkpoint=str(tmp_path / "c" / "checkpoint-2"))
        assert [e["loss"] for e in hf_style.state.log_history if "loss" in e] == want
    finally:
        hf_style.close()


def test_model_is_usable_after_train(dataset: Any, tmp_path: Any) -> None:
    _init()
    model = build(llama_config(2))
    before = model.model.norm.weight.detach().clone()
    tr = mt.Trainer(model, _args(tmp_path / "out", max_steps=2), train_dataset=dataset)
    try:
        tr.train()
        assert model.model.norm.weight.device.type == "cpu"
        assert torch.equal(model.model.norm.weight.detach(), tr.store.get("model.norm.weight"))
        assert not torch.equal(model.model.norm.weight.detach(), before)
        ids = dataset[0]["input_ids"][None]
        assert torch.isfinite(model(input_ids=ids).logits).all()
        assert model.lm_head.weight.shape == (256, 64)
    finally:
        tr.close()


def test_a_meta_skeleton_says_where_its_weights_are(dataset: Any, tmp_path: Any) -> None:
    src = build(llama_config(2))
    src.save_pretrained(tmp_path / "ckpt")
    mt.init(offload_dir=str(tmp_path / "store"), max_vram_gb="1MiB", max_ram_gb="64MiB",
            optimizer_compression="raw", device="cpu")
    model = mt.load_model(str(tmp_path / "ckpt"))
    tr = mt.Trainer(model, _args(tmp_path / "out", max_steps=1), train_dataset=dataset)
    try:
        tr.train()
        with pytest.raises(RuntimeError, match=f"weights live in the store at {tmp_path / 'store'}.*save_model"):
            model(input_ids=dataset[0]["input_ids"][None])
    finally:
        tr.close()


def test_export_and_save_model_give_model_and_tokenizer(tok: Any, tmp_path: Any) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling

    train_ds, eval_ds = text_splits(tok, n_train=16, n_eval=4)
    _init()
    model = tiny_llama(tok)
    tr = mt.Trainer(model, _args(tmp_path / "run", max_steps=2, gradient_accumulation_steps=1),
                    DataCollatorForLanguageModeling(tok, mlm=False), train_ds, eval_ds, tok)
    try:
        tr.train()
        metrics = tr.evaluate()
        saved = tr.save_model(str(tmp_path / "saved"))
        store_path = tr.store.path
    finally:
        tr.close()
    code = cli_main(["--quiet", "export", store_path, str(tmp_path / "exported"), "--format", "hf"])
    assert code == 0
    text = "def main(argv):\n    return 0"
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = model(input_ids=ids).logits  # the weights bound back after train
    for folder in (saved, str(tmp_path / "exported")):
        loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
        t2 = AutoTokenizer.from_pretrained(folder)
        assert t2(text)["input_ids"] == tok(text)["input_ids"] and t2.pad_token == "<pad>"
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=0, atol=0)
    assert metrics["eval_loss"] > 0 and metrics["eval_perplexity"] == pytest.approx(np.exp(metrics["eval_loss"]))


def test_iterable_dataset_with_max_steps(tmp_path: Any) -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # 10 sequences, then the stream restarts (an "epoch")
            g = torch.Generator().manual_seed(0)
            for _ in range(10):
                yield {"input_ids": torch.randint(0, 256, (16,), generator=g)}

    _init()
    tr = mt.Trainer(build(llama_config(2)), _args(tmp_path / "out", max_steps=3, save_steps=0), train_dataset=Stream())
    try:
        out = tr.train()
        assert out.global_step == 3 and np.isfinite(out.training_loss)
        losses = [e["loss"] for e in tr.state.log_history if "loss" in e]
        assert out.training_loss == pytest.approx(sum(losses) / 3)  # the run's mean, not the last step
    finally:
        tr.close()
    tr = mt.Trainer(build(llama_config(2)), _args(tmp_path / "o2", max_steps=-1, num_train_epochs=1),
                    train_dataset=Stream())
    with pytest.raises(ValueError, match="max_steps"):
        tr.train()
    tr.close()


def test_bert_is_refused_as_not_a_causal_lm() -> None:
    from transformers import AutoModelForMaskedLM, BertConfig

    bert = AutoModelForMaskedLM.from_config(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                       intermediate_size=64, vocab_size=100))
    with pytest.raises(mt.UnsupportedModelError, match="only decoder-only causal LMs"):
        mt.Trainer(bert, TrainingArguments(output_dir="unused"))


def test_trainer_arguments_transformers_refuses_too(dataset: Any) -> None:
    with pytest.raises(ValueError, match="needs an eval_dataset"):
        mt.Trainer(build(llama_config(1)), TrainingArguments(output_dir="unused", eval_strategy="steps"),
                   train_dataset=dataset)
    with pytest.raises(ValueError, match="compute_metrics=.... is refused"):
        mt.Trainer(build(llama_config(1)), TrainingArguments(output_dir="unused"), compute_metrics=lambda p: {})


def test_every_hf_field_has_a_policy_and_refusals_name_the_field(tmp_path: Any) -> None:
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments as HFArgs

    names = [f.name for f in dataclasses.fields(HFArgs)]
    assert sorted(set(names) - set(POLICY)) == []
    base = dict(output_dir=str(tmp_path), report_to=[])
    for field, value, kind in [("label_smoothing_factor", 0.1, REFUSED), ("optim", "sgd", REFUSED),
                               ("push_to_hub", True, REFUSED), ("dataloader_num_workers", 2, WARNED),
                               ("torch_compile", True, WARNED)]:
        hf = HFArgs(**base, **{field: value})
        if kind == REFUSED:
            with pytest.raises(ValueError, match=f"TrainingArguments.{field}=.* is refused"):
                from_hf_args(hf)
        else:
            with pytest.warns(UserWarning, match=f"TrainingArguments.{field}=.* is ignored"):
                from_hf_args(hf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults raise no warning
        a = from_hf_args(HFArgs(**base, save_total_limit=3, eval_strategy="steps", eval_steps=5))
    assert (a.save_total_limit, a.eval_strategy, a.eval_steps, a.report_to) == (3, "steps", 5, [])


def test_cli_train_keeps_its_store_in_output_dir_and_resumes(tmp_path: Any, capsys: Any) -> None:
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps(llama_config(2).to_dict()))
    np.save(tmp_path / "tokens.npy", np.arange(4096, dtype=np.int64) % 251)
    out = tmp_path / "D"
    temp_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "trainer-store-*")))
    common = ["--quiet", "train", "--model", str(cfg), "--data", str(tmp_path / "tokens.npy"), "--block-size", "16",
              "--per-device-train-batch-size", "2", "--output-dir", str(out), "--save-steps", "2",
              "--logging-steps", "1", "--max-ram-gb", "0.0625", "--optimizer-compression", "raw"]
    capsys.readouterr()
    code = cli_main(["--quiet", "train", *common[2:], "--max-steps", "1", "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "No valid checkpoint found" in err
    assert not os.path.exists(out / "store")
    assert cli_main([*common, "--max-steps", "2"]) == 0
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "trainer-store-*"))) == temp_before
    assert (out / "store" / "catalog").is_dir() and (out / "trace.json").is_file()
    assert (out / "trainer_log.jsonl").is_file()
    assert cli_main([*common, "--max-steps", "4", "--resume"]) == 0
    with tierstore.open(str(out / "store"), mode="r", device="cpu") as ro:
        assert [v.step for v in ro.versions()][-1] == 4
    lines = [json.loads(ln) for ln in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines if "loss" in e] == [1, 2, 3, 4]
    capsys.readouterr()
    assert cli_main(["--quiet", "trace", str(out), "--out", str(tmp_path / "t.png")]) == 0
    assert "compute" in capsys.readouterr().out and (tmp_path / "t.png").is_file()


def test_cli_errors_are_one_line(tmp_path: Any, capsys: Any) -> None:
    cfg = tmp_path / "bert.json"
    cfg.write_text(json.dumps({"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 300}))
    np.save(tmp_path / "tokens.npy", np.arange(512, dtype=np.int64) % 251)
    capsys.readouterr()
    code = cli_main(["--quiet", "train", "--model", str(cfg), "--data", str(tmp_path / "tokens.npy"),
                     "--output-dir", str(tmp_path / "o"), "--max-steps", "1"])
    err = capsys.readouterr().err
    assert code != 0 and len(err.strip().splitlines()) == 1, err
    assert "only decoder-only causal LMs" in err


def test_hf_args_table_lists_every_field_and_is_current() -> None:
    from tools.hf_args_table import DOC, END, START, table

    page = open(os.path.join(os.path.dirname(__file__), "..", "..", DOC)).read()
    block = page.split(START, 1)[1].split(END, 1)[0].strip()
    assert block == table().strip(), f"run: python -m tools.hf_args_table --write {DOC}"


def test_report_to_tensorboard_without_tensorboard_warns_and_jsonl_still_written(
        dataset: Any, tmp_path: Any, monkeypatch: Any) -> None:
    from transformers.integrations import integration_utils

    class Missing:
        def __init__(self) -> None:
            raise RuntimeError("TensorBoardCallback requires tensorboard to be installed")

    monkeypatch.setitem(integration_utils.INTEGRATION_TO_CALLBACK, "tensorboard", Missing)
    _init()
    with pytest.warns(UserWarning, match="report_to='tensorboard'.*requires tensorboard"):
        tr = mt.Trainer(build(llama_config(1)), _args(tmp_path / "out", max_steps=1, report_to="tensorboard"),
                        train_dataset=dataset)
    try:
        tr.train()
    finally:
        tr.close()
    assert (tmp_path / "out" / "trainer_log.jsonl").is_file() and not (tmp_path / "out" / "runs").exists()
