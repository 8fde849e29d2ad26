#!/usr/bin/env bash
# Session 14 (2026-12-04), issue 14, calls 1 and 2 (this script with PART=1, then PART=2).
# (1) The GPU tests of the final session-13 tree (a3c07b2), half of tests/gpu per call.
# (2) The open 512K question of docs/performance.md 6.4: session 13's single steps were
#     137.8 s with --gradient-accumulation-fusion (cold, first on the machine) and 130.3 s
#     without it (right after, warm compile caches). Here each runs two steps in a call of
#     its own (--iters 2 --warmup 0: iter_ms_each holds the cold first and the warm second
#     step): PART=1 fused (the default), PART=2 --no-gradient-accumulation-fusion.
# carry [".whl"]. Run as: PART=1 bash docs/perf/device_calls/s14_call1.sh
# Files under $OUT: run.log, e2e_512k_<fused|nofuse>.json, S524288_U1xR1_full.log.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
LOG=$OUT/run.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $LOG
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())" >> $LOG
if [ "${PART:-1}" = 1 ]; then
  TESTS="tests/gpu/test_linear_wgrad_gpu.py tests/gpu/test_fused_kernels_gpu.py tests/gpu/test_training_kernels_gpu.py tests/gpu/test_bf16_grad_buffer_gpu.py"
  NAME=fused; FLAGS=""
else
  TESTS="tests/gpu/test_usp_attention_gpu.py tests/gpu/test_document_attention_gpu.py tests/gpu/test_long_sequence_gpu.py tests/gpu/test_offload_optimizer_gpu.py"
  NAME=nofuse; FLAGS="--no-gradient-accumulation-fusion"
fi
echo "== gpu tests (t=$SECONDS): $TESTS" >> $LOG
env PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -rs -p no:cacheprovider $TESTS 2>&1 | tail -15 >> $LOG
LEFT=$((585 - SECONDS))
echo "== 512k $NAME (t=$SECONDS, $LEFT s left)" >> $LOG
env PYTHONPATH=/tmp/site:$PWD timeout $LEFT python3 tools/bench_e2e.py --seq-lens 512k --splits 1x1 --nproc-per-node 1 \
  --recompute full --iters 2 --warmup 0 --timeout $((LEFT - 5)) --ceiling off \
  --extra-args="--recompute-keep-core-attn --mlp-tile-tokens 16384 $FLAGS" --log-dir /tmp/e2e512 \
  --out $OUT/e2e_512k_$NAME.json 2>&1 | grep "bench_e2e\]" >> $LOG
cp /tmp/e2e512/*.log $OUT/ 2>/dev/null
echo "end t=$SECONDS" >> $LOG
