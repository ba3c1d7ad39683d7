"""The access predictor and the tracer stay within a fixed size whatever the caller does."""

from __future__ import annotations

import asyncio

import pytest
import torch

import tierstore
from tierstore import prefetch
from tierstore.prefetch import AccessPredictor
from tierstore.stats import Tracer


def test_a_million_reads_without_mark_step_keep_the_trace_bounded() -> None:
    p = AccessPredictor(ahead=4)
    keys = [f"layers.{i}.weight" for i in range(100)]
    for i in range(1_000_000):
        p.record(keys[i % 100])
    assert len(p._current) == prefetch.MAX_STEP_READS
    assert len(p._reads_this_step) <= 100
    assert p.dropped == 1_000_000 - prefetch.MAX_STEP_READS
    p.mark_step()  # the truncated step still teaches the order
    assert p.record(keys[0]) == keys[1:5]
    assert len(p._last) == prefetch.MAX_STEP_READS and len(p._current) == 1


def test_gets_without_mark_step_keep_the_stores_trace_and_predictor_bounded(tmp_path, monkeypatch) -> None:
    """Through the store (the cap lowered: a million gets take minutes on a busy machine)."""
    monkeypatch.setattr(prefetch, "MAX_STEP_READS", 500)

    async def main() -> None:
        s = await tierstore.open_async(tmp_path / "s", "w", ram_budget="1MiB",
                                       device_budget="1MiB", device="cpu", trace_events=300)
        try:
            for i in range(8):
                await s.put(f"k{i}", torch.full((4,), float(i)))
            for i in range(2000):
                await s.get(f"k{i % 8}")
            assert len(s._predictor._current) == 500
            assert len(s.tracer.events()) == 300
            st = s.stats()
            assert st["predictor_dropped_reads"] == 1500
            assert st["trace_dropped_events"] >= 2000 - 300  # a span per get, and the puts'
            s.mark_step()
            for i in range(16):
                await s.get(f"k{i % 8}")
            assert s.stats()["prediction_accuracy"] == 15 / 16  # all but the first read
        finally:
            await s.close()

    asyncio.run(main())


def test_the_tracer_is_small_by_default_and_can_be_turned_off(tmp_path) -> None:
    assert tierstore.StoreConfig().trace_events == Tracer().max_events <= 20_000
    t = Tracer(max_events=0)
    t.span("x", "y", 0.0, 1.0)
    assert t.events() == [] and t.dropped == 0  # off: nothing recorded, nothing dropped
    with tierstore.open(tmp_path / "s", "w", trace_events=0, ram_budget="1MiB") as s:
        s.put("a", torch.ones(3))
        s.get("a")
        assert '"traceEvents": []' in s.chrome_trace()


def test_a_kept_span_costs_about_200_bytes() -> None:
    """The trace's spans are the first thing a long run's memory grows by; kept as tuples, the
    default 10,000 cost about 2 MiB (as Chrome-trace dicts they cost 4.5 MiB)."""
    import tracemalloc

    t = Tracer(max_events=5000)
    key = "model.layers.0.mlp.up_proj.weight"
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(5000):
            t.span("get", "store", float(i), i + 0.5, key=key)
        per_span = (tracemalloc.get_traced_memory()[0] - before) / 5000
    finally:
        tracemalloc.stop()
    assert per_span < 260, per_span
    ev = t.events()[1]
    assert ev["name"] == "get" and ev["ph"] == "X" and ev["args"] == {"key": key}
    assert ev["dur"] == pytest.approx(0.5e6) and ev["ts"] == pytest.approx((1.0 - t._t0) * 1e6)
