#!/usr/bin/env bash
# 2026-12-02 (session 8), device call 3 (ONE H200, <= 590 s by its own caps).
#   [parallel, correctness only] tests/gpu/test_offload_optimizer_gpu.py (now with the pinned
#     copy-back and the state-dict round trip) and tests/gpu/test_long_sequence_gpu.py (resume
#     at fraction 0.5 failed in call 1: megatron-core's loader moved the GPU moments to the CPU);
#   [then alone] Llama-3-8B at 256K, full depth, one step, as call 2 but 30 % (not 35 %) of the
#     optimizer state on the CPU and the CPU sub-optimizers' values copied back through the
#     pinned staging: call 2 ran its forward and backward (GPU 125.9 GB by nvidia-smi, host
#     108 GB) and was killed by the host OOM killer at the optimizer step, host "used" rising
#     by 20 GB outside the process's RSS (anon 35.3 GB + shmem 71.4 GB); /proc/meminfo is
#     sampled this time to name the kind of memory.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ)" > $LOG
t() { local cap=$1 f=$2; timeout $cap python3 -m pytest -v -p no:cacheprovider --timeout $((cap - 10)) \
        --tb=long tests/gpu/$f > $OUT/pytest_${f%.py}.log 2>&1
      echo "$f rc=$? t=$SECONDS: $(tail -1 $OUT/pytest_${f%.py}.log)" >> $LOG; }
t 120 test_offload_optimizer_gpu.py &
A=$!
t 200 test_long_sequence_gpu.py &
B=$!
wait $A $B
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
( while true; do echo "t=$SECONDS host_used_MiB=$(free -m | awk '/Mem:/{print $3}') gpu_MiB=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits) $(awk '/^(AnonPages|Shmem|Mlocked|Unevictable|Slab|VmallocUsed|PageTables|Cached|MemFree):/{printf "%s%d ", $1, $2/1024}' /proc/meminfo)"; sleep 2; done > $OUT/mem_256k.log 2>&1 ) &
MON=$!
T=$(( 590 - SECONDS ))
timeout $T python3 tools/bench_e2e.py --model llama3-8b --nproc-per-node 1 --splits 1x1 --recompute full \
  --ceiling off --seq-lens 256k --iters 1 --warmup 0 --timeout $((T - 5)) --log-dir /tmp/e2e_8b_256k \
  --extra-args="--mlp-tile-tokens 8192 --recompute-cpu-offload layer_input --grad-reduce-in-bf16 --optimizer-cpu-offload --use-precision-aware-optimizer --optimizer-offload-fraction 0.3 --overlap-cpu-optimizer-d2h-h2d" \
  --out $OUT/llama8b_256k_full.json >> $LOG 2>&1
echo "8b 256k full depth rc=$? t=$SECONDS" >> $LOG
kill $MON 2>/dev/null
grep -v -i warn /tmp/e2e_8b_256k/*.log | grep -v "^\[rank0\]:  " | tail -40 > $OUT/llama8b_256k_full.log 2>/dev/null
{ dmesg 2>/dev/null | grep -i -E -A30 "invoked oom-killer" | tail -60; } > $OUT/dmesg_oom.log
{ dmesg 2>/dev/null | grep -i -E "killed process|out of memory" | tail -3; } >> $LOG
echo "end t=$SECONDS" >> $LOG
