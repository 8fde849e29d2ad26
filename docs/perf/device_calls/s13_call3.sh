#!/usr/bin/env bash
# Session 13 (2026-12-04), issue 14, call 3: this tree (call 2's) against HF + Liger at 128K
# (one round, the ceiling timed first), then 512K (full recompute, kept attention, tiled MLP,
# one step after start-up) with --gradient-accumulation-fusion on (the default now).
# carry [".whl"].
# Files under $OUT: run.log, e2e_128k.json, e2e_128k.md, e2e_512k.json, e2e_512k.md.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
LOG=$OUT/run.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $LOG
echo "== 128k vs hf-liger (t=$SECONDS)" >> $LOG
env PYTHONPATH=/tmp/site:$PWD timeout 260 python3 tools/bench_e2e.py --nproc-per-node 1 --splits 1x1 --seq-lens 128k \
  --iters 3 --warmup 1 --timeout 110 --recompute lean --peers hf-liger --extra-args="--fused-kernels usp" \
  --log-dir /tmp/e2e128 --out $OUT/e2e_128k.json --markdown $OUT/e2e_128k.md 2>&1 | grep "bench_e2e\]" >> $LOG
echo "== 512k (t=$SECONDS)" >> $LOG
env PYTHONPATH=/tmp/site:$PWD timeout $((590 - SECONDS)) python3 tools/bench_e2e.py --seq-lens 512k --splits 1x1 \
  --nproc-per-node 1 --recompute full --iters 1 --warmup 0 --timeout 330 \
  --extra-args="--recompute-keep-core-attn --mlp-tile-tokens 16384" --log-dir /tmp/e2e512 --out $OUT/e2e_512k.json \
  --markdown $OUT/e2e_512k.md 2>&1 | grep "bench_e2e\]" >> $LOG
echo "end t=$SECONDS" >> $LOG
