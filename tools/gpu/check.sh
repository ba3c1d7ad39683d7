#!/usr/bin/env bash
# The prepared check for a GPU machine without network access (python3 3.12 with torch,
# transformers, safetensors, aiofiles, tqdm, matplotlib, pytest). One command, <= 9 minutes,
# run from a checkout with .whl/ beside it: bash tools/gpu/check.sh (docs/gpu.md).
# The missing packages (lmdb, zarr, numcodecs, crc32c and their deps) travel as Python 3.12
# wheels in .whl/ (`bash tools/gpu/wheels.sh` fetches them on a machine with PyPI). At most 8
# files land in $OUT: nvidia-smi.txt, install.log, cuda_tests.txt, suite_cuda.txt (the whole
# tierstore and trainer suites, where every store's default device is the GPU), benches.txt
# (tools.bench.generate on the device, tools.bench.optimizer), gpu_bench.{json,txt,log}.
# DEVICE=cpu dry-runs the same steps on a machine without a GPU (tiny sizes, no wheel install).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_out}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-550}               # the whole check ends by then (the device call's limit is 600 s)
BENCH_BUDGET_S=${BENCH_BUDGET_S:-300}   # the benchmark's share
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-80}
SUITE_TIMEOUT_S=${SUITE_TIMEOUT_S:-180}
mkdir -p "$OUT"
start=$(date +%s)

if [ "$DEVICE" = cuda ]; then
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  {
    ls -la .whl
    wheels=(.whl/*.whl)
    # keep the machine's own typing_extensions (torch's) unless it lacks one
    if "$PY" -c "import typing_extensions" 2>/dev/null; then
      wheels=("${wheels[@]/*typing_extensions*/}")
    fi
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site ${wheels[@]}; then
      echo "pip install ok"
    else  # no pip there: a wheel is a zip archive laid out for site-packages
      echo "pip install failed: unzipping the wheels into /tmp/site"
      mkdir -p /tmp/site
      for w in ${wheels[@]}; do "$PY" -m zipfile -e "$w" /tmp/site; done
    fi
  } > "$OUT/install.log" 2>&1
  export PYTHONPATH=/tmp/site:$PWD
else
  echo "DEVICE=$DEVICE: no GPU, no install" > "$OUT/nvidia-smi.txt"
  echo "DEVICE=$DEVICE: the current environment is used" > "$OUT/install.log"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import torch, zarr, numcodecs, lmdb, crc32c, tierstore, trainer; print('imports ok: torch', torch.__version__, 'cuda', torch.cuda.is_available())" >> "$OUT/install.log" 2>&1

# The CUDA tests and the CPU tests of the pieces they share (staging, drain, bf16 numerics);
# -p no:cacheprovider: the checkout may be read-only; the asyncio option is unknown there.
timeout "$TESTS_TIMEOUT_S" "$PY" -m pytest -q -p no:cacheprovider -W ignore::pytest.PytestConfigWarning \
  tests/tierstore/test_cuda.py tests/tierstore/test_staging.py tests/trainer/test_grad_drain.py \
  tests/trainer/test_bf16_master.py tests/trainer/test_cuda_train.py > "$OUT/cuda_tests.txt" 2>&1
echo "pytest rc=$? after $(( $(date +%s) - start )) s" >> "$OUT/cuda_tests.txt"

# The rest of the suite with CUDA present: every store opened without device= lands on the GPU,
# so the window, staging and drain paths run under the same assertions as on the CPU. In parallel
# (xdist) where the machine has it; tests needing a package the machine lacks fail at import.
if { [ "$DEVICE" = cuda ] || [ -n "${SUITE:-}" ]; } && [ "$SUITE_TIMEOUT_S" -gt 0 ]; then
  opts=""
  "$PY" -c "import xdist" 2>/dev/null && opts="-n 12"
  "$PY" -c "import pytest_timeout" 2>/dev/null && opts="$opts --timeout 100"
  timeout "$SUITE_TIMEOUT_S" "$PY" -m pytest -p no:cacheprovider -W ignore::pytest.PytestConfigWarning $opts \
    -v --tb=short --maxfail 40 tests/tierstore tests/trainer > "$OUT/suite_cuda.txt" 2>&1
  echo "pytest rc=$? after $(( $(date +%s) - start )) s" >> "$OUT/suite_cuda.txt"
fi

# Generation on the GPU (the goals in docs/benchmarks.md): mt.generate with a 2-layer window against
# transformers in memory and accelerate's disk_offload, all computing on the same device; then
# the CPU AdamW over store-resident state against torch's fused AdamW in memory (at
# 1.1B the streaming step's optimizer took 10 s on an H200 host, its arithmetic a small part).
{
  timeout "${GENERATE_TIMEOUT_S:-60}" "$PY" -m tools.bench.generate --device "$DEVICE" \
    $( [ "$DEVICE" = cuda ] || echo "--quick --rounds 1 --hidden 128 --intermediate 256 --layers 4" )
  echo "bench_generate rc=$? after $(( $(date +%s) - start )) s"
  timeout "${OPTIMIZER_TIMEOUT_S:-60}" "$PY" -m tools.bench.optimizer --repeats 3 \
    $( [ "$DEVICE" = cuda ] && echo "--params-m 512 --tensors 16" || echo "--params-m 4 --tensors 2" )
  echo "bench_optimizer rc=$? after $(( $(date +%s) - start )) s"
} > "$OUT/benches.txt" 2>&1

# Whatever the tests took, the benchmark ends by TOTAL_S (each stage time-boxed).
left=$(( TOTAL_S - ($(date +%s) - start) ))
budget=$(( left < BENCH_BUDGET_S ? left : BENCH_BUDGET_S ))
"$PY" -m tools.gpu.bench --device "$DEVICE" --out "$OUT" --budget-s "$budget" "$@"
rc=$?
echo "gpu_check done in $(( $(date +%s) - start )) s (bench rc=$rc)" | tee -a "$OUT/gpu_bench.txt"
tail -3 "$OUT/cuda_tests.txt"
exit 0
