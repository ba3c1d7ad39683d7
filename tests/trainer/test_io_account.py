"""The per-step I/O account in log_history: bytes per tier and the minimum the budgets allow."""

from __future__ import annotations

from typing import Any

import pytest
from plain_reference import build, llama_config, weight_bytes

import trainer as mt
from trainer.args import TrainingArguments
from trainer.io_account import COUNTERS, copied_weight_bytes, cpu_window_capacity, minimum, moved
from trainer.optimizer import EXP_AVG, EXP_AVG_SQ

STEPS = 4


def test_minimum_and_moved() -> None:
    # forward and backward each read the weights, the moments once, less what RAM + window carry
    assert minimum(100, 40, 30, 10, first_step=False) == (2 * 100 + 40 - 2 * 40, 140)
    assert minimum(100, 40, 30, 10, first_step=True) == (2 * 100 - 2 * 40, 140)
    assert minimum(100, 40, 300, 10) == (0, 140)  # everything fits: only writes are needed
    assert minimum(100, 40, None, 10) == (0, 140)
    # the cache beyond the weights saves one read per moment byte, not two
    assert minimum(100, 40, 110, 10, first_step=False) == (2 * 100 + 40 - 2 * 100 - 20, 140)
    # clipping: the updates start after backward, when the cache holds at most C of the
    # W + M + G bytes they read; gradients beyond the cache are written once too
    assert minimum(100, 40, 30, 10, held_grads=100) == (2 * 60 + (100 + 40 + 100 - 40), 140 + 60)
    # a cache that holds the weights: the moments and gradients beside them, less what is left
    assert minimum(100, 40, 130, 10, held_grads=100) == (100 + 40 + 100 - 140, 140)
    assert minimum(100, 40, 300, 10, held_grads=100) == (0, 140)  # all of it fits
    # never less than without clipping: held gradients only take room
    for ram in (0, 30, 90, 130, 200):
        assert minimum(100, 40, ram, 10, held_grads=100)[0] >= minimum(100, 40, ram, 10)[0]
    before = {"bytes_read_disk": 5, "bytes_written_disk": 7, "bytes_h2d": 0, "bytes_d2h": 1}
    after = {"bytes_read_disk": 15, "bytes_written_disk": 27, "bytes_h2d": 3, "bytes_d2h": 1}
    assert moved(before, after) == {"io_disk_read_bytes": 10, "io_disk_written_bytes": 20,
                                    "io_h2d_bytes": 3, "io_d2h_bytes": 0}


def test_a_cpu_window_holds_only_the_weights_it_copies(tmp_path: Any) -> None:
    import torch

    import tierstore

    with tierstore.open(tmp_path / "s", mode="w", ram_budget="1MiB", chunk_bytes=4096, device="cpu") as s:
        s.put("lent", torch.ones(32, 32))              # 4 KiB: one raw chunk, lent from the RAM tier
        s.put("chunks", torch.ones(64, 32))            # 8 KiB: two chunks, copied into the window
        s.put("coded", torch.ones(32, 32), codec="q8")  # decoded into the window
        assert [s.info(k).chunks for k in ("lent", "chunks")] == [1, 2]
        assert copied_weight_bytes(s, ["lent"]) == 0
        assert copied_weight_bytes(s, ["lent", "chunks", "coded"]) == 8192 + 4096
    assert cpu_window_capacity(10_000, 12_288) == 10_000  # up to its budget
    assert cpu_window_capacity(None, 12_288) == 12_288
    # the minimum counts only what the window holds beside the RAM tier
    assert minimum(100, 40, 30, cpu_window_capacity(50, 0))[0] > minimum(100, 40, 30, 50)[0]


def test_log_history_carries_each_steps_io(dataset: Any, tmp_path: Any) -> None:
    model = build(llama_config(layers=4))
    names = [n for n, _ in model.named_parameters()]
    wbytes = weight_bytes(model)
    vram, ram = wbytes * 45 // 100, wbytes * 2  # state (16 B a parameter) spills to disk
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=STEPS,
                             learning_rate=1e-3, logging_steps=1, save_steps=0, disable_tqdm=True)
    mt.init(offload_dir=None, max_vram_gb=f"{vram}B", max_ram_gb=f"{ram}B", optimizer_compression="q4",
            device="cpu")
    tr = mt.Trainer(model=model, train_dataset=dataset, args=args)
    tr.train()
    try:
        logs = [e for e in tr.state.log_history if "loss" in e]
        stats = tr.store.stats()
        info = {k: tr.store.info(k).stored_nbytes for k in tr.store.keys()}
        copied = copied_weight_bytes(tr.store, names)
    finally:
        tr.close()
    assert [e["step"] for e in logs] == list(range(1, STEPS + 1))
    W = sum(info[n] for n in names)
    M = sum(info[p + n] for p in (EXP_AVG, EXP_AVG_SQ) for n in names)
    G = wbytes  # clipping is on (max_grad_norm 1.0): every fp32 gradient is held until backward ends
    assert M < W  # q4 moments: the minimum must use their stored size, not fp32's
    for e in logs:
        for k in COUNTERS:
            assert isinstance(e[k], int) and e[k] >= 0, (k, e)
        # step 1 logs before its moments exist (they are written by its own updates)
        m = 0 if e["step"] == 1 else M
        assert (e["io_min_disk_read_bytes"], e["io_min_disk_written_bytes"]) == \
            minimum(W, m, ram, cpu_window_capacity(vram, copied), first_step=e["step"] == 1, held_grads=G)
        assert e["io_disk_vs_min"] == (e["io_disk_read_bytes"] + e["io_disk_written_bytes"]) / (
            e["io_min_disk_read_bytes"] + e["io_min_disk_written_bytes"])
    # the steps' bytes are the store's own counts, a part of what it moved in all
    assert sum(e["io_disk_written_bytes"] for e in logs) <= stats["bytes_written_disk"]
    assert sum(e["io_disk_read_bytes"] for e in logs) <= stats["bytes_read_disk"]
    assert sum(e["io_disk_read_bytes"] for e in logs[1:]) > 0  # the state does not fit: it is read back
    print([(e["io_disk_read_bytes"], e["io_min_disk_read_bytes"], e["io_disk_written_bytes"],
            e["io_min_disk_written_bytes"], round(e["io_disk_vs_min"], 2)) for e in logs])


