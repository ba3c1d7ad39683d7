"""Sharded tables (``put(chunk_rows=)``): gathers equal torch indexing, plain zarr reads the
shards, a corrupted inner chunk is named, the RAM tier keeps hot inner chunks."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest
import torch
import zarr

import tierstore
from tierstore.catalog import Catalog
from tierstore.shards import TRAILER

ROWS, COLS, CHUNK_ROWS, SHARD_ROWS = 600, 64, 7, 35  # 86 inner chunks, 5 to a shard, 18 shards
BUDGET = "64KiB"  # the table is 150 KiB: larger than the RAM budget
INNER = CHUNK_ROWS * COLS * 4  # payload bytes of an inner chunk (raw fp32)


def _table() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))


def _indices() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    rand = torch.randint(0, ROWS, (200,), generator=g)
    return {
        "random": rand,
        "sorted": rand.sort().values,
        "repeated": torch.tensor([5, 5, 5, 90, 5, 599, 90]),
        "empty": torch.tensor([], dtype=torch.int64),
        "2-D": torch.randint(0, ROWS, (3, 4), generator=g),
        # the last row of an inner chunk, the first of the next; the same at shard edges
        "boundaries": torch.tensor([6, 7, 34, 35, 69, 70, 594, 595, 599, 0]),
        "negative": torch.tensor([-1, -600, 3]),
        "one": torch.tensor([42]),
        "int": torch.tensor(17),
    }


def _check_gathers(s: tierstore.Store, t: torch.Tensor) -> None:
    for name, idx in _indices().items():
        got = s.get("emb", index=idx)
        assert got.shape == t[idx].shape, name
        assert torch.equal(got, t[idx]), name
    assert torch.equal(s.get("emb", index=[3, 3, 500]), t[[3, 3, 500]])
    assert torch.equal(s.get("emb", index=slice(30, 500)), t[30:500])
    assert torch.equal(s.get("emb"), t)


def _committed_table(path) -> tuple[torch.Tensor, str]:
    """The table put sharded and committed at ``path``; returns it and its zarr folder."""
    t = _table()
    with tierstore.open(path, "w", ram_budget=BUDGET) as s:
        s.put("emb", t, chunk_rows=CHUNK_ROWS, shard_rows=SHARD_ROWS)
        s.commit()
        return t, s.zarr_path("emb")


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_gathers_equal_torch_indexing(tmp_path, codec: str) -> None:
    t = _table()
    with tierstore.open(tmp_path / "s", "w", ram_budget=BUDGET) as s:
        s.put("emb", t, codec, chunk_rows=CHUNK_ROWS, shard_rows=SHARD_ROWS)
        assert s.info("emb").chunks == -(-ROWS // CHUNK_ROWS)
        _check_gathers(s, t)  # before the commit: dirty inner chunks in RAM, the rest on disk
        s.commit()
        _check_gathers(s, t)
    with tierstore.open(tmp_path / "s", "r", ram_budget=BUDGET) as s:
        _check_gathers(s, t)  # from disk, through a cold RAM tier
        assert s.stats()["host_bytes"] <= s.stats()["ram_budget"]


def test_plain_zarr_reads_the_shards(tmp_path) -> None:
    t = _table()
    with tierstore.open(tmp_path / "s", "w", ram_budget=BUDGET) as s:
        s.put("emb", t, chunk_rows=CHUNK_ROWS, shard_rows=SHARD_ROWS)
        s.put("ids", torch.arange(1000, dtype=torch.int64), "zstd", chunk_rows=64)
        s.commit()
        emb, ids = s.zarr_path("emb"), s.zarr_path("ids")
    a = zarr.open_array(emb, mode="r")
    assert a.shards == (SHARD_ROWS, COLS) and a.chunks == (CHUNK_ROWS, COLS)
    assert np.array_equal(a[:], t.numpy())
    assert np.array_equal(a[[5, 599, 34, 35]], t[[5, 599, 34, 35]].numpy())
    assert np.array_equal(zarr.open_array(ids, mode="r")[:], np.arange(1000))
    # one file per shard, not per chunk: 18 shards + zarr.json
    files = [f for _, _, fs in os.walk(emb) for f in fs]
    assert len(files) == -(-ROWS // SHARD_ROWS) + 1


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corrupt_inner_chunk_is_named(tmp_path) -> None:
    t, folder = _committed_table(tmp_path / "s")
    # inner chunk 9 = position 4 of shard 1 (rows 63..69)
    _flip(os.path.join(folder, "c", "1", "0"), 4 * (INNER + TRAILER) + 100)
    with tierstore.open(tmp_path / "s", "r", ram_budget=BUDGET) as s:
        with pytest.raises(tierstore.CorruptData, match=r"'emb' chunk 9") as e:
            s.get("emb", index=torch.tensor([0, 65, 300]))
        assert (e.value.key, e.value.chunk) == ("emb", 9)
        # the inner chunks beside it, in the same shard, still read
        assert torch.equal(s.get("emb", index=torch.tensor([62, 70, 35])), t[[62, 70, 35]])
        with pytest.raises(tierstore.CorruptData, match=r"chunk 9"):
            s.get("emb", index=slice(60, 70))
        faults = s.verify()
        assert [(f.key, f.chunk) for f in faults] == [("emb", 9)]


def test_truncated_shard_names_the_chunk(tmp_path) -> None:
    t, folder = _committed_table(tmp_path / "s")
    os.truncate(os.path.join(folder, "c", "2", "0"), 2 * (INNER + TRAILER) + 10)  # inside chunk 12
    with tierstore.open(tmp_path / "s", "r", ram_budget=BUDGET) as s:
        with pytest.raises(tierstore.CorruptData) as e:
            s.get("emb", index=torch.tensor([CHUNK_ROWS * 12 + 1]))
        assert (e.value.key, e.value.chunk) == ("emb", 12)
        assert torch.equal(s.get("emb", index=torch.tensor([CHUNK_ROWS * 11])), t[[CHUNK_ROWS * 11]])


def test_ram_tier_keeps_hot_rows_of_a_table_larger_than_the_budget(tmp_path) -> None:
    t = _table()
    with tierstore.open(tmp_path / "s", "w", ram_budget=BUDGET) as s:
        s.put("emb", t, chunk_rows=CHUNK_ROWS, shard_rows=SHARD_ROWS)
        s.commit()
    hot = torch.tensor([3, 100, 101, 400, 598])  # 4 inner chunks: well under the budget
    # the loop's path (the page cache would serve these rows on the caller's thread instead)
    with tierstore.open(tmp_path / "s", "r", ram_budget=BUDGET, mapped_gathers=False) as s:
        assert torch.equal(s.get("emb", index=hot), t[hot])
        first = s.stats()
        assert first["reads_disk"] == 4 and first["host_bytes"] == 4 * INNER
        for _ in range(3):
            assert torch.equal(s.get("emb", index=hot), t[hot])
        again = s.stats()
        assert again["reads_disk"] == 4 and again["hits_host"] == first["hits_host"] + 12
        # a sweep over the whole table evicts least recently used chunks, within the budget
        for lo in range(0, ROWS, 50):
            s.get("emb", index=torch.arange(lo, lo + 50))
        assert s.stats()["host_bytes"] <= s.stats()["ram_budget"]


def test_format_version_rises_only_with_a_sharded_commit(tmp_path) -> None:
    def version() -> int:
        cat = Catalog(str(tmp_path / "s" / "catalog"), create=False)
        try:
            return cat.format_version()
        finally:
            cat.close()

    with tierstore.open(tmp_path / "s", "w") as s:
        s.put("plain", torch.ones(10))
        s.commit()
    assert version() == 1  # unsharded stores stay readable by the format-1 code
    with tierstore.open(tmp_path / "s") as s:
        s.put("emb", _table(), chunk_rows=CHUNK_ROWS)
        s.commit()
    assert version() == 2
    with tierstore.open(tmp_path / "s", "r") as s:
        assert torch.equal(s.get("emb", index=[1, 2]), _table()[[1, 2]])
        assert torch.equal(s.get("plain"), torch.ones(10))


def test_bad_chunk_rows_are_refused(tmp_path) -> None:
    with tierstore.open(tmp_path / "s", "w", ram_budget=BUDGET) as s:
        t = _table()
        with pytest.raises(tierstore.StoreError, match="chunk_rows must be a positive int"):
            s.put("a", t, chunk_rows=0)
        with pytest.raises(tierstore.StoreError, match="multiple of"):
            s.put("a", t, chunk_rows=7, shard_rows=20)
        with pytest.raises(tierstore.StoreError, match="needs chunk_rows"):
            s.put("a", t, shard_rows=20)
        with pytest.raises(tierstore.StoreError, match="0-d"):
            s.put("a", torch.tensor(1.0), chunk_rows=1)
        with pytest.raises(tierstore.BudgetError, match="lower chunk_rows"):
            s.put("a", t, chunk_rows=600)
        assert s.keys() == []


def test_cancelled_gathers_leave_the_tier_consistent(tmp_path) -> None:
    t = _table()

    async def run() -> None:
        s = await tierstore.open_async(tmp_path / "s", "w", ram_budget=BUDGET)
        try:
            await s.put("emb", t, chunk_rows=CHUNK_ROWS, shard_rows=SHARD_ROWS)
            await s.commit()
            s._host.drop_generation(s._head["emb"].generation, 86)  # cold: every gather reads
            for delay in range(6):
                task = asyncio.ensure_future(s.get("emb", index=torch.arange(0, ROWS, 3)))
                for _ in range(delay):
                    await asyncio.sleep(0)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                # a put superseding the generation meanwhile must wait for the in-flight reads
                await s.put("emb", t, chunk_rows=CHUNK_ROWS, shard_rows=SHARD_ROWS)
                await s.commit()
            await asyncio.sleep(0.2)  # the abandoned reads finish and settle their buffers
            held = sum(e.data.numel() for e in s._host._entries.values())
            spare = sum(b.numel() for bs in s._host._spare.values() for b in bs)
            assert s._host.used == held + spare  # no reservation leaked
            assert torch.equal(await s.get("emb", index=torch.arange(0, ROWS, 3)), t[::3])
        finally:
            await s.close()

    asyncio.run(run())


def _open_fds_under(folder: str) -> list[str]:
    """Files under ``folder`` this process holds open."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        if target.startswith(str(folder) + os.sep):
            out.append(target)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_shard_descriptors_are_cached_bounded_and_released(tmp_path) -> None:
    t = _table()
    s = tierstore.open(tmp_path / "s", "w", ram_budget=BUDGET, keep_last=1)
    try:
        s.async_store._disk.open_files.capacity = 4
        s.put("emb", t, chunk_rows=CHUNK_ROWS, shard_rows=SHARD_ROWS)
        s.commit()
        data = os.path.join(str(tmp_path / "s"), "data")
        _check_gathers(s, t)  # reads all 18 shards: at most 4 descriptors stay open
        held = _open_fds_under(data)
        assert 0 < len(held) <= 4, held
        folder = s.zarr_path("emb")
        s.put("emb", t + 1, chunk_rows=CHUNK_ROWS, shard_rows=SHARD_ROWS)
        s.commit()  # the first generation is deleted (in the background): its descriptors close
        for _ in range(200):
            if not [p for p in _open_fds_under(data) if p.startswith(folder + os.sep)]:
                break
            time.sleep(0.05)
        assert not [p for p in _open_fds_under(data) if p.startswith(folder + os.sep)]
        assert not os.path.exists(folder)
        assert torch.equal(s.get("emb", index=torch.tensor([3, 599])), (t + 1)[[3, 599]])
    finally:
        s.close()
    assert _open_fds_under(data) == []  # close releases every descriptor


