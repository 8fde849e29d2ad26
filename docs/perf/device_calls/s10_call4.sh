#!/usr/bin/env bash
# 2026-12-03 (session 10), device call 4 (ONE H200), same code as call 3 (whose run.log did not
# come back: a call returns at most 8 files): (a) every GPU test, its log kept this time;
# (b) the 128K row of the side-by-side table (--fused-kernels usp, --recompute lean) against
# HF + Liger (no recompute), as far as the device time left allows.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
step() { local t=$1; shift; echo "== $* (t=$SECONDS)" >> $LOG; timeout "$t" "$@" 2>&1 | grep -v "could not be imported\|UserWarning\|warnings.warn\|use_return_dict" >> $LOG; echo "rc=${PIPESTATUS[0]} t=$SECONDS" >> $LOG; }
cap() { local l=$(( 290 - SECONDS )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
step 130 python3 -m pytest -q -rs tests/gpu -p no:cacheprovider
step $(cap 160) python3 tools/bench_e2e.py --nproc-per-node 1 --splits 1x1 --seq-lens 128k --iters 3 --warmup 1 --timeout 80 --recompute lean \
  --peers hf-liger --extra-args="--fused-kernels usp" --log-dir /tmp/e2e_128k \
  --out $OUT/e2e_128k.json --markdown $OUT/e2e_128k.md
echo "end t=$SECONDS" >> $LOG
