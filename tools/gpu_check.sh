#!/usr/bin/env bash
# One prepared run on a lent GPU machine: the CUDA tests and the store benchmark, results in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
pip install -q "torch>=2.4" && pip install -q -e ".[train,dev]" > "$OUT/install.log" 2>&1
python -m pytest -q -m cuda tests 2>&1 | tee "$OUT/cuda_tests.txt"
python -m pytest -q tests/tierstore 2>&1 | tail -5 | tee "$OUT/store_tests.txt"
python -m tools.bench_store --size 4GiB --tensor 256MiB 2>&1 | tee "$OUT/bench_store.txt"
