"""store.plan(keys): eviction, write-back and read-ahead along a known cyclic order of updates."""

from __future__ import annotations

import pytest
import torch

import tierstore
from tierstore.errors import InvalidKey, StoreError
from tierstore.plan import AccessPlan

CHUNK = 64 << 10  # one key = one chunk of 16,384 fp32 values


def _cycle_bytes(tmp_path, plan: bool, n_keys: int = 24, fit: int = 12) -> tuple[int, int, dict]:
    keys = [f"k{i:02d}" for i in range(n_keys)]
    ref = {k: torch.full((16384,), float(i)) for i, k in enumerate(keys)}
    with tierstore.open(tmp_path / ("p" if plan else "n"), "w", ram_budget=fit * CHUNK, chunk_bytes=CHUNK,
                        device="cpu", device_budget=None) as s:
        for k in keys:
            s.put(k, ref[k].clone())
        s.commit()
        if plan:
            s.plan(keys)
        per_cycle = []
        for _ in range(3):
            st0 = s.stats()
            for k in keys:
                with s.update(k) as t:
                    t.add_(1)
                ref[k].add_(1)
            st = s.stats()
            per_cycle.append((st["bytes_read_disk"] - st0["bytes_read_disk"],
                              st["bytes_written_disk"] - st0["bytes_written_disk"]))
        for k in keys:
            assert torch.equal(s.get(k), ref[k]), k
    read, written = per_cycle[-1]
    return read, written, ref


def test_a_plan_moves_close_to_the_minimum_where_lru_moves_everything(tmp_path) -> None:
    n, fit = 24, 12
    lru_read, lru_written, _ = _cycle_bytes(tmp_path, plan=False, n_keys=n, fit=fit)
    plan_read, plan_written, _ = _cycle_bytes(tmp_path, plan=True, n_keys=n, fit=fit)
    least = (n - fit) * (CHUNK + 4)  # stored bytes: each chunk file ends in its crc32c
    # least recently used is the worst choice for a cycle: every key is read and written again
    assert lru_read >= (n - 1) * CHUNK
    # along the plan: the minimum plus the keys in flight (the one updated, the one read ahead,
    # the one being written back); never everything
    assert least <= plan_read <= least + 4 * (CHUNK + 4)
    assert plan_written <= least + 4 * (CHUNK + 4) + 4096
    assert plan_read < lru_read


def test_plan_distances_follow_the_cycle() -> None:
    p = AccessPlan(["a", "b", "c", "d"])
    assert p.touch("b") and not p.touch("zz")
    assert [p.distance(k) for k in "abcd"] == [3, 0, 1, 2]  # "a" was needed last
    assert p.distance("zz") == float("inf")
    assert list(p.upcoming()) == ["c", "d", "a", "b"]


def test_bad_plans_are_refused_by_name(tmp_path) -> None:
    with tierstore.open(tmp_path / "s", "w", device="cpu") as s:
        with pytest.raises(StoreError, match="twice"):
            s.plan(["a", "a"])
        with pytest.raises(StoreError, match="sequence"):
            s.plan("a")
        with pytest.raises(InvalidKey):
            s.plan(["../x"])
        s.plan(["a"])
        s.plan(None)  # forgotten: least recently used again


def test_reading_ahead_looks_at_the_next_keys_only_not_the_whole_plan(tmp_path, monkeypatch) -> None:
    # a state that fits: every key ahead is held, so a walk until one is missing would visit the
    # whole plan on every update (quadratic a cycle: seconds a step for a few hundred tensors)
    n = 300
    keys = [f"k{i:03d}" for i in range(n)]
    looked = 0
    real = AccessPlan.upcoming

    def counted(self):
        nonlocal looked
        for k in real(self):
            looked += 1
            yield k

    monkeypatch.setattr(AccessPlan, "upcoming", counted)
    # the read-ahead reaches a chunk (16 KiB) ahead: four of these 4 KiB keys
    with tierstore.open(tmp_path / "s", "w", ram_budget=4 * n * 4096, chunk_bytes=16384,
                        device="cpu", device_budget=None) as s:
        for k in keys:
            s.put(k, torch.zeros(1024))
        s.plan(keys)
        for _ in range(2):
            for k in keys:
                with s.update(k) as t:
                    t.add_(1)
        assert torch.equal(s.get(keys[0]), torch.full((1024,), 2.0))
        assert s.stats()["bytes_read_disk"] == 0
    # room to spare and the next key held: the key sizing the read-ahead only, not a walk (with
    # the walk, 5 keys an update; walking until a key is missing, n)
    assert looked <= 2 * n, looked


def test_hot_keys_rank_below_every_plan_key_wherever_the_cycle_is() -> None:
    p = AccessPlan(["w0", "m0", "w1", "m1"], hot=["w0", "w1"])
    for cursor_key in ("w0", "m0", "w1", "m1"):
        p.touch(cursor_key)
        # evicted last: below the moments whatever their distance, the weights updated just now included
        assert max(p.rank("w0"), p.rank("w1")) < min(p.rank("m0"), p.rank("m1"))
    assert p.rank("not-in-plan") == float("inf") and p.rank(None) == float("inf")
    assert AccessPlan(["w0", "m0"]).rank("w0") >= 0  # without hot, a weight is ranked by distance


def test_hot_keys_go_in_plan_order_among_themselves() -> None:
    # a training step's weights, updated last layer first, w2 now: w1's backward is done and its
    # update comes next; w3, updated first, is read last by the next forward pass
    p = AccessPlan(["w3", "w2", "w1", "w0"], hot=["w3", "w2", "w1", "w0"])
    p.touch("w2")
    ranks = [p.rank(k) for k in ("w2", "w1", "w0", "w3")]
    assert ranks == sorted(ranks) and len(set(ranks)) == 4  # evicted first: w3, w0, w1; w2 (in use) last
    assert all(-1.0 < r < 0 for r in ranks)  # any alloc may take them, a read ahead (above >= 0) none


def test_hot_keys_are_checked_like_plan_keys(tmp_path) -> None:
    with tierstore.open(tmp_path / "s", "w", device="cpu") as s:
        with pytest.raises(StoreError, match="sequence"):
            s.plan(["a"], hot="a")
        with pytest.raises(InvalidKey):
            s.plan(["a"], hot=["../x"])
