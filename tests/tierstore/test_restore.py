"""``restore(key, version)``: the head points at a retained commit's generation again, bytes as stored."""

from __future__ import annotations

import asyncio

import pytest
import torch

import tierstore
from tierstore import KeyNotFound, StoreNotFound


def _q8() -> object:
    return tierstore.codecs.get("q8", signed=False)


def test_restore_keeps_the_stored_bytes_codec_and_sharded_layout(tmp_path) -> None:
    v_sq = torch.rand(64, 16) ** 2  # a second moment: unsigned q8 is not idempotent on it
    emb = torch.randn(40, 8)
    with tierstore.open(tmp_path, keep_last=3) as s:
        s.put("v", v_sq, _q8())
        s.put("emb", emb, "zstd", chunk_rows=4, shard_rows=8)
        v1 = s.commit(step=1)
        stored = s.get("v")
        before = {k: s.info(k) for k in ("v", "emb")}
        s.put("v", torch.zeros(3))
        s.put("emb", torch.ones(2, 2))
        s.commit(step=2)
        assert s.info("v").shape == (3,) and s.info("emb").shape == (2, 2)
        s.restore("v", v1)
        s.restore("emb", v1)
        for k in ("v", "emb"):
            info = s.info(k)
            assert info.generation == before[k].generation and not info.uncommitted
            assert (info.codec, info.shape, info.stored_nbytes, info.chunks) == \
                (before[k].codec, before[k].shape, before[k].stored_nbytes, before[k].chunks)
        assert torch.equal(s.get("v"), stored)
        assert torch.equal(s.get("emb"), emb)
        assert torch.equal(s.get("emb", index=torch.tensor([39, 0, 17])), emb[[39, 0, 17]])
        # a re-encode changes values: what restore avoids
        s.put("again", stored, _q8())
        assert not torch.equal(s.get("again"), stored)
        s.commit(step=3)
    with tierstore.open(tmp_path, mode="r") as r:
        assert torch.equal(r.get("v"), stored) and torch.equal(r.get("emb"), emb)


def test_the_restored_generation_outlives_the_version_that_named_it(tmp_path) -> None:
    t = torch.randn(1000)
    with tierstore.open(tmp_path, keep_last=1, chunk_bytes="1KiB") as s:
        s.put("w", t)
        v1 = s.commit(step=1)
        s.put("w", torch.zeros(1000))  # uncommitted: retired by the restore
        s.restore("w", v1)
        assert torch.equal(s.get("w"), t)
        for step in range(2, 5):  # version 1 is dropped; the head still names its generation
            s.put("other", torch.full((4,), float(step)))
            s.commit(step=step)
        assert [c.version for c in s.versions()] == [4]
        assert torch.equal(s.get("w"), t)
    with tierstore.open(tmp_path) as s:
        assert torch.equal(s.get("w"), t)
        assert s.verify() == []


def test_restore_refuses_a_dropped_version_and_a_missing_key(tmp_path) -> None:
    with tierstore.open(tmp_path, keep_last=1) as s:
        s.put("a", torch.ones(2))
        v1 = s.commit(step=1)
        s.put("b", torch.ones(2))
        v2 = s.commit(step=2)
        with pytest.raises(StoreNotFound, match=f"version {v1} is not retained"):
            s.restore("a", v1)
        s.delete("b")
        s.put("c", torch.ones(3))
        with pytest.raises(KeyNotFound, match="has no key 'c'"):
            s.restore("c", v2)
        s.restore("b", v2)  # a key deleted from the head comes back
        assert torch.equal(s.get("b"), torch.ones(2)) and torch.equal(s.get("c"), torch.ones(3))
    with tierstore.open(tmp_path, mode="r") as r, pytest.raises(tierstore.ReadOnlyError):
        r.restore("a", v2)


def test_restore_waits_for_an_update_of_the_key(tmp_path) -> None:
    async def main() -> None:
        s = await tierstore.open_async(str(tmp_path))
        try:
            await s.put("w", torch.ones(8))
            v1 = await s.commit(step=1)
            async with s.update("w") as t:
                restoring = asyncio.ensure_future(s.restore("w", v1))
                await asyncio.sleep(0.01)
                assert not restoring.done()
                t.mul_(3)
            await restoring
            assert torch.equal(await s.get("w"), torch.ones(8))
        finally:
            await s.close()

    asyncio.run(main())
