"""import -> export round trips checked against transformers, safetensors and zarr themselves."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import zarr
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

import tierstore


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(1))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _safetensors(folder: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as f:
                for k in f.keys():
                    assert k not in out
                    out[k] = f.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[torch.nn.Module, str, str]:
    """A tiny Llama saved in small shards, and a store it was imported into."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    root = tmp_path_factory.mktemp("llama")
    src = str(root / "src")
    model.save_pretrained(src, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(src, "model.safetensors.index.json"))
    from tools.cli import main

    assert main(["-q", "import", src, str(root / "store")]) == 0
    return model, src, str(root / "store")


def test_import_commits_once_naming_the_source(llama) -> None:
    _, src, store = llama
    with tierstore.open(store, mode="r", device="cpu") as s:
        (commit,) = s.versions()
        assert src in commit.message
        assert json.loads(s.get("meta/hf/config.json").numpy().tobytes())["model_type"] == "llama"
        assert "meta/hf/generation_config.json" in s


def test_sharded_import_export_byte_identical(cli, llama, tmp_path) -> None:
    _, src, store = llama
    out = str(tmp_path / "st")
    code, _, err = cli("export", store, out, "--format", "safetensors", "--max-shard-size", "50KB")
    assert code == 0, err
    ref, got = _safetensors(src), _safetensors(out)
    assert sorted(got) == sorted(ref)
    for k, t in ref.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(_bits(got[k]), _bits(t)), k
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert sorted(index["weight_map"]) == sorted(ref)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ref.values())
    shards = {os.path.join(out, n) for n in index["weight_map"].values()}
    assert len(shards) > 1
    assert not os.path.exists(out + ".partial")


def test_hf_export_loads_with_exact_fp32_logits(cli, llama, tmp_path) -> None:
    model, _, store = llama
    out = str(tmp_path / "hf")
    assert cli("export", store, out, "--format", "hf", "--max-shard-size", "60KB")[0] == 0
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = _ids(96)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def test_hf_export_bf16(cli, llama, tmp_path) -> None:
    model, _, store = llama
    out = str(tmp_path / "hf16")
    assert cli("export", store, out, "--format", "hf", "--dtype", "bf16")[0] == 0
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.dtype == torch.bfloat16
    ref16 = copy.deepcopy(model).to(torch.bfloat16)
    for (name, p), (_, q) in zip(loaded.state_dict().items(), ref16.state_dict().items(), strict=True):
        assert torch.equal(p, q), name  # exactly the bf16 rounding of the fp32 weights
    ids = _ids(96)
    fp32 = _logits(model, ids)
    as32 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    got = _logits(as32, ids)
    assert not torch.equal(got, fp32)  # the weights were rounded
    torch.testing.assert_close(got, fp32, atol=3e-2, rtol=0)  # ... by bf16 rounding only


def test_gpt2_tied_embeddings(cli, tmp_path) -> None:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=80, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    src = str(tmp_path / "gpt2")
    model.save_pretrained(src)
    assert "lm_head.weight" not in _safetensors(src)  # safetensors drops the tied head
    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    assert cli("import", src, store)[0] == 0
    assert cli("export", store, out, "--format", "hf")[0] == 0
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    ids = _ids(80)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def test_training_state_excluded_unless_asked(cli, tmp_path, make_store) -> None:
    path = make_store(tmp_path / "s", {"w": torch.ones(4), "opt/exp_avg/w": torch.zeros(4),
                                       "grad/w": torch.zeros(4), "meta/hf/x": torch.zeros(1, dtype=torch.uint8)})
    assert cli("export", path, str(tmp_path / "a"), "--format", "safetensors")[0] == 0
    assert sorted(_safetensors(str(tmp_path / "a"))) == ["w"]
    assert cli("export", path, str(tmp_path / "b"), "--format", "safetensors", "--all-keys")[0] == 0
    assert sorted(_safetensors(str(tmp_path / "b"))) == ["grad/w", "meta/hf/x", "opt/exp_avg/w", "w"]
    code, _, err = cli("export", path, str(tmp_path / "c"), "--format", "hf")
    assert code == 2 and "config.json" in err and not os.path.exists(tmp_path / "c")
    code, _, err = cli("export", path, str(tmp_path / "a"), "--format", "safetensors")
    assert code == 2 and "not an empty folder" in err


def test_zarr_export_readable_by_zarr(cli, tmp_path, make_store) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {"emb.weight": torch.randn(300, 40, generator=g), "norm": torch.randn(40).to(torch.bfloat16),
               "opt/step": torch.tensor(7), "mask": torch.rand(5, 3, generator=g) > 0.5}
    path = make_store(tmp_path / "s", tensors)
    out = str(tmp_path / "z")
    # a tiny piece size makes emb.weight go through several dim-0 pieces
    assert cli("export", path, out, "--format", "zarr", "--piece-size", "8KiB")[0] == 0
    root = zarr.open_group(out, mode="r")
    assert torch.equal(torch.from_numpy(root["emb.weight"][...]), tensors["emb.weight"])
    assert root["emb.weight"].chunks[0] < 300
    assert torch.equal(torch.from_numpy(root["norm"][...]).view(torch.bfloat16), tensors["norm"])
    assert root["norm"].attrs["tierstore"]["dtype"] == "bfloat16"
    assert int(root["opt"]["step"][...]) == 7
    assert torch.equal(torch.from_numpy(root["mask"][...]), tensors["mask"])
    out32 = str(tmp_path / "z32")
    assert cli("export", path, out32, "--format", "zarr", "--dtype", "fp32")[0] == 0
    got = zarr.open_group(out32, mode="r")["norm"][...]
    assert str(got.dtype) == "float32" and torch.equal(torch.from_numpy(got), tensors["norm"].float())


def test_reserved_metadata_key_refused(cli, tmp_path, make_store) -> None:
    path = make_store(tmp_path / "s", {"__metadata__": torch.ones(2)})
    code, _, err = cli("export", path, str(tmp_path / "o"), "--format", "safetensors")
    assert code == 2 and "reserved" in err and not os.path.exists(tmp_path / "o")
