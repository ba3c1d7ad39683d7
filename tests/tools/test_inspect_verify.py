"""inspect reports what Store.info says; verify names every damaged chunk by key and chunk."""

from __future__ import annotations

import json
import os

import torch

import tierstore


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed.weight": torch.randn(256, 128, generator=g),  # 128 KiB: two 64 KiB chunks
        "model.norm.weight": torch.randn(128, generator=g).to(torch.bfloat16),
        "opt/exp_avg/model.embed.weight": torch.randn(256, 128, generator=g),
        "scalar": torch.tensor(3, dtype=torch.int64),
    }


def test_inspect_json_matches_store_info(cli, tmp_path, make_store) -> None:
    path = make_store(tmp_path / "s", _tensors(), codec="zstd")
    code, out, _ = cli("inspect", path, "--json")
    assert code == 0
    report = json.loads(out)
    with tierstore.open(path, mode="r", device="cpu") as s:
        assert [t["key"] for t in report["tensors"]] == s.keys()
        for row in report["tensors"]:
            info = s.info(row["key"])
            assert row["shape"] == list(info.shape)
            assert row["dtype"] == str(info.dtype).removeprefix("torch.")
            assert row["codec"] == info.codec
            assert (row["nbytes"], row["stored_nbytes"]) == (info.nbytes, info.stored_nbytes)
            assert (row["generation"], row["chunks"]) == (info.generation, info.chunks)
            assert row["tiers"] == list(info.tiers)
        assert report["totals"]["nbytes"] == sum(s.info(k).nbytes for k in s.keys())
        assert [c["version"] for c in report["commits"]] == [c.version for c in s.versions()]
    assert report["commits"][0]["message"] == "fixture" and report["commits"][0]["step"] == 1


def test_inspect_table_and_past_version(cli, tmp_path, make_store) -> None:
    path = make_store(tmp_path / "s", _tensors())
    with tierstore.open(path, device="cpu") as s:
        s.put("late", torch.ones(4))
        s.commit(step=2, message="second")
    code, out, _ = cli("inspect", path)
    assert code == 0
    assert "model.embed.weight" in out and "256x128" in out and "128.00 KiB" in out
    assert "late" in out and "second" in out and "TOTAL" in out
    code, out, _ = cli("inspect", path, "--version", "1", "--json")
    assert code == 0 and "late" not in [t["key"] for t in json.loads(out)["tensors"]]


def test_verify_clean_store_exit_0(cli, tmp_path, make_store) -> None:
    path = make_store(tmp_path / "s", _tensors())
    code, out, _ = cli("verify", path)
    assert code == 0
    assert "0 faults" in out and "FAULT" not in out


def test_verify_names_flipped_truncated_and_missing_chunks(cli, tmp_path, make_store) -> None:
    tensors = {f"w{i}": torch.randn(256, 128) for i in range(3)}
    path = make_store(tmp_path / "s", tensors)
    with tierstore.open(path, mode="r", device="cpu") as s:
        dirs = {k: s.zarr_path(k) for k in tensors}
        assert all(s.info(k).chunks == 2 for k in tensors)
    flipped = os.path.join(dirs["w0"], "c", "1", "0")
    with open(flipped, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)[0]
        f.seek(1000)
        f.write(bytes([byte ^ 0x10]))  # one bit
    truncated = os.path.join(dirs["w1"], "c", "0", "0")
    os.truncate(truncated, os.path.getsize(truncated) - 7)
    os.remove(os.path.join(dirs["w2"], "c", "1", "0"))
    code, out, err = cli("verify", path)
    assert code == 1, err
    faults = [line for line in out.splitlines() if line.startswith("FAULT")]
    assert len(faults) == 3, out
    assert faults[0].startswith("FAULT w0 chunk 1:") and "checksum" in faults[0]
    assert faults[1].startswith("FAULT w1 chunk 0:") and "truncated" in faults[1]
    assert faults[2].startswith("FAULT w2 chunk 1:") and "missing" in faults[2]
    assert "3 faults" in out


def test_verify_catalog_disagreeing_with_zarr_json(cli, tmp_path, make_store) -> None:
    path = make_store(tmp_path / "s", {"a": torch.zeros(8, 4)})
    with tierstore.open(path, mode="r", device="cpu") as s:
        meta = os.path.join(s.zarr_path("a"), "zarr.json")
    with open(meta) as f:
        d = json.load(f)
    d["shape"] = [4, 8]
    with open(meta, "w") as f:
        json.dump(d, f)
    code, out, _ = cli("verify", path)
    assert code == 1 and "FAULT a chunk -:" in out and "shape" in out
