#!/usr/bin/env bash
# Device call 2 (issue 6): final attention sweep with the native-CP peer, end-to-end 32K/64K/128K.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ)" > $LOG
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torch.cuda.nccl.version())" >> $LOG
timeout 240 python3 -m torch.distributed.run --nproc-per-node 2 --master-port 29531 tools/bench_attention.py \
  --seq-lens 32k,64k,128k,256k --splits 2x1,1x2 --iters 5 --warmup 2 --no-sdpa-anchor --check \
  --out $OUT/attention_h200x2.json --markdown $OUT/attention_h200x2.md >> $LOG 2>&1
echo "bench_attention rc=$? $(date -u +%T)" >> $LOG
timeout 300 python3 tools/bench_e2e.py --seq-lens 32k,64k,128k --splits 2x1,1x2 --iters 6 --warmup 3 --timeout 90 \
  --log-dir /tmp/e2e --out $OUT/e2e_h200x2.json --markdown $OUT/e2e_h200x2.md >> $LOG 2>&1
echo "bench_e2e rc=$? $(date -u +%T)" >> $LOG
echo "end $(date -u +%FT%TZ)" >> $LOG
