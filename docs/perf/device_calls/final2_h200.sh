#!/usr/bin/env bash
# The session's closing device call (one H200, <= 300 s): the whole GPU test tier alone on the
# GPU (the first final call ran it beside issue 13's runs and ran out of time), each test
# printed as it ends; then issue 17's checksum cost (tools/bench_checkpoint.py at 0.85B).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log; echo "start $(date -u +%FT%TZ)" > $LOG
timeout 185 python3 -m pytest -v -p no:cacheprovider --timeout 90 tests/gpu/test_fused_kernels_gpu.py \
  tests/gpu/test_training_kernels_gpu.py tests/gpu/test_usp_attention_gpu.py \
  tests/gpu/test_document_attention_gpu.py tests/gpu/test_long_sequence_gpu.py \
  tests/gpu/test_bf16_grad_buffer_gpu.py > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$? t=$SECONDS" >> $LOG
grep -E "PASSED|FAILED|SKIPPED|ERROR" $OUT/gpu_tests.log | sed 's/ *\[.*%\]//' >> $LOG
mkdir -p /tmp/ck; OUT=/tmp/ck timeout 85 bash docs/perf/device_calls/checksum_h200.sh
echo "checksum rc=$? t=$SECONDS" >> $LOG; cp /tmp/ck/* $OUT/ 2>/dev/null
echo "end t=$SECONDS" >> $LOG
