"""Disk use stays within head + keep_last commits; older versions are dropped."""

from __future__ import annotations

import os

import torch

import tierstore


def du(path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path / "data"):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total


def test_disk_use_bounded_by_retained_commits(tmp_path) -> None:
    n = 64 * 1024  # 256 KiB per tensor
    keep = 2
    with tierstore.open(tmp_path, keep_last=keep, chunk_bytes="64KiB", ram_budget="1MiB") as s:
        s.put("frozen", torch.randn(n))  # never rewritten: shared by every commit, stored once
        for step in range(20):
            s.put("w", torch.randn(n))
            s.put("m", torch.randn(n))
            s.put("scratch", torch.randn(n))  # overwritten before the commit: never kept
            s.put("scratch", torch.randn(n))  # this one is kept by the commit
            s.commit(step=step)
            one = 4 * n  # bytes of one tensor
            # frozen + keep x (w, m, scratch); slack for metadata and crc trailers
            assert du(tmp_path) <= (1 + 3 * keep) * one * 1.02, step
        assert len(s.versions()) == keep
    gens = {g for _, g in tierstore.store.DiskTier(str(tmp_path)).scan_generations()}
    assert len(gens) == 1 + 3 * keep
