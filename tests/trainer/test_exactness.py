"""The streaming trainer follows plain PyTorch training step for step (raw codecs, fp32)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from plain_reference import (
    build,
    clone,
    gpt2_config,
    llama_config,
    reference_train,
    train_streaming,
    weight_bytes,
)

from trainer.args import TrainingArguments
from trainer.optimizer import UpdateWorker
from trainer.streaming import StreamingEngine

STEPS = 6


def _args(tmp: Any, clip: float = 0.5) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             learning_rate=2e-3, weight_decay=0.1, max_steps=STEPS, warmup_steps=2,
                             lr_scheduler_type="cosine", max_grad_norm=clip, logging_steps=1, save_steps=0,
                             disable_tqdm=True)


def _run(config: Any, dataset: Any, tmp: Any, clip: float = 0.5, lend: bool = True) -> dict[str, Any]:
    if not lend:  # the CUDA path's copies into the window, on the CPU
        init = StreamingEngine.__init__
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(StreamingEngine, "__init__", functools.partialmethod(init, lend=False))
            return _run(config, dataset, tmp, clip)
    model = build(config)
    ref = clone(model)
    wbytes = weight_bytes(model)
    # A device window well under half the weights; a RAM budget below the training state (16 B/param).
    vram = wbytes * 45 // 100
    ram = wbytes * 2
    args = _args(tmp, clip)
    workers: list[UpdateWorker] = []
    init = UpdateWorker.__init__

    def recorded(self: UpdateWorker, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        workers.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(UpdateWorker, "__init__", recorded)
        tr = train_streaming(model, dataset, args, vram=f"{vram}B", ram=f"{ram}B")
    try:
        ref_losses = reference_train(ref, dataset, args, STEPS)
        weights = {n: tr.store.get(n) for n, _ in ref.named_parameters()}
        stats = tr.store.stats()
        kernel_threads = tr.store.config.kernel_threads, [w._kernel_threads for w in workers]
    finally:
        tr.close()
    return {"kernel_threads": kernel_threads, "losses": [e["loss"] for e in [e for e in tr.state.log_history if "loss" in e]], "ref_losses": ref_losses, "weights": weights,
            "ref": ref, "stats": stats, "vram": vram, "ram": ram, "log": [e for e in tr.state.log_history if "loss" in e]}


@pytest.fixture(scope="module")
def llama_run(dataset: Any, tmp_path_factory: Any) -> dict[str, Any]:
    return _run(llama_config(4), dataset, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def gpt2_run(dataset: Any, tmp_path_factory: Any) -> dict[str, Any]:
    return _run(gpt2_config(4), dataset, tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def llama_window_run(dataset: Any, tmp_path_factory: Any) -> dict[str, Any]:
    return _run(llama_config(3), dataset, tmp_path_factory.mktemp("window"), lend=False)


@pytest.fixture(scope="module")
def llama_noclip_run(dataset: Any, tmp_path_factory: Any) -> dict[str, Any]:
    # Without clipping each group is updated on the worker thread while backward goes on.
    return _run(llama_config(3), dataset, tmp_path_factory.mktemp("noclip"), clip=0.0)


@pytest.mark.parametrize("run", ["llama_run", "gpt2_run", "llama_noclip_run", "llama_window_run"])
def test_losses_and_weights_match_plain_pytorch(run: str, request: Any) -> None:
    r = request.getfixturevalue(run)
    assert len(r["losses"]) == STEPS
    for got, want in zip(r["losses"], r["ref_losses"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], r["ref_losses"])
    # Training moved the weights, so equal weights are not equal initial weights.
    assert r["losses"][-1] < r["losses"][0]
    for name, p in r["ref"].named_parameters():
        torch.testing.assert_close(r["weights"][name], p.detach(), atol=1e-5, rtol=0, msg=name)


def test_raw_moments_on_the_cpu_leave_the_cores_to_the_training_threads_team(llama_run: dict[str, Any]) -> None:
    # the store's threads and the optimizer's run their kernels on one thread each (and the
    # run above still equals plain PyTorch)
    assert llama_run["kernel_threads"] == (1, [1])


def test_gpt2_embeddings_are_tied_in_one_key(gpt2_run: dict[str, Any]) -> None:
    ref = gpt2_run["ref"]
    assert ref.lm_head.weight is ref.transformer.wte.weight
    assert "lm_head.weight" not in gpt2_run["weights"]


@pytest.mark.parametrize("run", ["llama_run", "gpt2_run", "llama_window_run"])
def test_peaks_stay_within_budgets(run: str, request: Any) -> None:
    r = request.getfixturevalue(run)
    s = r["stats"]
    assert s["peak_device_bytes"] <= r["vram"]
    assert 0 < s["peak_host_bytes"] <= r["ram"]
    # The window really was used for more than the whole model would fit at once... it is under half.
    assert r["vram"] < weight_bytes(r["ref"]) / 2


@pytest.mark.parametrize("run", ["llama_run", "gpt2_run"])
def test_a_cpu_window_computes_on_the_ram_tiers_buffers(run: str, request: Any) -> None:
    s = request.getfixturevalue(run)["stats"]
    # every weight is raw fp32 in one chunk: each read is a loan, none a copy into the window
    assert s["lent"] > 0 and s["bytes_lent"] > 0
    assert s["bytes_h2d"] == 0 and s["peak_device_bytes"] == 0


def test_copies_into_the_window_fill_it_within_its_budget(llama_window_run: dict[str, Any]) -> None:
    s = llama_window_run["stats"]
    assert s["lent"] == 0 and s["bytes_h2d"] > 0
    assert 0 < s["peak_device_bytes"] <= llama_window_run["vram"]


def test_log_history_fields(llama_run: dict[str, Any]) -> None:
    entry = llama_run["log"][-1]
    for key in ("step", "loss", "learning_rate", "grad_norm", "epoch", "tokens_per_s", "stall_s", "step_s"):
        assert key in entry
    assert [e["step"] for e in llama_run["log"]] == list(range(1, STEPS + 1))
    assert entry["grad_norm"] > 0 and entry["tokens_per_s"] > 0
    # AdamW's arithmetic, apart from the store traffic around it; 0 is a fair value only without updates
    assert sum(e["optimizer_math_s"] for e in llama_run["log"]) > 0
    assert all(e["optimizer_math_s"] >= 0 for e in llama_run["log"])


def test_bf16_compute_tracks_fp32(dataset: Any, tmp_path: Any) -> None:
    losses = {}
    for bf16 in (False, True):
        args = TrainingArguments(output_dir=str(tmp_path / str(bf16)), per_device_train_batch_size=4, max_steps=3,
                                 logging_steps=1, save_steps=0, bf16=bf16, learning_rate=1e-3, disable_tqdm=True)
        tr = train_streaming(build(llama_config(2)), dataset, args, vram="1MiB", ram="4MiB")
        tr.close()
        losses[bf16] = [e["loss"] for e in [e for e in tr.state.log_history if "loss" in e]]
    assert losses[True] != losses[False]  # bf16 really computed in bf16
    for a, b in zip(losses[True], losses[False], strict=True):
        assert abs(a - b) < 1e-2 * b


def test_moments_go_through_the_configured_codec(dataset: Any, tmp_path: Any) -> None:
    import trainer as mt

    runs = {}
    for comp in ("raw", "zstd", "q4"):  # zstd is lossless: the trajectory must not change
        mt.init(max_vram_gb="1MiB", max_ram_gb="4MiB", optimizer_compression=comp, device="cpu")
        args = TrainingArguments(output_dir=str(tmp_path / comp), per_device_train_batch_size=4, max_steps=3,
                                 logging_steps=1, save_steps=0, learning_rate=1e-3, disable_tqdm=True)
        tr = mt.Trainer(model=build(llama_config(2)), train_dataset=dataset, args=args)
        try:
            tr.train()
            big = tr.store.info("opt/exp_avg_sq/model.layers.0.mlp.up_proj.weight").codec
            big_m = tr.store.info("opt/exp_avg/model.layers.0.mlp.up_proj.weight").codec
            small = tr.store.info("opt/exp_avg/model.layers.0.input_layernorm.weight").codec["name"]
            runs[comp] = ([e["loss"] for e in [e for e in tr.state.log_history if "loss" in e]], tr.store.get("model.norm.weight"), big, small, big_m)
        finally:
            tr.close()
    assert runs["zstd"][2]["name"] == "zstd" and runs["zstd"][3] == "zstd"  # lossless: as asked
    assert runs["raw"][2]["name"] == "raw"
    assert runs["zstd"][0] == runs["raw"][0]
    assert torch.equal(runs["zstd"][1], runs["raw"][1])
    # q4: v unsigned with stochastic rounding, 1-D tensors keep raw moments (codecs.policy)
    assert runs["q4"][2] == {"name": "q4", "signed": False, "block": 128, "rounding": "stochastic",
                             "scales": "rank1"}
    assert runs["q4"][3] == "raw"
    # q4: m with subtractive dither on q4's own map (codecs.policy.FIRST_MOMENT_PARAMS)
    assert runs["q4"][4] == {"name": "q4", "signed": True, "block": 128, "rounding": "dither",
                             "scales": "rank1"}
    raw_losses, q4_losses = runs["raw"][0], runs["q4"][0]
    assert raw_losses[0] == q4_losses[0]  # the first step reads no moments
    assert q4_losses != raw_losses  # later steps do, through the lossy codec
    for a, b in zip(raw_losses, q4_losses, strict=True):
        assert abs(a - b) / a < 0.02
