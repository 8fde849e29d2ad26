#!/usr/bin/env bash
# 2026-12-02 (session 8), device call 2 (ONE H200, <= 590 s by its own caps).
#   Llama-3-8B at 256K tokens, full depth, one step, alone on the GPU: the staged
#   HybridDeviceOptimizer (megatron/training/offload_optimizer.py) with 35 % of the optimizer
#   state on the CPU, layer inputs offloaded (64 GiB pinned, reserved after the optimizer), MLP
#   tiles of 8192 tokens, bf16 gradient reduction. Call 1's 8K probe with the same flags:
#   87.4 GiB GPU / 37.5 GiB host after building the optimizer; by the 512K slices the 256K
#   activations add ~31 GiB GPU, the pinned layer inputs 64 GiB host.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ)" > $LOG
( while true; do echo "t=$SECONDS host_used_MiB=$(free -m | awk '/Mem:/{print $3}') gpu_MiB=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 2; done > $OUT/mem_256k.log 2>&1 ) &
MON=$!
T=$(( 590 - SECONDS ))
timeout $T python3 tools/bench_e2e.py --model llama3-8b --nproc-per-node 1 --splits 1x1 --recompute full \
  --ceiling off --seq-lens 256k --iters 1 --warmup 0 --timeout $((T - 5)) --log-dir /tmp/e2e_8b_256k \
  --extra-args="--mlp-tile-tokens 8192 --recompute-cpu-offload layer_input --grad-reduce-in-bf16 --optimizer-cpu-offload --use-precision-aware-optimizer --optimizer-offload-fraction 0.35 --overlap-cpu-optimizer-d2h-h2d" \
  --out $OUT/llama8b_256k_full.json >> $LOG 2>&1
echo "8b 256k full depth rc=$? t=$SECONDS" >> $LOG
kill $MON 2>/dev/null
grep -v -i warn /tmp/e2e_8b_256k/*.log | grep -v "^\[rank0\]:  " | tail -40 > $OUT/llama8b_256k_full.log 2>/dev/null
{ dmesg 2>/dev/null | grep -i -E "killed process|out of memory" | tail -3; } >> $LOG
echo "end t=$SECONDS" >> $LOG
