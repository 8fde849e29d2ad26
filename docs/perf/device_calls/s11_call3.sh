#!/usr/bin/env bash
# 2026-12-03 (session 11), device call 3 (ONE H200), issue 14: the optimizer step with the
# 1/num-tokens division, the clip and the non-finite skip inside PyTorch's fused Adam
# (megatron/training/grad_clip.py scaled_in_adam; training.guarded_optimizer_step;
# finalize_model_grads without its division and its host sync), side by side with the code
# of 583ccdc (session 10's last commit, exported to .base/ by `git archive 583ccdc megatron
# tools pretrain_gpt.py | tar -x -C .base` and carried) in the same call:
#   (a) this tree, --fused-kernels usp --recompute lean, 32K / 64K, against HF + Liger;
#   (b) .base (583ccdc), the same runs, no peers;
#   (c) one profiled 32K iteration of (a): where the rest of the time goes.
# Files under $OUT: run.log, e2e_new.json, e2e_new.md, e2e_base.json, e2e_prof.json,
# profile32k_kernels.txt, profile32k_summary.txt (7 of the 8 allowed).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
LOG=$OUT/run.log
step() { local t=$1; shift; echo "== $* (t=$SECONDS)" >> $LOG; timeout "$t" "$@" 2>&1 | grep -v "could not be imported\|UserWarning\|warnings.warn\|use_return_dict" >> $LOG; echo "rc=${PIPESTATUS[0]} t=$SECONDS" >> $LOG; }
cap() { local l=$(( 580 - SECONDS )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
COMMON="--nproc-per-node 1 --splits 1x1 --seq-lens 32k,64k --iters 4 --warmup 2 --timeout 100 --recompute lean"
export PYTHONPATH=/tmp/site:$PWD
step 60 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_fused_kernels_gpu.py -k "scaled_in_fused_adam or fused_adam_switch"
step $(cap 170) python3 tools/bench_e2e.py $COMMON --peers hf-liger --extra-args="--fused-kernels usp" \
  --log-dir /tmp/e2e_new --out $OUT/e2e_new.json --markdown $OUT/e2e_new.md
step $(cap 120) env PYTHONPATH=/tmp/site:$PWD/.base python3 .base/tools/bench_e2e.py $COMMON --ceiling off \
  --extra-args="--fused-kernels usp" --log-dir /tmp/e2e_base --out $OUT/e2e_base.json
mkdir -p /tmp/prof
step $(cap 90) python3 tools/bench_e2e.py --seq-lens 32k --nproc-per-node 1 --splits 1x1 --iters 5 --warmup 3 --timeout 85 --ceiling off \
  --recompute lean --extra-args="--fused-kernels usp --profile --profile-step-start 4 --profile-step-end 5 --profile-dir /tmp/prof" \
  --log-dir /tmp/e2e_prof --out $OUT/e2e_prof.json
cp /tmp/prof/rank0_iters4-4.txt $OUT/profile32k_kernels.txt 2>/dev/null
python3 -m megatron.bench.trace_summary /tmp/prof/rank0_iters4-4.json > $OUT/profile32k_summary.txt 2>&1
for d in /tmp/e2e_*; do for f in $d/*.log; do grep -q "Traceback\|Error\|error:" $f && { echo "== $f"; grep -v -i warn $f | grep -v "could not be imported" | tail -25; }; done; done >> $LOG 2>&1
echo "end t=$SECONDS" >> $LOG
