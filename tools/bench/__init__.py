"""Benchmarks: each module runs with ``python -m tools.bench.<name>`` and says in its docstring
what it measures; ``tierstore bench --list`` lists them. ``moments`` and ``convergence_runs``
are what the codec benchmarks share (tiny models and their Adam moments; the convergence record).
"""
