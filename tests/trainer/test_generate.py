"""mt.generate against transformers' in-memory generate: greedy, padded batches, sampling, KV beyond RAM."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from plain_reference import build, gpt2_config, llama_config, weight_bytes

import trainer as mt
from trainer.generate import KV_PREFIX, kv_workspace_bytes


def _streamed(tmp_path: Any, model: torch.nn.Module, window: int | str, ram: int | str = "64MiB") -> Any:
    """The model saved as a HF folder and loaded with mt.load_model into a store with these budgets."""
    folder = str(tmp_path / "hf")
    model.save_pretrained(folder)
    mt.init(offload_dir=str(tmp_path / "store"), max_vram_gb=f"{window}B" if isinstance(window, int) else window,
            max_ram_gb=f"{ram}B" if isinstance(ram, int) else ram, device="cpu")
    return mt.load_model(folder)


def _prompts(batch: int, length: int, seed: int = 1, pad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 256, (batch, length), generator=g)
    if not pad:
        return ids, None
    mask = torch.ones_like(ids)
    for b in range(batch):
        mask[b, : (b * 2) % length] = 0  # left padding of different lengths; row 0 has none
    return ids.masked_fill(mask == 0, 1), mask


@pytest.mark.parametrize("make", [lambda: llama_config(3), lambda: gpt2_config(3)], ids=["llama", "gpt2"])
@pytest.mark.parametrize("pad", [False, True], ids=["no-padding", "left-padding"])
def test_greedy_tokens_equal_transformers(tmp_path: Any, make: Any, pad: bool) -> None:
    model = build(make()).eval()
    ids, mask = _prompts(4 if pad else 1, 9, pad=pad)
    # the window holds a third of the weights and the KV workspace: every token streams every layer through it
    ws = kv_workspace_bytes(model.config, ids.shape[0], ids.shape[1] + 24, 5)
    skeleton = _streamed(tmp_path, model, weight_bytes(model) // 3 + ws)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    out = mt.generate(skeleton, ids, attention_mask=mask, max_new_tokens=24, kv_block_tokens=5)
    assert out.shape == ref.shape and out.shape[1] > ids.shape[1]
    assert torch.equal(out, ref)
    store = skeleton._trainer_store
    assert store.keys(prefix=KV_PREFIX) == []  # the KV blocks are deleted afterwards
    st = store.stats()
    # a CPU window lends the RAM tier's buffers: weights and KV blocks, nothing copied into it
    assert st["lent"] > 0 and st["bytes_h2d"] == 0


def test_each_token_closes_a_step_of_the_stores_access_trace(tmp_path: Any) -> None:
    """The predictor learns the reads of a token's step at ``mark_step()``: without it the
    trace grew by every read of a generation and nothing was ever predicted."""
    model = build(llama_config(2)).eval()
    ids, _ = _prompts(1, 5)
    skeleton = _streamed(tmp_path, model, "8MiB")
    store = skeleton._trainer_store
    mt.generate(skeleton, ids, max_new_tokens=6, eos_token_id=None)
    assert store.stats()["prediction_accuracy"] is not None
    assert store.async_store._predictor._current == []  # the last token's step is closed too


def test_eos_stops_and_pads_like_transformers(tmp_path: Any) -> None:
    model = build(llama_config(2)).eval()
    ids, mask = _prompts(3, 6, seed=3, pad=True)
    skeleton = _streamed(tmp_path, model, "8MiB")
    free = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    eos = int(free[1, ids.shape[1] + 2])  # a token row 1 emits: that row stops there, the others go on
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)
    out = mt.generate(skeleton, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)
    assert (out[1, ids.shape[1] + 3:] == 0).all()


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(top_k=5), dict(top_p=0.8, temperature=1.3),
                                dict(top_k=10, top_p=0.9, temperature=0.5)],
                         ids=["temperature", "top_k", "top_p", "all"])
def test_sampling_draws_what_transformers_draws_with_the_same_seed(tmp_path: Any, kw: dict[str, Any]) -> None:
    model = build(llama_config(2)).eval()
    ids, mask = _prompts(3, 5, seed=2, pad=True)
    skeleton = _streamed(tmp_path, model, weight_bytes(model) // 2)
    torch.manual_seed(5)
    ref = model.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=16, eos_token_id=None, **kw)
    torch.manual_seed(5)
    out = mt.generate(skeleton, ids, attention_mask=mask, do_sample=True, max_new_tokens=16, eos_token_id=None, **kw)
    assert torch.equal(out, ref)


def test_seeded_sampling_reproduces_and_top_k_1_is_greedy(tmp_path: Any) -> None:
    model = build(gpt2_config(2)).eval()
    ids, _ = _prompts(2, 5, seed=4)
    skeleton = _streamed(tmp_path, model, weight_bytes(model) // 2 + kv_workspace_bytes(model.config, 2, 21))
    run = lambda **kw: mt.generate(skeleton, ids, max_new_tokens=16, eos_token_id=None, **kw)  # noqa: E731
    a = run(do_sample=True, temperature=1.5, top_k=0, seed=11)
    torch.manual_seed(0)  # the seeded generator, not the global RNG, draws
    b = run(do_sample=True, temperature=1.5, top_k=0, seed=11)
    c = run(do_sample=True, temperature=1.5, top_k=0, generator=torch.Generator().manual_seed(12))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(run(do_sample=True, top_k=1, temperature=0.3, seed=13), run(do_sample=False))


def test_kv_cache_larger_than_the_ram_budget(tmp_path: Any) -> None:
    model = build(llama_config(2)).eval()
    ids, mask = _prompts(2, 40, seed=6, pad=True)
    new = 24
    # keys + values of every layer and position: 2 x layers x batch x kv_heads x positions x head_dim x 4 B
    kv_bytes = 2 * 2 * 2 * 2 * (ids.shape[1] + new) * 16 * 4
    ram = 48 * 1024
    assert kv_bytes > ram
    skeleton = _streamed(tmp_path, model, weight_bytes(model), ram=ram)
    store = skeleton._trainer_store
    written = store.stats()["bytes_written_disk"]
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None)
    out = mt.generate(skeleton, ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None, kv_block_tokens=8)
    assert torch.equal(out, ref)
    assert store.stats()["bytes_written_disk"] - written >= kv_bytes // 2  # the blocks spilled to disk
    assert store.stats()["peak_host_bytes"] <= ram


def _layer_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())


def test_kv_workspace_and_blocks_are_counted_in_the_budgets(tmp_path: Any) -> None:
    model = build(llama_config(2)).eval()
    ids, mask = _prompts(3, 30, seed=7, pad=True)
    new, block = 20, 4
    ws = kv_workspace_bytes(model.config, 3, ids.shape[1] + new, block)  # with room for one block read
    # room for one layer, the workspace and one KV block: a layer's 12 blocks never fit beside
    window, ram = _layer_bytes(model) + ws, 256 * 1024
    skeleton = _streamed(tmp_path, model, window, ram=ram)
    store = skeleton._trainer_store
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None)
    out = mt.generate(skeleton, ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None,
                      kv_block_tokens=block)
    assert torch.equal(out, ref)
    st = store.stats()
    # the workspace sat in the window (all of it but the room for one block read): counted, and
    # the weights and KV blocks were lent from the RAM tier (a CPU window), counted there: the
    # weights (428 KiB) do not fit the RAM budget, so lent chunks were read back and evicted
    # in turn, never beyond either budget
    assert st["peak_device_bytes"] >= ws - 2 * 3 * 2 * block * 16 * 4
    assert st["peak_device_bytes"] <= window
    assert st["lent"] > 0 and st["bytes_h2d"] == 0 and st["host_lent_bytes"] == 0
    assert weight_bytes(model) > ram and st["peak_host_bytes"] <= ram


def test_a_window_without_room_for_the_kv_workspace_raises(tmp_path: Any) -> None:
    from tierstore.errors import BudgetError

    model = build(llama_config(2)).eval()
    ids, _ = _prompts(4, 30, seed=7)
    ws = kv_workspace_bytes(model.config, 4, ids.shape[1] + 10, 8)
    skeleton = _streamed(tmp_path, model, _layer_bytes(model) + ws - 1)
    with pytest.raises(BudgetError, match="KV workspace .* do not fit the device window"):
        mt.generate(skeleton, ids, max_new_tokens=10, kv_block_tokens=8)
    assert skeleton._trainer_store.keys(prefix=KV_PREFIX) == []
    # one position fewer to keep: it fits
    assert mt.generate(skeleton, ids, max_new_tokens=9, kv_block_tokens=8).shape == (4, 39)


def _from_imported_store(tmp_path: Any, model: Any, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mt.generate from a `tierstore import` of ``model``, transformers' generate) on padded prompts."""
    from tools.cli import main

    model.save_pretrained(str(tmp_path / "hf"))
    assert main(["--quiet", "import", str(tmp_path / "hf"), str(tmp_path / "store")]) == 0
    mt.init(offload_dir=str(tmp_path / "other"), max_vram_gb="4MiB", max_ram_gb="16MiB", device="cpu")
    ids, mask = _prompts(2, 7, seed=seed, pad=True)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    out = mt.generate(str(tmp_path / "store"), ids, attention_mask=mask, max_new_tokens=10)
    return out, ref


