#!/usr/bin/env bash
# An imported checkpoint trains at the speed of a from-scratch model of the same shape: a
# Llama-3.2-1B-shaped Hugging Face model (random weights built here, nothing downloaded) goes
# through tools/convert_hf.py import, then pretrain_gpt.py trains it on packed mock documents
# at SEQ_LEN twice with the same flags: from the imported checkpoint (--load --finetune) and
# from random weights. Prints tokens/s and peak memory of both and their ratios.
#   SEQ_LEN=128k bash benchmarks/imported_model.sh
# Environment: SHAPE (llama3.2-1b; tiny for a CPU check) SEQ_LEN (128k) ITERS (8) WARMUP (3)
# DEVICE (cuda; cpu: float32 on gloo) NPROC (1) ULYSSES_DEGREE (1) RING_DEGREE (1)
# OUT_DIR (benchmarks/out/imported_model; replaced). Extra arguments go to both runs.
set -euo pipefail
cd "$(dirname "$0")/.."
SHAPE=${SHAPE:-llama3.2-1b}
SEQ_LEN=${SEQ_LEN:-128k}
ITERS=${ITERS:-8}
WARMUP=${WARMUP:-3}
DEVICE=${DEVICE:-cuda}
NPROC=${NPROC:-1}
U=${ULYSSES_DEGREE:-1}
R=${RING_DEGREE:-1}
OUT=${OUT_DIR:-benchmarks/out/imported_model}
case "$SEQ_LEN" in *k) S=$(( ${SEQ_LEN%k} * 1024 ));; *) S=$SEQ_LEN;; esac

rm -rf "$OUT" && mkdir -p "$OUT"
VOCAB=$(python -m megatron.bench.imported build --shape "$SHAPE" --out "$OUT/hf")
python tools/convert_hf.py import "$OUT/hf" "$OUT/imported"
read -r -a MODEL < "$OUT/imported/model_flags.txt"

COMMON=("${MODEL[@]}" --tokenizer-type NullTokenizer --vocab-size $((VOCAB - 1))
        --mock-data --reset-attention-mask --reset-position-ids --eod-mask-loss
        --seq-length "$S" --max-position-embeddings "$S"
        --ulysses-degree "$U" --ring-degree "$R"
        --micro-batch-size 1 --global-batch-size $((NPROC / (U * R)))
        --train-iters "$ITERS" --eval-iters 0 --lr 2e-5 --min-lr 0 --lr-decay-style cosine
        --lr-warmup-iters 0 --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --log-interval 1
        --recompute-granularity selective --recompute-modules layernorm swiglu)
if [ "$DEVICE" = cpu ]; then
  COMMON+=(--device cpu)
else
  COMMON+=(--bf16 --use-distributed-optimizer --fused-linear-cross-entropy
           --linear-cross-entropy-chunk-tokens 2048)
fi
train() {  # train NAME [flags]
  local name=$1; shift
  python -m torch.distributed.run --nproc-per-node "$NPROC" --master-addr 127.0.0.1 \
    --master-port "${MASTER_PORT:-29511}" pretrain_gpt.py "${COMMON[@]}" \
    --metrics-file "$OUT/$name.jsonl" "$@" > "$OUT/$name.log" 2>&1 \
    || { tail -20 "$OUT/$name.log"; exit 1; }
}
train imported --load "$OUT/imported" --finetune "$@"
train scratch "$@"
python -m megatron.bench.imported compare --imported "$OUT/imported.jsonl" \
  --scratch "$OUT/scratch.jsonl" --warmup "$WARMUP" --out "$OUT/imported_model.json" \
  | tee "$OUT/imported_model.md"
