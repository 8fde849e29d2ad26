#!/usr/bin/env bash
# 2026-12-02 (session 7), device call 5 (ONE H200, <= 200 s by its own caps).
#   (a) tests/gpu/test_long_sequence_gpu.py after the fix of call 4's failure: a resumed
#       HybridDeviceOptimizer run put the restored Adam step of CPU-stepped parameters on the
#       GPU (CPU fused Adam: "Tensors of the same index must be on the same device");
#   (b) at the same time, a probe of where Llama-3-8B's host memory goes with 25 % of the
#       optimizer state on the CPU and NO activation offload, at 8K tokens (2 steps): calls 2
#       and 4 were killed at 125 GiB during the optimizer's start-up, ~55 GiB above the
#       64 GiB of pinned layer-input buffers, more than the slices' 16.5 B per offloaded
#       parameter predicts. mem.log samples host and GPU memory every second.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ)" > $LOG
( timeout 150 python3 -m pytest -v -p no:cacheprovider --timeout 140 --tb=long \
    tests/gpu/test_long_sequence_gpu.py > $OUT/pytest_test_long_sequence_gpu.log 2>&1
  echo "long-seq test rc=$? t=$SECONDS: $(tail -1 $OUT/pytest_test_long_sequence_gpu.log)" >> $LOG ) &
A=$!
( while true; do echo "t=$SECONDS host_used_MiB=$(free -m | awk '/Mem:/{print $3}') gpu_MiB=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 1; done > $OUT/mem.log 2>&1 ) &
MON=$!
timeout 170 python3 tools/bench_e2e.py --model llama3-8b --nproc-per-node 1 --splits 1x1 --recompute full \
  --ceiling off --seq-lens 8k --iters 2 --warmup 1 --timeout 165 --log-dir /tmp/e2e_8b_probe \
  --extra-args="--grad-reduce-in-bf16 --optimizer-cpu-offload --use-precision-aware-optimizer --optimizer-offload-fraction 0.25 --overlap-cpu-optimizer-d2h-h2d --log-interval 1" \
  --out $OUT/llama8b_8k_probe.json >> $LOG 2>&1
echo "8b probe rc=$? t=$SECONDS" >> $LOG
kill $MON 2>/dev/null
grep -v -i warn /tmp/e2e_8b_probe/*.log | grep -E "iteration|layout|parameters|mem|Error|error" | cut -c1-400 | tail -12 >> $LOG
wait $A
echo "end t=$SECONDS" >> $LOG
