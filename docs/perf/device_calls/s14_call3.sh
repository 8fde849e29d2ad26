#!/usr/bin/env bash
# Session 14 (2026-12-04), call 3: the last GPU test that call 1's 200 s pytest limit cut off
# (tests/gpu/test_bf16_grad_buffer_gpu.py, ~100 s per case), alone. carry [".whl"].
# Files under $OUT: run.log.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
S=$SECONDS
env PYTHONPATH=/tmp/site:$PWD timeout 400 python3 -m pytest -q -rs -p no:cacheprovider --durations=5 \
  tests/gpu/test_bf16_grad_buffer_gpu.py 2>&1 | tail -15 | tee $OUT/run.log
echo "t=$((SECONDS-S))" | tee -a $OUT/run.log
