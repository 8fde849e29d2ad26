#!/usr/bin/env bash
# Session 13 (2026-12-04), issue 14, call 2 (after call 1's 32K A/B; the fused loss's
# output-layer weight gradient now also added in float32 inside each chunk's GEMM):
#   (1) GPU tests of the fused loss (tests/gpu/test_training_kernels_gpu.py);
#   (2) one profiled 32K iteration of this tree (--fused-kernels usp --recompute lean);
#   (3) 64K A/B: this tree against .base = 5253b23, 4 measured iterations each;
#   (4) this tree against HF + Liger at 32K and 64K, --rounds 2, the ceiling timed first.
# Before it: rm -rf .base && mkdir .base && git archive 5253b23 megatron tools pretrain_gpt.py | tar -x -C .base
# carry [".whl", ".base"].
# Files under $OUT: run.log, e2e_prof.json, profile32k_kernels.txt, profile32k_summary.txt,
# ab64_new.json, ab64_base.json, e2e_rounds.json, e2e_rounds.md.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
LOG=$OUT/run.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $LOG
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__)" >> $LOG
echo "== gpu tests (t=$SECONDS)" >> $LOG
env PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/gpu/test_training_kernels_gpu.py 2>&1 | tail -8 >> $LOG
echo "== profile 32k (t=$SECONDS)" >> $LOG
mkdir -p /tmp/prof
env PYTHONPATH=/tmp/site:$PWD timeout 90 python3 tools/bench_e2e.py --seq-lens 32k --nproc-per-node 1 --splits 1x1 \
  --iters 5 --warmup 3 --timeout 85 --ceiling off --recompute lean --extra-args="--fused-kernels usp --profile \
  --profile-step-start 4 --profile-step-end 5 --profile-dir /tmp/prof" --log-dir /tmp/e2e_prof --out $OUT/e2e_prof.json \
  2>&1 | grep "bench_e2e\]" >> $LOG
cp /tmp/prof/rank0_iters4-4.txt $OUT/profile32k_kernels.txt 2>/dev/null
env PYTHONPATH=/tmp/site:$PWD python3 -m megatron.bench.trace_summary /tmp/prof/rank0_iters4-4.json > $OUT/profile32k_summary.txt 2>&1
COMMON="--nproc-per-node 1 --splits 1x1 --seq-lens 64k --iters 6 --warmup 2 --timeout 80 --recompute lean --ceiling off"
run() {   # run NAME ROOT
  echo "== $1 (t=$SECONDS)" >> $LOG
  env PYTHONPATH=/tmp/site:$2 timeout 85 python3 $2/tools/bench_e2e.py $COMMON --extra-args="--fused-kernels usp" \
    --log-dir /tmp/$1 --out $OUT/$1.json 2>&1 | grep "bench_e2e\]" >> $LOG
}
run ab64_new $PWD
run ab64_base $PWD/.base
echo "== 32k,64k rounds 2 vs hf-liger (t=$SECONDS)" >> $LOG
env PYTHONPATH=/tmp/site:$PWD timeout $((585 - SECONDS)) python3 tools/bench_e2e.py --nproc-per-node 1 --splits 1x1 \
  --seq-lens 32k,64k --rounds 2 --iters 6 --warmup 2 --timeout 100 --recompute lean --peers hf-liger \
  --extra-args="--fused-kernels usp" --log-dir /tmp/e2e --out $OUT/e2e_rounds.json --markdown $OUT/e2e_rounds.md 2>&1 \
  | grep "bench_e2e\]" >> $LOG
echo "end t=$SECONDS" >> $LOG
