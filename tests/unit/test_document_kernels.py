"""Document-masked block kernels (megatron/usp/document_kernels.py) against a dense fp64 oracle.

The oracle is masked softmax attention with plain autograd ops on the block, the mask written
from positions and segments here. Blocks are random: queries and keys at arbitrary (sorted or
shuffled) positions, random document boundaries, rectangular and square blocks, GQA and MQA,
batch 2 with different documents per sample; rows with no visible key must come back with
out 0, lse -inf and zero gradients. Both CPU kernels (``tiles`` on PyTorch's CPU kernel, and
``math``) must match to 1e-10 in float64.
"""

import math

import numpy as np
import pytest
import torch

from megatron.usp.document_choice import AutoDocumentKernel, get_document_kernel
from megatron.usp.document_kernels import (
    MathDocumentKernel,
    TileDocumentKernel,
    _as_block,
    build_document_block,
    document_kernel_problem,
)
from megatron.usp.kernels import get_kernel

TOL = dict(atol=1e-10, rtol=1e-10)


def oracle(q, k, v, visible, scale):
    """out, lse of masked attention; visible [b, sq, sk]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0)[..., None])
    return p @ v, lse


def _side(rng, b, n, total, shuffle):
    rows = []
    for _ in range(b):
        pos = np.sort(rng.choice(total, n, replace=False))
        rows.append(rng.permutation(pos) if shuffle else pos)
    return np.stack(rows)


def random_block(seed):
    rng = np.random.default_rng(seed)
    b = 2
    sq = int(rng.integers(1, 24))
    sk = sq if seed % 3 == 0 else int(rng.integers(1, 24))
    total = sq + sk + 8
    q_pos = _side(rng, b, sq, total, seed % 5 == 4)
    k_pos = q_pos if sk == sq and seed % 2 == 0 else _side(rng, b, sk, total, seed % 7 == 6)
    cuts = [np.sort(rng.choice(total, int(rng.integers(0, 6)), replace=False)) for _ in range(b)]
    q_seg = np.stack([np.searchsorted(cuts[i], q_pos[i], side="right") for i in range(b)])
    k_seg = np.stack([np.searchsorted(cuts[i], k_pos[i], side="right") for i in range(b)])
    return q_pos, q_seg, k_pos, k_seg, seed % 4 != 3


# (kernel, local kernel of the tiles): the tile logic runs on the math kernel for most seeds
# (PyTorch's CPU op costs ~30 ms a call, and random blocks have dozens of tile groups).
KERNELS = [("tiles", "math"), ("math", "math")]


CASES = [(seed, name, local) for seed in range(30) for name, local in KERNELS] + [
    (seed, "tiles", "torch") for seed in (0, 7, 13, 20)]


@pytest.mark.parametrize("seed,name,local", CASES)
def test_block_kernels_match_the_oracle(seed, name, local):
    q_pos, q_seg, k_pos, k_seg, causal = random_block(seed)
    block = build_document_block(q_pos, q_seg, k_pos, k_seg, causal)
    visible = torch.as_tensor(q_seg[:, :, None] == k_seg[:, None, :])
    if causal:
        visible &= torch.as_tensor(k_pos[:, None, :] <= q_pos[:, :, None])
    if block is None:
        assert not visible.any()
        return
    assert block.pairs == int(visible.sum())
    gen = torch.Generator().manual_seed(seed)
    b, sq, sk = q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]
    hk = (4, 2, 1)[seed % 3]
    q = torch.randn(b, 4, sq, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hk, sk, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    scale = 1 / math.sqrt(8)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out_ref, lse_ref = oracle(qr, kr, vr, visible, scale)
    out_ref.backward(dout)
    kernel = get_document_kernel(name, get_kernel(local))
    out, lse = kernel.forward(q, k, v, block, scale)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, block, scale)
    torch.testing.assert_close(out, out_ref.detach(), **TOL)
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want, **TOL)
    empty = torch.isinf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty)          # rows without a visible key
    torch.testing.assert_close(lse[~empty], lse_ref[~empty], **TOL)
    assert not out[empty].any() and not dq[empty.unsqueeze(-1).expand_as(dq)].any()


def test_equal_documents_are_one_strided_call():
    """16 documents of one length packed back to back: one group, a strided view (no gather),
    written fresh; one document over the block is one dense call."""
    seg = np.repeat(np.arange(16), 8)[None]
    pos = np.arange(128)[None]
    block = build_document_block(pos, seg, pos, seg, True)
    assert len(block.groups) == 1
    g = block.groups[0]
    assert g.q.n == 16 and g.q.step == 8 and g.q.index is None and g.fresh_q and g.fresh_k
    assert not block.q_init and not block.k_init
    whole = build_document_block(pos, np.zeros_like(seg), pos, np.zeros_like(seg), True)
    assert whole.is_dense()
    lognormal = np.repeat(np.arange(5), [3, 40, 1, 60, 24])[None]
    assert len(build_document_block(pos, lognormal, pos, lognormal, True).groups) == 5


def test_auto_on_cpu_masks_many_tiny_documents_and_tiles_a_large_one():
    """The CPU's fixed costs: one masked product beats many small attention calls; a block
    past the masked product's memory bound is tiled."""
    kernel = get_document_kernel("auto", get_kernel("torch"))
    assert isinstance(kernel, AutoDocumentKernel)
    for seg, want in ((np.repeat(np.arange(16), 4), MathDocumentKernel),
                      (np.zeros(4096, dtype=np.int64), TileDocumentKernel)):
        pos = np.arange(seg.size)[None]
        block = build_document_block(pos, seg[None], pos, seg[None], True)
        x = torch.zeros(1, 2, seg.size, 8)
        assert isinstance(kernel.choose(x, x, block), want)


