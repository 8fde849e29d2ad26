#!/usr/bin/env bash
# Session 13 (2026-12-04), issue 14, call 5 (two runs on call 4's machine, kept warm; recorded
# here as they ran): (a) 512K without the fusion, (b) the weight-gradient GEMM fused / unfused /
# in 32K-row pieces at the 512K and 16384-token-tile shapes. carry [".whl"].
# Files under $OUT: e2e_512k_nofuse.json (a), addmm_bigk.json (b).
# (a)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
env PYTHONPATH=/tmp/site:$PWD timeout 330 python3 tools/bench_e2e.py --seq-lens 512k --splits 1x1 --nproc-per-node 1 \
  --recompute full --iters 1 --warmup 0 --timeout 320 --ceiling off \
  --extra-args="--recompute-keep-core-attn --mlp-tile-tokens 16384 --no-gradient-accumulation-fusion" \
  --log-dir /tmp/e2e512 --out $OUT/e2e_512k_nofuse.json 2>&1 | grep "bench_e2e\]"
# (b)
python3 - <<'PY'
import torch, json, os
res = {}
for (o, i, k) in [(3072, 2048, 524288), (2048, 2048, 524288), (3072, 2048, 131072), (3072, 2048, 32768),
                  (11264, 2048, 16384), (2048, 5632, 16384)]:
    a = torch.randn(k, o, device='cuda').bfloat16(); b = torch.randn(k, i, device='cuda').bfloat16()
    c = torch.zeros(o, i, device='cuda')
    def fused(): torch.addmm(c, a.t(), b, out_dtype=torch.float32, out=c)
    def unfused(): c.add_(a.t() @ b)
    def split():
        for s in range(0, k, 32768): torch.addmm(c, a[s:s+32768].t(), b[s:s+32768], out_dtype=torch.float32, out=c)
    r = {}
    for name, f in [('fused', fused), ('unfused', unfused), ('split32k', split)]:
        f(); torch.cuda.synchronize()
        e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(5): f()
        e1.record(); torch.cuda.synchronize(); r[name] = e0.elapsed_time(e1) / 5
    res[f"{o}x{i}x{k}"] = r; print(o, i, k, {n: round(v, 3) for n, v in r.items()}, flush=True)
json.dump(res, open(os.environ['OUT'] + '/addmm_bigk.json', 'w'), indent=1)
PY
