#!/usr/bin/env bash
# Fetch the Python 3.12 wheels that tools/gpu/check.sh installs on the GPU machine (which has no
# network and lacks these packages) into .whl/ (ignored by git; name it in the device run's carry).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=${PY:-python3}
for spec in lmdb==3.0.0 zarr==3.1.6 numcodecs==0.16.6 crc32c==2.9.post0 donfig==0.8.1.post1 \
            google-crc32c==1.9.0 typing-extensions==4.16.0 pytest-asyncio==1.5.0; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d .whl "$spec"
done
ls .whl
