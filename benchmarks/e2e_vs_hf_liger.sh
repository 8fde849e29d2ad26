#!/usr/bin/env bash
# End to end on one GPU: this project against Hugging Face + Liger on the same model and
# sequences, alternating rounds. Needs the peers: pip install -e .[peers].
#   SEQ_LENS=32k,64k ROUNDS=2 bash benchmarks/e2e_vs_hf_liger.sh
#   SEQ_LENS=128k ROUNDS=1 ITERS=3 WARMUP=1 bash benchmarks/e2e_vs_hf_liger.sh
#   MODEL=tiny SEQ_LENS=128 ROUNDS=1 ITERS=2 WARMUP=1 PEERS=hf \
#       bash benchmarks/e2e_vs_hf_liger.sh --extra-args "--num-workers 0"   # a CPU check
# Environment: SEQ_LENS (32k,64k) ROUNDS (2) ITERS (6) WARMUP (2) MODEL (llama-0.85b)
# PEERS (hf-liger; hf on the CPU, where Liger does not run) OUT_DIR (benchmarks/out).
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ_LENS=${SEQ_LENS:-32k,64k}
ROUNDS=${ROUNDS:-2}
ITERS=${ITERS:-6}
WARMUP=${WARMUP:-2}
MODEL=${MODEL:-llama-0.85b}
PEERS=${PEERS:-hf-liger}
OUT_DIR=${OUT_DIR:-benchmarks/out}
mkdir -p "$OUT_DIR"
python tools/bench_e2e.py --model "$MODEL" --nproc-per-node 1 --splits 1x1 \
    --seq-lens "$SEQ_LENS" --rounds "$ROUNDS" --iters "$ITERS" --warmup "$WARMUP" \
    --recompute lean --peers "$PEERS" \
    --out "$OUT_DIR/e2e_vs_hf_liger.json" --markdown "$OUT_DIR/e2e_vs_hf_liger.md" "$@"
