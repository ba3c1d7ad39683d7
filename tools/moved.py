"""The tools' old module names, still importable and runnable (``python -m``) for one release.

The tools moved into packages by role: ``tools.cli`` (the ``tierstore`` command), ``tools.bench``
(benchmarks), ``tools.harness`` (crash, fuzz and model checks), ``tools.gpu`` (the GPU check).
A shim file at each old path would have kept the old names working too, but a file left at a
moved path hides the move from git: an edit made on another branch to the old file then conflicts
with the shim instead of following the file to its new place. So the old names live here, in one
table, and a finder first on ``sys.meta_path`` answers for them (and for modules under an old
package name):

- ``import tools.bench_store`` gives the module ``tools.bench.store`` itself, one module object
  under both names, so ``isinstance`` and ``except`` see the same classes;
- ``python -m tools.bench_store`` runs ``tools/bench/store.py`` as ``__main__`` (runpy asks the
  loader for the code).

Imports warn with a ``DeprecationWarning``, commands with a ``FutureWarning`` (shown by default),
naming the new module. ``tools/__init__.py`` installs the finder; delete this module and that
line in the next release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType

#: old module name -> new module name
MOVED = {
    "tools.bench_cmd": "tools.cli.bench_cmd",
    "tools.bench_codecs": "tools.bench.codecs",
    "tools.bench_convergence": "tools.bench.convergence",
    "tools.bench_dp": "tools.bench.dp",
    "tools.bench_gather": "tools.bench.gather",
    "tools.bench_generate": "tools.bench.generate",
    "tools.bench_optimizer": "tools.bench.optimizer",
    "tools.bench_scale": "tools.bench.scale",
    "tools.bench_store": "tools.bench.store",
    "tools.bench_trainer": "tools.bench.trainer",
    "tools.check_generate": "tools.harness.check_generate",
    "tools.convergence_runs": "tools.bench.convergence_runs",
    "tools.crash_store": "tools.harness.crash_store",
    "tools.crash_train": "tools.harness.crash_train",
    "tools.errors": "tools.cli.errors",
    "tools.export_cmd": "tools.cli.export_cmd",
    "tools.fuzz_store": "tools.harness.fuzz_store",
    "tools.generate_cmd": "tools.cli.generate_cmd",
    "tools.gpu_bench": "tools.gpu.bench",
    "tools.heap": "tools.cli.heap",
    "tools.hf_meta": "tools.cli.hf_meta",
    "tools.import_cmd": "tools.cli.import_cmd",
    "tools.inspect_cmd": "tools.cli.inspect_cmd",
    "tools.modelcheck": "tools.harness.modelcheck",
    "tools.moment_stats": "tools.bench.moment_stats",
    "tools.moments": "tools.bench.moments",
    "tools.sizes": "tools.cli.sizes",
    "tools.timeline": "tools.cli.timeline",
    "tools.trace_cmd": "tools.cli.trace_cmd",
    "tools.train_cmd": "tools.cli.train_cmd",
    "tools.verify_cmd": "tools.cli.verify_cmd",
    "tools.zarr_writer": "tools.cli.zarr_writer",
}


def new_name(old: str) -> str | None:
    """The module's current name, None if ``old`` was not moved (a module under a moved package
    moved with it: ``tools.modelcheck.runner`` is ``tools.harness.modelcheck.runner``)."""
    parts = old.split(".")
    for i in range(len(parts), 1, -1):
        new = MOVED.get(".".join(parts[:i]))
        if new is not None:
            return ".".join([new, *parts[i:]])
    return None


def _warn(old: str, new: str, category: type[Warning]) -> None:
    warnings.warn(f"{old} is now {new}; the old name goes in the next release", category,
                  stacklevel=3)


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the new module object; gives runpy the new module's code."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(self.old, self.new, DeprecationWarning)
        return importlib.import_module(self.new)  # the import system keeps its attributes

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: ``create_module`` returned the new module, already executed."""

    def get_code(self, fullname: str) -> CodeType | None:
        _warn(self.old, self.new, FutureWarning)  # shown by default: a person typed the command
        spec = importlib.util.find_spec(self.new)
        assert spec is not None and spec.loader is not None, self.new
        return spec.loader.get_code(self.new)  # type: ignore[attr-defined]


class MovedFinder(importlib.abc.MetaPathFinder):
    """Answers for the old names only; every other name goes on to the next finder."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname) if fullname.startswith("tools.") else None
        if new is None:
            return None
        spec = importlib.util.find_spec(new)
        if spec is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname, new), origin=spec.origin)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once): before the path finder, which would
    otherwise load a second copy of a module under an old package name."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
