#!/usr/bin/env bash
# The GPU test tier (tests/gpu) in chunks of at most BUDGET_S seconds; writes a dated
# record (GPU, versions, commit, each test's outcome and duration) to OUT_DIR. Tests that
# need 2 GPUs are skipped on one.
#   BUDGET_S=540 bash benchmarks/gpu_tests.sh
#   bash benchmarks/gpu_tests.sh tests/gpu/test_float8_gpu.py      # one file
# Environment: BUDGET_S (540) OUT_DIR (benchmarks/out/gpu_tests). Arguments go to
# tools/run_gpu_tests.py (test paths; after --, pytest's own). Without a GPU every test is
# skipped and the record says so.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-benchmarks/out/gpu_tests}
python tools/run_gpu_tests.py --out "$OUT_DIR" --budget-s "${BUDGET_S:-540}" "$@"
