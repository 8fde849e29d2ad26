#!/usr/bin/env bash
# 2026-12-03 (session 10), device call 2 (ONE H200): issue 14, this project's RMSNorm and SwiGLU
# kernels (megatron/usp/lean_kernels.py: one Triton kernel each way, the lean layers' outputs
# refilled in place instead of recomputed through CheckpointWithoutOutput).
#   (a) tests/gpu/test_fused_kernels_gpu.py (bf16 kernel checks incl. usp, GPT step with usp kept / lean);
#   (b) tools/bench_fused_kernels.py at 32K / 64K (RMSNorm now with its weight gradient);
#   (c) the side-by-side table 32K / 64K against HF + Liger (defaults: --fused-kernels liger);
#   (d) the same two runs of this project with every op "usp": OP_IMPL's liger row edited in this
#       machine's copy only (sed below), so (c) and (d) differ in that one line;
#   (e) one profiled 32K iteration of (d).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
step() { local t=$1; shift; echo "== $* (t=$SECONDS)" >> $LOG; timeout "$t" "$@" >> $LOG 2>&1; echo "rc=$? t=$SECONDS" >> $LOG; }
cap() { local l=$(( 575 - SECONDS )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
step 150 python3 -m pytest -q tests/gpu/test_fused_kernels_gpu.py -p no:cacheprovider
step 70 python3 tools/bench_fused_kernels.py --tokens 32768,65536 --out $OUT/kernels.json
step $(cap 200) python3 tools/bench_e2e.py --nproc-per-node 1 --splits 1x1 --seq-lens 32k,64k --iters 4 --warmup 2 --timeout 100 --recompute lean \
  --peers hf-liger --extra-args="--fused-kernels liger" --log-dir /tmp/e2e_table \
  --out $OUT/e2e_lean.json --markdown $OUT/e2e_lean.md
sed -i 's/"liger": {"rms_norm": "torch", "swiglu": "liger", "rope": "liger"}/"liger": {"rms_norm": "usp", "swiglu": "usp", "rope": "usp"}/' megatron/usp/backend_names.py
grep -n '"liger": {' megatron/usp/backend_names.py >> $LOG
step $(cap 120) python3 tools/bench_e2e.py --nproc-per-node 1 --splits 1x1 --seq-lens 32k,64k --iters 4 --warmup 2 --timeout 100 --recompute lean \
  --ceiling off --extra-args="--fused-kernels liger" --log-dir /tmp/e2e_usp \
  --out $OUT/e2e_lean_usp.json --markdown $OUT/e2e_lean_usp.md
mkdir -p /tmp/prof
step $(cap 100) python3 tools/bench_e2e.py --seq-lens 32k --nproc-per-node 1 --splits 1x1 --iters 5 --warmup 3 --timeout 95 --ceiling off \
  --recompute lean --extra-args="--fused-kernels liger --profile --profile-step-start 4 --profile-step-end 5 --profile-dir /tmp/prof" \
  --log-dir /tmp/e2e_prof --out $OUT/e2e_prof_usp.json
cp /tmp/prof/rank0_iters4-4.txt $OUT/profile32k_usp_kernels.txt 2>/dev/null
python3 -m megatron.bench.trace_summary /tmp/prof/rank0_iters4-4.json > $OUT/profile32k_usp_summary.txt 2>&1
for d in /tmp/e2e_*; do for f in $d/*.log; do grep -q "Traceback\|Error\|error:" $f && { echo "== $f"; grep -v -i warn $f | grep -v "could not be imported" | tail -25; }; done; done >> $LOG 2>&1
echo "end t=$SECONDS" >> $LOG