def test_kernel_names_and_problems():
    assert document_kernel_problem("tiles", "cpu", torch.float32) is None
    assert "needs CUDA" in document_kernel_problem("varlen", "cpu", torch.float32)
    assert "needs CUDA" in document_kernel_problem("varlen", "cuda", torch.float32)
    assert "not known" in document_kernel_problem("flex", "cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="--document-attention-kernel 'dense' is not known"):
        get_document_kernel("dense", get_kernel("torch"))
    varlen = get_document_kernel("varlen", get_kernel("torch"))
    pos = np.arange(8)[None]
    block = build_document_block(pos, np.zeros_like(pos), pos, np.zeros_like(pos), True)
    x = torch.zeros(1, 2, 8, 8)
    with pytest.raises(ValueError, match="varlen needs CUDA fp16/bf16"):
        varlen.forward(x, x, x, block, 1.0)


@pytest.mark.parametrize("local", ["math", "torch"])
def test_equal_documents_match_the_oracle(local):
    """The one-call path (equal documents tiling the block) forward and backward."""
    seg = np.repeat(np.arange(4), 8)[None]
    pos = np.arange(32)[None]
    block = build_document_block(pos, seg, pos, seg, True)
    gen = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(1, 4, 32, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, 32, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    visible = torch.as_tensor((seg[:, :, None] == seg[:, None, :])
                              & (pos[:, None, :] <= pos[:, :, None]))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out_ref, _ = oracle(qr, kr, vr, visible, 0.5)
    out_ref.backward(dout)
    kernel = TileDocumentKernel(get_kernel(local))
    out, lse = kernel.forward(q, k, v, block, 0.5)
    grads = kernel.backward(dout, q, k, v, out, lse, block, 0.5)
    torch.testing.assert_close(out, out_ref.detach(), **TOL)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(got, want, **TOL)


def test_batched_output_laid_out_like_the_block_is_used_without_a_copy():
    block_storage = torch.randn(3, 4 * 5, 2)                     # [h, n*L, d]
    batched = block_storage.view(3, 4, 5, 2).transpose(0, 1)      # [n, h, L, d] view
    viewed = _as_block(batched)
    assert viewed.data_ptr() == block_storage.data_ptr() and torch.equal(viewed[0], block_storage)
    assert _as_block(torch.randn(4, 3, 5, 2)) is None            # contiguous [n, h, L, d]