def test_open_files_never_closes_a_descriptor_in_use(tmp_path) -> None:
    from tierstore.tiers.disk import OpenFiles

    paths = []
    for i in range(3):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes([i]) * 8)
        paths.append(str(p))
    files = OpenFiles(capacity=1)
    with files.open(paths[0]) as fd0:
        with files.open(paths[1]), files.open(paths[2]):
            pass  # f0 and f1 leave the cache while f0 is in use
        assert os.pread(fd0, 8, 0) == bytes([0]) * 8  # still open for its reader
        files.forget(str(tmp_path))
        assert os.pread(fd0, 8, 0) == bytes([0]) * 8
    assert files._fds == {} and files._retired == {}  # closed once let go
    assert _open_fds_under(str(tmp_path)) == []


def test_loop_gathers_of_one_row_inner_chunks_equal_torch_indexing(tmp_path) -> None:
    """The loop's gather of one-row inner chunks copies RAM-tier hits with one torch call:
    all hits, hits mixed with misses, dirty (uncommitted) rows and repeated rows."""
    t = _table()
    with tierstore.open(tmp_path / "s", "w", ram_budget=BUDGET, mapped_gathers=False) as s:
        s.put("emb", t, chunk_rows=1, shard_rows=40)
        _check_gathers(s, t)  # dirty rows in RAM beside rows written back and evicted
        s.commit()
        for _ in range(2):
            _check_gathers(s, t)  # the table is larger than the budget: hits mixed with misses
        hot = torch.tensor([5, 599, 7, 5, 300])
        assert torch.equal(s.get("emb", index=hot), t[hot])
        before = s.stats()
        assert torch.equal(s.get("emb", index=hot), t[hot])  # all hits
        after = s.stats()
        assert after["hits_host"] == before["hits_host"] + 4 and after["reads_disk"] == before["reads_disk"]
        s.put("emb", t * 2, chunk_rows=1, shard_rows=40)
        assert torch.equal(s.get("emb", index=hot), (t * 2)[hot])  # read your (dirty) writes
