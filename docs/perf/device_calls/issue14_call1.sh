#!/usr/bin/env bash
# Issue 14, device call 1 (one H200): fused-kernel GPU tests and micro-benchmarks, the
# zero-overhead ceiling, end to end 32K/64K with Liger kernels beside HF and HF + Liger, the
# torch-kernel baseline at 32K, and one profiled + memory-snapshot run at 32K.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
step() { local t=$1; shift; echo "== $* (t=$SECONDS)" >> $LOG; timeout "$t" "$@" >> $LOG 2>&1; echo "rc=$? t=$SECONDS" >> $LOG; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv >> $LOG 2>&1
step 100 python3 -m pytest -q -x tests/gpu -p no:cacheprovider
step 60 python3 tools/bench_fused_kernels.py --tokens 32768,65536 --out $OUT/kernels.json
E2E="--nproc-per-node 1 --splits 1x1 --iters 6 --warmup 3 --timeout 110"
step 260 python3 tools/bench_e2e.py --seq-lens 32k,64k $E2E --peers hf-liger,hf \
  --extra-args="--fused-kernels liger" --log-dir /tmp/e2e_liger --out $OUT/e2e_liger.json --markdown $OUT/e2e_liger.md
step 60 python3 tools/bench_e2e.py --seq-lens 32k $E2E --ceiling off \
  --extra-args="--fused-kernels torch" --log-dir /tmp/e2e_torch --out $OUT/e2e_torch.json
mkdir -p /tmp/prof
step 70 python3 tools/bench_e2e.py --seq-lens 32k --nproc-per-node 1 --splits 1x1 --iters 5 --warmup 3 --timeout 65 --ceiling off \
  --extra-args="--fused-kernels liger --profile --profile-step-start 4 --profile-step-end 5 --profile-dir /tmp/prof --record-memory-history --memory-snapshot-path /tmp/prof/snap.pickle --memory-snapshot-iteration 3" \
  --log-dir /tmp/e2e_prof --out /tmp/prof/e2e_prof.json
cp /tmp/prof/rank0_iters4-4.txt $OUT/profile32k_kernels.txt 2>/dev/null
python3 -m megatron.bench.trace_summary /tmp/prof/rank0_iters4-4.json > $OUT/profile32k_summary.txt 2>&1
cp /tmp/prof/snap.rank0.pickle.txt $OUT/memory32k.txt 2>/dev/null
tar czf $OUT/logs.tgz -C /tmp e2e_liger e2e_torch e2e_prof 2>/dev/null
echo "done t=$SECONDS" >> $LOG
