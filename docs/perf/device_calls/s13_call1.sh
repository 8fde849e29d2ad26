#!/usr/bin/env bash
# Session 13 (2026-12-04), issue 14, call 1: --gradient-accumulation-fusion (weight gradients
# added into the float32 main_grad by the GEMM, megatron/usp/linear_wgrad.py) and FC2 with the
# SwiGLU inside (its backward rewrites the SwiGLU output over the output gradient).
#   (1) GPU tests: tests/gpu/test_linear_wgrad_gpu.py, and the usp / SwiGLU checks of
#       tests/gpu/test_fused_kernels_gpu.py (the GPT step through the new FC2);
#   (2) 32K A/B, alternating: this tree against .base = 5253b23 (before the change), 4 measured
#       iterations each (--iters 6 --warmup 2), twice; then this tree with
#       --no-gradient-accumulation-fusion (the SwiGLU change alone) once.
# Before it: rm -rf .base && mkdir .base && git archive 5253b23 megatron tools pretrain_gpt.py | tar -x -C .base
# carry [".whl", ".base"].
# Files under $OUT: run.log, ab_new1.json, ab_base1.json, ab_new2.json, ab_base2.json, ab_nofuse.json.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
LOG=$OUT/run.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $LOG
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__)" >> $LOG
echo "== gpu tests (t=$SECONDS)" >> $LOG
env PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_linear_wgrad_gpu.py \
  tests/gpu/test_fused_kernels_gpu.py -k "wgrad or swiglu or usp" 2>&1 | tail -15 >> $LOG
COMMON="--nproc-per-node 1 --splits 1x1 --seq-lens 32k --iters 6 --warmup 2 --timeout 55 --recompute lean --ceiling off"
run() {   # run NAME ROOT [extra flags]
  echo "== $1 (t=$SECONDS)" >> $LOG
  env PYTHONPATH=/tmp/site:$2 timeout 60 python3 $2/tools/bench_e2e.py $COMMON --extra-args="--fused-kernels usp $3" \
    --log-dir /tmp/$1 --out $OUT/$1.json 2>&1 | grep "bench_e2e\]" >> $LOG
}
run ab_new1 $PWD ""
run ab_base1 $PWD/.base ""
run ab_new2 $PWD ""
run ab_base2 $PWD/.base ""
if [ $SECONDS -lt 500 ]; then run ab_nofuse $PWD "--no-gradient-accumulation-fusion"; fi
echo "end t=$SECONDS" >> $LOG
