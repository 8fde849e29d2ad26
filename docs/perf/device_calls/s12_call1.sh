#!/usr/bin/env bash
# Session 12 (2026-12-03), issue 14, call 1: session 11's prepared s11_call4.sh (32K A/B,
# this tree against 583ccdc, the code before the optimizer step moved into fused Adam,
# alternating, 4 measured iterations each) and s11_call5.sh (512K with the default kernels,
# --fused-kernels auto = usp on CUDA, full recompute) in one call.
# Before it: rm -rf .base && mkdir .base && git archive 583ccdc megatron tools pretrain_gpt.py | tar -x -C .base
# carry [".whl", ".base"]. Tree: 6256882 (session 11's last commit).
# Files under $OUT: run.log, ab_new1.json, ab_base1.json, e2e_512k.json, e2e_512k.md,
# S524288_U1xR1_full.log, ab_new2.json, ab_base2.json.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
LOG=$OUT/run.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $LOG
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())" >> $LOG
COMMON="--nproc-per-node 1 --splits 1x1 --seq-lens 32k --iters 6 --warmup 2 --timeout 55 --recompute lean --ceiling off"
ab() {
  echo "== new $1 (t=$SECONDS)" >> $LOG
  env PYTHONPATH=/tmp/site:$PWD timeout 60 python3 tools/bench_e2e.py $COMMON --extra-args="--fused-kernels usp" \
    --log-dir /tmp/ab_new$1 --out $OUT/ab_new$1.json 2>&1 | grep "bench_e2e\]" >> $LOG
  echo "== base $1 (t=$SECONDS)" >> $LOG
  env PYTHONPATH=/tmp/site:$PWD/.base timeout 60 python3 .base/tools/bench_e2e.py $COMMON --extra-args="--fused-kernels usp" \
    --log-dir /tmp/ab_base$1 --out $OUT/ab_base$1.json 2>&1 | grep "bench_e2e\]" >> $LOG
}
ab 1
echo "== 512k (t=$SECONDS)" >> $LOG
env PYTHONPATH=/tmp/site:$PWD timeout 345 python3 tools/bench_e2e.py --seq-lens 512k --splits 1x1 --nproc-per-node 1 \
  --recompute full --iters 1 --warmup 0 --timeout 330 --extra-args="--recompute-keep-core-attn --mlp-tile-tokens 16384" \
  --log-dir /tmp/e2e512 --out $OUT/e2e_512k.json --markdown $OUT/e2e_512k.md >> $LOG 2>&1
echo "rc=$? (t=$SECONDS)" >> $LOG
cp /tmp/e2e512/*.log $OUT/ 2>/dev/null
if [ $SECONDS -lt 470 ]; then ab 2; fi
echo "end t=$SECONDS" >> $LOG
