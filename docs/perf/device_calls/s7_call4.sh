#!/usr/bin/env bash
# 2026-12-02 (session 7), device call 4 (ONE H200, <= 560 s by its own caps).
#   [parallel, correctness only]
#     - tests/gpu/test_long_sequence_gpu.py after two fixes: the check tool takes a port of
#       its own (call 1 failed on EADDRINUSE: MASTER_PORT inherited from the tiled-MLP test),
#       and Megatron-FSDP over one rank is refused at start-up (call 1's diagnosis: gradients
#       doubled at every micro-batch); includes the HybridDeviceOptimizer save / resume;
#     - tests/gpu/test_bf16_grad_buffer_gpu.py[bf16-buffer] (cut by call 1's outer cap);
#   [then alone] Llama-3-8B at 256K, full depth, one step, as call 2 but 25 % (not 30 %) of
#     the optimizer state on the CPU: call 2 was killed by the host OOM killer at 125 GiB
#     during the optimizer's start-up (64 GiB pinned layer-input buffers + the offloaded
#     state); by the slices' count, GPU ~132 GiB, host ~100 GiB + what call 2 left unexplained.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ)" > $LOG
t() { local cap=$1; shift; timeout $cap python3 -m pytest -v -p no:cacheprovider --timeout $((cap - 10)) \
        --tb=long "$@" > $OUT/pytest_$(basename ${1%%.py*}).log 2>&1
      echo "$1 rc=$? t=$SECONDS: $(tail -1 $OUT/pytest_$(basename ${1%%.py*}).log)" >> $LOG; }
t 200 tests/gpu/test_long_sequence_gpu.py &
A=$!
t 200 "tests/gpu/test_bf16_grad_buffer_gpu.py::test_bf16_training_saves_and_resumes[bf16-buffer]" &
B=$!
wait $A $B
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:8
( while true; do echo "t=$SECONDS host_used_MiB=$(free -m | awk '/Mem:/{print $3}') gpu_MiB=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 2; done > $OUT/mem.log 2>&1 ) &
MON=$!
T=$(( 560 - SECONDS ))
timeout $T python3 tools/bench_e2e.py --model llama3-8b --nproc-per-node 1 --splits 1x1 --recompute full \
  --ceiling off --seq-lens 256k --iters 1 --warmup 0 --timeout $((T - 5)) --log-dir /tmp/e2e_8b_256k \
  --extra-args="--mlp-tile-tokens 8192 --recompute-cpu-offload layer_input --grad-reduce-in-bf16 --optimizer-cpu-offload --use-precision-aware-optimizer --optimizer-offload-fraction 0.25 --overlap-cpu-optimizer-d2h-h2d" \
  --out $OUT/llama8b_256k_full.json >> $LOG 2>&1
echo "8b 256k full depth rc=$? t=$SECONDS" >> $LOG
kill $MON 2>/dev/null
grep -v -i warn /tmp/e2e_8b_256k/*.log | grep -v "^\[rank0\]:  " | tail -30 > $OUT/llama8b_256k_full.log 2>/dev/null
{ dmesg 2>/dev/null | grep -i -E "killed process|out of memory" | tail -3; } >> $LOG
echo "end t=$SECONDS" >> $LOG
