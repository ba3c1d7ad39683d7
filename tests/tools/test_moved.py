"""The tools' old flat module names (``tools.bench_store``, ...) still import and run for one
release, as the very modules they moved to, and no file is left at an old path."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys

import pytest

from tools.moved import MOVED, new_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_old_name_has_a_new_module_and_no_file() -> None:
    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        stem = os.path.join(ROOT, *old.split("."))
        assert not os.path.exists(stem + ".py") and not os.path.exists(stem), (
            f"{old}: a file at the old path hides the move from git's rename detection")


def test_an_old_name_imports_the_same_module_with_a_warning() -> None:
    import tools.cli.errors
    import tools.harness.modelcheck.runner

    sys.modules.pop("tools.errors", None)
    with pytest.warns(DeprecationWarning, match="tools.errors is now tools.cli.errors"):
        old = importlib.import_module("tools.errors")
    assert old is tools.cli.errors
    with pytest.warns(DeprecationWarning):  # a module under a moved package moved with it
        from tools.modelcheck.runner import collect_strays
    assert collect_strays is tools.harness.modelcheck.runner.collect_strays
    assert new_name("tools.modelcheck.runner") == "tools.harness.modelcheck.runner"
    assert new_name("tools.cli") is None and new_name("tools.bench_storex") is None


def test_python_m_with_an_old_name_runs_the_new_module() -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "tools.check_generate", "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage: tools.harness.check_generate" in r.stdout
    assert "FutureWarning: tools.check_generate is now tools.harness.check_generate" in r.stderr
