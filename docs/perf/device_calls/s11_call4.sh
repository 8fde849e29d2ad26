#!/usr/bin/env bash
# PREPARED in session 11 (2026-12-03), NOT RUN (no machine, then too little device time left):
# for the next session, issue 14:
# call 3 measured this tree and .base (583ccdc) once each with 2 measured iterations, where
# run-to-run noise (~1-3 %) hides a ~1 % change. Here 32K only, alternating new / base, 4
# measured iterations each (--iters 6 --warmup 2), otherwise call 3's (a)/(b) command; each
# JSON is written when its run ends, so a cut-short call still returns the finished pairs.
# Before it: rm -rf .base && mkdir .base && git archive 583ccdc megatron tools pretrain_gpt.py | tar -x -C .base
# and carry [".whl", ".base"] (the pre-change code, as in s11_call3.sh).
# Files under $OUT: run.log, ab_new1.json, ab_base1.json, ab_new2.json, ab_base2.json.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
LOG=$OUT/run.log
COMMON="--nproc-per-node 1 --splits 1x1 --seq-lens 32k --iters 6 --warmup 2 --timeout 55 --recompute lean --ceiling off"
for i in 1 2; do
  echo "== new $i (t=$SECONDS)" >> $LOG
  env PYTHONPATH=/tmp/site:$PWD timeout 60 python3 tools/bench_e2e.py $COMMON --extra-args="--fused-kernels usp" \
    --log-dir /tmp/ab_new$i --out $OUT/ab_new$i.json 2>&1 | grep "bench_e2e\]" >> $LOG
  echo "== base $i (t=$SECONDS)" >> $LOG
  env PYTHONPATH=/tmp/site:$PWD/.base timeout 60 python3 .base/tools/bench_e2e.py $COMMON --extra-args="--fused-kernels usp" \
    --log-dir /tmp/ab_base$i --out $OUT/ab_base$i.json 2>&1 | grep "bench_e2e\]" >> $LOG
done
echo "end t=$SECONDS" >> $LOG
