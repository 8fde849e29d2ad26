#!/usr/bin/env bash
# Session 12 (2026-12-03), issue 14, call 3: the training loop that reads each step's loss and
# grad norm after the next forward-backward is queued (no host sync between iterations).
#   (1) GPU tests: HostRead (its copy does not wait for the queue), StepClock (step times on
#       the device clock), the fused-Adam step tests; the benchmark runs below train through the loop;
#   Call 2 measured step times on the host between outcome reads: biased low (see README).
#   (2) 32K A/B, alternating: this tree against .base = 620589b (the loop that waits for each
#       step), 4 measured iterations each (--iters 6 --warmup 2), twice;
#   (3) this tree against HF + Liger at 32K and 64K, --rounds 2, the ceiling timed first.
# Before it: rm -rf .base && mkdir .base && git archive 620589b megatron tools pretrain_gpt.py | tar -x -C .base
# carry [".whl", ".base"].
# Files under $OUT: run.log, ab_new1.json, ab_prev1.json, ab_new2.json, ab_prev2.json,
# e2e_rounds.json, e2e_rounds.md.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
LOG=$OUT/run.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $LOG
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__)" >> $LOG
echo "== gpu tests (t=$SECONDS)" >> $LOG
env PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_training_kernels_gpu.py \
  tests/gpu/test_fused_kernels_gpu.py -k "host_read or step_clock or fused_adam" 2>&1 | tail -8 >> $LOG
COMMON="--nproc-per-node 1 --splits 1x1 --seq-lens 32k --iters 6 --warmup 2 --timeout 55 --recompute lean --ceiling off"
ab() {
  echo "== new $1 (t=$SECONDS)" >> $LOG
  env PYTHONPATH=/tmp/site:$PWD timeout 60 python3 tools/bench_e2e.py $COMMON --extra-args="--fused-kernels usp" \
    --log-dir /tmp/ab_new$1 --out $OUT/ab_new$1.json 2>&1 | grep "bench_e2e\]" >> $LOG
  echo "== prev $1 (t=$SECONDS)" >> $LOG
  env PYTHONPATH=/tmp/site:$PWD/.base timeout 60 python3 .base/tools/bench_e2e.py $COMMON --extra-args="--fused-kernels usp" \
    --log-dir /tmp/ab_prev$1 --out $OUT/ab_prev$1.json 2>&1 | grep "bench_e2e\]" >> $LOG
}
ab 1
ab 2
echo "== 32k,64k rounds 2 vs hf-liger (t=$SECONDS)" >> $LOG
env PYTHONPATH=/tmp/site:$PWD timeout $((575 - SECONDS)) python3 tools/bench_e2e.py --nproc-per-node 1 --splits 1x1 \
  --seq-lens 32k,64k --rounds 2 --iters 6 --warmup 2 --timeout 100 --recompute lean --peers hf-liger \
  --extra-args="--fused-kernels usp" --log-dir /tmp/e2e --out $OUT/e2e_rounds.json --markdown $OUT/e2e_rounds.md 2>&1 \
  | grep "bench_e2e\]" >> $LOG
echo "end t=$SECONDS" >> $LOG
