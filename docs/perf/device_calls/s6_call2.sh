#!/usr/bin/env bash
# 2026-12-02, device call 2 of the session (ONE H200, <= 540 s by its own caps): issue 16 (and
# issue 14's ">= 512K on one H200"), longseq_h200.sh with one change after last session's
# 512K run was SIGKILLed before its first step (host memory suspected: 64 GiB of pinned
# offload buffers): (b) keeps everything on the GPU (kept attention + tiled MLP, no host
# offload: ~95 GiB by the count), and a monitor samples host and GPU memory every 2 s
# (mem.log, with the cgroup's limit and any OOM-killer lines) so that a kill is explained.
# (c) measures the offload cost at 128K, (d) Llama-3-8B slices at 256K + the depth arithmetic.
# Writes under $OUT: run.log, mem.log, e2e_512k.json, e2e_128k_keep.json,
#   e2e_128k_keep_offload.json, llama8b_256k_L1.json, llama8b_256k_L2.json, llama8b_256k_depth.json
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# Faster pinning of the offload buffers (cudaHostRegister on 8 threads); fewer fragments at 512K.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:8
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
echo "start $(date -u +%FT%TZ)" > $LOG
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> $LOG 2>&1
free -g | head -2 >> $LOG
{ echo "cgroup memory.max: $(cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null)"; } >> $LOG
( while true; do echo "t=$SECONDS host_used_MiB=$(free -m | awk '/Mem:/{print $3}') avail_MiB=$(free -m | awk '/Mem:/{print $7}') gpu_MiB=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 2; done > $OUT/mem.log 2>&1 ) &
MON=$!
cap() { local l=$(( 530 - SECONDS )); [ $l -lt $1 ] && echo $(( l > 5 ? l : 5 )) || echo $1; }
BENCH="python3 tools/bench_e2e.py --nproc-per-node 1 --splits 1x1 --recompute full"
KEEP="--recompute-keep-core-attn"
OFF="--recompute-cpu-offload layer_input core_attn"

# (a) the GPU tests ran in call 1 (s6_call1.sh)
# (b) 0.85B at 512K, one step (~40 s start-up + ~130 s step), all on the GPU
T=$(cap 230)
timeout $T $BENCH --seq-lens 512k --iters 1 --warmup 0 --timeout $((T - 5)) --log-dir /tmp/e2e_512k \
  --extra-args="$KEEP --mlp-tile-tokens 16384" --out $OUT/e2e_512k.json >> $LOG 2>&1
echo "(b) 512k rc=$? t=$SECONDS" >> $LOG

# (c) offload cost at 128K: same flags with and without offload, 1 timed step after 1 warm-up
for name in keep keep_offload; do
  extra="$KEEP --mlp-tile-tokens 8192"; [ $name = keep_offload ] && extra="$extra $OFF"
  T=$(cap 62)
  timeout $T $BENCH --seq-lens 128k --iters 2 --warmup 1 --timeout $((T - 4)) --log-dir /tmp/e2e_128k_$name \
    --extra-args="$extra" --out $OUT/e2e_128k_$name.json >> $LOG 2>&1
  echo "(c) 128k $name rc=$? t=$SECONDS" >> $LOG
done

# (d) Llama-3-8B at 256K: slices of 1 and 2 layers, optimizer state on the CPU, one step each
for L in 1 2; do
  T=$(cap $(( (525 - SECONDS) / (3 - L) )))
  timeout $T $BENCH --model llama3-8b --num-layers $L --seq-lens 256k --iters 1 --warmup 0 \
    --timeout $((T - 4)) --log-dir /tmp/e2e_8b_L$L --out $OUT/llama8b_256k_L$L.json \
    --extra-args="--mlp-tile-tokens 8192 --optimizer-cpu-offload --use-precision-aware-optimizer --optimizer-offload-fraction 1.0 --overlap-cpu-optimizer-d2h-h2d" >> $LOG 2>&1
  echo "(d) 8b L$L rc=$? t=$SECONDS" >> $LOG
done
timeout 10 python3 -m megatron.bench.depth $OUT/llama8b_256k_L1.json $OUT/llama8b_256k_L2.json \
  --full-layers 32 --gpu-gib 139 --host-gib 120 --out $OUT/llama8b_256k_depth.json >> $LOG 2>&1
echo "(d) depth rc=$? t=$SECONDS" >> $LOG

# failures: the tail of each failed run's log
for d in /tmp/e2e_*; do for f in $d/*.log; do grep -q "Traceback\|Error" $f && { echo "== $f"; tail -15 $f; }; done; done >> $LOG 2>&1
timeout 10 python3 - >> $LOG 2>&1 <<'EOF'
import glob, json, os
print(f"{'file':28s} {'S':>7s} {'L':>3s} {'status':7s} {'s/iter':>8s} {'MFU':>6s} {'GPU GiB':>8s} {'host GiB':>8s}")
for path in sorted(glob.glob(os.path.join(os.environ["OUT"], "*.json"))):
    for r in json.load(open(path)).get("results", []):
        f = lambda v, d=1: "n/a" if v is None else f"{v:.{d}f}"
        print(f"{os.path.basename(path)[:28]:28s} {r['seq_len']//1024:6d}K {r.get('num_layers') or 0:3d} "
              f"{r['status']:7s} {f(r['iter_ms'] and r['iter_ms'] / 1e3, 2):>8s} "
              f"{f(r['mfu'] and 100 * r['mfu']):>6s} {f(r['peak_mem_gib']):>8s} {f(r.get('peak_host_gib')):>8s}")
EOF
kill $MON 2>/dev/null
{ echo "cgroup memory.peak: $(cat /sys/fs/cgroup/memory.peak 2>/dev/null)"; dmesg 2>/dev/null | grep -i -E "killed process|out of memory" | tail -5; } >> $LOG
echo "end $(date -u +%FT%TZ) t=$SECONDS" >> $LOG
