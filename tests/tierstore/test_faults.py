"""Injected I/O errors at every call site of a commit leave the previous commit intact."""

from __future__ import annotations

import errno

import pytest
import torch

import tierstore
from tierstore.faults import FaultPlan

OPTS = dict(ram_budget="1MiB", chunk_bytes="16KiB")


def base_values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"a": torch.randn(10_000, generator=g), "b": torch.randn(7, generator=g)}


def new_values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {"a": torch.randn(10_000, generator=g), "c": torch.randn(3000, generator=g)}


def make_base(path) -> None:
    with tierstore.open(path, mode="w", **OPTS) as s:
        for k, v in base_values().items():
            s.put(k, v)
        s.commit(step=1)


def attempt(path, plan: FaultPlan) -> bool:
    """Puts and a commit under ``plan``; True if the commit went through."""
    s = tierstore.open(path, **OPTS)
    try:
        s.async_store.inject_faults(plan)
        for k, v in new_values().items():
            s.put(k, v)
        s.delete("b")
        s.commit(step=2)
        return True
    except tierstore.StoreError:
        return False
    finally:
        s.async_store.inject_faults(None)
        s.close(commit=False)


def check_reopen(path, committed: bool) -> None:
    with tierstore.open(path, **OPTS) as s:  # a writer open also deletes the orphans
        assert s.verify() == []
        want = dict(base_values())
        if committed:
            want.pop("b")
            want.update(new_values())
        assert s.keys() == sorted(want)
        for k, v in want.items():
            assert torch.equal(s.get(k), v), k


def calls_of_a_commit(path) -> list[tuple[int, str, str]]:
    make_base(path)
    plan = FaultPlan()
    assert attempt(path, plan)
    return plan.log


@pytest.mark.parametrize("error", [errno.EIO, errno.ENOSPC])
def test_every_call_site_of_a_commit(tmp_path, error) -> None:
    log = calls_of_a_commit(tmp_path / "count")
    assert {site for _, site, _ in log} == {"mkdir", "write", "fsync", "catalog"}
    for k, site, target in log:
        path = tmp_path / f"s{k}"
        make_base(path)
        target = target.replace(str(tmp_path / "count"), str(path))
        ok = attempt(path, FaultPlan(fail_at={(site, target)}, error=error))
        check_reopen(path, committed=ok)
        # a failed write-behind (folder creation or file write) is retried once by the commit;
        # a failed fsync (small files and folders are synced by the commit itself) or catalog
        # transaction aborts the commit
        assert ok == (site in ("write", "mkdir")), (k, site, target)


def test_fsync_failures_abort_the_commit(tmp_path) -> None:
    make_base(tmp_path)
    assert not attempt(tmp_path, FaultPlan(fail_sites={"fsync"}))
    check_reopen(tmp_path, committed=False)
    assert not attempt(tmp_path, FaultPlan(fail_sites={"catalog"}))
    check_reopen(tmp_path, committed=False)


def test_full_disk_then_space_freed_continues_without_reopen(tmp_path) -> None:
    make_base(tmp_path)
    with tierstore.open(tmp_path, **OPTS) as s:
        plan = FaultPlan(fail_sites={"write"}, error=errno.ENOSPC)
        s.async_store.inject_faults(plan)
        for k, v in new_values().items():
            s.put(k, v)  # lands in RAM; the write-behind hits ENOSPC
        with pytest.raises(tierstore.DiskError, match="No space left"):
            s.commit(step=2)
        assert torch.equal(s.get("a"), new_values()["a"])  # still readable from RAM
        s.async_store.inject_faults(None)  # space freed
        s.delete("b")
        assert s.commit(step=2) == 2
    check_reopen(tmp_path, committed=True)


def test_short_writes_are_resumed(tmp_path) -> None:
    make_base(tmp_path)
    assert attempt(tmp_path, FaultPlan(short_writes=1000))
    check_reopen(tmp_path, committed=True)


def test_read_errors_are_disk_errors(tmp_path) -> None:
    make_base(tmp_path)
    with tierstore.open(tmp_path, mode="r", **OPTS) as r:
        r.async_store.inject_faults(FaultPlan(fail_sites={"read"}))
        with pytest.raises(tierstore.DiskError, match="Input/output error"):
            r.get("a")
        r.async_store.inject_faults(None)
        assert torch.equal(r.get("a"), base_values()["a"])
