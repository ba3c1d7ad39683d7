"""Chrome-trace spans and their timeline picture: one lane per thread and category.

Reads the Chrome trace JSON written by ``Store.chrome_trace()`` (and the trainer's trace.json):
complete events (``ph: "X"``, ``ts``/``dur`` in microseconds) and begin/end pairs
(``ph: "B"``/``"E"``). Other events (counters, metadata) are ignored.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from typing import Any

from tools.cli.errors import MalformedInput


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """One timed span: what ran, on which thread, from ``start`` for ``dur`` (microseconds)."""

    name: str
    cat: str
    tid: str
    start: float
    dur: float


def load_trace(path: str) -> list[dict[str, Any]]:
    """The events of a Chrome trace file (the object form or the bare array form)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise MalformedInput(f"{path}: not valid UTF-8 JSON ({e})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise MalformedInput(f"{path}: not a Chrome trace (needs a traceEvents list of objects)")
    return events


def spans_of(events: list[dict[str, Any]]) -> list[Span]:
    """The spans of complete events and of matched begin/end pairs, by start time."""
    spans: list[Span] = []
    open_: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for ev in events:
        ph = ev.get("ph")
        try:
            ident = (str(ev.get("pid", 0)), str(ev.get("tid", 0)), str(ev.get("name", "")))
            if ph == "X":
                spans.append(Span(ident[2], str(ev.get("cat", "")), ident[1], float(ev["ts"]),
                                  float(ev.get("dur", 0.0))))
            elif ph == "B":
                open_[ident].append(ev)
            elif ph == "E" and open_[ident]:
                b = open_[ident].pop()
                spans.append(Span(ident[2], str(b.get("cat", ev.get("cat", ""))), ident[1],
                                  float(b["ts"]), float(ev["ts"]) - float(b["ts"])))
        except (KeyError, TypeError, ValueError):
            raise MalformedInput(f"trace event without a numeric ts: {ev!r:.200}") from None
    return sorted(spans, key=lambda s: s.start)


def step_window(events: list[dict[str, Any]], step: int) -> tuple[float, float] | None:
    """The (start, end) in microseconds of the trainer's ``step`` span for ``step``, if the trace has it."""
    for s in spans_of([e for e in events if e.get("name") == "step"
                       and isinstance(e.get("args"), dict) and e["args"].get("step") == step]):
        return s.start, s.start + s.dur
    return None


def clip_spans(spans: list[Span], lo: float, hi: float) -> list[Span]:
    """The parts of ``spans`` inside ``[lo, hi]`` (microseconds); spans wholly outside are dropped."""
    out = []
    for s in spans:
        a, b = max(s.start, lo), min(s.start + s.dur, hi)
        if b > a or (s.dur == 0 and lo <= s.start <= hi):
            out.append(dataclasses.replace(s, start=a, dur=max(0.0, b - a)))
    return out


def lanes_of(spans: list[Span]) -> dict[str, list[Span]]:
    """Spans grouped into lanes named ``thread · category``, sorted by lane name."""
    lanes: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        lanes[f"{s.tid} · {s.cat}" if s.cat else s.tid].append(s)
    return dict(sorted(lanes.items()))


def draw_timeline(lanes: dict[str, list[Span]], out: str, title: str = "") -> None:
    """Save a PNG of the lanes: one row each, bars coloured by category, time in ms."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render to files only
    import matplotlib.pyplot as plt

    cats = sorted({s.cat for spans in lanes.values() for s in spans})
    colours = {c: plt.get_cmap("tab10")(i % 10) for i, c in enumerate(cats)}
    t0 = min((s.start for spans in lanes.values() for s in spans), default=0.0)
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.45 * max(1, len(lanes))))
    try:
        for row, spans in enumerate(lanes.values()):
            for cat in cats:
                bars = [((s.start - t0) / 1e3, max(s.dur / 1e3, 1e-3)) for s in spans if s.cat == cat]
                if bars:
                    ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colours[cat],
                                   edgecolors="white", linewidth=0.3)
        ax.set_yticks(range(len(lanes)), list(lanes))
        ax.invert_yaxis()
        ax.set_xlabel("time (ms)")
        ax.set_title(title or "I/O and compute timeline")
        handles = [plt.Rectangle((0, 0), 1, 1, color=colours[c]) for c in cats]
        if handles:
            ax.legend(handles, [c or "(none)" for c in cats], loc="upper right", fontsize="small")
        fig.tight_layout()
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
