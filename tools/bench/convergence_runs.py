"""The convergence record: one JSON line per finished ``tools.bench.convergence`` run.

The file (``docs/convergence/runs.jsonl`` in the repository) only grows: a run is appended
when it ends, and a run whose *key* is already in the file is not run again, so a grid too long
for one sitting fills in over several invocations, and ``--max-minutes`` may stop any of them.
The key is everything that decides a run's numbers: the specs of the m and v codecs the
requested codec resolves to (a changed codec format is a new key, never a stale match; two
requests that resolve to the same specs are the same run), the model's size, the learning rate,
the seed, steps, batch and sequence length. The requested name, the commit and the machine are
recorded with each run but are not part of the key; the reports group runs by ``labels``.

Each line is appended with one ``write`` of the whole line and flushed before the next run
starts; a line cut short by a crash is skipped on reading (and reported), never fatal.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from collections.abc import Iterable
from typing import Any

from tierstore.errors import CodecError

#: where the repository keeps the record
DEFAULT_PATH = os.path.join("docs", "convergence", "runs.jsonl")
#: the fields of a record that make up its key
KEY_FIELDS = ("codec_specs", "hidden", "layers", "lr", "seed", "steps", "batch", "seq")
#: the shape a policy-resolved codec spec is recorded for (a 2-D weight the policy quantizes)
SPEC_SHAPE = (256, 256)


def codec_specs(requested: str | None) -> dict[str, Any]:
    """``{"m": spec, "v": spec}`` of the codecs a run requesting ``requested`` stores 2-D moments
    with (``{}`` for fp32)."""
    if requested is None:
        return {}
    from tools.bench.moments import moment_codec_pair

    pair = moment_codec_pair(requested, SPEC_SHAPE)
    assert pair is not None, "a 256x256 tensor is always quantized under a lossy request"
    return {"m": pair[0].spec(), "v": pair[1].spec()}


def label(record: dict[str, Any]) -> str:
    """The name a record is reported under: its requested codec, or, where that request now
    resolves to other codec specs (the policy's coding of the name changed since the run), the
    request followed by the recorded parameters that differ, e.g. ``q4 (m rounding=stochastic,
    signed_map=-)`` (``-``: absent). A request that no longer resolves keeps its name."""
    codec = record["codec"]
    now, then = _resolved(codec), record.get("codec_specs", {})
    if now is None or now == then:
        return codec
    diffs = []
    for role in sorted(set(now) | set(then)):
        old, new = then.get(role, {}), now.get(role, {})
        keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        if keys:
            diffs.append(f"{role} " + ", ".join(f"{k}={_plain(old.get(k, '-'))}" for k in keys))
    return f"{codec} ({'; '.join(diffs)})"


def _resolved(codec: str) -> dict[str, Any] | None:
    """What ``codec`` resolves to now (remembered in ``_CURRENT``); None if it no longer does."""
    if codec not in _CURRENT:
        try:
            _CURRENT[codec] = codec_specs(None if codec == "fp32" else codec)
        except (ValueError, CodecError):
            _CURRENT[codec] = None
    return _CURRENT[codec]


def _plain(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def labels(records: list[dict[str, Any]]) -> list[str]:
    """``label`` of each record, except that a record whose specs are what a recorded request
    resolves to now is reported under that request (the shortest one): the same coding recorded
    under an explicit request and under the policy's short name is one row."""
    names = [label(r) for r in records]
    # the records' requests and the policy's names they were made under ("q4" of
    # "q4:dither/stochastic"), by what each resolves to now: runs of a coding the policy has
    # since adopted are reported under its name
    requests = {r["codec"] for r in records} | {r["codec"].partition(":")[0] for r in records}
    by_specs: dict[str, str] = {}
    for name in sorted(requests):
        now = _resolved(name)
        if now is not None:
            k = json.dumps(now, sort_keys=True)
            if k not in by_specs or len(name) < len(by_specs[k]):
                by_specs[k] = name
    return [by_specs.get(json.dumps(r.get("codec_specs", {}), sort_keys=True), name)
            for r, name in zip(records, names, strict=True)]


#: request -> the codec specs it resolves to in this process (None: it no longer resolves)
_CURRENT: dict[str, dict[str, Any] | None] = {}


def run_key(record: dict[str, Any]) -> str:
    """The key of a run (a JSON string of ``KEY_FIELDS``; lr as a float, so 1e-3 == 0.001)."""
    parts = {k: record.get(k) for k in KEY_FIELDS}
    parts["lr"] = float(parts["lr"]) if parts["lr"] is not None else None
    return json.dumps(parts, sort_keys=True)


def load(path: str) -> list[dict[str, Any]]:
    """The records in ``path`` (none when it does not exist); torn or foreign lines are skipped."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                print(f"{path}:{n}: not a whole JSON line (a run cut short?), skipped")
                continue
            if isinstance(record, dict):
                out.append(record)
    return out


def done_keys(records: Iterable[dict[str, Any]]) -> set[str]:
    """The keys of the finished runs among ``records``."""
    return {run_key(r) for r in records if all(k in r for k in KEY_FIELDS)}


def append(path: str, record: dict[str, Any]) -> None:
    """Append one record as one line, flushed and fsynced (the next run may be killed)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    line = json.dumps(record, sort_keys=True) + "\n"
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def source_commit() -> str:
    """The checkout's commit (12 hex digits), ``+dirty`` when tracked code differs from it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        # the record itself and the docs change between runs; only code makes a run differ
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                "tierstore", "trainer", "tools"], cwd=root, check=True,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine() -> str:
    """A short description of where a run ran: CPU count, torch threads, architecture."""
    import torch

    return f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, {platform.machine()}"


def rounded_curve(losses: list[float]) -> list[float]:
    """The loss curve at 4 decimals (what the PNG needs; keeps a 300-step line near 3 KB)."""
    return [round(x, 4) for x in losses]


def estimate_seconds(records: list[dict[str, Any]], hidden: int, layers: int, codec: str,
                     steps: int) -> float | None:
    """A finished run's wall time for the same size and codec kind, scaled to ``steps``; None
    when there is none. fp32 and coded runs differ, so only the same requested codec counts."""
    same = [r for r in records if r.get("hidden") == hidden and r.get("layers") == layers
            and r.get("codec") == codec and r.get("steps") and r.get("seconds")]
    if not same:
        return None
    return max(r["seconds"] / r["steps"] for r in same) * steps


#: the fewest seeds a row's mean gap is given a standard error for
MIN_SEEDS_FOR_SE = 3


def standard_error(xs: list[float]) -> float:
    """The standard error of the mean of ``xs``: their sample standard deviation (n - 1) over
    the square root of their count; needs two or more."""
    n = len(xs)
    mean = sum(xs) / n
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1) / n)


def _fmt_gap(gaps: list[float]) -> str:
    """``mean`` for one seed, ``mean (min..max)`` for two, ``mean ± se (min..max)`` from three
    on; the standard error in percentage points, like the gaps."""
    mean = sum(gaps) / len(gaps)
    if len(gaps) == 1:
        return f"{mean:+.2%}"
    se = f" ± {standard_error(gaps) * 100:.2f}" if len(gaps) >= MIN_SEEDS_FOR_SE else ""
    return f"{mean:+.2%}{se} ({min(gaps):+.2%}..{max(gaps):+.2%})"


def markdown(records: list[dict[str, Any]], steps: int) -> str:
    """One table row per (size, lr, codec) over the runs of ``steps`` steps: seeds, mean losses,
    the paired gap to the same seeds' fp32 runs (mean, its standard error from
    ``MIN_SEEDS_FOR_SE`` seeds on, min..max), CPU seconds per run."""
    runs = [r for r in records if r.get("steps") == steps]
    cells: dict[tuple[int, str, float], dict[str, dict[int, dict[str, Any]]]] = {}
    for r, name in zip(runs, labels(runs), strict=True):
        cell = cells.setdefault((r.get("params", 0), r["size"], float(r["lr"])), {})
        cell.setdefault(name, {})[r["seed"]] = r  # a rerun of a key: the later line wins
    lines = ["| size | lr | run | seeds | train | vs fp32 | held-out | vs fp32 | CPU s/run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (_, size, lr), by_codec in sorted(cells.items()):
        base = by_codec.get("fp32", {})
        for codec, seeds in sorted(by_codec.items(), key=lambda kv: (kv[0] != "fp32", kv[0])):
            rs = [seeds[s] for s in sorted(seeds)]
            row = [size, f"{lr:g}", codec, ",".join(str(s) for s in sorted(seeds))]
            for key in ("train", "held-out"):
                row.append(f"{sum(r[key] for r in rs) / len(rs):.4f}")
                if codec == "fp32":
                    row.append("")
                    continue
                gaps = [(r[key] - base[s][key]) / base[s][key] for s, r in sorted(seeds.items())
                        if s in base]
                row.append(_fmt_gap(gaps) if gaps else "no fp32 run")
            cpu = [r.get("cpu_seconds", math.nan) for r in rs]
            row.append(f"{sum(cpu) / len(cpu):.0f}")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
