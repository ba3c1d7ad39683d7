"""Model-based concurrency checking of the store: random programs, a reference model, a runner.

``programs`` turns a seed into a program (phases of per-actor operation lists, barriers between
them); ``model`` holds what the committed and head states may be; ``runner`` executes a program
on a real store in a temporary folder from several asyncio tasks and threads, with injected I/O
faults, and compares every result with the model. ``tests/tierstore/test_model_based.py`` runs
a few thousand programs in CI, ``python -m tools.harness.fuzz_store`` as many as asked.
"""

from tools.harness.modelcheck.programs import FEATURES, KNOWN, Program, generate
from tools.harness.modelcheck.runner import Outcome, run_program, shrink

__all__ = ["FEATURES", "KNOWN", "Outcome", "Program", "generate", "run_program", "shrink"]
