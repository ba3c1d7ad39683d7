"""Issue 10 defects 6, 8 and 10: over-long key segments, absurd safetensors shapes, gather shapes.

Each test failed on the code before its fix: a 300-byte segment was accepted by ``put`` and
broke every later commit; a header dimension >= 2**63 with zero size passed validation and died
in ``reshape``; a 2-D gather index was flattened and a numpy integer kept the row dimension.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

import tierstore
from tierstore.keys import generation_relpath, validate_key
from tierstore.safetensors import read_header
from tools.cli import main as cli_main

OPTS = dict(ram_budget="1MiB", chunk_bytes="4KiB", device="cpu")


# ---------------------------------------------------------------- defect 6: segment length


@pytest.mark.parametrize("key", ["a/" + "x" * 300, "x" * 256 + "/b", "x" * 300])
def test_put_refuses_a_segment_over_the_file_name_limit(tmp_path, key) -> None:
    with tierstore.open(tmp_path / "s", **OPTS) as s:
        s.put("ok", torch.ones(3))
        with pytest.raises(tierstore.InvalidKey, match="bytes"):
            s.put(key, torch.ones(3))
        assert key not in s
        s.put("b", torch.arange(4.0))
        s.commit()  # the refused key leaves later commits working
    with tierstore.open(tmp_path / "s", mode="r", **OPTS) as r:
        assert r.keys() == ["b", "ok"]


def test_the_last_segment_counts_its_generation_suffix(tmp_path) -> None:
    # 252 bytes + "@1" fits the 255-byte name limit; + "@1000" would not
    assert validate_key("x" * 255) == "x" * 255  # a valid key by itself: it is a folder name
    generation_relpath("x" * 253, 1)
    with pytest.raises(tierstore.InvalidKey, match="suffix"):
        generation_relpath("x" * 253, 1000)
    with tierstore.open(tmp_path / "s", **OPTS) as s:
        s.put("d/" + "y" * 250, torch.ones(2))  # "@1" makes 252 bytes: allowed, committed
        with pytest.raises(tierstore.InvalidKey, match="255"):
            s.put("z" * 254, torch.ones(2))
        s.commit()
    with tierstore.open(tmp_path / "s", mode="r", **OPTS) as r:
        assert torch.equal(r.get("d/" + "y" * 250), torch.ones(2))


def test_generation_folders_are_the_checked_path_after_a_key_is_remembered(tmp_path) -> None:
    import os

    from tierstore.tiers.disk import DiskTier

    disk = DiskTier(str(tmp_path))
    for key in ["a", "x/y/z", "d-1/" + "w" * 250]:
        for gen in [1, 10, 7, 123456]:  # the first call remembers the key, the others use it
            want = os.path.normpath(os.path.join(disk.data_dir, f"{key}@{gen}"))
            if len((key.rpartition("/")[2] + f"@{gen}").encode()) > 255:
                with pytest.raises(tierstore.InvalidKey, match="suffix"):
                    disk.generation_dir(key, gen)  # more digits than the remembered key had room for
            else:
                assert disk.generation_dir(key, gen) == want


def test_segment_limit_is_in_bytes() -> None:
    validate_key("a/" + "b" * 255)
    with pytest.raises(tierstore.InvalidKey, match="segment 1 is 256 bytes"):
        validate_key("a/" + "b" * 256)


# ---------------------------------------------------------------- defect 8: huge dims


def write_safetensors(path, header: dict, data: bytes = b"") -> None:
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


@pytest.mark.parametrize("shape", [[2**63, 0], [0, 2**64 - 1], [2**40, 2**30, 0], [2**63]])
def test_header_dimensions_beyond_int64_are_malformed(tmp_path, shape) -> None:
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
    with pytest.raises(tierstore.MalformedFile, match="too large"):
        read_header(str(path))


def test_import_of_a_huge_zero_size_dimension_is_one_clear_error(tmp_path, capsys) -> None:
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"w": {"dtype": "F32", "shape": [2**63, 0], "data_offsets": [0, 0]}})
    assert cli_main(["-q", "import", str(path), str(tmp_path / "store")]) == 1
    err = capsys.readouterr().err
    assert "too large" in err and "Traceback" not in err


def test_large_but_valid_zero_size_shapes_still_load(tmp_path) -> None:
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"w": {"dtype": "F32", "shape": [2**40, 0], "data_offsets": [0, 0]}})
    (entry,) = read_header(str(path)).tensors
    assert entry.shape == (2**40, 0)
    assert torch.empty(0).reshape(entry.shape).shape == (2**40, 0)  # torch takes it too


# ---------------------------------------------------------------- defect 10: gather shapes

INDICES = [
    torch.tensor([[0, 1], [2, 5]]),
    torch.tensor([[[3]], [[3]]]),
    torch.tensor([[-1, 0, 4]]),
    np.int64(2),
    np.int32(-1),
    np.array(4),
    np.array([[1, 2], [0, 0]]),
    torch.tensor(3),
    3,
    -2,
    [1, 2, 1],
    [[0], [5]],
    torch.tensor([], dtype=torch.int64),
    torch.empty(0, 3, dtype=torch.int64),
    [],
]


@pytest.mark.parametrize("index", INDICES, ids=[f"{type(i).__name__}-{np.shape(i)}" for i in INDICES])
@pytest.mark.parametrize("shape", [(6, 3), (6,), (6, 2, 2)])
def test_gathers_follow_torch_indexing(tmp_path, shape, index) -> None:
    t = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    with tierstore.open(tmp_path / "s", chunk_bytes=16, ram_budget="1MiB", device="cpu") as s:
        s.put("t", t)  # 16-byte chunks: the rows come from several chunks
        for _ in range(2):  # from RAM, then after the commit from disk-backed chunks
            got = s.get("t", index=index)
            want = t[torch.as_tensor(index, dtype=torch.int64)] if isinstance(index, list) else t[index]
            assert got.shape == want.shape
            assert torch.equal(got, want)
            s.commit()


def test_integer_index_out_of_range_is_invalid_index(tmp_path) -> None:
    with tierstore.open(tmp_path / "s", **OPTS) as s:
        s.put("t", torch.ones(3, 2))
        for bad in (np.int64(3), torch.tensor([[0, 3]]), -4):
            with pytest.raises(tierstore.InvalidIndex):
                s.get("t", index=bad)
