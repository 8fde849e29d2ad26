#!/usr/bin/env bash
# 2026-12-02, device call 3 of the session (ONE H200, <= 500 s by its own caps).
#   [parallel, correctness only; the two GPU tests that failed in call 1 without a traceback
#    (pytest's report was cut by the call's own cap)]
#     - tools/gpu_long_sequence_check.py straight to $OUT/long_seq_gpu.json (each case's
#       losses or traceback; the assertions of test_training_flags_on_one_gpu read it);
#     - pytest tests/gpu/test_bf16_grad_buffer_gpu.py[fp32-buffer] alone, -x, its report kept;
#   [then alone on the GPU, timed] issue 16's offload cost at 128K (kept attention + tiled MLP,
#     with and without --recompute-cpu-offload layer_input core_attn, 1 timed step after 1
#     warm-up each), then a Llama-3-8B one-layer slice at 256K (optimizer state on the CPU)
#     whose failure in call 2 left no cause (bench_e2e now records it).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:8
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ)" > $LOG
( timeout 170 python3 tools/gpu_long_sequence_check.py --out $OUT/long_seq_gpu.json > /tmp/lsc.log 2>&1
  echo "long-seq check rc=$? t=$SECONDS" >> $LOG; grep -v -i warn /tmp/lsc.log | tail -40 > $OUT/long_seq_check.log ) &
CHK=$!
timeout 170 python3 -m pytest -x -p no:cacheprovider --timeout 160 --tb=short \
  "tests/gpu/test_bf16_grad_buffer_gpu.py::test_bf16_training_saves_and_resumes[fp32-buffer]" \
  > /tmp/bf16.log 2>&1
echo "bf16 test rc=$? t=$SECONDS" >> $LOG
grep -v -i "warn" /tmp/bf16.log | tail -80 > $OUT/bf16_test.log
wait $CHK
BENCH="python3 tools/bench_e2e.py --nproc-per-node 1 --splits 1x1 --recompute full"
KEEP="--recompute-keep-core-attn --mlp-tile-tokens 8192"
for name in keep keep_offload; do
  extra="$KEEP"; [ $name = keep_offload ] && extra="$extra --recompute-cpu-offload layer_input core_attn"
  timeout 110 $BENCH --seq-lens 128k --iters 2 --warmup 1 --timeout 105 --log-dir /tmp/e2e_128k_$name \
    --extra-args="$extra" --out $OUT/e2e_128k_$name.json >> $LOG 2>&1
  echo "128k $name rc=$? t=$SECONDS" >> $LOG
done
T=$(( 495 - SECONDS )); [ $T -gt 120 ] && T=120
timeout $T $BENCH --model llama3-8b --num-layers 1 --seq-lens 256k --iters 1 --warmup 0 \
  --timeout $((T - 4)) --log-dir /tmp/e2e_8b_L1 --out $OUT/llama8b_256k_L1.json \
  --extra-args="--mlp-tile-tokens 8192 --optimizer-cpu-offload --use-precision-aware-optimizer --optimizer-offload-fraction 1.0 --overlap-cpu-optimizer-d2h-h2d" >> $LOG 2>&1
echo "8b L1 rc=$? t=$SECONDS" >> $LOG
grep -v -i warn /tmp/e2e_8b_L1/*.log 2>/dev/null | grep -B2 -A12 -m3 "Traceback\|error:" | head -60 >> $LOG
echo "end t=$SECONDS" >> $LOG
