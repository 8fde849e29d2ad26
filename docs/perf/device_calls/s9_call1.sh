#!/usr/bin/env bash
# 2026-12-02 (session 9), device call 1 (ONE H200): issue 14, where a 32K step goes now.
#   (a) one profiled iteration of the 0.85B model at 32K with the configuration of the
#       side-by-side table (--fused-kernels liger, --recompute lean): kernel table + trace summary
#       (the committed profile predates every issue-14 change);
#   (b) whether torch.addmm can accumulate a bf16 x bf16 product straight into a float32 buffer
#       (out_dtype), and what that costs against mm + add_ (gradient-accumulation fusion).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
LOG=$OUT/run.log
step() { local t=$1; shift; echo "== $* (t=$SECONDS)" >> $LOG; timeout "$t" "$@" >> $LOG 2>&1; echo "rc=$? t=$SECONDS" >> $LOG; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv >> $LOG 2>&1
mkdir -p /tmp/prof
step 100 python3 tools/bench_e2e.py --seq-lens 32k --nproc-per-node 1 --splits 1x1 --iters 5 --warmup 3 --timeout 95 --ceiling off \
  --recompute lean --extra-args="--fused-kernels liger --profile --profile-step-start 4 --profile-step-end 5 --profile-dir /tmp/prof" \
  --log-dir /tmp/e2e_prof --out $OUT/e2e_prof.json
cp /tmp/prof/rank0_iters4-4.txt $OUT/profile32k_kernels.txt 2>/dev/null
python3 -m megatron.bench.trace_summary /tmp/prof/rank0_iters4-4.json > $OUT/profile32k_summary.txt 2>&1
gzip -c /tmp/prof/rank0_iters4-4.json > $OUT/trace32k.json.gz 2>/dev/null
step 60 python3 - <<'PY'
import torch, json, os
from megatron.bench.timing import median_ms_alone
cuda_time_ms = lambda fn, iters: median_ms_alone(fn, warmup=3, iters=iters, device=torch.device("cuda"))
res = {}
dev = "cuda"
for (m, n, k) in [(2048, 3072, 32768), (2048, 11264, 32768), (5632, 2048, 32768), (2048, 2048, 32768)]:
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    c = torch.zeros(m, n, device=dev, dtype=torch.float32)
    row = {}
    try:
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
        ref = c.clone(); c.zero_(); torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
        row["fused_ms"] = cuda_time_ms(lambda: torch.addmm(c, a, b, out_dtype=torch.float32, out=c), iters=10)
        d = torch.zeros_like(c); d.add_(a @ b)
        row["max_rel_err_vs_unfused"] = float(((ref - d).abs().max() / d.abs().max()).item())
    except Exception as e:  # noqa: BLE001
        row["fused_error"] = repr(e)[:300]
    row["unfused_ms"] = cuda_time_ms(lambda: c.add_(a @ b), iters=10)
    row["mm_bf16_ms"] = cuda_time_ms(lambda: a @ b, iters=10)
    res[f"{m}x{n}x{k}"] = row
print(json.dumps(res, indent=1))
json.dump(res, open(os.environ["OUT"] + "/addmm_out_dtype.json", "w"), indent=1)
PY
tar czf $OUT/logs.tgz -C /tmp e2e_prof 2>/dev/null
echo "done t=$SECONDS" >> $LOG
