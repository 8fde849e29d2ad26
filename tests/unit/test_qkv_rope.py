"""megatron.layers.qkv_rope: the plain reference against megatron-core's own split and RoPE in
float64, argument checks, the cos/sin cache, and (where Triton is installed) the Triton
kernels themselves under Triton's CPU interpreter in float32 against the float64 reference,
forward and backward. The bf16 GPU check is tests/gpu/test_fused_kernels_gpu.py."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from megatron.layers import qkv_rope
from tests.harness import run_under_triton_interpreter


def _freqs(s: int, r: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pos = torch.randperm(4 * s, generator=gen)[: s * batch].view(s, batch).double()
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    f = pos[..., None] * inv                                  # [s, b, r/2]
    return torch.cat((f, f), dim=-1)[:, :, None, :]           # megatron's [s, b, 1, r]


@pytest.mark.parametrize("batch,groups,per,d,r", [(1, 2, 3, 16, 16), (2, 1, 4, 8, 4),
                                                  (3, 4, 1, 8, 8)])
def test_reference_is_megatrons_split_and_rope(batch, groups, per, d, r):
    from megatron.core.models.common.embeddings.rope_utils import (
        _apply_rotary_pos_emb_bshd,  # megatron-core on first use
    )

    s = 7
    mixed = torch.randn(s, batch, groups, (per + 2) * d, dtype=torch.float64)
    freqs = _freqs(s, r, batch)
    q, k, v = qkv_rope.qkv_split_rope_reference(mixed, freqs, per, d)
    mq, mk, mv = torch.split(mixed, [per * d, d, d], dim=3)
    mq = mq.reshape(s, batch, groups * per, d)
    torch.testing.assert_close(q, _apply_rotary_pos_emb_bshd(mq, freqs, rotary_interleaved=False),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k, _apply_rotary_pos_emb_bshd(mk, freqs, rotary_interleaved=False),
                               rtol=1e-12, atol=1e-12)
    assert torch.equal(v, mv) and v.is_contiguous()


def test_bad_shapes_are_refused_by_name():
    mixed = torch.randn(4, 1, 2, 5 * 8)
    with pytest.raises(ValueError, match=r"\(3 \+ 2\) \* 8"):
        qkv_rope.qkv_split_rope(mixed[..., :-8], _freqs(4, 8), 3, 8)
    with pytest.raises(ValueError, match="rotary frequencies"):
        qkv_rope.qkv_split_rope(mixed, _freqs(4, 10), 3, 8)       # r > d
    with pytest.raises(ValueError, match="rotary frequencies"):
        qkv_rope.qkv_split_rope(mixed, _freqs(4, 8, batch=2), 3, 8)   # b of 2 for b = 1


def test_cos_sin_cache_follows_the_freqs_tensor():
    cache = qkv_rope._CosSinCache()
    f = _freqs(5, 8).float()
    c1, s1 = cache.get(f)
    assert cache.get(f)[0] is c1                                # same tensor: reused
    torch.testing.assert_close(c1, f.squeeze(2).cos())
    f.mul_(2)                                                   # changed in place: recomputed
    c2, _ = cache.get(f)
    assert c2 is not c1
    torch.testing.assert_close(c2, f.squeeze(2).cos())
    g = f.clone()
    assert cache.get(g)[0] is not c2                            # another tensor: recomputed


_INTERPRETED = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from megatron.layers import qkv_rope
    torch.manual_seed(0)
    for (s, b, ng, g, d, r, fb, strided) in [(37, 1, 2, 3, 16, 16, 1, False),
                                            (9, 2, 1, 2, 8, 4, 2, True),
                                            (11, 3, 2, 1, 8, 8, 1, False),
                                            (40, 1, 1, 4, 16, 8, 1, True)]:
        mixed = torch.randn(s, b, ng, (g + 2) * d, requires_grad=True)
        pos = torch.randperm(4 * s)[: s * fb].view(s, fb, 1, 1).float()
        inv = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
        freqs = torch.cat((pos * inv, pos * inv), dim=-1)
        q, k, v = qkv_rope.qkv_split_rope(mixed, freqs, g, d)
        assert qkv_rope.triton_usable(mixed)
        m64 = mixed.detach().double().requires_grad_(True)
        ref = qkv_rope.qkv_split_rope_reference(m64, freqs.double(), g, d)
        for got, want in zip((q, k, v), ref):
            assert got.shape == want.shape and got.is_contiguous()
            assert (got.double() - want).abs().max().item() < 1e-5
        grads = [torch.randn_like(t) for t in (q, k, v)]
        if strided:   # incoming gradients in another memory order ([b, h, s, d] storage)
            grads = [x.permute(2, 1, 0, 3).contiguous().permute(2, 1, 0, 3) for x in grads]
        torch.autograd.backward((q, k, v), grads)
        torch.autograd.backward(ref, [x.double() for x in grads])
        assert (mixed.grad.double() - m64.grad).abs().max().item() < 1e-5
    print("kernels ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernels_under_the_interpreter():
    assert "kernels ok" in run_under_triton_interpreter(_INTERPRETED)
