#!/usr/bin/env bash
# Packed documents on one GPU: end to end on megatron-core's mock documents against
# Hugging Face + Liger on the same sequences (useful FLOPs only), then the document
# attention kernels alone.
#   SEQ_LEN=32k DOCS=mock bash benchmarks/packed_documents.sh
#   PEERS=none SEQ_LEN=64k bash benchmarks/packed_documents.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ_LEN=${SEQ_LEN:-32k}
DOCS=${DOCS:-mock}
PEERS=${PEERS:-hf-liger}
OUT_DIR=${OUT_DIR:-benchmarks/out}
mkdir -p "$OUT_DIR"
python tools/bench_e2e.py --nproc-per-node 1 --splits 1x1 --recompute lean --docs "$DOCS" \
    --seq-lens "$SEQ_LEN" --iters 8 --warmup 4 --peers "$PEERS" --ceiling on \
    --out "$OUT_DIR/docs_$DOCS$SEQ_LEN.json" --markdown "$OUT_DIR/docs_$DOCS$SEQ_LEN.md"
python tools/bench_attention.py --docs uniform:4k,fixed:2k,fixed:8k,lognormal,corpus \
    --seq-lens "$SEQ_LEN" --heads 32 --kv-heads 8 --head-dim 128 \
    --doc-kernels dense,tiles,varlen,per-document,auto,packed,auto-recurring,packed-recurring \
    --iters 5 --warmup 2 \
    --out "$OUT_DIR/doc_kernels_$SEQ_LEN.json"
