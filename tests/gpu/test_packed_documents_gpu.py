"""GPU checks of the documents read in place (megatron/usp/packed_documents.py), bf16 on CUDA.

The in-place path runs forward and backward on megatron's [s, b, h, d] tensors with each plan
kind forced (every document batched through cuDNN views; every run of mixed documents through
the flash varlen op; every document padded to its call shape, on a copy where the call runs
past the sample's end) and with the measured costs after the padded shapes' plans were built
ahead, for equal documents, a lognormal mix, one document, 1-token documents among random ones
and uniform 1..4K lengths, batch 1 and 2, GQA and MQA. Reference: the exact ``math`` document kernel in float64 on the same (bf16-rounded)
inputs. Bound: relative L2 error of out, dq, dk, dv below 2e-2, and each path within 1.5x the
error of the block path's contiguous-copy tiles (the kernel this path replaces) on the same
inputs: views and cumulative lengths must not cost accuracy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.usp.document_kernels import MathDocumentKernel, TileDocumentKernel
from megatron.usp.document_ring import build_document_ring_plan
from megatron.usp.kernels import get_kernel
from megatron.usp.packed_documents import (
    _ALWAYS_BATCHED,
    _ALWAYS_VARLEN,
    KernelCosts,
    build_packed_plan,
    costs_for,
    documents_in_order,
    packed_backward,
    packed_forward,
    prebuild_padded_plans,
)

S = 4096
MIXES = {
    "equal": [512] * 8,
    "lognormal": None,
    "one": [S],
    "ones_and_random": [1, 1, 300, 1, 77, 1000, 1, 667, 2048],
    "uniform4k": "uniform",
}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _lengths(name, seed):
    lengths = MIXES[name]
    rng = np.random.default_rng(seed)
    if lengths is None:
        lengths = np.maximum(1, rng.lognormal(np.log(256), 1.2, 64).astype(int))
    elif lengths == "uniform":
        lengths = rng.integers(1, 4096, 16)
    out, total = [], 0
    for n in lengths:
        n = int(min(n, S - total))
        if n > 0:
            out.append(n)
            total += n
    if total < S:
        out.append(S - total)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("batch,kv_heads", [(1, 2), (2, 1)])
def test_packed_documents_on_gpu(mix, batch, kv_heads):
    h, d = 8, 128
    lengths = [_lengths(mix, i) for i in range(batch)]
    seg = np.stack([np.repeat(np.arange(len(r)), r) for r in lengths])
    block = build_document_ring_plan(seg, 0, 1, None, True, "cuda").blocks[0]
    assert documents_in_order(block) == lengths
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, dout = (torch.randn(S, batch, h, d, generator=gen, device="cuda").bfloat16()
               for _ in range(2))
    k, v = (torch.randn(S, batch, kv_heads, d, generator=gen, device="cuda").bfloat16()
            for _ in range(2))
    scale = d ** -0.5

    def heads(x):
        return x.permute(1, 2, 0, 3)

    def run_block(kernel, *xs):
        dout_, q_, k_, v_ = (heads(x) for x in xs)
        out, lse = kernel.forward(q_, k_, v_, block, scale)
        return (out,) + tuple(kernel.backward(dout_, q_, k_, v_, out, lse, block, scale))

    ref = run_block(MathDocumentKernel(), *(t.double() for t in (dout, q, k, v)))
    local = get_kernel("auto")
    copies = [_rel(g, r) for g, r in zip(run_block(TileDocumentKernel(local, False),
                                                   dout, q, k, v), ref)]
    padded = KernelCosts([1, 2], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], has_varlen=False,
                         padding=True)
    padded.batched = lambda n, count, **_: 1.0 / n  # every document is padded
    measured = costs_for(local, q, k, True)
    prebuild_padded_plans(measured, local, q, k, v, scale)
    plans = {"batched": _ALWAYS_BATCHED, "varlen": _ALWAYS_VARLEN, "padded": padded,
             "measured": measured}
    for name, costs in plans.items():
        plan = build_packed_plan(lengths, True, costs, "cuda")
        out, lses = packed_forward(q, k, v, plan, local, scale)
        grads = packed_backward(dout, q, k, v, out, lses, plan, local, scale)
        got = [heads(out)] + [heads(g) for g in grads]
        errors = [_rel(g, r) for g, r in zip(got, ref)]
        assert out.dtype == torch.bfloat16
        assert max(errors) < 2e-2, (name, errors)
        for e, base in zip(errors, copies):
            assert e <= 1.5 * base + 1e-4, (name, errors, copies)
