#!/usr/bin/env bash
# The GPU test tier (tests/gpu) in chunks of at most BUDGET_S seconds; writes a dated
# record (GPU, versions, commit, each test's outcome and duration) to OUT_DIR. Tests that
# need 2 GPUs are skipped on one.
#   BUDGET_S=540 bash benchmarks/gpu_tests.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-benchmarks/out/gpu_tests}
python tools/run_gpu_tests.py --out "$OUT_DIR" --budget-s "${BUDGET_S:-540}" "$@"
