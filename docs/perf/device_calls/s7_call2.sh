#!/usr/bin/env bash
# 2026-12-02 (session 7), device call 2 (ONE H200, <= 560 s by its own caps): issue 16's
# Llama-3-8B targets.
#   (a) Llama-3-8B (preset llama3-8b, 32 layers, 8.03B parameters) at 256K, FULL DEPTH, one
#       step: full recompute with the layer inputs in pinned host memory, 30 % of the optimizer
#       state (float32 master + Adam) on the CPU, bf16 gradients, MLP tiles of 8192 tokens.
#       By the count: GPU 15 (bf16 weights) + 15 (bf16 grads) + 63 (70 % of 12 B/param) +
#       ~24 (one layer's recompute and backward at 256K x 4096) + 4 (two layer inputs in
#       flight) ~ 121 GiB of 140; host 64 (32 layer inputs of 2 GiB) + 36 (30 % of 16 B/param)
#       + ~10 (pinned cache, process) ~ 110 GiB of 125. A monitor samples host/GPU memory.
#   (b) Llama-3-8B at 512K: slices of 1 and 2 layers (all optimizer state on the CPU, layer
#       inputs offloaded), and the depth arithmetic (python -m megatron.bench.depth): does the
#       full depth fit one H200 (the issue expects it does not: 128 GiB of layer inputs alone).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:8
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null)" > $LOG
free -g | head -2 >> $LOG
( while true; do echo "t=$SECONDS host_used_MiB=$(free -m | awk '/Mem:/{print $3}') avail_MiB=$(free -m | awk '/Mem:/{print $7}') gpu_MiB=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 2; done > $OUT/mem.log 2>&1 ) &
MON=$!
cap() { local l=$(( 545 - SECONDS )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
BENCH="python3 tools/bench_e2e.py --model llama3-8b --nproc-per-node 1 --splits 1x1 --recompute full --ceiling off"

T=$(cap 390)
timeout $T $BENCH --seq-lens 256k --iters 1 --warmup 0 --timeout $((T - 5)) --log-dir /tmp/e2e_8b_256k \
  --extra-args="--mlp-tile-tokens 8192 --recompute-cpu-offload layer_input --grad-reduce-in-bf16 --optimizer-cpu-offload --use-precision-aware-optimizer --optimizer-offload-fraction 0.3 --overlap-cpu-optimizer-d2h-h2d" \
  --out $OUT/llama8b_256k_full.json >> $LOG 2>&1
echo "(a) 8b 256k full depth rc=$? t=$SECONDS" >> $LOG

for L in 1 2; do
  T=$(cap $(( (540 - SECONDS) / (3 - L) )))
  timeout $T $BENCH --num-layers $L --seq-lens 512k --iters 1 --warmup 0 --timeout $((T - 4)) \
    --log-dir /tmp/e2e_8b_512k_L$L --out $OUT/llama8b_512k_L$L.json \
    --extra-args="--mlp-tile-tokens 8192 --recompute-cpu-offload layer_input --grad-reduce-in-bf16 --optimizer-cpu-offload --use-precision-aware-optimizer --optimizer-offload-fraction 1.0 --overlap-cpu-optimizer-d2h-h2d" >> $LOG 2>&1
  echo "(b) 8b 512k L$L rc=$? t=$SECONDS" >> $LOG
done
timeout 10 python3 -m megatron.bench.depth $OUT/llama8b_512k_L1.json $OUT/llama8b_512k_L2.json \
  --full-layers 32 --gpu-gib 139 --host-gib 125 --out $OUT/llama8b_512k_depth.json >> $LOG 2>&1
echo "(b) depth rc=$? t=$SECONDS" >> $LOG

for d in /tmp/e2e_*; do for f in $d/*.log; do grep -q "Traceback\|Error\|error:" $f && { echo "== $f"; grep -v -i warn $f | tail -25; }; done; done >> $LOG 2>&1
timeout 10 python3 - >> $LOG 2>&1 <<'PY'
import glob, json, os
for path in sorted(glob.glob(os.path.join(os.environ["OUT"], "llama8b_*.json"))):
    for r in json.load(open(path)).get("results", []):
        print(os.path.basename(path), {k: r.get(k) for k in ("seq_len", "num_layers", "status",
              "iter_ms", "mfu", "peak_mem_gib", "peak_host_gib")})
PY
kill $MON 2>/dev/null
{ echo "cgroup memory.peak: $(cat /sys/fs/cgroup/memory.peak 2>/dev/null)"; dmesg 2>/dev/null | grep -i -E "killed process|out of memory" | tail -5; } >> $LOG
echo "end $(date -u +%FT%TZ) t=$SECONDS" >> $LOG
