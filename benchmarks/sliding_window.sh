#!/usr/bin/env bash
# Sliding-window attention on one GPU, the two speed targets of docs/sliding_window.md:
# (a) one window layer's attention at SEQ_LEN with 32 query / 8 KV heads of 128 (bf16; the
#     0.85B model has 16 / 4): USP (U1xR1) with --window against the window kernel's own call
#     on the whole sequence; target: the USP row's efficiency >= 90 % (window_kernel_*.md);
# (b) the 0.85B model trained all-full and with one layer in SKIP_FREQ full (the rest windowed),
#     alternating ROUNDS times; target: the measured speed-up at least 90 % of the one the FLOP
#     count predicts (the last line printed, window_speedup_*.json).
#   bash benchmarks/sliding_window.sh
#   SEQ_LEN=64k WINDOW=2048 ROUNDS=1 bash benchmarks/sliding_window.sh
#   HEADS=16 KV_HEADS=4 bash benchmarks/sliding_window.sh        # (a) at the 0.85B model's heads
#   MODEL=tiny SEQ_LEN=256 WINDOW=32 HEADS=4 KV_HEADS=2 HEAD_DIM=16 ROUNDS=1 ITERS=3 WARMUP=1 \
#       bash benchmarks/sliding_window.sh --extra-args "--num-workers 0"   # a CPU check
# Environment: PARTS (kernel,train: (a) and (b); or one of them) SEQ_LEN (128k) WINDOW (4096)
# SKIP_FREQ (2) ROUNDS (2) ITERS (6) WARMUP (2) MODEL (llama-0.85b; tiny for a CPU check) HEADS (32) KV_HEADS (8) HEAD_DIM (128) of (a)
# OUT_DIR (benchmarks/out; each run's logs in OUT_DIR/logs/NAME). Extra arguments go to every
# bench_e2e run (an --extra-args among them adds to the windowed runs' own).
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ_LEN=${SEQ_LEN:-128k}
WINDOW=${WINDOW:-4096}
SKIP_FREQ=${SKIP_FREQ:-2}
ROUNDS=${ROUNDS:-2}
ITERS=${ITERS:-6}
WARMUP=${WARMUP:-2}
MODEL=${MODEL:-llama-0.85b}
HEADS=${HEADS:-32}
KV_HEADS=${KV_HEADS:-8}
HEAD_DIM=${HEAD_DIM:-128}
OUT_DIR=${OUT_DIR:-benchmarks/out}
PARTS=${PARTS:-kernel,train}
case ",$PARTS," in *,kernel,*|*,train,*) ;; *)
    echo "error: PARTS=$PARTS: name kernel, train or both, e.g. PARTS=kernel,train" >&2; exit 2;; esac
mkdir -p "$OUT_DIR"
if [[ ",$PARTS," == *,kernel,* ]]; then
python tools/bench_attention.py --seq-lens "$SEQ_LEN" --heads "$HEADS" --kv-heads "$KV_HEADS" \
    --head-dim "$HEAD_DIM" --dtype bf16 --window "$WINDOW" --peers none --no-sdpa-anchor \
    --check --iters 5 --warmup 2 \
    --out "$OUT_DIR/window_kernel_$SEQ_LEN.json" --markdown "$OUT_DIR/window_kernel_$SEQ_LEN.md"
fi
[[ ",$PARTS," == *,train,* ]] || exit 0

e2e() {  # e2e NAME [bench_e2e flags]: one run, written to $OUT_DIR/NAME.json and .md
    local name=$1; shift
    python tools/bench_e2e.py --model "$MODEL" --nproc-per-node 1 --splits 1x1 \
        --seq-lens "$SEQ_LEN" --iters "$ITERS" --warmup "$WARMUP" --recompute lean \
        --peers none --ceiling off --log-dir "$OUT_DIR/logs/$name" \
        --out "$OUT_DIR/$name.json" --markdown "$OUT_DIR/$name.md" "$@"
}
FULL=() HYBRID=()
for round in $(seq "$ROUNDS"); do
    e2e "window_full_${SEQ_LEN}_r$round" "$@"
    FULL+=("$OUT_DIR/window_full_${SEQ_LEN}_r$round.json")
    e2e "window_hybrid_${SEQ_LEN}_r$round" \
        --extra-args="--window-size $WINDOW --window-attn-skip-freq $SKIP_FREQ" "$@"
    HYBRID+=("$OUT_DIR/window_hybrid_${SEQ_LEN}_r$round.json")
done
python -m megatron.bench.window_speedup --seq-len "$SEQ_LEN" --full "${FULL[@]}" \
    --hybrid "${HYBRID[@]}" --out "$OUT_DIR/window_speedup_$SEQ_LEN.json" \
    | tee "$OUT_DIR/window_speedup_$SEQ_LEN.md"
