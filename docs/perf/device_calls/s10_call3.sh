#!/usr/bin/env bash
# 2026-12-03 (session 10), device call 3 (ONE H200): issue 14 after call 2:
#   * --fused-kernels usp (the new choice; auto picks it on CUDA): megatron/usp/lean_kernels.py
#     (the refill hook now lets go of the refilled output: call 2's lean runs kept every layer's
#     until the end of the backward, +3.5 GiB at 32K) and megatron/usp/qkv_rope.py (cos/sin loaded
#     once per token block instead of once per head);
#   * the optimizer step's grad norm and clipping with torch._foreach_* and one host read of
#     loss + norm (megatron/training/grad_clip.py, training.guarded_optimizer_step).
#   (a) tests/gpu (every GPU test: the training loop changed);
#   (b) tools/bench_fused_kernels.py at 32K / 64K;
#   (c) the side-by-side table 32K / 64K against HF + Liger with --fused-kernels usp;
#   (d) the same runs with --fused-kernels liger (the previous default), same code otherwise;
#   (e) one profiled 32K iteration of (c), trace kept.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
step() { local t=$1; shift; echo "== $* (t=$SECONDS)" >> $LOG; timeout "$t" "$@" 2>&1 | grep -v "could not be imported\|UserWarning\|warnings.warn\|use_return_dict" >> $LOG; echo "rc=${PIPESTATUS[0]} t=$SECONDS" >> $LOG; }
cap() { local l=$(( 575 - SECONDS )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
step 170 python3 -m pytest -q tests/gpu -p no:cacheprovider
step 60 python3 tools/bench_fused_kernels.py --tokens 32768,65536 --out $OUT/kernels.json
step $(cap 150) python3 tools/bench_e2e.py --nproc-per-node 1 --splits 1x1 --seq-lens 32k,64k --iters 4 --warmup 2 --timeout 100 --recompute lean \
  --peers hf-liger --extra-args="--fused-kernels usp" --log-dir /tmp/e2e_table \
  --out $OUT/e2e_lean.json --markdown $OUT/e2e_lean.md
step $(cap 100) python3 tools/bench_e2e.py --nproc-per-node 1 --splits 1x1 --seq-lens 32k,64k --iters 4 --warmup 2 --timeout 100 --recompute lean \
  --ceiling off --extra-args="--fused-kernels liger" --log-dir /tmp/e2e_liger \
  --out $OUT/e2e_lean_liger.json --markdown $OUT/e2e_lean_liger.md
mkdir -p /tmp/prof
step $(cap 90) python3 tools/bench_e2e.py --seq-lens 32k --nproc-per-node 1 --splits 1x1 --iters 5 --warmup 3 --timeout 85 --ceiling off \
  --recompute lean --extra-args="--fused-kernels usp --profile --profile-step-start 4 --profile-step-end 5 --profile-dir /tmp/prof" \
  --log-dir /tmp/e2e_prof --out $OUT/e2e_prof.json
cp /tmp/prof/rank0_iters4-4.txt $OUT/profile32k_kernels.txt 2>/dev/null
python3 -m megatron.bench.trace_summary /tmp/prof/rank0_iters4-4.json > $OUT/profile32k_summary.txt 2>&1
gzip -c /tmp/prof/rank0_iters4-4.json > $OUT/trace32k.json.gz 2>/dev/null
for d in /tmp/e2e_*; do for f in $d/*.log; do grep -q "Traceback\|Error\|error:" $f && { echo "== $f"; grep -v -i warn $f | grep -v "could not be imported" | tail -25; }; done; done >> $LOG 2>&1
echo "end t=$SECONDS" >> $LOG
