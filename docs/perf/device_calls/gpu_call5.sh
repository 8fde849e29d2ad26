#!/usr/bin/env bash
# Device call 5: end to end at 128K with U2 again (this session's split causal forward applies to
# U2's 128K local sequence; the call-2 row predates it) and a second 128K attention sample.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ)" > $LOG
timeout 100 python3 tools/bench_e2e.py --seq-lens 128k --splits 2x1 --iters 6 --warmup 3 --timeout 95 \
  --log-dir /tmp/e2e --out $OUT/e2e_128k_u2_split.json --markdown $OUT/e2e_128k_u2_split.md >> $LOG 2>&1
echo "bench_e2e rc=$? t=$SECONDS" >> $LOG
timeout 80 python3 -m torch.distributed.run --nproc-per-node 2 --master-port 29551 tools/bench_attention.py \
  --seq-lens 128k --splits 2x1,1x2 --iters 7 --warmup 2 --no-sdpa-anchor \
  --out $OUT/attention_128k_repeat.json --markdown $OUT/attention_128k_repeat.md >> $LOG 2>&1
echo "bench_attention rc=$? t=$SECONDS" >> $LOG
