#!/usr/bin/env bash
# The longest sequence one GPU trains: full recompute keeping each layer's attention output,
# the MLP over tiles of tokens. SEQ_LEN=512k measures one length (two steps); SEARCH=1
# doubles from SEQ_LEN to MAX_SEQ with the layer inputs and attention outputs offloaded to
# pinned host memory and reports the longest that fits.
#   SEQ_LEN=512k bash benchmarks/longest_sequence.sh
#   SEARCH=1 SEQ_LEN=512k MAX_SEQ=2m bash benchmarks/longest_sequence.sh
#   MODEL=tiny SEQ_LEN=256 TILE=64 bash benchmarks/longest_sequence.sh \
#       --extra-args "--num-workers 0"                                # a CPU check
# Environment: SEQ_LEN (512k) SEARCH (0; 1: the doubling search up to MAX_SEQ) MAX_SEQ (2m)
# TILE (16384 tokens per MLP tile) MODEL (llama-0.85b) OUT_DIR (benchmarks/out). Extra
# arguments go to tools/bench_e2e.py.
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ_LEN=${SEQ_LEN:-512k}
MAX_SEQ=${MAX_SEQ:-2m}
TILE=${TILE:-16384}
MODEL=${MODEL:-llama-0.85b}
OUT_DIR=${OUT_DIR:-benchmarks/out}
mkdir -p "$OUT_DIR"
if [[ "${SEARCH:-0}" == 1 ]]; then
    python tools/bench_e2e.py --model "$MODEL" --find-max-seq --start-seq "$SEQ_LEN" \
        --max-seq "$MAX_SEQ" --splits 1x1 --nproc-per-node 1 --recompute full --iters 1 \
        --warmup 0 --extra-args="--recompute-keep-core-attn \
        --recompute-cpu-offload layer_input core_attn --mlp-tile-tokens $TILE" \
        --out "$OUT_DIR/max_seq.json" "$@"
else
    python tools/bench_e2e.py --model "$MODEL" --seq-lens "$SEQ_LEN" --splits 1x1 \
        --nproc-per-node 1 --recompute full --iters 2 --warmup 0 --ceiling off \
        --extra-args="--recompute-keep-core-attn --mlp-tile-tokens $TILE" \
        --out "$OUT_DIR/e2e_$SEQ_LEN.json" "$@"
fi
