#!/usr/bin/env bash
# Issue 15 (packed documents) on ONE H200, < 240 s in all: the GPU tests of the document
# kernels (bf16 against float64), then the single-GPU document kernel comparison of
# tools/bench_attention.py at 32K and 128K (32 q / 8 KV heads of 128, bf16, causal within
# documents, useful TFLOP/s) for 2K, 8K and lognormal documents. Each phase has its own
# timeout and output file; the bench writes its JSON after every case.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ)" > $LOG
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $LOG 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())" >> $LOG 2>&1
timeout 45 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_document_attention_gpu.py \
  > $OUT/gpu_tests.log 2>&1
echo "pytest gpu rc=$? t=$SECONDS" >> $LOG
BENCH="tools/bench_attention.py --docs fixed:2k,fixed:8k,lognormal --heads 32 --kv-heads 8 \
  --head-dim 128 --dtype bf16 --iters 3 --warmup 1 \
  --doc-kernels dense,tiles,tiles-copy,varlen,per-document,auto"
timeout 75 python3 $BENCH --seq-lens 32k --out $OUT/doc_kernels_32k.json \
  --markdown $OUT/doc_kernels_32k.md >> $LOG 2>&1
echo "bench 32k rc=$? t=$SECONDS" >> $LOG
timeout 100 python3 $BENCH --seq-lens 128k --out $OUT/doc_kernels_128k.json \
  --markdown $OUT/doc_kernels_128k.md >> $LOG 2>&1
echo "bench 128k rc=$? t=$SECONDS" >> $LOG
