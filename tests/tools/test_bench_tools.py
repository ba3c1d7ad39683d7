"""Smoke tests of the codec benchmarks: they run end to end and their numbers make sense."""

from __future__ import annotations

import os
import re

import pytest
import torch

from tierstore import codecs
from tierstore.codecs.policy import choose_codec
from tools.bench import codecs as bench_codecs
from tools.bench import convergence as bench_convergence
from tools.bench import convergence_runs, moment_stats, moments
from tools.bench.moments import tiny_model


def _rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 9 and parts[-1].replace(".", "", 1).isdigit():
            rows[" ".join(parts[:-8])] = parts[-8:]
    return rows



def test_round_trip_states_takes_m_and_v_roundings_apart() -> None:
    """``q2:calibrated/stochastic``: m through the calibrated codec, v through the stochastic one."""
    torch.manual_seed(0)
    model = tiny_model(hidden=64, layers=1)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 256, (2, 16))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    p = max(opt.state, key=lambda q: q.numel())
    m, v = opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()
    bench_convergence.round_trip_states(opt, "q2:calibrated/stochastic")
    want = [codecs.get("q2", **{**choose_codec("q2", tuple(m.shape), role).params(), "rounding": r})
            for role, r in (("exp_avg", "calibrated"), ("exp_avg_sq", "stochastic"))]
    for t, got, codec in ((m, opt.state[p]["exp_avg"], want[0]), (v, opt.state[p]["exp_avg_sq"], want[1])):
        ref = codec.decode(memoryview(codec.encode(t).numpy()), tuple(t.shape), t.dtype)
        assert torch.equal(got, ref)
    assert float(opt.state[p]["exp_avg"].norm() / m.norm()) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.slow
def test_bench_codecs_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_codecs.main(["--steps", "2", "--hidden", "64", "--layers", "1",
                              "--chunk-mib", "0.5", "--repeats", "1", "--compile", "never"]) == 0
    rows = _rows(capsys.readouterr().out)
    ratio, m_err, v_err, zeroed, _, syn_m, syn_v, _ = rows["raw"]
    assert (ratio, m_err, v_err, syn_m, syn_v) == ("1.00", "0.0000", "0.0000", "0.0000", "0.0000")
    for name, bits in (("q8", 8), ("q4", 4), ("q2", 2)):
        ratio, m_err, v_err, zeroed, *_ = rows[f"{name} (m signed, v unsigned)"]
        assert float(zeroed) == 0.0
        assert 32 / (bits + 1) < float(ratio) <= 32 / bits
    assert float(rows["q8 (m signed, v unsigned)"][1]) < 0.02
    assert float(rows["q4 signed v (ablation)"][3]) > 0  # the zero-point problem, shown


