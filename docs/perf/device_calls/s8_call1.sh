#!/usr/bin/env bash
# 2026-12-02 (session 8), device call 1 (ONE H200, <= 560 s by its own caps).
#   [parallel, correctness only]
#     - tests/gpu/test_offload_optimizer_gpu.py: the staged HybridDeviceOptimizer
#       (megatron/training/offload_optimizer.py) bitwise against megatron-core's;
#     - tests/gpu/test_long_sequence_gpu.py: pretrain with --optimizer-cpu-offload (now the
#       staged optimizer) at fraction 1.0 and 0.5, each saved at step 3 and resumed;
#   [then alone] Llama-3-8B, full depth, 8K tokens, 2 steps (1 warm-up), the flags of the
#     256K try (35 % of the optimizer state on the CPU, layer inputs offloaded): the start-up
#     memory lines and the steady-state GPU / host memory without the long activations.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ)" > $LOG
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> $LOG 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())" >> $LOG 2>&1
free -g >> $LOG; nproc >> $LOG
t() { local cap=$1 f=$2; timeout $cap python3 -m pytest -v -p no:cacheprovider --timeout $((cap - 10)) \
        --tb=long tests/gpu/$f > $OUT/pytest_${f%.py}.log 2>&1
      echo "$f rc=$? t=$SECONDS: $(tail -1 $OUT/pytest_${f%.py}.log)" >> $LOG; }
t 150 test_offload_optimizer_gpu.py &
A=$!
t 260 test_long_sequence_gpu.py &
B=$!
wait $A $B
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
( while true; do echo "t=$SECONDS host_used_MiB=$(free -m | awk '/Mem:/{print $3}') gpu_MiB=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 2; done > $OUT/mem_8k.log 2>&1 ) &
MON=$!
T=$(( 560 - SECONDS ))
timeout $T python3 tools/bench_e2e.py --model llama3-8b --nproc-per-node 1 --splits 1x1 --recompute full \
  --ceiling off --seq-lens 8k --iters 2 --warmup 1 --timeout $((T - 5)) --log-dir /tmp/e2e_8b_8k \
  --extra-args="--mlp-tile-tokens 8192 --recompute-cpu-offload layer_input --grad-reduce-in-bf16 --optimizer-cpu-offload --use-precision-aware-optimizer --optimizer-offload-fraction 0.35 --overlap-cpu-optimizer-d2h-h2d" \
  --out $OUT/llama8b_8k_probe.json >> $LOG 2>&1
echo "8b 8k probe rc=$? t=$SECONDS" >> $LOG
kill $MON 2>/dev/null
grep -v -i warn /tmp/e2e_8b_8k/*.log | grep -v "^\[rank0\]:  " | tail -40 > $OUT/llama8b_8k_probe.log 2>/dev/null
{ dmesg 2>/dev/null | grep -i -E "killed process|out of memory" | tail -3; } >> $LOG
echo "end t=$SECONDS" >> $LOG
