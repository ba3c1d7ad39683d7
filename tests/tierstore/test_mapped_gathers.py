"""Gathers served on the caller's thread from mapped shard files (``tierstore.mapped``): they
equal torch indexing, read the newest put, decline cold or corrupt rows to the loop, never mix
two generations, and unmap deleted generations."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch
from test_shards import ROWS
from test_shards import _indices as shard_indices

import tierstore

COLS = 64
BUDGET = "64KiB"  # the table is 150 KiB (fp32): larger than the RAM budget


def _table(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _indices() -> dict[str, torch.Tensor | int]:
    # test_shards' index kinds (its boundaries are its chunk and shard edges), and
    # the index types the mapped path converts itself
    return {**shard_indices(), "int32": torch.tensor([599, 0, 17], dtype=torch.int32),
            "0-d": torch.tensor(17), "python int": 123}


def _served(s: tierstore.Store) -> int:
    return s.stats()["mapped_gathers"]


def _check(s: tierstore.Store, t: torch.Tensor) -> None:
    """Every index kind equals torch indexing, each served by the mapped path."""
    for name, idx in _indices().items():
        before = _served(s)
        got = s.get("emb", index=idx)
        want = t[idx]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), name
        assert _served(s) == before + 1, f"{name}: not served by the mapped path"


@pytest.mark.parametrize("chunk_rows,shard_rows,dtype", [
    (1, 40, torch.float32), (7, 35, torch.float32), (7, 35, torch.bfloat16), (5, None, torch.int64)])
def test_mapped_gathers_equal_torch_indexing(tmp_path, chunk_rows, shard_rows, dtype) -> None:
    t = _table(dtype) if dtype != torch.int64 else torch.randint(-9, 10**12, (ROWS, COLS))
    with tierstore.open(tmp_path / "s", "w", ram_budget=BUDGET) as s:
        s.put("emb", t, chunk_rows=chunk_rows, shard_rows=shard_rows)
        s.commit()
        _check(s, t)  # the writer, on its own committed generation
    with tierstore.open(tmp_path / "s", "r", ram_budget=BUDGET) as s:
        _check(s, t)
        for _ in range(3):  # warm: again, and larger than the RAM budget in total
            _check(s, t)
        assert s.stats()["reads_disk"] == 0  # nothing went through the loop's reads


def test_gather_after_a_put_returns_the_put(tmp_path) -> None:
    t1, t2, t3 = _table(seed=1), _table(seed=2), _table(seed=3)
    idx = torch.tensor([599, 3, 3, 250, -2])
    with tierstore.open(tmp_path / "s", "w", ram_budget=BUDGET) as s:
        s.put("emb", t1, chunk_rows=3, shard_rows=30)
        s.commit()
        assert torch.equal(s.get("emb", index=idx), t1[idx])
        served = _served(s)
        s.put("emb", t2, chunk_rows=3, shard_rows=30)  # not committed: the loop serves it
        assert torch.equal(s.get("emb", index=idx), t2[idx])
        assert _served(s) == served
        s.commit()
        assert torch.equal(s.get("emb", index=idx), t2[idx])
        assert _served(s) == served + 1
        s.put("emb", t3[:10], chunk_rows=3)  # a new shape
        assert torch.equal(s.get("emb", index=torch.tensor([9, 0])), t3[[9, 0]])
        s.delete("emb")
        with pytest.raises(tierstore.KeyNotFound):
            s.get("emb", index=idx)


@pytest.mark.parametrize("chunk_rows", [1, 7])
def test_corrupt_and_short_files_go_through_the_loop(tmp_path, chunk_rows) -> None:
    t = _table()
    inner = chunk_rows * COLS * 4
    bad = 65 // chunk_rows  # the inner chunk of row 65: shard 1 (rows 35..69)
    with tierstore.open(tmp_path / "s", "w", ram_budget=BUDGET) as s:
        s.put("emb", t, chunk_rows=chunk_rows, shard_rows=35)
        s.commit()
        folder = s.zarr_path("emb")
    with tierstore.open(tmp_path / "s", "r", ram_budget=BUDGET) as s:
        assert torch.equal(s.get("emb", index=torch.tensor([65])), t[[65]])  # mapped now
        # a byte of that inner chunk flipped under the mapping
        at = (bad - 35 // chunk_rows) * (inner + 4) + 100
        with open(os.path.join(folder, "c", "1", "0"), "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))
        declined = s.stats()["mapped_declined"]
        with pytest.raises(tierstore.CorruptData) as e:
            s.get("emb", index=torch.tensor([0, 65, 300]))
        assert (e.value.key, e.value.chunk) == ("emb", bad)
        assert s.stats()["mapped_declined"] == declined + 1
        assert torch.equal(s.get("emb", index=torch.tensor([62, 70])), t[[62, 70]])
    os.truncate(os.path.join(folder, "c", "2", "0"), 10)  # a short file is never mapped
    with tierstore.open(tmp_path / "s", "r", ram_budget=BUDGET) as s:
        with pytest.raises(tierstore.CorruptData):
            s.get("emb", index=torch.tensor([72]))
        assert torch.equal(s.get("emb", index=torch.tensor([0])), t[[0]])  # through the loop
        assert _served(s) == 0


def _evict(folder: str) -> None:
    os.sync()
    for d, _, fs in os.walk(folder):
        for f in fs:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def test_rows_not_in_the_page_cache_are_read_by_the_loop(tmp_path) -> None:
    t = _table()
    with tierstore.open(tmp_path / "s", "w", ram_budget=BUDGET) as s:
        s.put("emb", t, chunk_rows=1, shard_rows=100)
        s.commit()
        folder = s.zarr_path("emb")
    _evict(folder)
    with tierstore.open(tmp_path / "s", "r", ram_budget=BUDGET) as s:
        idx = torch.tensor([10, 310, 590])
        assert torch.equal(s.get("emb", index=idx), t[idx])
        if _served(s):
            pytest.skip("this file system keeps the pages after POSIX_FADV_DONTNEED")
        assert s.stats()["reads_disk"] == 3  # the loop read them (and the page cache has them)
        assert torch.equal(s.get("emb", index=idx), t[idx])
        assert _served(s) == 1


def _mapped_files(folder: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if folder in line]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_deleted_generations_are_unmapped(tmp_path) -> None:
    t = _table()
    with tierstore.open(tmp_path / "s", "w", ram_budget=BUDGET, keep_last=1) as s:
        s.put("emb", t, chunk_rows=7, shard_rows=35)
        s.commit()
        old = s.zarr_path("emb")
        assert torch.equal(s.get("emb", index=torch.tensor([1, 500])), t[[1, 500]])
        assert _mapped_files(old)
        s.put("emb", t + 1, chunk_rows=7, shard_rows=35)
        s.commit()  # the old generation is deleted: its mapping goes first
        for _ in range(200):
            if not os.path.exists(old):
                break
            time.sleep(0.01)
        assert not os.path.exists(old) and not _mapped_files(old)
        assert torch.equal(s.get("emb", index=torch.tensor([1, 500])), (t + 1)[[1, 500]])
        new = s.zarr_path("emb")
        assert _mapped_files(new)
    assert not _mapped_files(new)  # close unmaps everything


def test_gathers_racing_with_puts_never_mix_generations(tmp_path) -> None:
    """Each put fills the table with one value; a gather must see one value only."""
    shape = (400, 32)
    s = tierstore.open(tmp_path / "s", "w", ram_budget=BUDGET, keep_last=1)
    try:
        s.put("emb", torch.zeros(shape), chunk_rows=2, shard_rows=20)
        s.commit()
        stop = threading.Event()
        errors: list[BaseException] = []
        seen: list[set[float]] = []

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            values: set[float] = set()
            try:
                while not stop.is_set():
                    n = rng.choice((1, 5, 64, 400))
                    idx = torch.tensor([rng.randrange(-400, 400) for _ in range(n)])
                    got = s.get("emb", index=idx)
                    u = torch.unique(got)
                    assert len(u) == 1, f"a gather mixed generations: {u.tolist()}"
                    values.add(float(u[0]))
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)
            seen.append(values)

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(3)]
        for th in threads:
            th.start()
        for v in range(1, 41):
            s.put("emb", torch.full(shape, float(v)), chunk_rows=2, shard_rows=20)
            if v % 2 == 0:
                s.commit()  # odd values are read through the loop only, even ones mapped too
            time.sleep(0.002)
        time.sleep(0.05)
        stop.set()
        for th in threads:
            th.join()
        assert not errors, errors[0]
        assert all(vals <= {float(v) for v in range(41)} for vals in seen)
        assert len(set().union(*seen)) > 3  # the readers saw the values change
        assert _served(s) > 0
        assert torch.equal(s.get("emb", index=torch.tensor([0, 399])), torch.full((2, 32), 40.0))
        assert len(s.async_store._mapped._regions) <= 2  # the deleted generations were forgotten
    finally:
        s.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_a_generation_forgotten_while_it_is_mapped_is_not_kept(tmp_path, monkeypatch) -> None:
    """The loop forgets (then deletes) a generation while a caller thread maps it: that
    mapping serves its one gather and is unmapped, never kept for the deleted files."""
    from tierstore import mapped

    t = _table()
    with tierstore.open(tmp_path / "s", "w", ram_budget=BUDGET) as s:
        s.put("emb", t, chunk_rows=7, shard_rows=35)
        s.commit()
        folder = s.zarr_path("emb")
        mg = s.async_store._mapped
        made = mapped._Region.__init__

        def forgotten_meanwhile(self, rec, paths):  # type: ignore[no-untyped-def]
            made(self, rec, paths)
            mg.forget(rec.generation)

        monkeypatch.setattr(mapped._Region, "__init__", forgotten_meanwhile)
        assert torch.equal(s.get("emb", index=torch.tensor([3, 400])), t[[3, 400]])
        assert _served(s) == 1
        assert not mg._regions and not mg._forgotten
        assert not _mapped_files(folder)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "loop"])
def test_out_of_range_indices_raise_invalid_index_on_both_paths(tmp_path, mapped) -> None:
    """The error of a bad index does not depend on whether the page cache holds the rows."""
    t = _table()
    with tierstore.open(tmp_path / "s", "w", ram_budget=BUDGET, mapped_gathers=mapped) as s:
        s.put("emb", t, chunk_rows=7, shard_rows=35)
        s.commit()
        assert torch.equal(s.get("emb", index=torch.tensor([3])), t[[3]])
        assert _served(s) == int(mapped)
        bad = [2**63, 2**70, -2**63 - 1, -2**70, ROWS, -ROWS - 1,
               torch.tensor([2**64 - 1], dtype=torch.uint64), torch.tensor([ROWS], dtype=torch.uint64)]
        for idx in bad:
            with pytest.raises(tierstore.InvalidIndex):
                s.get("emb", index=idx)
        assert torch.equal(s.get("emb", index=torch.tensor([ROWS - 1], dtype=torch.uint64)), t[[ROWS - 1]])


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_a_generation_forgotten_before_its_gather_maps_it_is_not_kept(tmp_path) -> None:
    """A caller thread reads the head, then the loop forgets that generation (its folder is
    about to be deleted), then the thread maps it: the mapping serves at most that gather and
    is never kept (it used to stay mapped until close, holding the deleted files' blocks)."""
    t = _table()
    with tierstore.open(tmp_path / "s", "w", ram_budget=BUDGET) as s:
        s.put("emb", t, chunk_rows=7, shard_rows=35)
        s.commit()
        folder = s.zarr_path("emb")
        a = s.async_store
        mg = a._mapped
        armed = True

        class ForgetAfterRead(dict):  # the interleaving: forget right after the head is read
            def get(self, key, default=None):  # type: ignore[no-untyped-def]
                nonlocal armed
                rec = super().get(key, default)
                if rec is not None and armed and threading.current_thread() is threading.main_thread():
                    armed = False
                    mg.forget(rec.generation)
                return rec

        a._head = ForgetAfterRead(a._head)
        idx = torch.tensor([3, 400])
        assert torch.equal(s.get("emb", index=idx), t[idx])  # served by the loop or that mapping
        gen = a._head["emb"].generation
        assert gen not in mg._regions and not _mapped_files(folder)
        assert not mg._forgotten  # no gather in flight: no tombstone is kept
