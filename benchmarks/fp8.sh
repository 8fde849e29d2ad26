#!/usr/bin/env bash
# Float8 linear layers (torchao, --fp8-format) against bf16 on one GPU of compute capability
# >= 8.9, Hugging Face + Liger (bf16) beside them: the 0.85B model and a Llama-3-8B-shaped
# slice of 8 layers, at 8K and 32K tokens. Per model, one bf16 run with the peer, then one
# float8 run; tokens/s of each in its JSON and markdown table (the float8 run's start-up log,
# OUT_DIR/logs/fp8_NAME_fp8/*.log, lists which linears the timing kept in float8), then their
# ratios per length, tokens/s and peak memory (python -m megatron.bench.fp8_speedup:
# OUT_DIR/fp8_NAME_speedup.json and .md). Needs pip install -e .[fp8,peers].
#   bash benchmarks/fp8.sh
#   SEQ_LENS=32k FP8_LINEARS=all bash benchmarks/fp8.sh
#   MODELS=tiny:2:tiny SEQ_LENS=128 ROUNDS=1 ITERS=3 WARMUP=1 PEERS=hf FP8_EMULATE=1 \
#       FP8_LINEARS=all bash benchmarks/fp8.sh --extra-args "--num-workers 0"   # a CPU check
# Environment: SEQ_LENS (8k,32k) ROUNDS (2) ITERS (6) WARMUP (2) FP8_FORMAT (hybrid)
# FP8_RECIPE (tensorwise) FP8_LINEARS (auto) FP8_OUTPUT_LAYER (0; 1: the output layer is a
# float8 candidate too, --fp8-output-layer, for models with the fused loss) FP8_EMULATE (0; 1:
# torchao's emulation, the only float8 on the CPU) PEERS (hf-liger; hf or none on the CPU, where Liger does not run)
# MODELS ("llama-0.85b:16:0p85b llama3-8b:8:llama3_8b_8l": MODEL:LAYERS:NAME, NAME in the
# file names) CEILING (off; on: each run times its zero-overhead ceiling first) OUT_DIR
# (benchmarks/out; each run's logs in OUT_DIR/logs/NAME). Extra arguments
# go to every bench_e2e run (an --extra-args among them adds to the float8 run's own).
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ_LENS=${SEQ_LENS:-8k,32k}
ROUNDS=${ROUNDS:-2}
ITERS=${ITERS:-6}
WARMUP=${WARMUP:-2}
FP8_FORMAT=${FP8_FORMAT:-hybrid}
FP8_RECIPE=${FP8_RECIPE:-tensorwise}
FP8_LINEARS=${FP8_LINEARS:-auto}
FP8_EMULATE=${FP8_EMULATE:-0}
FP8_OUTPUT_LAYER=${FP8_OUTPUT_LAYER:-0}
PEERS=${PEERS:-hf-liger}
MODELS=${MODELS:-llama-0.85b:16:0p85b llama3-8b:8:llama3_8b_8l}
CEILING=${CEILING:-off}
OUT_DIR=${OUT_DIR:-benchmarks/out}
FLOAT8_FLAGS="--fp8-format $FP8_FORMAT --fp8-recipe $FP8_RECIPE --fp8-linears $FP8_LINEARS"
if [ "$FP8_OUTPUT_LAYER" = 1 ]; then FLOAT8_FLAGS="$FLOAT8_FLAGS --fp8-output-layer"; fi
if [ "$FP8_EMULATE" = 1 ]; then FLOAT8_FLAGS="$FLOAT8_FLAGS --fp8-emulate"; fi
mkdir -p "$OUT_DIR"
for spec in $MODELS; do
    IFS=: read -r MODEL LAYERS NAME <<< "$spec"
    python tools/bench_e2e.py --model "$MODEL" --num-layers "$LAYERS" --nproc-per-node 1 \
        --splits 1x1 --seq-lens "$SEQ_LENS" --rounds "$ROUNDS" --iters "$ITERS" \
        --warmup "$WARMUP" --recompute lean --peers "$PEERS" --ceiling "$CEILING" \
        --log-dir "$OUT_DIR/logs/fp8_${NAME}_bf16" \
        --out "$OUT_DIR/fp8_${NAME}_bf16.json" --markdown "$OUT_DIR/fp8_${NAME}_bf16.md" "$@"
    python tools/bench_e2e.py --model "$MODEL" --num-layers "$LAYERS" --nproc-per-node 1 \
        --splits 1x1 --seq-lens "$SEQ_LENS" --rounds "$ROUNDS" --iters "$ITERS" \
        --warmup "$WARMUP" --recompute lean --peers none --ceiling "$CEILING" \
        --extra-args="$FLOAT8_FLAGS" \
        --log-dir "$OUT_DIR/logs/fp8_${NAME}_fp8" \
        --out "$OUT_DIR/fp8_${NAME}_fp8.json" --markdown "$OUT_DIR/fp8_${NAME}_fp8.md" "$@"
    python -m megatron.bench.fp8_speedup --bf16 "$OUT_DIR/fp8_${NAME}_bf16.json" \
        --fp8 "$OUT_DIR/fp8_${NAME}_fp8.json" --out "$OUT_DIR/fp8_${NAME}_speedup.json" \
        | tee "$OUT_DIR/fp8_${NAME}_speedup.md"
done
