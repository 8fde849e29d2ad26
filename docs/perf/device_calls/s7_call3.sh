#!/usr/bin/env bash
# 2026-12-02 (session 7), device call 3 (ONE H200, <= 560 s by its own caps).
#   (a) issue 16: the 0.85B model at 1M tokens, slices of 1 and 2 layers (a full step, ~8 min of
#       attention alone, does not fit a call next to its start-up), full recompute keeping each
#       layer's attention output on the GPU (4 GiB per layer at 1M) and its input in pinned host
#       memory (4 GiB per layer), MLP tiles of 16384; then the depth arithmetic for 16 layers.
#   (b) issue 14: the side-by-side table again (32K / 64K: 128K does not fit the call, ours with Liger kernels and
#       the lean recompute vs HF + Liger, same run) with the float32 gradient buffer that is now
#       the default under --bf16 (the table of 2026-12-01 kept bf16 gradients).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:8
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null)" > $LOG
( while true; do echo "t=$SECONDS host_used_MiB=$(free -m | awk '/Mem:/{print $3}') gpu_MiB=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 2; done > $OUT/mem.log 2>&1 ) &
MON=$!
cap() { local l=$(( 550 - SECONDS )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
BENCH="python3 tools/bench_e2e.py --nproc-per-node 1 --splits 1x1"
for L in 1 2; do
  T=$(cap $(( 70 + 50 * L )))
  timeout $T $BENCH --num-layers $L --seq-lens 1024k --recompute full --ceiling off --iters 1 --warmup 0 \
    --timeout $((T - 4)) --log-dir /tmp/e2e_1m_L$L --out $OUT/e2e_1m_L$L.json \
    --extra-args="--recompute-keep-core-attn --recompute-cpu-offload layer_input --mlp-tile-tokens 16384" >> $LOG 2>&1
  echo "(a) 0.85B 1M L$L rc=$? t=$SECONDS" >> $LOG
done
timeout 10 python3 -m megatron.bench.depth $OUT/e2e_1m_L1.json $OUT/e2e_1m_L2.json \
  --full-layers 16 --gpu-gib 139 --host-gib 125 --out $OUT/e2e_1m_depth.json >> $LOG 2>&1
echo "(a) depth rc=$? t=$SECONDS" >> $LOG
T=$(cap 330)
timeout $T $BENCH --seq-lens 32k,64k --iters 4 --warmup 2 --timeout 100 --recompute lean \
  --peers hf-liger --extra-args="--fused-kernels liger" --log-dir /tmp/e2e_table \
  --out $OUT/e2e_lean.json --markdown $OUT/e2e_lean.md >> $LOG 2>&1
echo "(b) e2e table rc=$? t=$SECONDS" >> $LOG
for d in /tmp/e2e_*; do for f in $d/*.log; do grep -q "Traceback\|Error\|error:" $f && { echo "== $f"; grep -v -i warn $f | tail -25; }; done; done >> $LOG 2>&1
kill $MON 2>/dev/null
echo "end $(date -u +%FT%TZ) t=$SECONDS" >> $LOG
