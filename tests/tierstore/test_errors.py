"""Bad input gets the documented exception, and the store stays usable afterwards."""

from __future__ import annotations

import os

import pytest
import torch

import tierstore
from tierstore.catalog import Catalog


@pytest.fixture
def store(tmp_path):
    s = tierstore.open(tmp_path / "s", ram_budget="1MiB", device_budget="64KiB")
    s.put("ok", torch.arange(10.0))
    s.commit()
    yield s
    s.close()


def still_usable(s: tierstore.Store) -> None:
    assert torch.equal(s.get("ok"), torch.arange(10.0))
    s.put("ok2", torch.ones(3))
    s.commit()


@pytest.mark.parametrize("key, match", [
    ("a/../b", r"'\.\.' segment"), ("..", r"'\.\.' segment"), ("./a", r"'\.' segment"),
    ("/abs", "empty segment"), ("a//b", "empty segment"), ("a/", "empty segment"), ("", "empty"),
    ("a\x00b", "holds"), ("x" * 513, "limit is 512"), ("sp ace", "holds"), ("a@3", "holds"),
    ("ü", "holds"), (5, "is a str"),
])
def test_invalid_keys(store, key, match) -> None:
    with pytest.raises(tierstore.InvalidKey, match=match):
        store.put(key, torch.zeros(1))
    with pytest.raises(tierstore.InvalidKey):
        store.get(key)
    still_usable(store)


def test_unknown_key(store) -> None:
    with pytest.raises(tierstore.KeyNotFound, match="'nope'"):
        store.get("nope")
    with pytest.raises(tierstore.KeyNotFound):
        store.info("nope")
    with pytest.raises(tierstore.KeyNotFound):
        store.delete("nope")
    with pytest.raises(tierstore.KeyNotFound):
        store.prefetch(["nope"])
    still_usable(store)


def test_bad_indices(store) -> None:
    with pytest.raises(tierstore.InvalidIndex, match="out of range"):
        store.get("ok", index=[10])
    with pytest.raises(tierstore.InvalidIndex, match="step 1"):
        store.get("ok", index=slice(0, 10, 2))
    with pytest.raises(tierstore.InvalidIndex, match="integers"):
        store.get("ok", index=torch.tensor([0.5]))
    store.put("scalar", torch.tensor(1.0))
    with pytest.raises(tierstore.InvalidIndex, match="0-d"):
        store.get("scalar", index=0)
    still_usable(store)


def test_unknown_codec_and_dtype(store) -> None:
    with pytest.raises(tierstore.CodecError, match="unknown codec"):
        store.put("x", torch.zeros(2), codec="lzma9")
    with pytest.raises(tierstore.CodecError, match="not supported"):
        store.put("x", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(tierstore.StoreError, match="torch.Tensor"):
        store.put("x", [1, 2, 3])
    assert "x" not in store.keys()
    still_usable(store)


def test_write_on_read_only(tmp_path, store) -> None:
    with tierstore.open(tmp_path / "s", mode="r") as r:
        with pytest.raises(tierstore.ReadOnlyError):
            r.put("y", torch.zeros(1))
        with pytest.raises(tierstore.ReadOnlyError):
            r.commit()
        with pytest.raises(tierstore.ReadOnlyError):
            r.delete("ok")
        assert torch.equal(r.get("ok"), torch.arange(10.0))
    still_usable(store)


def test_second_writer_is_refused(tmp_path, store) -> None:
    import subprocess
    import sys
    code = ("import tierstore, sys\n"
            "try:\n    tierstore.open(sys.argv[1])\nexcept tierstore.StoreLocked as e:\n"
            "    print('LOCKED', e); sys.exit(3)\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")], capture_output=True, text=True)
    assert p.returncode == 3, p.stderr
    assert "LOCK" in p.stdout
    still_usable(store)


