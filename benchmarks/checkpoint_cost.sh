#!/usr/bin/env bash
# What checkpoint checksums cost: saves with and without them alternate after a warm-up,
# then one verified load. SAVE_DIR should be the disk your runs save to.
#   MODEL=llama-0.85b SAVE_DIR=/tmp/checkpoint_cost bash benchmarks/checkpoint_cost.sh
#   MODEL=tiny SAVE_DIR=/tmp/checkpoint_cost bash benchmarks/checkpoint_cost.sh  # a CPU check
# Environment: MODEL (llama-0.85b) SAVE_DIR (/tmp/checkpoint_cost) OUT_DIR (benchmarks/out).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-llama-0.85b}
SAVE_DIR=${SAVE_DIR:-/tmp/checkpoint_cost}
OUT_DIR=${OUT_DIR:-benchmarks/out}
mkdir -p "$OUT_DIR"
python tools/bench_checkpoint.py --model "$MODEL" --seq-length 4096 --saves 3 \
    --save-dir "$SAVE_DIR" --out "$OUT_DIR/checkpoint_cost.json"
