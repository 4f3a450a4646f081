#!/usr/bin/env bash
# The whole GPU check of issue 18 in one run on a device machine (jax with CUDA already installed):
# the Triton-compiled kernels' tests at model shapes, the block-size sweep, then the roofline benchmark
# with the swept choices. Results land in benchmarks/results/ and configs/kernels/, copied to $OUT.
#   run: bash benchmarks/gpu_session.sh            (about 10 minutes on an H200)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
python -c 'import jax; print(jax.__version__, jax.devices())' | tee "$OUT/devices.txt"
timeout 240 python -m pytest -p no:xdist -q -m gpu tests/pallas_kernels 2>&1 | tail -40 | tee "$OUT/pytest_gpu.txt"
timeout 180 python benchmarks/tune_kernels.py 2>&1 | tee "$OUT/tune_kernels.txt"
timeout 180 python benchmarks/kernels.py --gpu 2>&1 | tee "$OUT/kernels_gpu.txt"
cp -r benchmarks/results configs/kernels "$OUT/" 2>/dev/null
