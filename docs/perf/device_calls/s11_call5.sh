#!/usr/bin/env bash
# PREPARED in session 11 (2026-12-03), NOT RUN (no device time left), for the next session,
# issue 14: 0.85B at 512K on one H200 with the default kernels (--fused-kernels auto = usp on
# CUDA) and full recompute, as s6_call2.sh ran it with liger (132.4 s step, 43.2 % MFU,
# 102.5 GiB, 225 s with start-up). s11_call1.sh gave it only 190 s; here 330 s, and the
# pretrain log comes back (a call returns at most 8 files).
# Files under $OUT: run.log, e2e_512k.json, e2e_512k.md, e2e/S524288_U1xR1_full.log.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
echo "start t=$SECONDS" > $LOG
timeout 345 python3 tools/bench_e2e.py --seq-lens 512k --splits 1x1 --nproc-per-node 1 --recompute full --iters 1 --warmup 0 \
  --timeout 330 --extra-args="--recompute-keep-core-attn --mlp-tile-tokens 16384" --log-dir $OUT/e2e \
  --out $OUT/e2e_512k.json --markdown $OUT/e2e_512k.md >> $LOG 2>&1
echo "rc=$? end t=$SECONDS" >> $LOG
