#!/usr/bin/env bash
# 2026-12-02 (session 7), device call 1 (ONE H200, <= 560 s by its own caps):
#   [parallel, correctness only]
#     - every file of tests/gpu in its own pytest process (two chains), each report kept whole
#       under $OUT/pytest_<file>.log (a pytest killed by an outer timeout prints no traceback);
#     - Megatron-FSDP's loss gap (2.8 % in 6 steps last session): tools/gpu_long_sequence_check.py
#       with the diagnosis pairs (one micro-batch per step; --clip-grad 0) beside full / fsdp,
#       each case's losses, lr and grad norm per step -> $OUT/fsdp_diagnosis.json;
#   [then alone on the GPU, timed] issue 17's checksum cost at the 0.85B model with the
#     memory-mapped, parallel hashing (checksum_h200.sh).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null)" > $LOG
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> $LOG 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())" >> $LOG 2>&1
t() { local cap=$1 f=$2; timeout $cap python3 -m pytest -v -p no:cacheprovider --timeout $((cap - 10)) \
        --tb=long tests/gpu/$f > $OUT/pytest_${f%.py}.log 2>&1
      echo "$f rc=$? t=$SECONDS: $(tail -1 $OUT/pytest_${f%.py}.log)" >> $LOG; }
( t 200 test_long_sequence_gpu.py; t 120 test_fused_kernels_gpu.py; t 120 test_document_attention_gpu.py ) &
C1=$!
( t 240 test_bf16_grad_buffer_gpu.py; t 120 test_training_kernels_gpu.py; t 120 test_usp_attention_gpu.py ) &
C2=$!
( MASTER_PORT=29611 timeout 200 python3 tools/gpu_long_sequence_check.py --cases full fsdp \
    full_one_microbatch fsdp_one_microbatch full_no_clip fsdp_no_clip \
    --out $OUT/fsdp_diagnosis.json > /tmp/fsdp.log 2>&1
  echo "fsdp diagnosis rc=$? t=$SECONDS" >> $LOG; grep -v -i warn /tmp/fsdp.log | tail -30 > $OUT/fsdp_diagnosis.log ) &
C3=$!
wait $C1 $C2 $C3
T=$(( 555 - SECONDS )); [ $T -gt 190 ] && T=190
CK_SAVES=3 CK_TIMEOUT=$((T - 5)) OUT=/tmp/ck timeout $T bash -c 'mkdir -p /tmp/ck; bash docs/perf/device_calls/checksum_h200.sh'
RC=$?; cp /tmp/ck/checksum_h200.json $OUT/ 2>/dev/null; cp /tmp/ck/run.log $OUT/checksum_run.log 2>/dev/null
echo "checksum rc=$RC t=$SECONDS: $(grep -o '"overhead": [0-9.e-]*' $OUT/checksum_h200.json 2>/dev/null)" >> $LOG
echo "end t=$SECONDS" >> $LOG
