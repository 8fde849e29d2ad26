#!/usr/bin/env bash
# Unified Sequence Parallelism: each sequence is split over Ulysses (U ranks, all-to-all,
# keep it inside a node) x Ring (R ranks, load-balanced ring attention);
# DP = GPUS_PER_NODE x NNODES / (U x R). Same Llama-style model as pretrain_dp.sh at a
# 4x longer sequence. To compare loss curves with the DP baseline, give both scripts the
# same --seq-length and --global-batch-size and run tools/compare_loss.py on their metrics.
#
#   bash examples/pretrain_usp.sh [extra pretrain_gpt.py flags, which win over the ones here]
#
# Environment overrides: GPUS_PER_NODE (8) NNODES (1) NODE_RANK (0) MASTER_ADDR (localhost)
# MASTER_PORT (unset: on one node a free port is picked; set it for several nodes) ULYSSES_DEGREE (4) RING_DEGREE (2) PRECISION (bf16 | fp32)
# RUN_DIR (runs/usp: checkpoints, TensorBoard, metrics.jsonl)
# DATA_PATH + TOKENIZER_MODEL (default: the built-in corpus and its tokenizer).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
ULYSSES_DEGREE=${ULYSSES_DEGREE:-4}
RING_DEGREE=${RING_DEGREE:-2}
RUN_DIR=${RUN_DIR:-runs/usp}
PRECISION=${PRECISION:-bf16}

# The shape comes from the one preset table (megatron/shapes/presets.py).
MODEL=($(python3 "$ROOT/tools/model_flags.py" llama-0.85b)
       --seq-length 16384 --max-position-embeddings 16384 --rotary-base 500000)
TRAINING=(--micro-batch-size 1 --global-batch-size 16 --train-iters 1000
          --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 50
          --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --use-distributed-optimizer)
PARALLEL=(--tensor-model-parallel-size 1
          --ulysses-degree "$ULYSSES_DEGREE" --ring-degree "$RING_DEGREE")
PRECISION_ARGS=()
if [ "$PRECISION" = bf16 ]; then
  # Gradients accumulate and reduce in float32 (the --bf16 default, as in Megatron-LM);
  # --grad-reduce-in-bf16 trades that accuracy for 2 bytes per parameter.
  PRECISION_ARGS=(--bf16)
fi
DATA=()
if [ -n "${DATA_PATH:-}" ]; then
  DATA=(--data-path "$DATA_PATH" --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL with DATA_PATH}")
fi
OUTPUT=(--save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 500
        --tensorboard-dir "$RUN_DIR/tensorboard" --metrics-file "$RUN_DIR/metrics.jsonl"
        --log-interval 10 --eval-interval 200 --eval-iters 10)

# A fixed port collides with other jobs; on one node without MASTER_PORT torchrun picks a
# free one. tools/launch.py is torchrun passing the failed rank's exit status through
# (2 for bad input) and checking that MASTER_PORT is free.
RDZV=()
if [ -n "${MASTER_PORT:-}" ] || [ "$NNODES" -gt 1 ]; then
  RDZV=(--master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}")
fi
exec python3 "$ROOT/tools/launch.py" --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" \
  --node-rank "$NODE_RANK" "${RDZV[@]}" \
  "$ROOT/pretrain_gpt.py" "${MODEL[@]}" "${TRAINING[@]}" "${PARALLEL[@]}" \
  "${PRECISION_ARGS[@]}" "${DATA[@]}" "${OUTPUT[@]}" "$@"
