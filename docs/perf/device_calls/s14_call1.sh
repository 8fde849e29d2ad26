#!/usr/bin/env bash
# Prepared in session 13 (2026-12-04), not run: issue 14's open 512K question. Session 13's
# 512K step with --gradient-accumulation-fusion took 137.8 s (a cold first step) and 130.3 s
# without it right after on the same machine (warm compile caches). Here both run with one
# warm-up step before the measured one, alternating: fused, unfused, fused. Then the GPU tests
# of the final session-13 tree (tests/gpu/test_linear_wgrad_gpu.py, the usp checks).
# carry [".whl"]. About 560 s: split into two calls if a 512K run takes longer than 170 s.
# Files under $OUT: run.log, fused1.json, unfused.json, fused2.json.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
LOG=$OUT/run.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $LOG
echo "== gpu tests (t=$SECONDS)" >> $LOG
env PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_linear_wgrad_gpu.py \
  tests/gpu/test_fused_kernels_gpu.py -k "wgrad or swiglu or usp" 2>&1 | tail -8 >> $LOG
run() {   # run NAME [extra flags]
  echo "== $1 (t=$SECONDS)" >> $LOG
  env PYTHONPATH=/tmp/site:$PWD timeout 200 python3 tools/bench_e2e.py --seq-lens 512k --splits 1x1 --nproc-per-node 1 \
    --recompute full --iters 2 --warmup 1 --timeout 190 --ceiling off \
    --extra-args="--recompute-keep-core-attn --mlp-tile-tokens 16384 $2" --log-dir /tmp/$1 --out $OUT/$1.json 2>&1 \
    | grep "bench_e2e\]" >> $LOG
}
run fused1 ""
run unfused "--no-gradient-accumulation-fusion"
if [ $SECONDS -lt 400 ]; then run fused2 ""; fi
echo "end t=$SECONDS" >> $LOG
