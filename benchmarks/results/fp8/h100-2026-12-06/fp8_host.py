"""Float8 linear: host issue time vs device time per forward+backward (GPU kept busy ahead).

The script that produced fp8_host.json (statements one per line; nothing else changed).
Needs a GPU of compute capability >= 8.9 and torchao: python3 fp8_host.py OUT.json
"""
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from megatron.layers import linear_wgrad
from megatron.layers.float8_gemms import Float8Gemms
from megatron.layers.float8_options import Float8Options

dev = torch.device("cuda")
dt = torch.bfloat16
SHAPES = {"8b_qkv_8k": (8192, 4096, 6144), "8b_proj_8k": (8192, 4096, 4096),
          "8b_fc1_8k": (8192, 4096, 28672), "8b_fc2_8k": (8192, 14336, 4096),
          "0p85b_qkv_32k": (32768, 2048, 3072), "0p85b_proj_32k": (32768, 2048, 2048),
          "0p85b_qkv_8k": (8192, 2048, 3072), "0p85b_proj_8k": (8192, 2048, 2048)}


def operands(shape):
    n, i, o = shape
    x = torch.randn(n, i, device=dev, dtype=dt).requires_grad_(True)
    w = torch.randn(o, i, device=dev, dtype=dt).requires_grad_(True)
    return x, w, torch.randn(n, o, device=dev, dtype=dt)


def run(shape, gemms, reps=20):
    x, w, gr = operands(shape)

    def once():
        y = linear_wgrad.linear(x, w, None, False, False, None, fuse_wgrad=False, gemms=gemms)
        y.backward(gr)
        x.grad = w.grad = None

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    # wall, back to back
    t = time.perf_counter()
    for _ in range(reps):
        once()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / reps * 1e3
    # host issue time with the GPU held busy, device time by events
    torch.cuda._sleep(int(2e9))   # ~1 s of GPU cycles ahead of the calls
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    s.record()
    for _ in range(reps):
        once()
    e.record()
    host = (time.perf_counter() - t) / reps * 1e3
    torch.cuda.synchronize()
    device = s.elapsed_time(e) / reps
    return dict(wall_ms=wall, host_ms=host, device_ms=device)


def main():
    g8 = Float8Gemms(Float8Options())
    res = {}
    for name, sh in SHAPES.items():
        row = {"bf16": run(sh, None), "fp8": run(sh, g8)}
        res[name] = row
        print(name, json.dumps(row), flush=True)
    # where the host time goes, one float8 proj at 8K
    x, w, gr = operands(SHAPES["8b_proj_8k"])
    for _ in range(3):
        linear_wgrad.linear(x, w, None, False, False, None, fuse_wgrad=False,
                            gemms=g8).backward(gr)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(5):
            linear_wgrad.linear(x, w, None, False, False, None, fuse_wgrad=False,
                                gemms=g8).backward(gr)
        torch.cuda.synchronize()
    tab = p.key_averages().table(sort_by="cpu_time_total", row_limit=40)
    print(tab)
    res["profile"] = tab
    with open(sys.argv[1], "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
