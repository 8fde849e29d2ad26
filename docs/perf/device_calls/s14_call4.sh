#!/usr/bin/env bash
# Session 14 (2026-12-04), issue 14, call 4: the float32 -> bf16 write-back after the step as
# one multi-tensor copy (megatron/training/param_copy.py). NOT KEPT: the module and its tests are
# in docs/perf/issue14/s14_2026-12-04/foreach_param_copy_not_kept.patch (`git apply` it on
# a3c07b2 to re-run this script); docs/performance.md 6.5 says why.
#   (1) GPU tests: tests/gpu/test_param_copy_gpu.py;
#   (2) the copy alone at the 0.85B model's parameter shapes, laid out in one bf16 buffer as
#       the distributed optimizer lays them: a copy_ per tensor (megatron-core's method) against
#       param_copy.foreach_copy, CUDA events, median of 20 (copy_bench.json);
#   (3) 32K A/B, alternating: this tree against .base = a3c07b2 (before the change), 4 measured
#       iterations each (--iters 6 --warmup 2), twice.
# Before it: rm -rf .base && mkdir .base && git archive a3c07b2 megatron tools pretrain_gpt.py | tar -x -C .base
# carry [".whl", ".base"].
# Files under $OUT: run.log, copy_bench.json, ab_new1.json, ab_base1.json, ab_new2.json, ab_base2.json.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
LOG=$OUT/run.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $LOG
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())" >> $LOG
echo "== gpu tests (t=$SECONDS)" >> $LOG
env PYTHONPATH=/tmp/site:$PWD timeout 100 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_param_copy_gpu.py 2>&1 | tail -5 >> $LOG
echo "== copy bench (t=$SECONDS)" >> $LOG
env PYTHONPATH=/tmp/site:$PWD timeout 100 python3 - >> $LOG 2>&1 <<'PY'
import json, os, torch
from megatron.training.param_copy import foreach_copy
h, q, kv, f, v, layers = 2048, 2048, 1024, 5632, 32000, 16
shapes = [(v, h)] + [(q + kv, h), (h,), (h, q), (2 * f, h), (h, f), (h,)] * layers + [(h,), (v, h)]
numels = [a * (b if len(s) > 1 else 1) for s in shapes for a, b in [(s[0], s[-1])]]
pad = lambda n: (n + 63) // 64 * 64
buf = torch.empty(sum(pad(n) for n in numels), dtype=torch.bfloat16, device="cuda")
mains, dsts, off = [], [], 0
for n in numels:
    mains.append(torch.randn(n, device="cuda"))
    dsts.append(buf[off:off + n]); off += pad(n)
pairs = list(zip(dsts, mains))
def per_tensor():
    for d, s in pairs: d.copy_(s)
def foreach():
    foreach_copy(pairs)
res = {"tensors": len(numels), "elements": sum(numels), "bytes_moved": sum(numels) * 6}
for name, fn in (("per_tensor_copy", per_tensor), ("foreach_copy", foreach)):
    for _ in range(3): fn()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); times.append(a.elapsed_time(b))
    times.sort()
    res[name + "_ms"] = {"median": times[10], "min": times[0], "max": times[-1]}
res["ratio_per_tensor_over_foreach"] = res["per_tensor_copy_ms"]["median"] / res["foreach_copy_ms"]["median"]
res["torch"] = torch.__version__
print(json.dumps(res))
json.dump(res, open(os.environ["OUT"] + "/copy_bench.json", "w"), indent=1)
PY
COMMON="--nproc-per-node 1 --splits 1x1 --seq-lens 32k --iters 6 --warmup 2 --timeout 55 --recompute lean --ceiling off"
run() {   # run NAME ROOT
  echo "== $1 (t=$SECONDS)" >> $LOG
  env PYTHONPATH=/tmp/site:$2 timeout 60 python3 $2/tools/bench_e2e.py $COMMON --extra-args="--fused-kernels usp" \
    --log-dir /tmp/$1 --out $OUT/$1.json 2>&1 | grep "bench_e2e\]" >> $LOG
  grep " iteration " /tmp/$1/*.log | sed 's/.*elapsed time per iteration (ms): \([0-9.]*\).*lm loss[^:]*: \([0-9.E+-]*\).*grad norm (mean): \([0-9.]*\).*/  \1 ms, loss \2, grad norm \3/' >> $LOG
}
run ab_new1 $PWD
run ab_base1 $PWD/.base
run ab_new2 $PWD
run ab_base2 $PWD/.base
echo "end t=$SECONDS" >> $LOG
