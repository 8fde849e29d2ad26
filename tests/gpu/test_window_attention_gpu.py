"""GPU check of the windowed flash path (megatron/usp/window_kernel.py), bf16 on CUDA.

PyTorch's flash op with its own window runs forward and backward on one sequence of 2048
tokens, 8 query / 2 KV heads (and MQA) of 128, as a causal square with windows of 1, 128 and
1000 keys, and as a rectangle of queries after their keys (the ring's halo block: 512
queries on 768 earlier keys, bottom-right window). The reference is the masked product of the
same module in float64 on the same (bf16-rounded) inputs. Bound: relative L2 error of out, dq,
dk, dv below 2e-2 (bf16). Also checked to the same bound against the float64 ``math``
kernel: the windowed ``tiles`` and ``varlen`` kernels on every block of a zigzag ring plan
built with a window, and packed documents with a window read in place (U = R = 1: documents
the window cuts on the varlen op's own window, the rest on the run's kernel).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron.usp.document_kernels import (
    MathDocumentKernel,
    TileDocumentKernel,
    VarlenDocumentKernel,
    build_document_block,
)
from megatron.usp.document_ring import build_document_ring_plan
from megatron.usp.kernels import get_kernel
from megatron.usp.packed_documents import (
    _ALWAYS_BATCHED,
    PackedDocumentAttention,
    build_packed_plan,
    costs_for,
    packed_plan_for,
)
from megatron.usp.window_kernel import (
    _masked_backward,
    _masked_forward,
    flash_window_usable,
    window_backward,
    window_forward,
)
from tests.helpers import rel_err

BOUND = 2e-2


def _inputs(sq, sk, h, hk, d=128):
    gen = torch.Generator(device="cuda").manual_seed(sq + sk + hk)

    def r(heads, s):
        return torch.randn(1, heads, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)

    return r(h, sq), r(hk, sk), r(hk, sk), r(h, sq)


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk,causal,left", [(2048, 2048, True, 1), (2048, 2048, True, 128),
                                               (2048, 2048, True, 1000),
                                               (512, 768, False, 300)])
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_flash_window_matches_the_masked_reference(sq, sk, causal, left, kv_heads):
    q, k, v, dout = _inputs(sq, sk, 8, kv_heads)
    assert flash_window_usable(q)
    scale = 128 ** -0.5
    out, lse = window_forward(q, k, v, causal, left, scale)
    grads = window_backward(dout, q, k, v, out, lse, causal, left, scale)
    d64 = [t.double() for t in (q, k, v, dout)]
    ref_out, ref_lse = _masked_forward(*d64[:3], causal, left, scale)
    ref = (ref_out,) + _masked_backward(d64[3], *d64[:3], ref_out, ref_lse, causal, left, scale)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out,) + tuple(grads), ref):
        assert rel_err(got.double(), want) < BOUND, name


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiles", "varlen"])
def test_windowed_kernels_on_a_ring_block_match_math(name):
    seq, ring, window = 4096, 4, 700
    plan = build_document_ring_plan(np.zeros((1, seq), dtype=np.int64), 1, ring, None, True,
                                    "cuda", window)
    tiles = (TileDocumentKernel(get_kernel("auto")) if name == "tiles"
             else VarlenDocumentKernel())
    exact = MathDocumentKernel()
    for block in plan.blocks:
        if block is None:
            continue
        q, k, v, dout = _inputs(block.sq, block.sk, 8, 2)
        out, lse = tiles.forward(q, k, v, block, 128 ** -0.5)
        got = (out,) + tuple(tiles.backward(dout, q, k, v, out, lse, block, 128 ** -0.5))
        d64 = [t.double() for t in (q, k, v, dout)]
        r_out, r_lse = exact.forward(*d64[:3], block, 128 ** -0.5)
        want = (r_out,) + tuple(exact.backward(d64[3], *d64[:3], r_out, r_lse, block,
                                               128 ** -0.5))
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert rel_err(a.double(), b) < BOUND, name


@pytest.mark.gpu
@pytest.mark.parametrize("choice", ["auto", "batched"])
def test_windowed_documents_in_place_match_math(choice):
    """Documents read in place under a window: the plan ``auto``'s timed costs give, and one
    with every run of equal documents in its own batched call (the documents the window cuts
    on the batched window kernel, the others plain causal)."""
    lengths = [300, 1500, 40, 40, 1200, 1024]                  # 4104 tokens, three cut
    seq, window, scale = sum(lengths), 512, 128 ** -0.5
    seg = np.repeat(np.arange(len(lengths)), lengths)[None]
    pos = np.arange(seq)[None]
    block = build_document_block(pos, seg, pos, seg, True, "cuda", window)
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, dout = (torch.randn(seq, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(2))
    k, v = (torch.randn(seq, 1, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    kernel = get_kernel("auto")
    assert costs_for(kernel, q, k, True).has_varlen
    if choice == "auto":
        plan = packed_plan_for(block, kernel, q, k)
    else:
        plan = build_packed_plan([lengths], True, _ALWAYS_BATCHED, "cuda", window)
        assert [s.lengths for s in plan.segments[0]] == [(300,), (1500,), (40, 40), (1200,),
                                                          (1024,)]
    assert plan is not None and plan.window == window
    for s in plan.segments[0]:                     # the window where a document is cut
        assert plan.segment_window(s) == (window if max(s.lengths) > window + 1 else None)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = PackedDocumentAttention.apply(*leaves, plan, kernel, scale)
    got = (out,) + torch.autograd.grad(out, leaves, dout)

    def heads(x):                                              # [s, 1, h, d] -> [1, h, s, d]
        return x.double().permute(1, 2, 0, 3)

    exact = MathDocumentKernel()
    r_out, r_lse = exact.forward(heads(q), heads(k), heads(v), block, scale)
    want = (r_out,) + tuple(exact.backward(heads(dout), heads(q), heads(k), heads(v), r_out,
                                           r_lse, block, scale))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(heads(a), b) < BOUND, name
