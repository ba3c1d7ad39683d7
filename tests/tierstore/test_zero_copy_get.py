"""get(copy=False) on a CPU window: the RAM tier's buffers lent, counted once, never reused while held."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

import tierstore

CHUNK = 64 << 10  # chunk_bytes: 16,384 fp32 values a chunk
N = 16384  # one full chunk of fp32


def _open(path, budget="1MiB", device="cpu", window="1MiB", **kw):
    return tierstore.open(path, "w", ram_budget=budget, chunk_bytes=CHUNK, device=device,
                          device_budget=window, **kw)


def _buffer_ptrs(host) -> set[int]:
    """Data pointers of every buffer the RAM tier holds as a chunk or keeps as a spare."""
    ptrs = {e.data.data_ptr() for e in host._entries.values()}
    ptrs |= {b.data_ptr() for bufs in host._spare.values() for b in bufs}
    return ptrs


def test_lent_tensors_equal_normal_gets_and_share_the_ram_tiers_memory(tmp_path) -> None:
    values = {
        "w": torch.randn(128, 128),  # one full chunk
        "bias": torch.randn(77),  # a short (padded) chunk
        "half": torch.randn(64, 100).half(),
        "bf16": torch.randn(50, 30).bfloat16(),
        "int": torch.arange(1000, dtype=torch.int64).reshape(10, 100),
        "scalar": torch.tensor(2.5),
    }
    with _open(tmp_path / "s") as s:
        for k, v in values.items():
            s.put(k, v)
        a = s.async_store
        for k, v in values.items():
            lent = s.get(k, device="cpu", copy=False)
            copied = s.get(k, device="cpu")
            assert lent.dtype == v.dtype and lent.shape == v.shape and torch.equal(lent, v), k
            assert torch.equal(lent, copied) and lent.data_ptr() != copied.data_ptr(), k
            held = a._host.lookup((a._head[k].generation, 0))
            assert lent.data_ptr() == held.data_ptr(), k  # no copy: the tier's own buffer
        st = s.stats()
        assert st["lent"] == len(values)
        assert st["bytes_lent"] == sum(v.numel() * v.element_size() for v in values.values())
        many = s.get_many(list(values), device="cpu", copy=False)  # the window's copies now: no loan
        for (k, v), t in zip(values.items(), many, strict=True):
            assert torch.equal(t, v), k
        assert s.stats()["lent"] == len(values)


def test_lent_bytes_are_counted_in_the_ram_budget_once_not_in_the_window(tmp_path) -> None:
    w = torch.randn(4, N // 4)
    with _open(tmp_path / "s", window=str(N * 4)) as s:  # the window holds one copy of w
        s.put("w", w)
        host = s.async_store._host
        used = host.used
        lent = [s.get("w", device="cpu", copy=False) for _ in range(3)]
        st = s.stats()
        assert host.used == used  # the buffer was counted when it was cached; lending adds nothing
        assert st["device_bytes"] == 0  # nor does the window count it
        assert st["host_lent_bytes"] == N * 4  # one buffer, however many loans
        copy = s.get("w", device="cpu")  # a copy fills the window
        assert s.stats()["device_bytes"] == N * 4
        with pytest.raises(tierstore.BudgetError):
            s.get("w", device="cpu", index=slice(0, 2))  # the window is full of the copy
        del copy, lent
        gc.collect()
        assert s.stats()["host_lent_bytes"] == 0


def test_a_put_of_the_same_key_leaves_a_lent_tensor_unchanged(tmp_path) -> None:
    w = torch.randn(128, 128)
    keep = w.clone()
    with _open(tmp_path / "s") as s:
        s.put("w", w)
        lent = s.get("w", device="cpu", copy=False)
        ptr = lent.data_ptr()
        s.put("w", torch.zeros(128, 128))  # copy-on-write: new buffers
        s.put("w", torch.ones(128, 128))
        s.commit()  # waits for the superseded generations to be dropped
        assert torch.equal(lent, keep)
        now = s.get("w", device="cpu", copy=False)
        assert torch.equal(now, torch.ones(128, 128)) and now.data_ptr() != ptr
        assert torch.equal(s.get("w"), torch.ones(128, 128))


def test_a_lent_buffer_is_not_reused_while_held_and_is_once_dropped(tmp_path) -> None:
    with _open(tmp_path / "s", budget=str(8 * N * 4)) as s:  # room for 8 chunks
        host = s.async_store._host
        s.put("w", torch.full((N,), 7.0))
        s.commit()
        lent = s.get("w", device="cpu", copy=False)
        view = lent[10:].view(-1, 2).t()  # a view alone must keep the loan too
        del lent
        ptr = view.data_ptr() - 10 * 4
        s.put("w", torch.zeros(N))  # supersedes the lent generation...
        s.commit()
        s.commit()  # ...which retention then drops (keep_last=2)
        assert ptr not in {e.data.data_ptr() for e in host._entries.values()}
        assert [e.data.data_ptr() for e in host._held] == [ptr]  # held, still counted
        for i in range(24):  # 3x the budget of chunks of the lent buffer's size
            s.put(f"x{i}", torch.full((N,), float(i)))
            assert ptr not in _buffer_ptrs(host)  # never handed to another allocation
            assert host.used <= host.budget
        assert bool((view == 7.0).all())
        s.commit()
        for i in range(24):
            assert torch.equal(s.get(f"x{i}"), torch.full((N,), float(i)))
        assert s.stats()["host_lent_bytes"] == N * 4
        del view
        gc.collect()
        assert s.stats()["host_lent_bytes"] == 0
        s.put("y", torch.full((N,), 3.0))  # the given-back buffer is the next one recycled
        assert host._held == []
        y = host.lookup((s.async_store._head["y"].generation, 0))
        assert y.data_ptr() == ptr and torch.equal(y.view(torch.float32), torch.full((N,), 3.0))


def test_a_lent_chunk_is_not_evicted_and_blocks_no_other_room(tmp_path) -> None:
    with _open(tmp_path / "s", budget=str(4 * N * 4)) as s:  # 4 chunks
        s.put("w", torch.full((N,), 1.0))
        s.commit()
        a = s.async_store
        lent = s.get("w", device="cpu", copy=False)
        for i in range(8):  # clean chunks are evicted around it
            s.put(f"x{i}", torch.full((N,), float(i)))
            s.commit()
        assert a._host.holds((a._head["w"].generation, 0))  # still cached: eviction skipped it
        assert a._host.used <= a._host.budget
        assert torch.equal(lent, torch.full((N,), 1.0))


def test_a_budget_full_of_lent_buffers_raises_instead_of_waiting_forever(tmp_path) -> None:
    with _open(tmp_path / "s", budget=str(2 * N * 4)) as s:  # 2 chunks
        s.put("a", torch.full((N,), 1.0))
        s.put("b", torch.full((N,), 2.0))
        s.commit()
        held = s.get_many(["a", "b"], device="cpu", copy=False)
        with pytest.raises(tierstore.BudgetError, match="lent"):
            s.put("c", torch.full((N,), 3.0))
        del held
        gc.collect()
        s.put("c", torch.full((N,), 3.0))  # room again once they are dropped
        assert torch.equal(s.get("c"), torch.full((N,), 3.0))


def test_a_chunk_on_disk_is_read_into_the_ram_tier_and_lent(tmp_path) -> None:
    w = torch.randn(N)
    with _open(tmp_path / "s") as s:
        s.put("w", w)
        s.commit()
    with tierstore.open(tmp_path / "s", "r", ram_budget="1MiB", device="cpu", device_budget="1MiB") as s:
        host = s.async_store._host
        lent = s.get("w", device="cpu", copy=False)
        assert torch.equal(lent, w)
        assert s.stats()["reads_disk"] == 1 and s.stats()["lent"] == 1
        assert lent.data_ptr() == host.lookup((s.async_store._head["w"].generation, 0)).data_ptr()


def test_what_cannot_be_lent_is_copied(tmp_path) -> None:
    with _open(tmp_path / "s", budget="4MiB", window="4MiB") as s:
        s.put("q8", torch.randn(64, 64), codec="q8")  # not the raw layout
        s.put("zstd", torch.randn(64, 64), codec="zstd")
        s.put("multi", torch.randn(3 * N))  # three chunks: no one buffer holds it
        s.put("table", torch.randn(64, 16), chunk_rows=8)  # sharded
        s.put("w", torch.randn(N))
        a = s.async_store
        for k in ("q8", "zstd", "multi", "table"):
            want = s.get(k)
            got = s.get(k, device="cpu", copy=False)
            assert torch.equal(got, want), k
            assert s.stats()["lent"] == 0, k
        part = s.get("w", device="cpu", index=slice(0, 5), copy=False)  # an index reads a copy
        host_read = s.get("w", copy=False)  # a host read is the caller's own copy
        assert s.stats()["lent"] == 0
        buf = a._host.lookup((a._head["w"].generation, 0))
        assert part.data_ptr() != buf.data_ptr() and host_read.data_ptr() != buf.data_ptr()


def test_a_copy_already_in_the_window_is_returned_instead(tmp_path) -> None:
    with _open(tmp_path / "s") as s:
        s.put("w", torch.randn(N))
        copy = s.get("w", device="cpu")
        again = s.get("w", device="cpu", copy=False)
        assert again.data_ptr() == copy.data_ptr() and s.stats()["lent"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_window_copies(tmp_path) -> None:
    with _open(tmp_path / "s", device="cuda") as s:
        s.put("w", torch.randn(N))
        got = s.get("w", device="cuda", copy=False)
        assert got.device.type == "cuda" and s.stats()["lent"] == 0
        assert torch.equal(got.cpu(), s.get("w"))


def test_a_cancelled_get_lends_nothing_that_stays_held(tmp_path) -> None:
    async def run() -> None:
        s = await tierstore.open_async(tmp_path / "s", "w", ram_budget="1MiB", chunk_bytes=CHUNK,
                                       device="cpu", device_budget="1MiB")
        try:
            await s.put("w", torch.randn(N))
            await s.commit()
        finally:
            await s.close()
        s = await tierstore.open_async(tmp_path / "s", "r", ram_budget="1MiB", device="cpu")
        try:
            task = asyncio.ensure_future(s.get("w", device="cpu", copy=False))
            await asyncio.sleep(0)  # the disk read has started
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await s.prefetch(["w"], wait=True)  # the shielded read finished and cached the chunk
            gc.collect()
            assert s.stats()["host_lent_bytes"] == 0
            lent = await s.get("w", device="cpu", copy=False)
            assert s.stats()["host_lent_bytes"] == N * 4
            del lent
            gc.collect()
            assert s.stats()["host_lent_bytes"] == 0
        finally:
            await s.close()

    asyncio.run(run())


def test_writing_into_a_loan_of_a_dirty_chunk_is_refused_at_commit(tmp_path) -> None:
    # A write into a get(copy=False) loan of a dirty chunk, then a write-behind that failed once
    # and was retried by the commit: the retry wrote the changed bytes under the crc32c taken at
    # put time, the commit succeeded, and every read of it after reopen raised CorruptData.
    from tierstore.faults import FaultPlan

    path = tmp_path / "s"
    old, new, other = torch.arange(N, dtype=torch.float32), torch.full((N,), 3.0), torch.ones(10)
    with _open(path) as s:
        s.put("w", old)
        s.put("other", other)
        v1 = s.commit()
        s.async_store.inject_faults(FaultPlan(fail_sites={"write"}))  # the write-behind fails
        s.put("w", new)
        s.put("other", other * 2)
        lent = s.get("w", device="cpu", copy=False)
        lent[:5] = -1.0  # forbidden: the loan is read-only
        s.async_store.inject_faults(None)
        with pytest.raises(tierstore.LoanWritten, match="'w'.*get\\(copy=False\\)") as err:
            s.commit()  # retries the failed writes: the changed chunk is refused
        assert err.value.key == "w" and err.value.chunk == 0
        assert s.versions()[-1].version == v1  # nothing was published
        del lent
        s.put("w", new)  # a put of the key replaces the changed bytes
        v2 = s.commit()
    with tierstore.open(path, "r", version=v1, chunk_bytes=CHUNK) as r:
        assert not r.verify()
        assert torch.equal(r.get("w"), old) and torch.equal(r.get("other"), other)
    with tierstore.open(path, "r", chunk_bytes=CHUNK) as r:
        assert r.versions()[-1].version == v2 and not r.verify()
        assert torch.equal(r.get("w"), new) and torch.equal(r.get("other"), other * 2)


def test_a_refused_chunk_leaves_the_last_commit_readable_and_delete_clears_it(tmp_path) -> None:
    from tierstore.faults import FaultPlan

    path = tmp_path / "s"
    with _open(path) as s:
        s.put("keep", torch.ones(N))
        v1 = s.commit()
        s.async_store.inject_faults(FaultPlan(fail_sites={"write"}))
        s.put("w", torch.zeros(N))
        s.get("w", device="cpu", copy=False).add_(1.0)  # written into, and dropped at once
        s.async_store.inject_faults(None)
        with pytest.raises(tierstore.LoanWritten):
            s.close()  # close commits: refused the same way, and the store is closed all the same
    with tierstore.open(path, "a", ram_budget="1MiB", chunk_bytes=CHUNK, device="cpu") as s:
        assert s.versions()[-1].version == v1 and s.keys() == ["keep"]
        s.async_store.inject_faults(FaultPlan(fail_sites={"write"}))
        s.put("w", torch.zeros(N))
        s.get("w", device="cpu", copy=False).add_(1.0)
        s.async_store.inject_faults(None)
        s.delete("w")  # the changed bytes go with the key
        s.commit()
    with tierstore.open(path, "r", chunk_bytes=CHUNK) as r:
        assert r.keys() == ["keep"] and not r.verify()


def test_writing_into_a_loan_of_a_clean_chunk_never_reaches_the_disk(tmp_path) -> None:
    path = tmp_path / "s"
    x = torch.arange(N, dtype=torch.float32)
    with _open(path) as s:
        s.put("w", x)
        s.commit()  # on disk: the RAM copy is clean
        s.get("w", device="cpu", copy=False)[:3] = 7.0  # forbidden, and harmless to what is stored
        s.put("z", torch.ones(4))
        s.commit()
    with tierstore.open(path, "r", chunk_bytes=CHUNK) as r:
        assert torch.equal(r.get("w"), x) and not r.verify()


def test_writing_into_a_loan_of_a_chunk_changed_in_place_is_refused_too(tmp_path) -> None:
    # an update's chunk takes its crc32c when it is written: a loan taken before that write
    # must not make the write-back take the crc of bytes changed through the loan
    path = tmp_path / "s"
    x = torch.arange(N, dtype=torch.float32)
    with _open(path) as s:
        s.put("w", x)
        v1 = s.commit()
        with s.update("w") as t:
            t.mul_(2)
        lent = s.get("w", device="cpu", copy=False)
        assert torch.equal(lent, x * 2)
        lent[0] = 123.0
        with pytest.raises(tierstore.LoanWritten, match="'w'"):
            s.commit()
        del lent
        s.put("w", x * 3)
        s.commit()
    with tierstore.open(path, "r", version=v1, chunk_bytes=CHUNK) as r:
        assert torch.equal(r.get("w"), x)
    with tierstore.open(path, "r", chunk_bytes=CHUNK) as r:
        assert torch.equal(r.get("w"), x * 3) and not r.verify()


async def _reads_back_intact(path, x: torch.Tensor, chunk: int) -> None:
    """The last commit at ``path`` verifies and holds ``x`` under "w"."""
    r = await tierstore.open_async(path, "r", chunk_bytes=chunk)
    try:
        assert not await r.verify()
        assert torch.equal(await r.get("w"), x)
    finally:
        await r.close()


def test_a_loan_taken_after_an_in_place_chunk_got_its_crc_but_before_its_write_is_refused(tmp_path) -> None:
    # A chunk changed in place takes its crc32c when the write-back reaches it; its write may
    # then wait (behind others, for the io threads). A loan taken and written into in between
    # must fail that write too: the write re-checks what it wrote, whoever took the crc32c.
    async def run() -> None:
        x = torch.arange(N, dtype=torch.float32)
        s = await tierstore.open_async(tmp_path / "s", "w", ram_budget="1MiB", chunk_bytes=CHUNK,
                                       device="cpu", device_budget="1MiB", io_depth=1)
        try:
            await s.put("keep", torch.ones(4))
            v1 = await s.commit()
            await s.put("w", x, lazy=True)  # dirty in RAM, written only when a commit needs it
            async with s.update("w") as t:
                t.mul_(2)  # in place: a new generation whose crc32c is taken when it is written
            cid = (s._head["w"].generation, 0)
            assert cid not in s._late_crcs
            await s._write_sem.acquire()  # the commit's writes wait here, like behind another's
            commit = asyncio.ensure_future(s.commit())
            while cid not in s._late_crcs:  # the write-back took the crc32c, its write waits
                await asyncio.sleep(0.001)
            lent = await s.get("w", device="cpu", copy=False)
            assert torch.equal(lent, x * 2)
            lent[0] = 123.0  # forbidden: the loan is read-only
            s._write_sem.release()
            with pytest.raises(tierstore.LoanWritten, match="'w'"):
                await commit
            assert s.versions()[-1].version == v1  # nothing was published
            del lent
            await s.put("w", x * 3)  # clears the condition
            await s.commit()
        finally:
            await s.close()
        await _reads_back_intact(tmp_path / "s", x * 3, CHUNK)

    asyncio.run(run())


def test_a_crc_the_write_back_takes_while_a_loan_is_written_never_replaces_the_loans(tmp_path) -> None:
    # A large chunk changed in place takes its crc32c on a cpu thread. A get(copy=False) that
    # takes its own meanwhile lends the chunk once it has one; a write into that loan must not
    # let the write-back's crc32c, read from the changed bytes, replace the first one taken.
    import threading

    import tierstore.writes as writes

    n = 1 << 18  # 1 MiB of fp32: crc32c taken on the cpu threads, not the loop's
    entered, go = threading.Event(), threading.Event()
    plain = writes.checksum

    def held(parts):  # the write-back's crc32c, held until the loan is written into
        entered.set()
        assert go.wait(30)
        return plain(parts)

    async def run() -> None:
        x = torch.arange(n, dtype=torch.float32)
        s = await tierstore.open_async(tmp_path / "s", "w", ram_budget="8MiB", chunk_bytes=4 * n,
                                       device="cpu", device_budget="8MiB")
        try:
            await s.put("keep", torch.ones(4))
            v1 = await s.commit()
            await s.put("w", x, lazy=True)
            async with s.update("w") as t:
                t.mul_(2)
            writes.checksum = held
            try:
                commit = asyncio.ensure_future(s.commit())
                while not entered.is_set():
                    await asyncio.sleep(0.001)
                lent = await s.get("w", device="cpu", copy=False)  # takes its crc32c first
                lent[0] = 123.0  # forbidden
                go.set()
                with pytest.raises(tierstore.LoanWritten, match="'w'"):
                    await commit
            finally:
                go.set()
                writes.checksum = plain
            assert s.versions()[-1].version == v1
            del lent
            await s.put("w", x * 3)  # clears the condition
            await s.commit()
        finally:
            await s.close()
        await _reads_back_intact(tmp_path / "s", x * 3, 4 * n)

    asyncio.run(run())
