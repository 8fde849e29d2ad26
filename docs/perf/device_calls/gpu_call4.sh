#!/usr/bin/env bash
# Device call 4: GPU test tier for this session's changes (narrow ring accumulators, split causal
# forward, fused loss) + fwd/bwd numerics of U2xR1 / U1xR2 against fp32 references.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl scratch/pyw/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ)" > $LOG
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_training_kernels_gpu.py \
  "tests/gpu/test_usp_attention_gpu.py::test_torch_kernel_routes_on_gpu" >> $LOG 2>&1
echo "pytest gpu rc=$? t=$SECONDS" >> $LOG
timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 tools/gpu_attention_check.py \
  --out $OUT/gpu_attention_check_session3.json --layouts 2x1 1x2 --seq-lens 8192 32768 \
  --timing-iters 2 >> $LOG 2>&1
echo "gpu_attention_check rc=$? t=$SECONDS" >> $LOG
echo "end $(date -u +%FT%TZ)" >> $LOG
