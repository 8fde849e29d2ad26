#!/usr/bin/env bash
# USP pretraining on CPU processes (gloo, float32): a tiny Llama-style GPT on the built-in
# corpus, U2 x R2 on 4 processes by default. Everything else runs the same code as on GPUs.
#
#   bash examples/pretrain_cpu.sh [extra pretrain_gpt.py flags, which win over the ones here]
#
# Environment overrides: GPUS_PER_NODE (4: processes per node here) NNODES (1) NODE_RANK (0)
# MASTER_ADDR (localhost) MASTER_PORT (unset: on one node a free port is picked; set it for several nodes) ULYSSES_DEGREE (2) RING_DEGREE (2)
# TP_SIZE (1) TRAIN_ITERS (100) RUN_DIR (runs/cpu: checkpoints, metrics.jsonl)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

GPUS_PER_NODE=${GPUS_PER_NODE:-4}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
ULYSSES_DEGREE=${ULYSSES_DEGREE:-2}
RING_DEGREE=${RING_DEGREE:-2}
TP_SIZE=${TP_SIZE:-1}
TRAIN_ITERS=${TRAIN_ITERS:-100}
RUN_DIR=${RUN_DIR:-runs/cpu}

# The shape comes from the one preset table (megatron/shapes/presets.py).
MODEL=($(python3 "$ROOT/tools/model_flags.py" cpu-tiny)
       --seq-length 256 --max-position-embeddings 256 --make-vocab-size-divisible-by 32)
TRAINING=(--micro-batch-size 2 --global-batch-size 8 --train-iters "$TRAIN_ITERS"
          --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 10
          --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --num-workers 1)
PARALLEL=(--device cpu --tensor-model-parallel-size "$TP_SIZE"
          --ulysses-degree "$ULYSSES_DEGREE" --ring-degree "$RING_DEGREE")
OUTPUT=(--save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints"
        --save-interval "$TRAIN_ITERS" --metrics-file "$RUN_DIR/metrics.jsonl"
        --log-interval 10 --eval-interval "$TRAIN_ITERS" --eval-iters 2)

# A fixed port collides with other jobs; on one node without MASTER_PORT torchrun picks a
# free one. tools/launch.py is torchrun passing the failed rank's exit status through
# (2 for bad input) and checking that MASTER_PORT is free.
RDZV=()
if [ -n "${MASTER_PORT:-}" ] || [ "$NNODES" -gt 1 ]; then
  RDZV=(--master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}")
fi
exec python3 "$ROOT/tools/launch.py" --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" \
  --node-rank "$NODE_RANK" "${RDZV[@]}" \
  "$ROOT/pretrain_gpt.py" "${MODEL[@]}" "${TRAINING[@]}" "${PARALLEL[@]}" "${OUTPUT[@]}" "$@"
