"""Tier budgets hold under a random mixed workload; the content matches a model dict."""

from __future__ import annotations

import random

import torch

import tierstore


def test_random_workload_respects_budgets(tmp_path) -> None:
    ram, window = 256 * 1024, 128 * 1024
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rng = random.Random(7)
    model: dict[str, torch.Tensor] = {}
    committed: dict[str, torch.Tensor] = {}
    with tierstore.open(tmp_path, ram_budget=ram, device_budget=window, chunk_bytes="8KiB",
                        keep_last=2) as s:
        for op_i in range(400):
            op = rng.choice(["put", "put", "get", "get", "getdev", "slice", "delete", "commit",
                             "prefetch", "step"])
            key = f"k{rng.randrange(12)}"
            if op == "put":
                n = rng.choice([1, 100, 3000, 20000, 70000])
                t = torch.randn(n) if rng.random() < 0.7 else torch.randint(0, 9, (n // 2 + 1, 2))
                s.put(key, t, codec=rng.choice(["raw", "raw", "zstd"]))
                model[key] = t
            elif op in ("get", "getdev", "slice") and key in model:
                want = model[key]
                if op == "get":
                    assert torch.equal(s.get(key), want)
                elif op == "slice":
                    a = rng.randrange(want.shape[0])
                    assert torch.equal(s.get(key, index=slice(a, a + 50)), want[a : a + 50])
                elif want.numel() * want.element_size() <= window:
                    got = s.get(key, device=dev)
                    assert torch.equal(got.cpu(), want)
                    del got
            elif op == "delete" and key in model:
                s.delete(key)
                del model[key]
            elif op == "commit":
                s.commit(step=op_i)
                committed = dict(model)
            elif op == "prefetch" and model:
                s.prefetch(rng.sample(sorted(model), min(3, len(model))),
                           to=rng.choice(["host", "device"]))
            elif op == "step":
                s.mark_step()
            st = s.stats()
            assert st["host_bytes"] <= ram and st["device_bytes"] <= window
        st = s.stats()
        assert 0 < st["peak_host_bytes"] <= ram
        assert 0 < st["peak_device_bytes"] <= window
        assert st["reads_disk"] > 0 and st["hits_host"] > 0 and st["hits_device"] >= 0
        s.commit()
        committed = dict(model)
    with tierstore.open(tmp_path, mode="r") as r:
        assert r.keys() == sorted(committed)
        for k, t in committed.items():
            assert torch.equal(r.get(k), t)
        assert r.verify() == []


def test_predictor_learns_a_repeated_order(tmp_path) -> None:
    with tierstore.open(tmp_path, ram_budget="1MiB", chunk_bytes="16KiB") as s:
        keys = [f"layers.{i}.w" for i in range(8)]
        for k in keys:
            s.put(k, torch.randn(4096))
        s.commit()
        assert s.stats()["prediction_accuracy"] is None
        for _ in range(3):
            for k in keys:
                s.get(k)
            s.mark_step()
        acc = s.stats()["prediction_accuracy"]
        # after the first step every read but the first of each step was announced in advance
        assert acc is not None and acc >= (len(keys) - 1) / len(keys) - 1e-9
        assert s.stats()["prefetched_chunks"] >= 0


def test_prefetch_wait_fills_the_ram_tier(tmp_path) -> None:
    with tierstore.open(tmp_path, ram_budget="1MiB", chunk_bytes="16KiB") as s:
        s.put("a", torch.randn(8192))
        s.commit()
    with tierstore.open(tmp_path, mode="r", ram_budget="1MiB", chunk_bytes="16KiB") as r:
        r.get("a")
        assert "host" not in r.info("a").tiers  # a raw get reads straight into its result
        r.prefetch(["a"], to="host", wait=True)
        assert "host" in r.info("a").tiers
        reads = r.stats()["reads_disk"]
        r.get("a")
        assert r.stats()["reads_disk"] == reads and r.stats()["hits_host"] > 0


def test_host_tier_reuses_the_buffers_of_dropped_chunks() -> None:
    """Replacing a tensor recycles its old chunks' buffers (no fresh pages), counted in the
    budget all along; a buffer someone still holds is never handed out again."""
    from tierstore.tiers.host import HostTier

    tier = HostTier(budget=4096)
    a = tier.try_alloc(1024)
    b = tier.try_alloc(1024)
    assert a is not None and b is not None and tier.fresh_buffers == 2
    tier.insert((1, 0), a, dirty=False)
    tier.insert((1, 1), b, dirty=False)
    a_ptr = a.data_ptr()
    del a, b
    tier.drop_generation(1, 2)
    assert tier.used == 2048  # spares stay counted: the budget bounds memory really held
    c = tier.try_alloc(1024)
    assert c is not None and tier.fresh_buffers == 2  # recycled, not allocated
    held = tier.try_alloc(1024)
    assert held is not None and tier.fresh_buffers == 2
    assert a_ptr in (c.data_ptr(), held.data_ptr())
    # a dropped chunk that a reader still references is not recycled
    tier.insert((2, 0), held, dirty=False)
    tier.drop((2, 0))
    d = tier.try_alloc(1024)
    assert d is not None and d.data_ptr() != held.data_ptr() and tier.fresh_buffers == 3
    # under budget pressure spares go before cached chunks
    tier.insert((3, 0), c, dirty=False)
    tier.insert((3, 1), d, dirty=False)
    tier.drop((3, 1))
    del d
    big = tier.try_alloc(2048)  # 1024 (chunk) + 1024 (spare) + 2048 > 4096: the spare goes
    assert big is not None and tier.holds((3, 0)) and tier.used <= 4096
    # without a budget nothing bounds spares, so none are kept
    free = HostTier(budget=None)
    e = free.try_alloc(64)
    free.insert((1, 0), e, dirty=False)
    del e
    free.drop((1, 0))
    assert free.used == 0


def test_window_empty_is_counted_until_dropped_and_refused_without_room(tmp_path) -> None:
    from tierstore.errors import BudgetError

    with tierstore.open(tmp_path, device_budget=64 * 1024) as s:
        s.put("w", torch.randn(8 * 1024))  # 32 KiB
        held = s.get("w", device="cpu")
        buf = s.window_empty((6 * 1024,), torch.float32)  # 24 KiB beside it
        assert buf.shape == (6 * 1024,) and s.stats()["device_bytes"] == 56 * 1024
        try:
            s.window_empty((4 * 1024,), torch.float32)  # 16 KiB more: the held tensors leave no room
            raise AssertionError("window_empty went beyond the window")
        except BudgetError as e:
            assert "does not fit the device window" in str(e)
        del buf
        assert s.stats()["device_bytes"] == 32 * 1024
        assert torch.equal(held, s.get("w"))


def test_get_many_equals_gets_and_starts_its_prefetch(tmp_path) -> None:
    with tierstore.open(tmp_path, ram_budget=64 * 1024, device_budget=256 * 1024, chunk_bytes="8KiB") as s:
        ts = {f"k{i}": torch.randn(4 * 1024) for i in range(6)}
        for k, t in ts.items():
            s.put(k, t)
        s.commit()
        got = s.get_many(["k0", "k1"], device="cpu", then_prefetch=[(["k4", "k5"], "device")])
        assert all(torch.equal(a, ts[k]) for a, k in zip(got, ["k0", "k1"], strict=True))
        before = s.stats()["hits_device"]
        assert torch.equal(s.get_many(["k4"], device="cpu")[0], ts["k4"])
        assert s.stats()["hits_device"] == before + 1  # the hint had put k4 in the window
        assert s.get_many([]) == []


def _tier_with(budget_chunks: int, chunk: int, kinds: list[str]) -> object:
    """A RAM tier holding one chunk of each kind: "dirty", "clean" or "fresh" (read, unused)."""
    from tierstore.tiers.host import HostTier

    tier = HostTier(budget=budget_chunks * chunk)
    for i, kind in enumerate(kinds):
        buf = tier.try_alloc(chunk)
        assert buf is not None
        tier.insert((i, 0), buf, dirty=kind == "dirty", fresh=kind == "fresh")
    return tier


def test_a_read_not_yet_used_is_evicted_last_and_not_while_a_write_back_can_make_room() -> None:
    chunk = 4096
    tier = _tier_with(4, chunk, ["fresh", "clean", "dirty", "dirty"])
    assert tier.try_alloc(chunk) is not None  # the used clean chunk goes, not the older fresh one
    assert tier.holds((0, 0)) and not tier.holds((1, 0))
    assert tier.try_alloc(chunk) is None  # only the fresh chunk is clean: the dirty ones are written first
    tier.mark_clean((2, 0))
    assert tier.try_alloc(chunk) is not None and not tier.holds((2, 0)) and tier.holds((0, 0))
    tier.mark_clean((3, 0))
    assert tier.lookup((0, 0)) is not None  # used: an ordinary clean chunk now, the most recently used
    assert tier.try_alloc(chunk) is not None and not tier.holds((3, 0)) and tier.holds((0, 0))
    assert tier.try_alloc(chunk) is not None and not tier.holds((0, 0))


def test_fresh_chunks_go_when_no_write_back_can_make_room() -> None:
    chunk = 4096
    # no dirty chunk: the fresh one is evicted rather than refusing the room
    tier = _tier_with(2, chunk, ["fresh", "fresh"])
    assert tier.try_alloc(chunk) is not None and not tier.holds((0, 0))
    # fresh chunks over half the budget: the oldest goes even with a dirty chunk to write
    tier = _tier_with(4, chunk, ["fresh", "fresh", "fresh", "dirty"])
    assert tier.try_alloc(chunk) is not None and not tier.holds((0, 0))


def test_a_waiter_that_no_write_back_can_serve_takes_a_fresh_chunks_room() -> None:
    import asyncio

    chunk = 4096
    tier = _tier_with(2, chunk, ["fresh", "dirty"])
    tier.explain_stuck = lambda: "the dirty chunk cannot be written"  # e.g. its write failed
    buf = asyncio.run(tier.alloc(chunk))
    assert buf.numel() == chunk and not tier.holds((0, 0)) and tier.holds((1, 0))
    assert tier.keep_fresh


def test_when_nothing_can_be_freed_an_optional_waiter_gives_up_first() -> None:
    """A read that can go uncached gives up; the put beside it waits and gets the room the
    reader's update frees (an update holding its loans while its reads wait for room)."""
    import asyncio

    from tierstore.errors import BudgetError

    chunk = 4096
    tier = _tier_with(2, chunk, ["clean", "clean"])
    for i in range(2):
        tier.take_for_update((i, 0), (10 + i, 0))  # lent writable: neither written nor evicted
    stuck: list[str] = []  # nothing yet: a write in flight may free room
    tier.explain_stuck = lambda: stuck[0] if stuck else None
    events: list[str] = []

    async def main() -> None:
        async def put() -> None:
            await tier.alloc(chunk)
            events.append("put got room")

        async def read() -> None:
            try:
                await tier.alloc(chunk, optional=True)
            except BudgetError:
                events.append("read gave up")
                tier.end_update((10, 0))  # read uncached, the update ends: its chunk can be written
                tier.mark_clean((10, 0))

        read_task = asyncio.ensure_future(read())
        await asyncio.sleep(0)  # the read waits for room first
        stuck.append("2 chunks wait to be written")  # the write ended and freed nothing
        await asyncio.wait_for(asyncio.gather(put(), read_task), timeout=5)

    asyncio.run(main())
    assert events == ["read gave up", "put got room"]
    assert not tier.holds((10, 0)) and tier.holds((11, 0))
    # without an optional waiter the same wait is refused at once, naming why
    tier2 = _tier_with(1, chunk, ["clean"])
    tier2.take_for_update((0, 0), (1, 0))
    tier2.explain_stuck = lambda: "1 chunk waits to be written"
    try:
        asyncio.run(tier2.alloc(chunk))
    except BudgetError as e:
        assert "1 chunk waits to be written" in str(e)
    else:
        raise AssertionError("expected BudgetError")


def test_a_fresh_chunk_lent_to_an_update_is_no_longer_fresh() -> None:
    chunk = 4096
    tier = _tier_with(2, chunk, ["fresh", "dirty"])
    tier.take_for_update((0, 0), (5, 0))
    tier.end_update((5, 0))
    tier.mark_clean((5, 0))  # written: an ordinary clean chunk, evicted before a write-back
    assert tier.try_alloc(chunk) is not None and not tier.holds((5, 0)) and tier.holds((1, 0))


def test_ranked_evictions_of_one_allocation_take_the_chunks_one_walk_each_would() -> None:
    """An allocation that evicts several chunks ranks them in one walk; it takes the same
    chunks, in the same order, as a walk per eviction (``_evict_one``), fresh, dirty, lent
    and tied ranks included."""
    import random

    from tierstore.tiers.host import HostTier

    rng = random.Random(7)
    sizes = [1024, 2048, 4096]
    for trial in range(40):
        layout = [(rng.choice(sizes), rng.choice(["clean", "clean", "dirty", "fresh", "lent"]),
                   float(rng.randrange(6))) for _ in range(30)]
        tiers = []
        for batched in (True, False):
            tier = HostTier(budget=sum(n for n, _, _ in layout))
            ranks = {(i, 0): r for i, (_, _, r) in enumerate(layout)}
            tier.rank = ranks.__getitem__
            if not batched:
                tier._ranked_victims = lambda above: []  # every eviction walks the tier again
            loans = []
            for i, (n, kind, _) in enumerate(layout):
                buf = tier.try_alloc(n)
                assert buf is not None
                tier.insert((i, 0), buf, dirty=kind == "dirty", fresh=kind == "fresh")
                if kind == "lent":
                    loans.append(tier.lend((i, 0)))
            tiers.append((tier, loans))
        for step in range(12):
            want, above = rng.choice(sizes) * rng.choice([1, 3, 6]), rng.choice([-1.0, 2.5])
            got = [t.try_alloc(want, above=above) is not None for t, _ in tiers]
            held = [sorted(t._entries) for t, _ in tiers]
            assert got[0] == got[1] and held[0] == held[1], (trial, step)
            assert list(tiers[0][0]._entries) == list(tiers[1][0]._entries)


def test_a_read_ahead_hint_for_chunks_held_or_on_their_way_starts_no_task(tmp_path) -> None:
    """The predictor's and the plan's hints skip keys already in RAM (a task each would find
    nothing to do); ``prefetch`` itself still returns a task a caller can wait on."""
    import asyncio

    with tierstore.open(tmp_path, ram_budget="1MiB", chunk_bytes="16KiB") as s:
        s.put("held", torch.randn(8192))
        s.put("gone", torch.randn(8192))
        s.commit()
        store = s._a

        async def hints() -> tuple[int, int, int]:
            store._host.drop_generation(store._head["gone"].generation, store._head["gone"].grid.n_chunks)
            held = len(store._prefetch_keys(["held"], "host", hint=True))
            waited = len(store._prefetch_keys(["held"], "host"))
            tasks = store._prefetch_keys(["gone"], "host", hint=True)
            await asyncio.gather(*tasks)
            return held, waited, len(tasks)

        assert s._loop.run(hints()) == (0, 1, 1)
        assert "host" in s.info("gone").tiers and torch.equal(s.get("gone"), s.get("gone"))
