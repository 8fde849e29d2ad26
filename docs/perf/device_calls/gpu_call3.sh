#!/usr/bin/env bash
# Device call 3 (issue 6): attention sweep with the split causal forward; longest sequence 512K.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ)" > $LOG
timeout 210 python3 -m torch.distributed.run --nproc-per-node 2 --master-port 29541 tools/bench_attention.py \
  --seq-lens 32k,64k,128k,256k --splits 2x1,1x2 --iters 5 --warmup 2 --no-sdpa-anchor --check \
  --out $OUT/attention_h200x2.json --markdown $OUT/attention_h200x2.md >> $LOG 2>&1
echo "bench_attention rc=$? $(date -u +%T) t=$SECONDS" >> $LOG
for split in 2x1 1x2; do
  left=$((585 - SECONDS))
  [ $left -lt 120 ] && { echo "skip $split: $left s left" >> $LOG; continue; }
  timeout $left python3 tools/bench_e2e.py --find-max-seq --start-seq 512k --max-seq 512k --splits $split \
    --iters 2 --warmup 1 --timeout $((left - 5)) --log-dir /tmp/max_$split \
    --out $OUT/max_seq_512k_$split.json --markdown $OUT/max_seq_512k_$split.md >> $LOG 2>&1
  echo "max_seq $split rc=$? $(date -u +%T) t=$SECONDS" >> $LOG
  grep -h "iteration\|memory\|Error" /tmp/max_$split/*/*.log 2>/dev/null | tail -4 >> $LOG
done
echo "end $(date -u +%FT%TZ)" >> $LOG
