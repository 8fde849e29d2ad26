#!/usr/bin/env bash
# The session's last device call (one H200, <= 590 s): the GPU test tier of every issue, and the
# GPU evidence of issues 13, 15, 16 and 17 in as little device time as fits, each part capped:
#   [t=15..]  issue 13's five small bf16 runs (numerics_h200.sh, launch-bound, ~275 s) in the
#             background, beside: the whole GPU test tier (tests/gpu), then issue 17's checksum
#             cost (checksum_h200.sh; save/hash times, disk-bound, compared with and without in
#             alternation, so the shared GPU does not bias the ratio);
#   [quiet]   issue 15's single-GPU document kernel comparison at 32K;
#   [quiet]   issue 16's 0.85B model at 512K tokens, one step (kept attention + offload + tiled MLP).
# Each part writes into its own folder, tarred into one file (the device returns 8 files).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
FINAL=$OUT; LOG=$FINAL/run.log
mkdir -p /tmp/o/numerics /tmp/o/checksum /tmp/o/docs /tmp/o/longseq /tmp/o/gpu
echo "start $(date -u +%FT%TZ)" > $LOG
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> $LOG 2>&1
left() { echo $(( 585 - SECONDS )); }
( OUT=/tmp/o/numerics TOTAL_S=270 bash docs/perf/device_calls/numerics_h200.sh > /tmp/o/numerics/driver.log 2>&1 ) &
NUM=$!
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu > /tmp/o/gpu/pytest.log 2>&1
echo "gpu tests rc=$? t=$SECONDS: $(tail -1 /tmp/o/gpu/pytest.log)" >> $LOG
OUT=/tmp/o/checksum timeout 110 bash docs/perf/device_calls/checksum_h200.sh > /tmp/o/checksum/driver.log 2>&1
echo "checksum rc=$? t=$SECONDS" >> $LOG
wait $NUM; echo "numerics done t=$SECONDS: $(grep 'compare rc' /tmp/o/numerics/run.log)" >> $LOG
BENCH="tools/bench_attention.py --docs fixed:2k,fixed:8k,lognormal --heads 32 --kv-heads 8 \
  --head-dim 128 --dtype bf16 --iters 3 --warmup 1 \
  --doc-kernels dense,tiles,tiles-copy,varlen,per-document,auto"
timeout 80 python3 $BENCH --seq-lens 32k --out /tmp/o/docs/doc_kernels_32k.json \
  --markdown /tmp/o/docs/doc_kernels_32k.md > /tmp/o/docs/bench32k.log 2>&1
echo "docs 32k rc=$? t=$SECONDS" >> $LOG
T=$(( $(left) - 8 ))
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:8 \
  timeout $T python3 tools/bench_e2e.py --nproc-per-node 1 --splits 1x1 --recompute full --seq-lens 512k \
  --iters 1 --warmup 0 --timeout $((T - 5)) --ceiling off --log-dir /tmp/o/longseq/logs \
  --extra-args="--recompute-keep-core-attn --recompute-cpu-offload layer_input core_attn --mlp-tile-tokens 16384" \
  --out /tmp/o/longseq/e2e_512k.json > /tmp/o/longseq/bench.log 2>&1
echo "512k rc=$? t=$SECONDS: $(grep 'S=524288' /tmp/o/longseq/bench.log | tail -1)" >> $LOG
for p in numerics checksum docs longseq gpu; do tar czf $FINAL/$p.tgz -C /tmp/o $p 2>/dev/null; done
echo "end t=$SECONDS" >> $LOG