def test_each_optimizer_step_closes_a_step_of_the_stores_access_trace(dataset: Any, tmp_path: Any,
                                                                        monkeypatch: Any) -> None:
    """The predictor learns a step's reads only at ``mark_step()``: without it the trace grew by
    every get and ``prediction_accuracy`` stayed None for a whole training run."""
    import tierstore

    marks: list[int] = []
    mark = tierstore.Store.mark_step

    def counted(self: Any) -> None:
        marks.append(1)
        mark(self)

    monkeypatch.setattr(tierstore.Store, "mark_step", counted)
    model = build(llama_config(layers=1))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3,
                             learning_rate=1e-3, logging_steps=1, save_steps=0, disable_tqdm=True)
    mt.init(offload_dir=None, device="cpu")
    tr = mt.Trainer(model=model, train_dataset=dataset, args=args)
    tr.train()
    try:
        stats = tr.store.stats()
    finally:
        tr.close()
    assert len(marks) == 3
    assert stats["prediction_accuracy"] is not None and stats["predictor_dropped_reads"] == 0


@pytest.mark.parametrize("clip,first", [(None, "model.norm.weight"), (1.0, "model.embed_tokens.weight")])
def test_the_store_plan_follows_the_order_of_the_updates(dataset: Any, tmp_path: Any, clip: float | None,
                                                         first: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without clipping each group is updated as backward hands over its gradients, head first;
    # with clipping after backward, in forward order. A plan the other way round would rank the
    # group updated next as needed last (and read ahead the one just updated).
    from tierstore.sync import Store

    seen: list[list[str]] = []
    real = Store.plan

    def spy(self: Any, keys: Any, hot: Any = ()) -> Any:
        seen.append(list(keys))
        return real(self, keys, hot=hot)

    monkeypatch.setattr(Store, "plan", spy)
    model = build(llama_config())
    mt.init(offload_dir=None, max_vram_gb=f"{weight_bytes(model)}B", device="cpu")
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1,
                             save_steps=0, logging_steps=1, report_to=[], disable_tqdm=True,
                             max_grad_norm=clip)
    tr = mt.Trainer(model=model, args=args, train_dataset=dataset)
    try:
        tr.train()
    finally:
        tr.close()
    assert seen, "the optimizer gave the store no plan"
    assert seen[-1][0] == first, seen[-1][:3]
    assert seen[-1][1] == EXP_AVG + seen[-1][0] and seen[-1][2] == EXP_AVG_SQ + seen[-1][0]


@pytest.mark.parametrize(("clip", "accumulate", "kept"), [(None, 1, True), (1.0, 1, False), (None, 2, True)])
def test_backward_holds_each_groups_weights_until_its_update(dataset: Any, tmp_path: Any, clip: float | None,
                                                             accumulate: int, kept: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # On the CPU a group's weights are backward's loans from the RAM tier. Where its update
    # follows at once (no clipping, the last micro-batch) they are held until it begins, so the
    # RAM tier cannot evict them in between; it lets go first, so nothing is copied on write.
    from trainer.optimizer import StoreAdamW

    calls: list[tuple[int, int]] = []
    at_update: list[bool] = []
    real_keep, real_update = StoreAdamW.keep_for_update, StoreAdamW.update_group

    def keep(self: Any, g: int, loans: list[Any]) -> None:
        calls.append((g, len(loans)))
        real_keep(self, g, loans)

    def update(self: Any, g: int, *args: Any, **kwargs: Any) -> None:
        at_update.append(g in self._kept)
        real_update(self, g, *args, **kwargs)
        assert g not in self._kept

    monkeypatch.setattr(StoreAdamW, "keep_for_update", keep)
    monkeypatch.setattr(StoreAdamW, "update_group", update)
    model = build(llama_config())
    mt.init(offload_dir=None, max_vram_gb=f"{weight_bytes(model)}B", device="cpu")
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                             gradient_accumulation_steps=accumulate, save_steps=0, logging_steps=1,
                             report_to=[], disable_tqdm=True, max_grad_norm=clip)
    tr = mt.Trainer(model=model, args=args, train_dataset=dataset)
    try:
        tr.train()
        groups = len(tr._engine.groups)
        stats = tr.store.stats()
    finally:
        tr.close()
    assert len(at_update) == 2 * groups
    if kept:  # every group, once a step (the last micro-batch's backward only), each with its weights
        assert sorted(g for g, _ in calls) == sorted(2 * list(range(groups))) and all(n > 0 for _, n in calls)
        assert all(at_update)
    else:
        assert calls == [] and not any(at_update)
    assert stats["bytes_copied_on_write"] == 0
