#!/usr/bin/env bash
# The whole GPU check in one run on a device machine (jax with CUDA already installed), sized
# for a 10-minute command: the Triton-compiled kernels' tests at model shapes, the roofline benchmark at the
# kernels' defaults, then the block-size sweep with what time is left (it records after every case).
# Results land in benchmarks/results/ and configs/kernels/, copied to $OUT.
#   run: bash benchmarks/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
python -c 'import jax; print(jax.__version__, jax.devices())' | tee "$OUT/devices.txt"
timeout 200 python -m pytest -n 0 -q -m gpu tests/pallas_kernels 2>&1 | tail -40 | tee "$OUT/pytest_gpu.txt"
timeout 200 python benchmarks/kernels.py --gpu 2>&1 | tee "$OUT/kernels_gpu.txt"
# the step's roofline estimate (benchmarks/estimate.py, computed without a GPU), next to what was measured here
cat benchmarks/results/estimate.txt | tee "$OUT/estimate.txt"
timeout 150 python benchmarks/tune_kernels.py --repeats 3 2>&1 | tee "$OUT/tune_kernels.txt"
cp -r benchmarks/results configs/kernels "$OUT/" 2>/dev/null
