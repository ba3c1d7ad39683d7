"""The prepared check for a GPU machine: ``bash tools/gpu/check.sh`` (wheels fetched by
``bash tools/gpu/wheels.sh``) runs the CUDA tests, the suite on the device, two benchmarks and
``python -m tools.gpu.bench``, all time-boxed (docs/gpu.md).
"""
