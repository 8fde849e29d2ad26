#!/usr/bin/env bash
# USP attention against the single-GPU kernel and PyTorch's native context parallel.
# Needs NGPUS >= 2 GPUs on one node. Writes $OUT_DIR/attention.json and .md.
#   NGPUS=2 SEQ_LENS=32k,64k,128k,256k SPLITS=2x1,1x2 bash benchmarks/attention.sh
#   NGPUS=2 SEQ_LENS=256 bash benchmarks/attention.sh --heads 4 --kv-heads 2 --head-dim 16 \
#       --dtype fp32 --peers none --iters 2 --warmup 1          # a CPU check (gloo ranks)
# Environment: NGPUS (2: processes) SEQ_LENS (32k,64k,128k,256k) SPLITS (NGPUSx1,1xNGPUS)
# OUT_DIR (benchmarks/out). Extra arguments go to tools/bench_attention.py (later flags win).
set -euo pipefail
cd "$(dirname "$0")/.."
NGPUS=${NGPUS:-2}
SEQ_LENS=${SEQ_LENS:-32k,64k,128k,256k}
SPLITS=${SPLITS:-$NGPUS"x1,1x"$NGPUS}
OUT_DIR=${OUT_DIR:-benchmarks/out}
mkdir -p "$OUT_DIR"
torchrun --nproc-per-node "$NGPUS" tools/bench_attention.py --seq-lens "$SEQ_LENS" \
    --splits "$SPLITS" --iters 5 --warmup 2 --no-sdpa-anchor --check \
    --out "$OUT_DIR/attention.json" --markdown "$OUT_DIR/attention.md" "$@"
