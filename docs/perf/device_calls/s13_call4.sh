#!/usr/bin/env bash
# Session 13 (2026-12-04), issue 14, call 4: 512K again after the fix found by call 3 (under
# the tiled MLP's non-reentrant checkpoint the linear layers set grad_added_to_main_grad on the
# recomputed saved tensor, not on the parameter, so DDP's hook added the uninitialised
# stand-in gradient: grad norm NaN). The same command as call 3's second part.
# carry [".whl"].
# Files under $OUT: run.log, e2e_512k.json, e2e_512k.md, S524288_U1xR1_full.log.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
LOG=$OUT/run.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $LOG
echo "== 512k (t=$SECONDS)" >> $LOG
env PYTHONPATH=/tmp/site:$PWD timeout 345 python3 tools/bench_e2e.py --seq-lens 512k --splits 1x1 \
  --nproc-per-node 1 --recompute full --iters 1 --warmup 0 --timeout 330 \
  --extra-args="--recompute-keep-core-attn --mlp-tile-tokens 16384" --log-dir /tmp/e2e512 --out $OUT/e2e_512k.json \
  --markdown $OUT/e2e_512k.md 2>&1 | grep "bench_e2e\]" >> $LOG
cp /tmp/e2e512/*.log $OUT/ 2>/dev/null
echo "end t=$SECONDS" >> $LOG