def test_round_trip_states_matches_codec() -> None:
    model = tiny_model(hidden=64, layers=1)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 256, (2, 16))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    before = {id(p): (s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for p, s in opt.state.items()}
    quantized, total = bench_convergence.round_trip_states(opt, "q8")
    assert 0 < quantized < total
    for p, s in opt.state.items():
        m, v = before[id(p)]
        if p.dim() >= 2 and p.numel() >= 4096:
            assert not torch.equal(s["exp_avg"], m)
            assert float((s["exp_avg"] - m).norm() / m.norm()) < 0.02
            assert bool((s["exp_avg_sq"][v > 0] > 0).all())
        else:  # the policy keeps small and 1-D tensors exact
            assert torch.equal(s["exp_avg"], m) and torch.equal(s["exp_avg_sq"], v)


@pytest.mark.slow
def test_bench_convergence_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_convergence.main(["--steps", "6", "--hidden", "64", "--layers", "1",
                                   "--batch", "2", "--seq", "32", "--codecs", "q8",
                                   "--seeds", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum("seed" in ln and "train" in ln for ln in lines) == 4  # 2 seeds x (fp32, q8)
    fp32 = next(ln for ln in lines if ln.split()[:1] == ["fp32"] and "%" in ln).split()
    q8 = next(ln for ln in lines if ln.split()[:1] == ["q8"] and "%" in ln).split()
    assert float(fp32[1]) == 0.0 and 0 < float(q8[1]) < 1
    assert fp32[3] == "+0.00%"  # fp32 against itself, per seed
    assert abs(float(q8[2]) - float(fp32[2])) / float(fp32[2]) < 0.05


def test_parse_sizes() -> None:
    assert bench_convergence.parse_sizes("128x4, 256x2") == [(128, 4), (256, 2)]
    for bad in ("128", "0x4", "ax4", "128x"):
        with pytest.raises(ValueError, match="HIDDENxLAYERS"):
            bench_convergence.parse_sizes(bad)


@pytest.mark.slow
def test_bench_convergence_grid_png(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # noqa: ANN001
    png, runs = tmp_path / "curves.png", tmp_path / "runs.jsonl"
    assert bench_convergence.main(["--steps", "4", "--sizes", "32x1,48x1", "--lrs", "1e-3,3e-3",
                                   "--batch", "2", "--seq", "16", "--codecs", "q8",
                                   "--seeds", "1", "--png", str(png),
                                   "--runs-jsonl", str(runs)]) == 0
    out = capsys.readouterr().out
    assert out.count("model: ") == 4  # 2 sizes x 2 learning rates
    assert "worst cell per codec" in out and "worst seed 0" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(runs.read_text().splitlines()) == 8  # 4 cells x (fp32, q8)
    # the same tables again from the saved runs, without training; a cut-short run is dropped
    with runs.open("a") as f:
        f.write(runs.read_text().splitlines()[-1].replace('"seed": 0', '"seed": 7') + "\n")
    png.unlink()
    assert bench_convergence.main(["--from-jsonl", str(runs), "--png", str(png)]) == 0
    again = capsys.readouterr().out
    def table_rows(text: str) -> list[str]:
        return [ln for ln in text.splitlines() if ln.split()[:1] in (["fp32"], ["q8"])]
    # 4 cells x (fp32, q8) table rows, then the worst-cell lines (train, held-out)
    assert len(table_rows(out)) == 10 and table_rows(out) == table_rows(again)
    assert png.exists()


def test_moment_stats_orders_codecs() -> None:
    stats = moment_stats.collect(["q8:stochastic", "q2:stochastic", "q2:stochastic:v"], steps=5,
                                 hidden=64, layers=1, batch=2, seq=32, lr=1e-3, seed=0)
    q8, q2, q2v = (moment_stats.summarize(stats[c]) for c in ("q8:stochastic", "q2:stochastic",
                                                                "q2:stochastic:v"))
    assert abs(q8["ratio"] - 1) < 0.01 and q8["cos"] > 0.99 and q8["m_err"] < 0.05
    assert q2["cos"] < q8["cos"] and q2["m_err"] > 5 * q8["m_err"]
    assert q2v["m_err"] < 1e-5  # only v coded: m is exact (up to the order of operations)


def test_moment_stats_error_feedback_shortens_the_update_and_counts_its_bits() -> None:
    """The residual carried exactly (``+ef=raw``) stops q4's rounding noise from accumulating in m
    (past the first steps, where m grows and each step's noise is its own): the update is closer
    to fp32's length than without it and m's error stops growing; read with m
    (``ef_update=sum``), m is fp32's own; and the residual's bits are counted."""
    reqs = ["q4", "q4+ef=raw", "q4+ef=raw+ef_update=sum"]
    stats = moment_stats.collect(reqs, steps=10, hidden=64, layers=1, batch=2, seq=32, lr=1e-3, seed=0)
    plain, ef, ef_sum = (moment_stats.summarize(stats[c]) for c in reqs)
    assert abs(ef["ratio"] - 1) < abs(plain["ratio"] - 1)
    assert ef["m_err"] < plain["m_err"] and abs(ef["drift"]) < abs(plain["drift"])
    assert ef_sum["m_err"] < 1e-5  # (the ratio is v's alone)
    assert moments.request_bits("q4") == pytest.approx(8.5)  # 4 + 32/128 bits each for m and v
    assert moments.request_bits("q4+ef=q2") == pytest.approx(8.5 + 2.5)  # q2: 2 + 32/64
    assert moments.request_bits("q4+ef=raw") == pytest.approx(8.5 + 32)
    assert moments.request_bits("q4+m=q5") == pytest.approx(9.5)


def test_moment_codec_pair_error_feedback_grammar() -> None:
    m, v, ef = moments.moment_codec_pair("q4+ef=q3:nearest", (256, 256), with_ef=True)
    assert (m.name, v.name, ef[0].name, ef[0].rounding, ef[1]) == ("q4", "q4", "q3", "nearest", "m")
    assert moments.moment_codec_pair("q4", (256, 256), with_ef=True)[2] is None
    with pytest.raises(ValueError, match="'q7'"):
        moments.moment_codec_pair("q4+ef=q7", (256, 256), with_ef=True)
    with pytest.raises(ValueError, match="'zstd'"):
        moments.moment_codec_pair("q4+ef=zstd", (256, 256), with_ef=True)
    with pytest.raises(ValueError, match="ef_update 'both'"):
        moments.moment_codec_pair("q4+ef=q2+ef_update=both", (256, 256), with_ef=True)
    # callers that cannot run error feedback (convergence) refuse it rather than drop it
    with pytest.raises(ValueError, match="error feedback"):
        moments.moment_codec_pair("q4+ef=q2", (256, 256))
    with pytest.raises(SystemExit):
        moment_stats.main(["--codecs", "q4+ef=q9", "--steps", "2"])


def test_bench_generate_runs_and_every_run_agrees_with_transformers(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from tools.bench import generate as bench_generate

    argv = ["--rounds", "1", "--new", "3", "--big-batch", "4", "--hidden", "64", "--intermediate", "96",
            "--layers", "3", "--heads", "4", "--prompt", "5", "--dir", str(tmp_path)]
    assert bench_generate.main(argv) == 0  # 1 when any run's tokens differ from the in-memory ones
    out = capsys.readouterr().out
    for run in ("transformers in memory", "accelerate disk_offload", "mt.generate, window 2 layers"):
        assert run in out
    assert out.count(" yes") == 5
    assert "goal batch 4 >= 10x batch 1 throughput" in out


def test_bench_optimizer_measures_the_same_update_on_both_sides(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from tools.bench import optimizer as bench_optimizer

    # exit 0 only when the store's weights equal torch's fused AdamW's after the same steps
    assert bench_optimizer.main(["--params-m", "1", "--tensors", "2", "--repeats", "2", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "equal on both sides: yes" in out
    store_row = next(line for line in out.splitlines() if line.startswith("store: StoreAdamW"))
    math_s, store_s, faults, read_mib, written_mib = (float(x) for x in store_row.split()[4:9])
    assert store_s >= 0 and math_s >= 0  # the split of the store's step (a tiny state: well under 1 ms)
    # the state fits the budget: updated in place, no disk traffic in a step
    assert read_mib == 0 and written_mib == 0
    assert "the minimum is 0" in out


def test_bench_optimizer_at_half_the_budget_reports_bytes_against_the_minimum(tmp_path, capsys) -> None:  # noqa: ANN001
    from tools.bench import optimizer as bench_optimizer

    argv = ["--params-m", "1", "--tensors", "4", "--repeats", "2", "--ram-fraction", "0.5", "--dir", str(tmp_path)]
    assert bench_optimizer.main(argv) == 0
    out = capsys.readouterr().out
    assert "equal on both sides: yes" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("disk per step"))
    assert "the minimum with this budget" in line and "the step's floor" in out
    if os.path.isdir("/proc/self/task"):  # each side's CPU a step by thread (10 ms ticks: at
        # this size a thread may show none)
        for side in ("in memory", "store"):
            assert any(re.match(rf"{side}: \d+\.\d{{3}} core-s a step \(\d+\.\d of \d+ cores", ln)
                       for ln in out.splitlines()), side


def test_bench_optimizer_cpu_line_means_steps_and_orders_threads_by_cpu() -> None:
    from tools.bench.optimizer import cpu_line

    steps = [{"MainThread": (0.04, 3), "tierstore-io": (0.20, 9), "idle": (0.0, 1)},
             {"MainThread": (0.06, 2), "tierstore-io": (0.24, 8), "idle": (0.0, 0)}]
    line = cpu_line(steps, 0.25)
    assert line.startswith("0.270 core-s a step (1.1 of ")  # (0.05 + 0.22) over 0.25 s
    assert line.index("tierstore-io 0.220") < line.index("MainThread 0.050")
    assert "idle" not in line  # a thread that used no CPU is not listed
    assert cpu_line([], 0.25) == "" and cpu_line([{}], 0.25) == ""


def test_check_generate_agrees_and_finds_a_difference(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.harness import check_generate

    argv = ["--device", "cpu", "--new", "3", "--hidden", "64", "--intermediate", "96", "--layers", "2",
            "--heads", "4", "--prompt", "5", "--batch", "2"]
    assert check_generate.main(argv) == 0
    assert "2 of 2 rows equal" in capsys.readouterr().out
    ref = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    out = ref.clone()
    out[1, 3] = 9
    assert check_generate.first_difference(out, ref, 2) == [None, 3]


def test_runs_record_appends_and_skips(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # noqa: ANN001
    """Every finished run is appended with its key fields; a second invocation runs only what is
    missing, --max-minutes stops before a run, and the markdown table comes from the record."""
    runs = tmp_path / "runs.jsonl"
    tiny = ["--steps", "3", "--sizes", "32x1", "--batch", "2", "--seq", "16", "--codecs", "q8",
            "--runs-jsonl", str(runs)]
    assert bench_convergence.main([*tiny, "--seeds", "1"]) == 0
    first = convergence_runs.load(str(runs))
    assert [r["codec"] for r in first] == ["fp32", "q8"]
    for r in first:
        assert {"commit", "codec_specs", "lr", "seed", "steps", "train", "held-out", "curve",
                "machine", "cpu_seconds"} <= set(r)
        assert len(r["curve"]) == 3
    assert first[1]["codec_specs"]["m"]["name"] == "q8" and first[0]["codec_specs"] == {}
    assert first[1]["codec_specs"]["v"]["signed"] is False
    capsys.readouterr()
    assert bench_convergence.main([*tiny, "--seeds", "2"]) == 0  # seed 0 is in the record
    out = capsys.readouterr().out
    assert out.count(f"in {runs}") == 2
    again = convergence_runs.load(str(runs))
    assert again[:2] == first and [(r["seed"], r["codec"]) for r in again[2:]] == [(1, "fp32"), (1, "q8")]
    # a changed codec spec is a new key, never a stale match
    assert bench_convergence.main([*tiny, "--seeds", "1", "--codecs", "q8:nearest",
                                   "--max-minutes", "0"]) == 0
    assert "--max-minutes 0: stopping before seed 0 q8:nearest" in capsys.readouterr().out
    assert len(convergence_runs.load(str(runs))) == 4
    with runs.open("a") as f:  # a line torn by a crash is skipped, not fatal
        f.write('{"codec": "q8", "tr')
    assert len(convergence_runs.load(str(runs))) == 4
    md = tmp_path / "README.md"
    assert bench_convergence.main(["--from-jsonl", str(runs), "--steps", "3", "--markdown", str(md)]) == 0
    rows = [ln for ln in md.read_text().splitlines() if ln.startswith("| 0.")]
    assert [ln.split(" | ")[2:4] for ln in rows] == [["fp32", "0,1"], ["q8", "0,1"]]
    assert "%" in rows[1] and "(" in rows[1]  # mean gap with its range over the two seeds


def test_runs_markdown_gives_the_standard_error_from_three_seeds() -> None:
    """A row over three or more seeds reads ``mean ± standard error (min..max)`` of its paired
    gaps (the error in percentage points); a row over two seeds has no standard error."""
    q8 = convergence_runs.codec_specs("q8")

    def run(codec: str, seed: int, train: float, held: float) -> dict:
        return {"codec": codec, "codec_specs": q8 if codec == "q8" else {}, "size": "0.01M (8x1)",
                "params": 10_000, "lr": 1e-3, "seed": seed, "steps": 3, "train": train,
                "held-out": held, "cpu_seconds": 1.0}

    # train gaps -1%, 0%, +2%: mean +0.33%, sd 1.528 points, se 0.882; held-out gaps +1%, +1%, +4%
    records = [run("fp32", s, 2.0, 4.0) for s in range(3)]
    records += [run("q8", 0, 1.98, 4.04), run("q8", 1, 2.00, 4.04), run("q8", 2, 2.04, 4.16)]
    table = convergence_runs.markdown(records, 3)
    assert table == convergence_runs.markdown(list(records), 3)  # deterministic
    row = next(ln for ln in table.splitlines() if "| q8 |" in ln).split(" | ")
    assert row[3:] == ["0,1,2", "2.0067", "+0.33% ± 0.88 (-1.00%..+2.00%)", "4.0800",
                       "+2.00% ± 1.00 (+1.00%..+4.00%)", "1 |"]
    assert convergence_runs.standard_error([-0.01, 0.0, 0.02]) == pytest.approx(0.0088192, rel=1e-4)
    two = convergence_runs.markdown([r for r in records if r["seed"] < 2], 3)
    row = next(ln for ln in two.splitlines() if "| q8 |" in ln).split(" | ")
    assert row[5] == "-0.50% (-1.00%..+0.00%)" and "±" not in two


def test_runs_record_labels_follow_the_codec_specs() -> None:
    """A request whose coding changed since its run is reported with the recorded parameters
    that differ; the same specs under an explicit request and a short name are one run."""
    q4 = convergence_runs.codec_specs("q4")
    explicit = "q4:dither/stochastic+signed_map=sqrt"
    assert convergence_runs.codec_specs(explicit) == q4
    older = {**q4, "m": {**q4["m"], "rounding": "nearest", "signed_map": "de"}}
    records = [{"codec": "q4", "codec_specs": q4}, {"codec": explicit, "codec_specs": q4},
               {"codec": "q4", "codec_specs": older}, {"codec": "fp32", "codec_specs": {}}]
    assert convergence_runs.labels(records) == [
        "q4", "q4", "q4 (m rounding=nearest, signed_map=de)", "fp32"]
    # a coding recorded under an explicit request, adopted by the policy since: reported as "q4"
    convergence_runs._CURRENT.clear()
    assert convergence_runs.labels([{"codec": explicit, "codec_specs": q4}]) == ["q4"]
    head = {"hidden": 8, "layers": 1, "lr": 1e-3, "seed": 0, "steps": 3, "batch": 2, "seq": 16}
    assert convergence_runs.run_key({**records[0], **head}) == convergence_runs.run_key({**records[1], **head})
    assert convergence_runs.run_key({**records[0], **head}) != convergence_runs.run_key({**records[2], **head})


def test_bench_scale_times_methods_that_exist() -> None:
    # the child wraps these by name: a renamed method would fail the 4B run after its setup
    from tools.bench.scale import timed_methods

    timed = timed_methods()
    assert {label for _, _, label in timed} >= {"fb", "fetch", "submit", "wait_all"}
    for owner, name, _ in timed:
        assert callable(getattr(owner, name, None)), f"{owner.__name__}.{name}"
