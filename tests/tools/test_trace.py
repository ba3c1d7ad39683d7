"""trace draws a timeline PNG from a store's Chrome trace and writes the trace next to it."""

from __future__ import annotations

import json

import matplotlib.image
import torch

import tierstore
from tools.cli.timeline import lanes_of, load_trace, spans_of


def _run_dir(tmp_path) -> str:
    run = tmp_path / "run"
    run.mkdir()
    with tierstore.open(run / "store", mode="w", ram_budget="1MiB", chunk_bytes="64KiB",
                        device="cpu") as s:
        for i in range(4):
            s.put(f"w{i}", torch.randn(128, 256))
        s.commit()
        for i in range(4):
            s.get(f"w{i}")
        (run / "trace.json").write_text(s.chrome_trace())
    return str(run)


def test_trace_of_a_store_workload(cli, tmp_path) -> None:
    run = _run_dir(tmp_path)
    events = load_trace(f"{run}/trace.json")
    lanes = lanes_of(spans_of(events))
    assert any(lane.endswith("· disk") for lane in lanes) and any(lane.endswith("· store") for lane in lanes)
    code, out, err = cli("trace", run, "--out", str(tmp_path / "pics" / "timeline.png"))
    assert code == 0, err
    img = matplotlib.image.imread(tmp_path / "pics" / "timeline.png")
    assert img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 500
    assert img[..., :3].std() > 0.05  # not a blank canvas
    copy = json.loads((tmp_path / "pics" / "timeline.json").read_text())
    assert copy["traceEvents"] == events
    for lane in lanes:
        assert lane in out
    n_writes = sum(1 for e in events if e["name"] == "write")
    assert n_writes >= 4 * 2  # every chunk write is a span (2 chunks per tensor)


def test_begin_end_pairs_and_default_out(cli, tmp_path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    events = [
        {"name": "forward", "cat": "compute", "ph": "B", "ts": 0, "pid": 0, "tid": "main"},
        {"name": "forward", "cat": "compute", "ph": "E", "ts": 1500, "pid": 0, "tid": "main"},
        {"name": "read", "cat": "disk", "ph": "X", "ts": 200, "dur": 300, "pid": 0, "tid": "io"},
        {"name": "counter", "ph": "C", "ts": 5, "args": {"x": 1}},
    ]
    (run / "trace.json").write_text(json.dumps(events))  # the bare-array form
    spans = spans_of(load_trace(str(run / "trace.json")))
    assert [(s.name, s.start, s.dur) for s in spans] == [("forward", 0.0, 1500.0), ("read", 200.0, 300.0)]
    code, out, _ = cli("trace", str(run))
    assert code == 0
    assert (run / "timeline.png").is_file() and (run / "timeline.json").is_file()
    assert "main · compute" in out and "io · disk" in out


def test_trace_errors(cli, tmp_path) -> None:
    code, _, err = cli("trace", str(tmp_path / "none"))
    assert code == 2 and "no such file or folder" in err
    (tmp_path / "empty").mkdir()
    code, _, err = cli("trace", str(tmp_path / "empty"))
    assert code == 2 and "holds no trace.json" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    code, _, err = cli("trace", str(bad))
    assert code == 1 and "not valid UTF-8 JSON" in err
    bad.write_text(json.dumps({"traceEvents": []}))
    code, _, err = cli("trace", str(bad))
    assert code == 2 and "no spans" in err


def test_one_step_is_cut_out(cli, tmp_path) -> None:
    run = tmp_path / "steps"
    run.mkdir()
    events = [
        {"name": "step", "cat": "compute", "ph": "X", "ts": 0, "dur": 1000, "pid": 0, "tid": "main",
         "args": {"step": 1}},
        {"name": "step", "cat": "compute", "ph": "X", "ts": 1000, "dur": 2000, "pid": 0, "tid": "main",
         "args": {"step": 2}},
        {"name": "read", "cat": "disk", "ph": "X", "ts": 900, "dur": 300, "pid": 0, "tid": "io"},
        {"name": "write", "cat": "disk", "ph": "X", "ts": 100, "dur": 50, "pid": 0, "tid": "io"},
    ]
    (run / "trace.json").write_text(json.dumps(events))
    code, out, err = cli("trace", str(run), "--step", "2")
    assert code == 0, err
    # step 2's span and the part of the read inside it: 2,000 us of compute, 200 us of disk
    busy = {line.split("  ")[0]: line.split()[-5:] for line in out.splitlines() if "busy" in line}
    assert busy == {"main · compute": ["1", "spans", "2.0", "ms", "busy"],
                    "io · disk": ["1", "spans", "0.2", "ms", "busy"]}
    code, _, err = cli("trace", str(run), "--step", "7")
    assert code == 2 and "no span of step 7" in err and "[1, 2]" in err
