#!/usr/bin/env bash
# Packed documents on one GPU, three parts:
# (e2e) end to end on megatron-core's mock documents against Hugging Face + Liger on the same
#       sequences (useful FLOPs only);
# (kernels) the document attention kernels alone, each on one sample of every mix, repeated
#       (every plan built after the warm-up; auto and packed choose as on a first use);
# (stream) the same kernels on a stream of STREAM distinct samples per kernel, each through
#       LAYERS forward+backward calls timed once, as a model of LAYERS layers meets them: the
#       table that says which kernel is fastest in training, with each row's ratio to the
#       fastest (docs/packed_documents.md). auto and packed choose with a new shape's plan
#       build spread over LAYERS calls, in both kernel parts, as training does.
#   SEQ_LEN=32k DOCS=mock bash benchmarks/packed_documents.sh
#   PEERS=none SEQ_LEN=64k bash benchmarks/packed_documents.sh
#   PARTS=stream STREAM=32 bash benchmarks/packed_documents.sh
#   PARTS=kernels,stream SEQ_LEN=128 STREAM_SEQ_LENS=256 MIXES=fixed:16,lognormal HEADS=4 \
#       KV_HEADS=2 HEAD_DIM=16 DTYPE=fp32 STREAM=3 bash benchmarks/packed_documents.sh  # a CPU check
# Environment: PARTS (e2e,kernels,stream: all three; or some of them) SEQ_LEN (32k: e2e and
# kernels) DOCS (mock: e2e) PEERS (hf-liger: e2e) STREAM (8 samples per kernel) LAYERS (16,
# the 0.85B model's)
# STREAM_SEQ_LENS (32k,128k) MIXES (uniform:4k,fixed:2k,fixed:8k,lognormal,corpus: kernels and
# stream) HEADS (32) KV_HEADS (8) HEAD_DIM (128) DTYPE (bf16) OUT_DIR (benchmarks/out).
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ_LEN=${SEQ_LEN:-32k}
DOCS=${DOCS:-mock}
PEERS=${PEERS:-hf-liger}
STREAM=${STREAM:-8}
LAYERS=${LAYERS:-16}
STREAM_SEQ_LENS=${STREAM_SEQ_LENS:-32k,128k}
MIXES=${MIXES:-uniform:4k,fixed:2k,fixed:8k,lognormal,corpus}
HEADS=${HEADS:-32}
KV_HEADS=${KV_HEADS:-8}
HEAD_DIM=${HEAD_DIM:-128}
DTYPE=${DTYPE:-bf16}
OUT_DIR=${OUT_DIR:-benchmarks/out}
PARTS=${PARTS:-e2e,kernels,stream}
for part in ${PARTS//,/ }; do case "$part" in e2e|kernels|stream) ;; *)
    echo "error: PARTS=$PARTS: name e2e, kernels or stream, e.g. PARTS=kernels,stream" >&2
    exit 2;; esac; done
if [ -z "${PARTS//,/}" ]; then
    echo "error: PARTS is empty: name e2e, kernels or stream, e.g. PARTS=kernels,stream" >&2
    exit 2; fi
mkdir -p "$OUT_DIR"
SHAPE=(--heads "$HEADS" --kv-heads "$KV_HEADS" --head-dim "$HEAD_DIM" --dtype "$DTYPE")
if [[ ",$PARTS," == *,e2e,* ]]; then
python tools/bench_e2e.py --nproc-per-node 1 --splits 1x1 --recompute lean --docs "$DOCS" \
    --seq-lens "$SEQ_LEN" --iters 8 --warmup 4 --peers "$PEERS" --ceiling on \
    --out "$OUT_DIR/docs_$DOCS$SEQ_LEN.json" --markdown "$OUT_DIR/docs_$DOCS$SEQ_LEN.md"
fi
if [[ ",$PARTS," == *,kernels,* ]]; then
python tools/bench_attention.py --docs "$MIXES" --seq-lens "$SEQ_LEN" "${SHAPE[@]}" \
    --doc-kernels dense,tiles,varlen,per-document,auto,packed,auto-recurring,packed-recurring \
    --doc-layers "$LAYERS" --iters 5 --warmup 2 \
    --out "$OUT_DIR/doc_kernels_$SEQ_LEN.json" --markdown "$OUT_DIR/doc_kernels_$SEQ_LEN.md"
fi
if [[ ",$PARTS," == *,stream,* ]]; then
STREAM_NAME="doc_stream${STREAM}_${STREAM_SEQ_LENS//,/_}"
python tools/bench_attention.py --docs "$MIXES" --seq-lens "$STREAM_SEQ_LENS" "${SHAPE[@]}" \
    --doc-kernels tiles,varlen,per-document,auto,packed --doc-stream "$STREAM" \
    --doc-layers "$LAYERS" --warmup 2 \
    --out "$OUT_DIR/$STREAM_NAME.json" --markdown "$OUT_DIR/$STREAM_NAME.md"
fi
