#!/usr/bin/env bash
# Pallas kernels on one lent GPU (an H200): correctness of the compiled kernels
# against the references, then batch-64 decode timings at contexts 1k-128k,
# window 1024 and full attention, as a fraction of copy bandwidth.
# At most 5 minutes. Run from anywhere:  bash benchmarks/device_check.sh
# Results: stdout, and device_check.{json,md} under $OUT (the device tool's
# output folder) when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The decode stage holds a 34 GB cache; let JAX's allocator take most of HBM.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
"$PYTHON" -c 'import jax; print("jax", jax.__version__, jax.devices())' || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv 2>/dev/null || true
timeout 285 "$PYTHON" benchmarks/device_check.py ${OUT:+--out "$OUT"}
