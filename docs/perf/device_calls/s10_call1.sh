#!/usr/bin/env bash
# 2026-12-03 (session 10), device call 1 (ONE H200): issue 14, the fused QKV split + RoPE kernel
# (megatron/usp/qkv_rope.py, RoPE "usp"); s9_call2.sh was refused (no machine), this replaces it.
#   (a) tests/gpu/test_fused_kernels_gpu.py (the bf16 kernel check, and the GPT step with it);
#   (b) tools/bench_fused_kernels.py: op qkv_rope, megatron's split + each RoPE vs the kernel;
#   (c) the side-by-side table 32K / 64K against HF + Liger, same run (as s7_call3.sh), RoPE Liger's;
#   (d) the same two runs of this project with RoPE "usp": OP_IMPL's liger row is edited in this
#       machine's copy only (sed below), so (c) and (d) differ in that one entry.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
step() { local t=$1; shift; echo "== $* (t=$SECONDS)" >> $LOG; timeout "$t" "$@" >> $LOG 2>&1; echo "rc=$? t=$SECONDS" >> $LOG; }
cap() { local l=$(( 575 - SECONDS )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
step 130 python3 -m pytest -q tests/gpu/test_fused_kernels_gpu.py -p no:cacheprovider
step 70 python3 tools/bench_fused_kernels.py --tokens 32768,65536 --out $OUT/kernels.json
step $(cap 200) python3 tools/bench_e2e.py --nproc-per-node 1 --splits 1x1 --seq-lens 32k,64k --iters 4 --warmup 2 --timeout 100 --recompute lean \
  --peers hf-liger --extra-args="--fused-kernels liger" --log-dir /tmp/e2e_table \
  --out $OUT/e2e_lean.json --markdown $OUT/e2e_lean.md
sed -i 's/"liger": {"rms_norm": "torch", "swiglu": "liger", "rope": "liger"}/"liger": {"rms_norm": "torch", "swiglu": "liger", "rope": "usp"}/' megatron/usp/backend_names.py
grep -n '"liger": {' megatron/usp/backend_names.py >> $LOG
step $(cap 150) python3 tools/bench_e2e.py --nproc-per-node 1 --splits 1x1 --seq-lens 32k,64k --iters 4 --warmup 2 --timeout 100 --recompute lean \
  --ceiling off --extra-args="--fused-kernels liger" --log-dir /tmp/e2e_usp \
  --out $OUT/e2e_lean_usp_rope.json --markdown $OUT/e2e_lean_usp_rope.md
for d in /tmp/e2e_*; do for f in $d/*.log; do grep -q "Traceback\|Error\|error:" $f && { echo "== $f"; grep -v -i warn $f | tail -25; }; done; done >> $LOG 2>&1
echo "end t=$SECONDS" >> $LOG
