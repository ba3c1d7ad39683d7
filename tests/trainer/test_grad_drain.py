"""The gradient drain: same gradients, same order, errors surfaced; training unchanged by it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from plain_reference import build, clone, llama_config, reference_train, train_streaming

import trainer.streaming as streaming
from tierstore.tiers.staging import StagingPool
from trainer.args import TrainingArguments
from trainer.grad_drain import GradDrain


def test_sync_drain_on_cpu_calls_the_sink_at_once() -> None:
    drain = GradDrain.for_groups(torch.device("cpu"), [10, 10, 10])
    assert not drain.threaded and drain.pool is None  # the CPU gets the cheap synchronous path
    got: list[Any] = []
    g = torch.randn(3, 4, dtype=torch.bfloat16)
    drain.submit(1, {"w": g}, lambda i, d: got.append((i, d, threading.current_thread())))
    assert got[0][0] == 1 and got[0][2] is threading.current_thread()
    assert got[0][1]["w"].dtype == torch.float32 and torch.equal(got[0][1]["w"], g.float())


def test_threaded_drain_keeps_order_and_values() -> None:
    drain = GradDrain(torch.device("cpu"), threaded=True)
    seen: list[tuple[int, torch.Tensor, str]] = []
    grads = [torch.randn(5, 6) for _ in range(8)]
    for i, t in enumerate(grads):
        drain.submit(i, {"w": t}, lambda g, d: seen.append((g, d["w"], threading.current_thread().name)))
    drain.flush()
    assert [s[0] for s in seen] == list(range(8))
    assert all(torch.equal(s[1], t) for s, t in zip(seen, grads, strict=True))
    assert {s[2] for s in seen} == {"trainer-grad-drain"}
    drain.close()


def test_threaded_drain_reraises_a_sink_error() -> None:
    drain = GradDrain(torch.device("cpu"), threaded=True)

    def bad(g: int, d: dict[str, torch.Tensor]) -> None:
        raise ValueError("sink broke")

    drain.submit(0, {"w": torch.ones(2)}, bad)
    with pytest.raises(RuntimeError, match="drain failed") as info:
        drain.flush()
    assert isinstance(info.value.__cause__, ValueError)
    drain.flush()  # reported once
    drain.close()


class _DoneEvent:
    def synchronize(self) -> None:
        pass


def test_staged_payload_is_unpacked_to_fp32_and_the_buffer_recycled() -> None:
    pool = StagingPool(4096, 1)
    g = torch.randn(7, 9, dtype=torch.bfloat16)
    buf = pool.acquire()
    n = g.numel() * g.element_size()
    buf[128:128 + n].copy_(g.reshape(-1).view(torch.uint8))  # what the D2H stream would have written
    out = GradDrain._finish(g.shape, g.dtype, (buf, 128, n))
    assert out.dtype == torch.float32 and torch.equal(out, g.float())
    assert out.data_ptr() != buf.data_ptr()  # the sink's tensor is its own, not the buffer


def test_drain_thread_releases_the_group_buffer_after_its_event() -> None:
    pool = StagingPool(4096, 1)
    drain = GradDrain(torch.device("cpu"), pool=pool, threaded=True)
    buf = pool.acquire()
    g = torch.randn(10)
    buf[:40].copy_(g.view(torch.uint8))
    got: list[torch.Tensor] = []
    with drain._cond:
        drain._pending += 1
    drain._q.put((3, lambda i, d: got.append(d["w"]), [("w", g.shape, g.dtype, (buf, 0, 40))], buf, _DoneEvent()))
    drain.flush()
    assert torch.equal(got[0], g)
    assert pool.try_acquire() is buf  # back in the pool once the sink had its copy
    drain.close()


def test_training_with_a_threaded_drain_matches_plain_pytorch(dataset: Any, tmp_path: Any, monkeypatch: Any) -> None:
    # The CUDA path's drain runs sinks on its own thread: force that on the CPU.
    made: list[GradDrain] = []

    def threaded(device: torch.device, group_bytes: list[int], threaded: Any = None, store: Any = None) -> GradDrain:
        made.append(GradDrain(device, threaded=True))
        return made[-1]

    monkeypatch.setattr(streaming.GradDrain, "for_groups", staticmethod(threaded))
    model = build(llama_config(3))
    ref = clone(model)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             learning_rate=2e-3, weight_decay=0.1, max_steps=3, max_grad_norm=0.0,
                             logging_steps=1, save_steps=0, disable_tqdm=True)
    tr = train_streaming(model, dataset, args, vram="1MiB", ram="8MiB")
    try:
        ref_losses = reference_train(ref, dataset, args, 3)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(tr.store.get(name), p.detach(), atol=1e-5, rtol=0, msg=name)
    finally:
        tr.close()
    assert made and made[0].threaded
    got = [e["loss"] for e in tr.state.log_history if "loss" in e]
    for a, b in zip(got, ref_losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_close_soon_frees_the_budgeted_pool_on_the_drain_thread(tmp_path: Any) -> None:
    import tierstore

    with tierstore.open(tmp_path, ram_budget="1MiB", device="cpu") as s:
        drain = GradDrain(torch.device("cpu"), pool=s.staging_pool(64 * 1024, 3), threaded=True)
        assert s.stats()["host_bytes"] == 3 * 64 * 1024
        got: list[int] = []
        for i in range(3):
            drain.submit(i, {"w": torch.ones(3)}, lambda g, d: got.append(g))
        thread = drain._thread
        drain.close_soon()  # what the engine's finalizer calls: it never waits
        assert thread is not None
        thread.join(timeout=30)
        assert not thread.is_alive() and got == [0, 1, 2]
        assert drain.pool is None and s.stats()["host_bytes"] == 0
