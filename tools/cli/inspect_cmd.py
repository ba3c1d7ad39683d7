"""inspect: list a store's tensors (shape, dtype, codec, sizes, tiers) and its commits.

    tierstore inspect STORE [--version V] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any

from tqdm import tqdm

import tierstore
from tools.cli.sizes import human_bytes
from tools.table import render_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    p.add_argument("store", metavar="STORE", help="the store folder")
    p.add_argument("--version", type=int, default=None, help="a retained commit (default: last)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead")


def dtype_str(dtype: Any) -> str:
    """``torch.float32`` -> ``float32``."""
    return str(dtype).removeprefix("torch.")


def codec_str(spec: dict[str, Any]) -> str:
    """A codec spec as ``name`` or ``name(k=v,...)``."""
    spec = dict(spec)
    name = str(spec.pop("name", "?"))
    params = spec.get("configuration", spec)
    if isinstance(params, dict) and params:
        return name + "(" + ",".join(f"{k}={v}" for k, v in sorted(params.items())) + ")"
    return name


def tensor_row(info: tierstore.TensorInfo) -> dict[str, Any]:
    """The JSON form of one ``TensorInfo``."""
    return {
        "key": info.key, "shape": list(info.shape), "dtype": dtype_str(info.dtype),
        "codec": info.codec, "nbytes": info.nbytes, "stored_nbytes": info.stored_nbytes,
        "ratio": ratio(info.nbytes, info.stored_nbytes), "generation": info.generation,
        "chunks": info.chunks, "tiers": list(info.tiers), "uncommitted": info.uncommitted,
    }


def ratio(logical: int, stored: int) -> float | None:
    """Logical over stored bytes (above 1 = compressed); None when nothing is stored."""
    return round(logical / stored, 4) if stored else None


def describe(store: tierstore.Store, version: int | None, quiet: bool = False) -> dict[str, Any]:
    """Everything ``inspect`` reports, as one JSON-ready dict."""
    keys = store.keys()
    tensors = [tensor_row(store.info(k))
               for k in tqdm(keys, desc="inspect", unit="key", file=sys.stderr,
                             disable=quiet or len(keys) < 1000, leave=False)]
    commits = store.versions()
    opened = version if version is not None else (commits[-1].version if commits else None)
    logical = sum(t["nbytes"] for t in tensors)
    stored = sum(t["stored_nbytes"] for t in tensors)
    return {
        "store": store.path, "version": opened,
        "tensors": tensors,
        "totals": {"tensors": len(tensors), "nbytes": logical, "stored_nbytes": stored,
                   "ratio": ratio(logical, stored)},
        "commits": [{"version": c.version, "step": c.step, "time": c.time, "message": c.message,
                     "tensors": len(c.generations)} for c in commits],
    }


def format_report(report: dict[str, Any]) -> str:
    """The human-readable form: a tensor table, totals, and a commit table."""
    rows = [[t["key"], "x".join(map(str, t["shape"])) or "()", t["dtype"], codec_str(t["codec"]),
             human_bytes(t["nbytes"]), human_bytes(t["stored_nbytes"]),
             "-" if t["ratio"] is None else f"{t['ratio']:.2f}", t["generation"],
             ",".join(t["tiers"])] for t in report["tensors"]]
    tot = report["totals"]
    rows.append(["TOTAL", f"{tot['tensors']} tensors", "", "", human_bytes(tot["nbytes"]),
                 human_bytes(tot["stored_nbytes"]),
                 "-" if tot["ratio"] is None else f"{tot['ratio']:.2f}", "", ""])
    right = ("logical", "stored", "ratio", "gen")
    out = [f"store {report['store']}  version {report['version']}", "",
           render_table(["key", "shape", "dtype", "codec", "logical", "stored", "ratio", "gen",
                         "tiers"], rows, right)]
    crow = [[c["version"], "-" if c["step"] is None else c["step"],
             datetime.datetime.fromtimestamp(c["time"]).strftime("%Y-%m-%d %H:%M:%S"),
             c["tensors"], c["message"]] for c in report["commits"]]
    out += ["", "commits:", render_table(["version", "step", "time", "tensors", "message"], crow,
                                         ("version", "step", "tensors"))]
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    """Print the report of the store (table or JSON)."""
    store = tierstore.open(args.store, mode="r", version=args.version, ram_budget=None,
                           device_budget=None, device="cpu")
    try:
        report = describe(store, args.version, quiet=getattr(args, "quiet", False))
    finally:
        store.close(commit=False)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0