def test_budget_smaller_than_a_chunk(tmp_path) -> None:
    with pytest.raises(tierstore.BudgetError, match="smaller than one chunk"):
        tierstore.open(tmp_path / "b", ram_budget=1000)
    with pytest.raises(tierstore.BudgetError, match="smaller than one chunk"):
        tierstore.open(tmp_path / "b", ram_budget="1MiB", chunk_bytes="2MiB")
    with pytest.raises(tierstore.BudgetError, match="positive"):
        tierstore.open(tmp_path / "b", ram_budget=0)
    with pytest.raises(tierstore.StoreError, match="cannot parse"):
        tierstore.open(tmp_path / "b", ram_budget="lots")


def test_tensor_larger_than_device_window(store) -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    store.put("big", torch.zeros(100_000))
    with pytest.raises(tierstore.BudgetError, match="larger than the device window"):
        store.get("big", device=dev)
    still_usable(store)


def test_newer_format_version(tmp_path) -> None:
    path = tmp_path / "f"
    with tierstore.open(path) as s:
        s.put("a", torch.ones(1))
    cat = Catalog(str(path / "catalog"), create=False)
    cat.set_format_version(99)
    cat.close()
    with pytest.raises(tierstore.FormatVersionError, match="newer"):
        tierstore.open(path, mode="r")
    with pytest.raises(tierstore.FormatVersionError):
        tierstore.open(path)


def test_missing_store_and_bad_mode(tmp_path) -> None:
    with pytest.raises(tierstore.StoreNotFound):
        tierstore.open(tmp_path / "none", mode="r")
    with pytest.raises(tierstore.StoreError, match="mode"):
        tierstore.open(tmp_path / "x", mode="rw")
    with pytest.raises(tierstore.StoreError, match="read-only"):
        tierstore.open(tmp_path / "x", mode="a", version=1)
    (tmp_path / "notastore").mkdir()
    (tmp_path / "notastore" / "precious.txt").write_text("keep me")
    with pytest.raises(tierstore.StoreError, match="refuses to wipe"):
        tierstore.open(tmp_path / "notastore", mode="w")
    assert (tmp_path / "notastore" / "precious.txt").read_text() == "keep me"


def _chunk_file(s: tierstore.Store, key: str, chunk: int = 0) -> str:
    rec = s.async_store._head[key]
    return os.path.join(s.zarr_path(key), rec.grid.zarr_key(chunk))


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped"])
def test_damaged_chunk_names_key_and_chunk(tmp_path, damage) -> None:
    path = tmp_path / "d"
    with tierstore.open(path, chunk_bytes="4KiB", ram_budget="1MiB") as s:
        w = torch.randn(4096)
        s.put("w", w)
        s.put("fine", torch.ones(3))
        s.commit()
        victim = _chunk_file(s, "w", 2)
    if damage == "missing":
        os.remove(victim)
    elif damage == "truncated":
        os.truncate(victim, 100)
    else:
        with open(victim, "r+b") as f:
            f.seek(10)
            b = f.read(1)
            f.seek(10)
            f.write(bytes([b[0] ^ 0x04]))
    with tierstore.open(path, mode="r") as r:
        with pytest.raises(tierstore.CorruptData, match=r"'w' chunk 2") as ei:
            r.get("w")
        assert ei.value.key == "w" and ei.value.chunk == 2
        faults = r.verify()
        assert [(f.key, f.chunk) for f in faults] == [("w", 2)]
        assert torch.equal(r.get("fine"), torch.ones(3))  # the rest stays readable
        assert torch.equal(r.get("w", index=slice(0, 100)), w[:100])  # chunk 0 is intact


def test_closed_store(tmp_path) -> None:
    s = tierstore.open(tmp_path / "c")
    a = s.async_store
    s.close()
    with pytest.raises(tierstore.StoreClosed):
        a.keys()


def test_a_store_left_open_does_not_hang_the_exit(tmp_path) -> None:
    import subprocess
    import sys
    code = ("import sys, torch, tierstore\n"
            "s = tierstore.open(sys.argv[1])\n"
            "s.put('a', torch.ones(3)); s.commit()\n"
            "s.put('b', torch.ones(3))\n"
            "raise SystemExit(3)\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")], timeout=60)
    assert p.returncode == 3
    with tierstore.open(tmp_path / "s", mode="r") as r:
        assert r.keys() == ["a"]  # closed at exit without a commit: "b" is dropped
