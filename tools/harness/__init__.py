"""Harnesses that look for faults rather than time: SIGKILL crash loops for the store
(``crash_store``) and training (``crash_train``), model-checked random programs (``modelcheck``,
run at scale by ``fuzz_store``), and generation checked token by token against transformers
(``check_generate``). Each runs with ``python -m tools.harness.<name>``.
"""
