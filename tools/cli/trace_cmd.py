"""trace: draw an I/O and compute timeline (PNG) from a run's Chrome trace JSON.

    tierstore trace RUN_DIR [--out timeline.png] [--step N]

RUN_DIR holds ``trace.json`` (the trainer writes it to its output_dir; ``Store.chrome_trace()``
gives the same format), or is the trace file itself. The picture has one lane per thread and
category; the Chrome trace is also written next to it (``timeline.json`` for ``timeline.png``),
to open in Perfetto or chrome://tracing. ``--step N`` draws only the time of the trainer's step N
(its ``step`` span, global step numbering), with every span clipped to it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

from tools.cli.errors import EXIT_OK, UsageError
from tools.cli.timeline import (
    clip_spans,
    draw_timeline,
    lanes_of,
    load_trace,
    spans_of,
    step_window,
)

TRACE_NAME = "trace.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    p.add_argument("run_dir", metavar="RUN_DIR", help="a folder holding trace.json, or the file")
    p.add_argument("--out", default=None, help="the PNG to write (default RUN_DIR/timeline.png)")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="draw only the trainer's step N (its 'step' span), spans clipped to it")


def find_trace(run_dir: str) -> str:
    """The trace file of a run folder (trace.json, else the only *.json trace), or the file."""
    if os.path.isfile(run_dir):
        return run_dir
    if not os.path.isdir(run_dir):
        raise UsageError(f"{run_dir}: no such file or folder")
    path = os.path.join(run_dir, TRACE_NAME)
    if os.path.isfile(path):
        return path
    found = sorted(glob.glob(os.path.join(run_dir, "*trace*.json")))
    if len(found) == 1:
        return found[0]
    raise UsageError(f"{run_dir}: holds no {TRACE_NAME}"
                     + (f" and several traces: {found}" if found else ""))


def run(args: argparse.Namespace) -> int:
    """Draw the timeline PNG and write the Chrome trace JSON next to it."""
    src = find_trace(args.run_dir)
    folder = args.run_dir if os.path.isdir(args.run_dir) else os.path.dirname(src)
    out = args.out or os.path.join(folder, "timeline.png")
    events = load_trace(src)
    spans = spans_of(events)
    title = os.path.basename(os.path.abspath(folder))
    if args.step is not None:
        window = step_window(events, args.step)
        if window is None:
            steps = sorted({e["args"]["step"] for e in events if e.get("name") == "step"
                            and isinstance(e.get("args"), dict) and "step" in e["args"]})
            raise UsageError(f"{src}: no span of step {args.step} (steps in the trace: {steps or 'none'})")
        spans = clip_spans(spans, *window)
        title = f"{title}: step {args.step}, {(window[1] - window[0]) / 1e3:.0f} ms"
    lanes = lanes_of(spans)
    if not lanes:
        raise UsageError(f"{src}: the trace has no spans to draw")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    draw_timeline(lanes, out, title=title)
    copy = os.path.splitext(out)[0] + ".json"
    if os.path.abspath(copy) != os.path.abspath(src):
        with open(copy, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    for lane, spans in lanes.items():
        busy = sum(s.dur for s in spans) / 1e3
        print(f"{lane:40} {len(spans):7d} spans {busy:10.1f} ms busy")
    print(f"wrote {out} and {copy}")
    return EXIT_OK
