#!/usr/bin/env bash
# Issue 13, part 4: does the micro-batch split still move the bf16 loss curve now that
# gradients accumulate in float32? ONE H200, DP1, the docs/perf/h200x2_curves model, global
# batch 4 as micro-batch x accumulation 4x1 (the reference), 2x2 and 1x4, STEPS steps, bf16
# with the new default; the noise pairs are 4x1 against 4x1 with the output layer's weight
# gradient summed over chunks of 2048, 4096 and 8192 tokens (--fused-linear-cross-entropy
# --linear-cross-entropy-chunk-tokens N) instead of inside one GEMM: changes of reduction
# order only, three of them so that the band does not rest on one chaotic pair (the widest
# is used). Control: 1x4 with the old default (--grad-reduce-in-bf16). The seven runs share
# the GPU at once (each is launch-bound: ~6 % MFU alone); then tools/compare_loss.py's drift
# test. Run from the repository root: bash docs/perf/device_calls/numerics_h200.sh (about
# 5 min). Writes to $OUT: run.log, the seven metrics files (mb*.jsonl), drift.png and
# summary.json: 10 files, so a caller keeping to the device's 8 returned files tars them.
# Reading: docs/perf/bf16_microbatch/README.md.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
STEPS=${STEPS:-500}
TOTAL_S=${TOTAL_S:-285}      # the whole script's deadline; the lead's limit is 300 s
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null) STEPS=$STEPS" > "$LOG"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$LOG" 2>&1
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version())" >> "$LOG" 2>&1
python3 tools/build_default_corpus.py >> "$LOG" 2>&1 || { echo "corpus build failed" >> "$LOG"; exit 1; }
echo "corpus ready t=$SECONDS" >> "$LOG"

MODEL="--num-layers 8 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16
  --group-query-attention --num-query-groups 4 --seq-length 4096 --max-position-embeddings 4096
  --position-embedding-type rope --rotary-base 500000 --swiglu --normalization RMSNorm
  --disable-bias-linear --untie-embeddings-and-output-weights"
TRAIN="--global-batch-size 4 --train-iters $STEPS --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
  --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --bf16
  --use-distributed-optimizer --log-interval 100 --eval-iters 0"
# What is left for training once the compare (~20 s) is set aside.
BUDGET=$(( TOTAL_S - SECONDS - 20 ))

launch() {  # name port flags...: one DP1 run, cut at the deadline (its metrics survive)
  local name=$1 port=$2; shift 2
  # Own sample-index cache: five processes writing megatron-core's shared one would race.
  # shellcheck disable=SC2086
  timeout "$BUDGET" python3 -m torch.distributed.run --nproc-per-node 1 --master-port "$port" \
    pretrain_gpt.py $MODEL $TRAIN "$@" --data-cache-path "/tmp/dcache_$name" \
    --metrics-file "$OUT/$name.jsonl" > "/tmp/$name.log" 2>&1
  echo "$name rc=$? t=$SECONDS" >> "$LOG"
}
launch mb4x1 29611 --micro-batch-size 4 &
launch mb2x2 29612 --micro-batch-size 2 &
launch mb1x4 29613 --micro-batch-size 1 &
for chunk in 2048 4096 8192; do
  launch mb4x1_chunked$chunk $(( 29620 + chunk / 1024 )) --micro-batch-size 4 \
    --fused-linear-cross-entropy --linear-cross-entropy-chunk-tokens $chunk &
done
launch mb1x4_bf16grad 29615 --micro-batch-size 1 --grad-reduce-in-bf16 &
wait
RUNS="mb4x1 mb2x2 mb1x4 mb4x1_chunked2048 mb4x1_chunked4096 mb4x1_chunked8192 mb1x4_bf16grad"
for name in $RUNS; do
  { echo "--- $name (tail)"; grep -v Warning "/tmp/$name.log" | grep -v warnings.warn | tail -n 6; } >> "$LOG"
done

# The steps every run reached (all of them unless the deadline cut a run): the drift window
# is the second half of those.
LAST=$(python3 -c "
import json, sys
last = []
for name in sys.argv[1:]:
    try:
        its = [r['iteration'] for r in map(json.loads, open(name)) if r.get('kind') == 'train']
    except OSError:
        its = []
    last.append(max(its, default=0))
print(min(last))" $(for name in $RUNS; do echo "$OUT/$name.jsonl"; done))
echo "steps reached by every run: $LAST of $STEPS (t=$SECONDS)" >> "$LOG"
EXTRA=()
if [ "$LAST" -lt "$STEPS" ]; then
  EXTRA=(--allow-missing --drift-window "$(( LAST / 2 + 1 )):$LAST")
fi
python3 tools/compare_loss.py "$OUT"/mb4x1.jsonl "$OUT"/mb2x2.jsonl "$OUT"/mb1x4.jsonl \
  "$OUT"/mb1x4_bf16grad.jsonl --labels 4x1 2x2 1x4 "1x4 bf16 grads" \
  --noise-pair "$OUT"/mb4x1.jsonl "$OUT"/mb4x1_chunked2048.jsonl \
  --noise-pair "$OUT"/mb4x1.jsonl "$OUT"/mb4x1_chunked4096.jsonl \
  --noise-pair "$OUT"/mb4x1.jsonl "$OUT"/mb4x1_chunked8192.jsonl \
  ${EXTRA[@]+"${EXTRA[@]}"} --png "$OUT/drift.png" --summary-json "$OUT/summary.json" \
  --print-every 50 >> "$LOG" 2>&1
echo "compare rc=$? (expected 1: only '1x4 bf16 grads' drifts) t=$SECONDS" >> "$LOG"
