"""cuDNN ragged attention (aten::_cudnn_attention_forward/backward with cum_seq) against the
flash varlen op: values, speed, plan builds (exact shapes vs bucketed document count/max).

The script that produced cudnn_ragged.json (statements one per line; nothing else changed).
Needs a CUDA build of PyTorch: python3 cudnn_ragged.py OUT.json
"""
import json
import math
import sys
import time

import numpy as np
import torch

from megatron.bench.document_bench import mix_lengths

dev = torch.device("cuda")
dt = torch.bfloat16
F, B = torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward
CF, CB = torch.ops.aten._cudnn_attention_forward, torch.ops.aten._cudnn_attention_backward


def pack(lengths, total):
    out, tot = [], 0
    for n in lengths:
        n = int(min(n, total - tot))
        if n <= 0:
            break
        out.append(n)
        tot += n
    return out


def cu(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32,
                        device=dev)


def flash(q, k, v, c, mx, dout):
    o, lse, rng, un, _ = F(q, k, v, c, c, mx, mx, 0.0, True, False, scale=None)
    dq, dk, dv = B(dout, q, k, v, o, lse, c, c, mx, mx, 0.0, True, rng, un, scale=None)
    return o, dq, dk, dv


def cudnn(q, k, v, c, mx, dout):
    r = CF(q, k, v, None, c, c, mx, mx, True, 0.0, True, False, scale=None)
    o, lse, seed, off = r[0], r[1], r[6], r[7]
    dq, dk, dv = CB(dout, q, k, v, o, lse, seed, off, None, c, c, mx, mx, 0.0, True,
                    scale=None)
    return o, dq, dk, dv


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def first_call_ms(fn):
    t0 = time.perf_counter()
    got = fn()
    torch.cuda.synchronize()
    return got, (time.perf_counter() - t0) * 1e3


def bucket(lengths, mult=64):
    n = len(lengths)
    nb = ((n + mult - 1) // mult) * mult
    mx = 1 << int(math.ceil(math.log2(max(lengths))))
    return list(lengths) + [0] * (nb - n), mx


def max_errors(got, ref):
    return [float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref)]


def case(q, k, v, dout, mix, T, hq):
    L = pack(mix_lengths(mix, T, 0), T)
    c, mx = cu(L), max(L)
    pairs = sum(n * (n + 1) / 2 for n in L)
    fl = 4 * pairs * 128 * hq * 3.5
    ref = flash(q, k, v, c, mx, dout)
    tf = timed(lambda: flash(q, k, v, c, mx, dout))
    got, first = first_call_ms(lambda: cudnn(q, k, v, c, mx, dout))
    tc = timed(lambda: cudnn(q, k, v, c, mx, dout))
    Lb, mxb = bucket(L)
    cb = cu(Lb)
    gotb, firstb = first_call_ms(lambda: cudnn(q, k, v, cb, mxb, dout))
    tcb = timed(lambda: cudnn(q, k, v, cb, mxb, dout))
    # a fresh sample of the same mix in its buckets: is the plan reused?
    Lb2, mxb2 = bucket(pack(mix_lengths(mix, T, 1), T))
    cb2 = cu(Lb2)
    _, second_sample = first_call_ms(lambda: cudnn(q, k, v, cb2, mxb2, dout))
    return dict(docs=len(L), max=mx, flash_ms=tf, cudnn_ms=tc, cudnn_first_ms=first,
                cudnn_bucketed_ms=tcb, bucketed_first_ms=firstb, bucket=(len(Lb), mxb),
                next_sample_bucket=(len(Lb2), mxb2), next_sample_first_ms=second_sample,
                flash_tflops=fl / tf / 1e9, cudnn_tflops=fl / tc / 1e9,
                max_err=max_errors(got, ref), max_err_bucketed=max_errors(gotb, ref),
                ref_scale=[float(r.float().abs().max()) for r in ref])


def main():
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(),
          torch.cuda.get_device_name())
    out = {}
    for hq, hk in ((16, 4), (32, 8)):
        for T in (32768, 131072):
            g = torch.Generator(device=dev).manual_seed(0)
            q = torch.randn(T, hq, 128, device=dev, dtype=dt, generator=g)
            k = torch.randn(T, hk, 128, device=dev, dtype=dt, generator=g)
            v = torch.randn(T, hk, 128, device=dev, dtype=dt, generator=g)
            dout = torch.randn(T, hq, 128, device=dev, dtype=dt, generator=g)
            for mix in ("uniform:4k", "lognormal", "fixed:2k", "corpus"):
                key = f"h{hq}/{hk} T{T} {mix}"
                try:
                    row = case(q, k, v, dout, mix, T, hq)
                except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                    row = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
                out[key] = row
                print(key, json.dumps(row), flush=True)
    with open(sys.argv[1], "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
