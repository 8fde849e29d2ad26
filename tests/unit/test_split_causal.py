"""A ring of one splits long causal forwards into three half-size blocks: same result."""

import math

import pytest
import torch

from megatron.usp.kernels import get_kernel
from megatron.usp.ring_attention import (
    SPLIT_CAUSAL_FORWARD_TOKENS,
    ring_attention_backward,
    ring_attention_forward,
    split_causal_forward,
)
from megatron.usp.ring_comm import RingComm


def _inputs(dtype, seq=24, b=2, h=4, hk=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return rand(b, h, seq, d), rand(2, b, hk, seq, d), rand(b, h, seq, d)


def _reference(q, kv):
    """Plain float64 causal attention and its log-sum-exp (GQA by repetition)."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1).double() for x in kv)
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


@pytest.mark.parametrize("backend", ["torch", "math"])
def test_split_equals_whole_causal_attention_fp64(backend):
    q, kv, _ = _inputs(torch.float64)
    out, lse = split_causal_forward(q, kv, get_kernel(backend), 1 / math.sqrt(q.shape[-1]))
    ref_out, ref_lse = _reference(q, kv)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)
    assert out.is_contiguous() and lse.dtype == torch.float64


def test_ring_of_one_routes_long_causal_forwards_and_backward_matches():
    q, kv, dout = _inputs(torch.float64, seq=32)
    kernel, scale, comm = get_kernel("torch"), 1 / math.sqrt(q.shape[-1]), RingComm(None)
    whole = ring_attention_forward(q, kv, comm, kernel, True, scale, split_causal_tokens=64)
    split = ring_attention_forward(q, kv, comm, kernel, True, scale, split_causal_tokens=32)
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    # the backward reads only the final out and lse, so its gradients agree as well
    g_whole = ring_attention_backward(dout, q, kv, *whole, comm, kernel, True, scale)
    g_split = ring_attention_backward(dout, q, kv, *split, comm, kernel, True, scale)
    for a, b in zip((g_whole.dq, *g_whole.dkv()), (g_split.dq, *g_split.dkv())):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    # full attention and short sequences are never split
    assert SPLIT_CAUSAL_FORWARD_TOKENS >= 64 * 1024


def test_split_in_bf16_is_close_to_fp64():
    q, kv, _ = _inputs(torch.bfloat16, seq=64, d=16)
    out, lse = split_causal_forward(q, kv, get_kernel("torch"), 0.25)
    ref_out, ref_lse = _reference(q, kv)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    err = (out.double() - ref_out).norm() / ref_out.norm()
    assert err < 1e-2, err
