"""GPU checks of the document-masked kernels (megatron/usp/document_kernels.py), bf16 on CUDA.

Each kernel (``tiles`` on strided views straight to cuDNN, ``tiles`` with contiguous copies,
``varlen``, ``auto``) runs forward and backward on one packed sequence of 2048 tokens, 8 query
/ 2 KV heads (and MQA) of 128, for several document mixes: equal documents (one batched cuDNN
call), a lognormal mix, one document (the dense call), 1-token documents among random ones.
The reference is the exact ``math`` kernel in float64 on the same (bf16-rounded) inputs.
Bounds: relative L2 error of out, dq, dk, dv below 2e-2 (bf16), and the strided-view path
within 1.5x the error of the contiguous path on the same inputs (cuDNN is known to return
wrong gradients silently when strides disagree; this catches it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.usp import flash_varlen
from megatron.usp.document_choice import AutoDocumentKernel
from megatron.usp.document_kernels import (
    MathDocumentKernel,
    TileDocumentKernel,
    VarlenDocumentKernel,
    build_document_block,
)
from megatron.usp.kernels import get_kernel
from tests.helpers import rel_err

MIXES = {
    "equal": [256] * 8,
    "lognormal": None,
    "one": [2048],
    "ones_and_random": [1, 1, 300, 1, 77, 1000, 1, 667],
}


def _segments(name, s=2048):
    lengths = MIXES[name]
    if lengths is None:
        rng = np.random.default_rng(0)
        lengths = np.maximum(1, rng.lognormal(np.log(256), 1.2, 64).astype(int))
    seg = np.repeat(np.arange(len(lengths)), lengths)[:s]
    return np.pad(seg, (0, s - seg.size), mode="edge")[None]


def _run(kernel, block, q, k, v, dout, scale):
    out, lse = kernel.forward(q, k, v, block, scale)
    return (out,) + tuple(kernel.backward(dout, q, k, v, out, lse, block, scale))


@pytest.mark.gpu
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_document_kernels_on_gpu(mix, kv_heads):
    s, h, d = 2048, 8, 128
    seg = _segments(mix, s)
    pos = np.arange(s)[None]
    block = build_document_block(pos, seg, pos, seg, True, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, dout = (torch.randn(1, h, s, d, generator=gen, device="cuda").bfloat16()
               for _ in range(2))
    k, v = (torch.randn(1, kv_heads, s, d, generator=gen, device="cuda").bfloat16()
            for _ in range(2))
    scale = d ** -0.5
    ref = _run(MathDocumentKernel(), block, *(t.double() for t in (q, k, v, dout)), scale)
    local = get_kernel("auto")
    kernels = {"views": TileDocumentKernel(local), "copies": TileDocumentKernel(local, False),
               "auto": AutoDocumentKernel(local)}
    if flash_varlen.available():
        kernels["varlen"] = VarlenDocumentKernel()
    errors = {}
    for name, kernel in kernels.items():
        got = _run(kernel, block, q, k, v, dout, scale)
        errors[name] = [rel_err(g, r, floor=1e-30)    # a reference may be all zeros
                        for g, r in zip(got, ref)]
        assert got[0].dtype == torch.bfloat16
        assert max(errors[name]) < 2e-2, (name, errors[name])
    for e_view, e_copy in zip(errors["views"], errors["copies"]):
        assert e_view <= 1.5 * e_copy + 1e-4, errors
