"""Benchmarks: each module listed in ``BENCHMARKS`` runs with ``python -m tools.bench.<name>`` and
says in its docstring what it measures; ``tierstore bench --list`` prints them. ``moments`` and
``convergence_runs`` are what the codec benchmarks share (a tiny model and its Adam moments; the
convergence record), ``cputime`` what the optimizer and trainer benchmarks share (CPU seconds
by thread). Measured figures, with command and machine: docs/benchmarks.md.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

#: the runnable benchmarks of this package, in the order ``tierstore bench --list`` shows them
BENCHMARKS = ("store", "gather", "codecs", "convergence", "moment_stats", "optimizer", "trainer",
              "generate", "dp", "scale")
#: benchmarks kept elsewhere: module -> the file beside this package's folder that holds it
ELSEWHERE = {"tools.gpu.bench": os.path.join("gpu", "bench.py")}

_HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True, slots=True)
class Benchmark:
    """One benchmark: its module, what it measures (its docstring's first line), how to run it."""

    module: str
    measures: str
    command: str


def _summary(path: str) -> str:
    """The first line of a module's docstring as plain text, read without importing the module
    (a benchmark imports torch, transformers and more; listing them should not)."""
    with open(path, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read(), path)) or ""
    return (doc.strip().splitlines() or [""])[0].replace("``", "")


def benchmarks() -> list[Benchmark]:
    """Every benchmark with what it measures and its command (``--help`` shows its options)."""
    found = [(f"tools.bench.{name}", os.path.join(_HERE, name + ".py")) for name in BENCHMARKS]
    found += [(module, os.path.join(os.path.dirname(_HERE), rel)) for module, rel in ELSEWHERE.items()]
    return [Benchmark(module, _summary(path), f"python -m {module}") for module, path in found]
