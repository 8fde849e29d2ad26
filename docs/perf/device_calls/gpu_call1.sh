#!/usr/bin/env bash
# Device call 1 (issue 6): per-phase profiles + overlap-chunk sweep + e2e profiles + 256K probe.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ)" > $LOG
TR="python3 -m torch.distributed.run --nproc-per-node 2"
timeout 100 $TR --master-port 29521 tools/bench_attention.py --seq-lens 32k --splits 2x1,1x2 \
  --overlap-chunks auto,1,2,4 --iters 5 --warmup 2 --peers none --no-sdpa-anchor \
  --profile-dir /tmp/prof/attn --out $OUT/attn_chunks_32k.json --markdown /tmp/attn32.md >> $LOG 2>&1
echo "attn32 rc=$? $(date -u +%T)" >> $LOG
timeout 120 $TR --master-port 29522 tools/bench_attention.py --seq-lens 128k --splits 2x1,1x2 \
  --overlap-chunks auto,1,2,4 --iters 3 --warmup 1 --peers none --no-sdpa-anchor \
  --out $OUT/attn_chunks_128k.json --markdown /tmp/attn128.md >> $LOG 2>&1
echo "attn128 rc=$? $(date -u +%T)" >> $LOG
cat /tmp/attn32.md /tmp/attn128.md >> $LOG
for spec in "u2 2x1 auto" "r2 1x2 auto" "u2g2 2x1 2"; do
  set -- $spec
  timeout 75 python3 tools/bench_e2e.py --seq-lens 64k --splits $2 --iters 6 --warmup 3 --timeout 70 \
    --log-dir /tmp/e2e_$1 --out $OUT/e2e64_$1.json \
    --extra-args="--usp-overlap-chunks $3 --profile --profile-step-start 5 --profile-step-end 6 --profile-dir /tmp/prof/e2e_$1" >> $LOG 2>&1
  echo "e2e $1 rc=$? $(date -u +%T)" >> $LOG
done
for f in /tmp/prof/e2e_*/*.txt; do echo "== $f"; head -60 $f; done >> $LOG 2>&1
timeout 110 python3 tools/bench_e2e.py --seq-lens 256k --splits 2x1 --recompute full --iters 2 --warmup 1 --timeout 105 \
  --log-dir /tmp/e2e_256 --out $OUT/e2e256_probe.json >> $LOG 2>&1
echo "e2e256 rc=$? $(date -u +%T)" >> $LOG
tail -5 /tmp/e2e_256/*/*.log >> $LOG 2>&1
cd /tmp/prof && find . -name '*.txt' > /tmp/list && find ./attn -name '*32K_USP*G*' >> /tmp/list && tar czf $OUT/prof.tgz -T /tmp/list
echo "end $(date -u +%FT%TZ)" >> $LOG
