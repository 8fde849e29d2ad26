#!/usr/bin/env bash
# Device call (issue 17): the save-time cost of per-file checkpoint checksums at the 0.85B
# model on ONE H200 (budget: <= 5 %), and the load-time verification rate.
# tools/bench_checkpoint.py builds the llama-0.85b preset of tools/bench_e2e.py (bf16,
# distributed optimizer: weights + fp32 main params + Adam, ~12 GB per checkpoint), trains
# one step, then saves 2x without and 2x with checksums alternately after one warm-up save,
# to local /tmp, and verifies the last one. Writes $OUT/checksum_h200.json (+ run.log).
# Expected: ~60-100 s in all (install ~10 s, model build ~15 s, 5 saves of ~12 GB).
# Look at: "overhead" (<= 0.05 is the budget), "checksum_s", "verify_s"/"verify_gbps".
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import xxhash" 2>/dev/null || { echo "xxhash missing" > "$OUT/run.log"; exit 1; }
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ); free: $(df -h /tmp | tail -1)" > "$LOG"
timeout ${CK_TIMEOUT:-110} python3 tools/bench_checkpoint.py --model llama-0.85b --seq-length 4096 --saves ${CK_SAVES:-2} \
  --save-dir /tmp/checkpoint_cost --out "$OUT/checksum_h200.json" >> "$LOG" 2>&1
echo "bench_checkpoint rc=$? t=${SECONDS}s" >> "$LOG"
rm -rf /tmp/checkpoint_cost