def test_generate_from_a_store_folder(tmp_path: Any) -> None:
    out, ref = _from_imported_store(tmp_path, build(gpt2_config(2)).eval(), seed=8)
    assert torch.equal(out, ref)


def test_bf16_weights_equal_transformers_in_bf16(tmp_path: Any) -> None:
    out, ref = _from_imported_store(tmp_path, build(llama_config(2)).to(torch.bfloat16).eval(), seed=9)
    assert torch.equal(out, ref)


def test_bad_inputs_say_what_is_wrong(tmp_path: Any) -> None:
    model = build(llama_config(2)).eval()
    with pytest.raises(TypeError, match="in-memory model"):
        mt.generate(model, torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="not a tierstore store"):
        mt.generate(str(tmp_path), torch.ones(1, 3, dtype=torch.long))
    skeleton = _streamed(tmp_path, model, "8MiB")
    with pytest.raises(ValueError, match="attention_mask shape"):
        mt.generate(skeleton, torch.ones(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        mt.generate(skeleton, torch.ones(1, 3, dtype=torch.long), do_sample=True, temperature=0.0)
    assert os.path.isdir(str(tmp_path / "store"))


def test_cli_generate_prints_transformers_tokens_and_leaves_the_store_as_it_was(tmp_path: Any, capsys: Any) -> None:
    import tierstore
    from tools.cli import main

    model = build(llama_config(2)).eval()
    model.save_pretrained(str(tmp_path / "hf"))
    store = str(tmp_path / "store")
    assert main(["--quiet", "import", str(tmp_path / "hf"), store]) == 0
    with tierstore.open(store, mode="r") as ro:
        before = (ro.keys(), [v.version for v in ro.versions()])
    capsys.readouterr()
    prompts = ["def f(x):", "import os"]
    argv = ["--quiet", "generate", store, "--ids", "--max-new-tokens", "8", "--device-budget", "320KiB"]
    assert main([*argv, *[a for p in prompts for a in ("--prompt", p)]]) == 0
    out, err = capsys.readouterr()
    assert "tokens/s" in err
    ids, mask = _encode_bytes(prompts)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    want = [" ".join(map(str, row[ids.shape[1]:].tolist())) for row in ref]
    assert out.splitlines() == want
    with tierstore.open(store, mode="r") as ro:
        assert (ro.keys(), [v.version for v in ro.versions()]) == before
    assert main(["--quiet", "generate", str(tmp_path), "--prompt", "x"]) == 2


def _encode_bytes(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    from tools.cli.generate_cmd import _encode

    return _encode(prompts, None, 256)


def test_the_cache_goes_by_the_name_the_model_takes() -> None:
    # transformers 5.2x calls it cache=, earlier releases past_key_values=; by the wrong name the
    # model's **kwargs swallowed it and every decode step attended to itself only (seen with 5.17)
    from trainer.generate import cache_kwarg

    class New(torch.nn.Module):
        def forward(self, input_ids: Any = None, cache: Any = None, **kwargs: Any) -> None: ...

    class Old(torch.nn.Module):
        def forward(self, input_ids: Any = None, past_key_values: Any = None, **kwargs: Any) -> None: ...

    class Neither(torch.nn.Module):
        def forward(self, input_ids: Any = None, **kwargs: Any) -> None: ...

    assert cache_kwarg(New()) == "cache" and cache_kwarg(Old()) == "past_key_values"
    with pytest.raises(ValueError, match="neither cache= nor past_key_values="):
        cache_kwarg(Neither())
