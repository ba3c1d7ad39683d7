"""The memory-leak harness: both loops run at tiny counts, and growth past the limit fails."""

from __future__ import annotations

import re

import pytest

from tools.harness import rss


def _figures(out: str) -> tuple[float, float, float]:
    m = re.search(r"rss after warm-up \(iteration \d+\) ([\d.]+) MiB; at the end \(iteration \d+\) ([\d.]+) MiB", out)
    g = re.search(r"growth ([+-][\d.]+) MiB", out)
    assert m and g, out
    return float(m.group(1)), float(m.group(2)), float(g.group(1))


@pytest.mark.parametrize("api", ["async", "sync"])
def test_store_mode_runs_every_kind_of_get(api: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = rss.main(["store", "--gets", "400", "--sample-every", "20", "--max-growth-mb", "10000", "-q",
                     "--api", api])
    out = capsys.readouterr().out
    before, after, growth = _figures(out)
    assert code == 0 and "flat" in out and "store 400 gets" in out
    assert before > 10 and after > 10 and growth == pytest.approx(after - before, abs=0.11)  # each figure is rounded


@pytest.mark.parametrize("budgets", ["under", "fit"])
def test_trainer_mode_trains_and_samples(capsys: pytest.CaptureFixture[str], budgets: str) -> None:
    code = rss.main(["trainer", "--steps", "3", "--sample-every", "1", "--save-steps", "2",
                     "--max-growth-mb", "10000", "-q", "--budgets", budgets])
    out = capsys.readouterr().out
    _figures(out)
    assert code == 0 and "trainer 3 steps" in out


def test_growth_past_the_limit_fails(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    log = rss.RssLog(total=100, every=10, warmup=20, quiet=True, unit="get")
    sizes = iter([100, 100, 100] + [100 + 3 * k for k in range(1, 8)])  # MiB: +21 after warm-up
    monkeypatch.setattr(rss, "rss_bytes", lambda: next(sizes) << 20)
    for i in range(1, 101):
        log.tick(i)
    monkeypatch.undo()
    assert log.baseline == (20, 100 << 20)
    assert log.report("store", max_growth_mb=5) == 1
    out = capsys.readouterr().out
    assert "growth +21.00 MiB" in out and "GROWS" in out
    assert rss.RssLog(total=5, every=1, warmup=0, quiet=True, unit="get").report("x", 5) == 1  # no samples


def test_rss_is_read_from_proc() -> None:
    assert rss.rss_bytes() > 1 << 20


def test_a_deadline_stops_the_loop_with_a_last_sample(capsys: pytest.CaptureFixture[str]) -> None:
    log = rss.RssLog(total=1000, every=10, warmup=5, quiet=True, unit="get")
    assert not any(log.tick(i) for i in range(1, 21))
    log.deadline = 0.0  # long past
    assert log.tick(23) and log.stopped_at == 23 and log.samples[-1][0] == 23
    log.report("store", max_growth_mb=10_000)
    assert "stopped by --max-minutes after iteration 23 of 1000" in capsys.readouterr().out


def test_max_minutes_stops_a_store_run(capsys: pytest.CaptureFixture[str]) -> None:
    code = rss.main(["store", "--gets", "1000000", "--sample-every", "10", "--warmup", "0",
                     "--max-minutes", "0.002", "--max-growth-mb", "10000", "-q"])
    out = capsys.readouterr().out
    assert code == 0 and "stopped by --max-minutes after iteration" in out
