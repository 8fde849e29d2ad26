#!/usr/bin/env bash
# Session 14 (2026-12-04), call 5: Adam's state made when the optimizer is built
# (training.allocate_adam_state), so the first step holds the memory of every later one.
#   (1) GPU tests: tests/gpu/test_adam_state_gpu.py, the fused-Adam checks of
#       test_fused_kernels_gpu.py, test_offload_optimizer_gpu.py, and the bf16 save / resume
#       test (fp32-buffer case) of test_bf16_grad_buffer_gpu.py;
#   (2) 32K, two steps each (--iters 2 --warmup 0), this tree and .base = bbc0211 (before the
#       change): the per-iteration "mem (GiB)" of each log (the peak so far).
# Before it: rm -rf .base && mkdir .base && git archive bbc0211 megatron tools pretrain_gpt.py | tar -x -C .base
# carry [".whl", ".base"]. Files under $OUT: run.log, mem_new.json, mem_base.json.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
LOG=$OUT/run.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $LOG
echo "== gpu tests (t=$SECONDS)" >> $LOG
env PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_adam_state_gpu.py \
  tests/gpu/test_offload_optimizer_gpu.py "tests/gpu/test_fused_kernels_gpu.py::test_fused_adam_switch_on_gpu" \
  tests/gpu/test_fused_kernels_gpu.py::test_step_scaled_in_fused_adam_on_gpu \
  "tests/gpu/test_bf16_grad_buffer_gpu.py::test_bf16_training_saves_and_resumes[fp32-buffer]" 2>&1 | tail -8 >> $LOG
run() {   # run NAME ROOT
  echo "== $1 (t=$SECONDS)" >> $LOG
  env PYTHONPATH=/tmp/site:$2 timeout 80 python3 $2/tools/bench_e2e.py --nproc-per-node 1 --splits 1x1 --seq-lens 32k \
    --iters 2 --warmup 0 --timeout 75 --recompute lean --ceiling off --extra-args="--fused-kernels usp" \
    --log-dir /tmp/$1 --out $OUT/$1.json 2>&1 | grep "bench_e2e\]" >> $LOG
  grep -h "after building\|iteration " /tmp/$1/*.log | sed 's/.*elapsed time per iteration (ms): \([0-9.]*\).*lm loss[^:]*: \([0-9.E+-]*\).*mem (GiB): \([0-9.]*\).*/  iteration: \1 ms, loss \2, mem (GiB) \3/' >> $LOG
}
run mem_new $PWD
run mem_base $PWD/.base
echo "end t=$SECONDS" >> $LOG
