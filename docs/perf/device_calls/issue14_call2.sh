#!/usr/bin/env bash
# Issue 14, device call 2 (one H200): GPU tests of the fused kernels, the sequence-major local
# attention, the in-forward loss gradients and the fused Adam; end to end at 32K/64K/128K with
# Liger kernels and the elementwise recompute (lean) beside HF + Liger in the same run, memory
# snapshots after iteration 2 of each length.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
step() { local t=$1; shift; echo "== $* (t=$SECONDS)" >> $LOG; timeout "$t" "$@" >> $LOG 2>&1; echo "rc=$? t=$SECONDS" >> $LOG; }
step 120 python3 -m pytest -q tests/gpu -p no:cacheprovider
mkdir -p /tmp/snap
step 330 python3 tools/bench_e2e.py --seq-lens 32k,64k,128k --nproc-per-node 1 --splits 1x1 \
  --iters 4 --warmup 2 --timeout 100 --recompute lean --peers hf-liger \
  --extra-args="--fused-kernels liger --record-memory-history --memory-snapshot-path /tmp/snap/snap{seq_length}.pickle --memory-snapshot-iteration 2" \
  --log-dir /tmp/e2e --out $OUT/e2e_lean.json --markdown $OUT/e2e_lean.md
for f in /tmp/e2e/*.log; do grep -h "memory snapshot" $f; done >> $LOG 2>&1
for f in /tmp/snap/*.txt; do echo "== $f"; cat $f; done > $OUT/memory_lean.txt 2>/dev/null
step 60 python3 tools/bench_e2e.py --seq-lens 32k --nproc-per-node 1 --splits 1x1 --iters 4 --warmup 2 \
  --timeout 55 --recompute none --ceiling off --extra-args="--fused-kernels liger" --log-dir /tmp/e2e_none --out $OUT/e2e_none.json
tar czf $OUT/logs.tgz -C /tmp e2e e2e_none 2>/dev/null
echo "done t=$SECONDS" >> $LOG
