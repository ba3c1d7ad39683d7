"""put(lazy=True): chunks stay dirty in RAM until the budget or a commit needs them written."""

from __future__ import annotations

import os

import torch

import tierstore

CHUNK = 64 << 10  # chunk_bytes: 16,384 fp32 values a chunk


def _open(path, budget="1MiB"):
    return tierstore.open(path, "w", ram_budget=budget, chunk_bytes=CHUNK)


def _folders(path) -> int:
    """Generation folders on disk (each holds a zarr.json)."""
    return sum("zarr.json" in files for _, _, files in os.walk(path))


def test_a_value_replaced_before_a_commit_never_touches_the_disk(tmp_path) -> None:
    with _open(tmp_path / "s") as s:
        for step in range(4):
            g = torch.full((2 * 16384,), float(step))
            s.put("grad/w", g, copy=False, lazy=True)
            assert torch.equal(s.get("grad/w"), g)
        s.delete("grad/w")
        st = s.stats()
        assert st["bytes_written_disk"] == 0
        assert _folders(tmp_path / "s") == 0
        s.put("w", torch.ones(16384))  # an eager put, for contrast
        s.commit()
        assert s.stats()["bytes_written_disk"] > 0


def test_a_lazy_value_is_durable_after_a_commit(tmp_path) -> None:
    t = torch.randn(3 * 16384 + 5)
    with _open(tmp_path / "s") as s:
        s.put("a", t, lazy=True)
        s.put("b", t.clone() * 2, copy=False, lazy=True)
        assert _folders(tmp_path / "s") == 0
        s.commit()
    with tierstore.open(tmp_path / "s", "r") as s:
        assert torch.equal(s.get("a"), t)
        assert torch.equal(s.get("b"), t * 2)
        assert s.verify() == []


def test_lazy_values_larger_than_the_budget_are_written_to_make_room(tmp_path) -> None:
    values = {f"k{i}": torch.randn(4 * 16384) for i in range(6)}  # 6 x 256 KiB, budget 512 KiB
    with _open(tmp_path / "s", budget="512KiB") as s:
        for k, v in values.items():
            s.put(k, v.clone(), copy=False, lazy=True)
        assert s.stats()["bytes_written_disk"] > 0  # the budget forced writes
        assert s.async_store._host.used <= 512 << 10
        for k, v in values.items():
            assert torch.equal(s.get(k), v), k
        s.commit()
    with tierstore.open(tmp_path / "s", "r") as s:
        for k, v in values.items():
            assert torch.equal(s.get(k), v), k


def test_the_sync_ledger_forgets_deleted_files_and_keeps_the_rest(tmp_path) -> None:
    from tierstore.tiers.disk import SyncLedger

    ledger = SyncLedger()
    kept = tmp_path / "kept"
    kept.write_bytes(b"x")
    ledger.written(str(kept))
    for i in range(20):
        ledger.written(str(tmp_path / f"gone{i}"))  # never created: as if deleted since
    ledger.prune(limit=100)
    assert len(ledger) == 21  # under the limit: nothing checked
    ledger.prune(limit=10)
    assert ledger.pending() == [str(kept)]


def test_write_backs_for_room_leave_no_growing_ledger(tmp_path) -> None:
    # state rewritten every step under a tight budget: written back for room, superseded, deleted
    with _open(tmp_path / "s", budget="512KiB") as s:
        for i in range(6):
            s.put(f"k{i}", torch.randn(4 * 16384))
        s.commit()
        ledger = s.async_store._ledger
        for _ in range(250):
            for i in range(6):
                with s.update(f"k{i}") as t:
                    t.add_(1.0)
        assert s.stats()["bytes_written_disk"] > 0
        assert len(ledger) < 4096 + 6 * 8  # pruned, not one entry per file ever written
        s.commit()
    with tierstore.open(tmp_path / "s", "r") as s:
        assert s.verify() == []


def _cycle(s, n_keys: int, cycles: int, ref: dict[str, torch.Tensor]) -> None:
    for _ in range(cycles):
        for i in range(n_keys):
            with s.update(f"k{i}", chunked=True) as parts:  # in place, as the trainer's AdamW
                for p in parts:
                    p.add_(1.0)
            ref[f"k{i}"] += 1.0


def test_state_written_back_for_room_takes_over_its_folders(tmp_path) -> None:
    ref = {f"k{i}": torch.randn(4 * 16384) for i in range(6)}  # 1.5 MiB of state, 512 KiB budget
    with _open(tmp_path / "s", budget="512KiB") as s:
        for k, v in ref.items():
            s.put(k, v.clone())
        s.commit()
        _cycle(s, 6, 8, ref)
        assert s.stats()["folders_recycled"] >= 6 * 4  # most write-backs rename, none remade
        for k, v in ref.items():
            assert torch.equal(s.get(k), v), k
        # a key's committed folder, its head's and one spare at most: nothing grows per cycle
        assert _folders(tmp_path / "s") <= 6 * 3
        s.commit()
        retained = {g for c in s.versions() for g in c.generations.values()}
    assert _folders(tmp_path / "s") == len(retained)  # the spares went with the close
    with tierstore.open(tmp_path / "s", "r") as s:
        assert s.verify() == []
        for k, v in ref.items():
            assert torch.equal(s.get(k), v), k


def test_a_failed_rename_of_a_spare_folder_makes_a_new_one(tmp_path) -> None:
    from tierstore.faults import FaultPlan

    ref = {f"k{i}": torch.randn(4 * 16384) for i in range(6)}
    with _open(tmp_path / "s", budget="512KiB") as s:
        for k, v in ref.items():
            s.put(k, v.clone())
        s.commit()
        _cycle(s, 6, 3, ref)
        store = s.async_store
        spares = dict(store._spare_folders)
        assert spares  # the next write-backs rename these
        plan = FaultPlan(sites=("mkdir",), fail_calls={0})
        store._disk.faults = plan
        _cycle(s, 6, 2, ref)
        store._disk.faults = None
        _, site, path = plan.log[0]
        key, _, gen = os.path.basename(path).partition("@")
        assert site == "mkdir" and key in spares and int(gen) > spares[key][0]  # a rename
        assert len(plan.log) > 1  # then new folders were made for it (calls past the failure)
        for k, v in ref.items():
            assert torch.equal(s.get(k), v), k
        s.commit()  # waits for deletions
        # the spare it could not take was deleted, not left behind
        assert not os.path.exists(store._disk.generation_dir(key, spares[key][0]))
    with tierstore.open(tmp_path / "s", "r") as s:
        assert s.verify() == []
        for k, v in ref.items():
            assert torch.equal(s.get(k), v), k
