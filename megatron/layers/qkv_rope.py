"""Split megatron's fused QKV projection output into q, k, v and rotate q and k, in one pass.

megatron-core's ``SelfAttention.get_query_key_value_tensors`` returns strided views of the
QKV projection's output ``[s, b, ng, (g + 2) * d]`` (``ng`` query groups of ``g`` query heads,
one key and one value head each). On the way to the attention kernel the training step then
spends, per layer and per direction, a reshape copy of q, RoPE's copies of k, the attention
kernel's contiguous copy of v, the RoPE kernel itself and, in the backward, the
``torch.split`` backward that concatenates dq, dk, dv. The one-H200 profile of the 0.85B model
at 32K tokens (one H200) puts those at ~8.4 ms per step.

:func:`qkv_split_rope` does the same work as one Triton kernel each way: the forward reads the
projection output once and writes contiguous ``q [s, b, ng*g, d]``, ``k [s, b, ng, d]`` (both
rotated) and ``v [s, b, ng, d]``; the backward reads dq, dk, dv once and writes the projection
output's gradient with the inverse rotation. No library kernel does this for megatron's
interleaved GQA weight order (TransformerEngine's fused QKV RoPE is megatron's only fused path and
does not reach our GPU machine; Liger rotates q and k but leaves the split and copies), so it
is ours; ``tools/bench_fused_kernels.py`` measures it against megatron's split + Liger's RoPE.

RoPE convention: rotate-half (megatron's non-interleaved bshd path), the first ``r`` of ``d``
dims rotated by the per-token ``freqs [s, b or 1, 1, r]`` the layer receives (so the
load-balanced token order's positions are used as they are), the rest passed through. Products in
float32 from float32 cos/sin, rounded once to the input dtype. YaRN's concentration factor
(``mscale``) multiplies cos and sin before the kernels read them, as megatron-core multiplies
them, so the kernels (forward and its transpose) are unchanged by it.

:func:`qkv_split_rope_reference` is the plain PyTorch function of the same thing (the CPU path
and the tests' reference). On the CPU the Triton kernels run only under Triton's interpreter
(``TRITON_INTERPRET=1``), which the CPU tests use in float32.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

Tensor = torch.Tensor


# --------------------------------------------------------------------------- reference
def _rotate(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE of the first ``r = cos.shape[-1]`` dims of ``t [s, b, h, d]`` with
    ``cos``/``sin [s, b or 1, 1, r]``, in float32 (float64 when ``t`` or cos/sin is)."""
    r = cos.shape[-1]
    wide = torch.promote_types(torch.promote_types(t.dtype, cos.dtype), torch.float32)
    rot, rest = t[..., :r].to(wide), t[..., r:].to(wide)
    cos, sin = cos.to(wide), sin.to(wide)
    first, second = torch.chunk(rot, 2, dim=-1)
    out = rot * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((out, rest), dim=-1)


def qkv_split_rope_reference(mixed: Tensor, freqs: Tensor, heads_per_group: int,
                             head_dim: int, mscale: float = 1.0) -> Tuple[Tensor, Tensor, Tensor]:
    """``mixed [s, b, ng, (g + 2) * d]`` -> contiguous q ``[s, b, ng*g, d]``, k, v
    ``[s, b, ng, d]``, q and k rotated with ``freqs [s, b or 1, 1, r]``, cos and sin times
    ``mscale`` (float32 math)."""
    s, b, ng = mixed.shape[:3]
    g, d = heads_per_group, head_dim
    q, k, v = torch.split(mixed, [g * d, d, d], dim=3)
    q = q.reshape(s, b, ng * g, d)
    f = freqs if freqs.dtype == torch.float64 else freqs.float()
    cos, sin = f.cos() * mscale, f.sin() * mscale
    return (_rotate(q, cos, sin).to(mixed.dtype), _rotate(k, cos, sin).to(mixed.dtype),
            v.contiguous())


# --------------------------------------------------------------------------- Triton
_KERNELS = None


def _triton_kernels():
    """The two kernels, compiled on first use (Triton is imported only then)."""
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import triton  # optional: triton
    import triton.language as tl  # optional: triton

    # One program per block of BLOCK_T tokens, all heads of the row in a static loop: the
    # block's cos / sin are loaded once, not once per head (24 times for the 0.85B model).
    @triton.jit
    def _fwd(mixed, q, k, v, cos, sin, n_tokens, batch, cos_s_stride, cos_b_stride,
             row_stride, GROUPS: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
             R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        dd = tl.arange(0, BLOCK_D)
        tmask = t < n_tokens
        mask = tmask[:, None] & (dd < D)[None, :]
        half = R // 2
        rot = dd < R
        partner = tl.where(dd < half, dd + half, dd - half)
        sign = tl.where(dd < half, -1.0, 1.0)
        crow = (t // batch) * cos_s_stride + (t % batch) * cos_b_stride
        cmask = tmask[:, None] & rot[None, :]
        c = tl.load(cos + crow[:, None] + dd[None, :], mask=cmask, other=1.0)
        sn = sign[None, :] * tl.load(sin + crow[:, None] + dd[None, :], mask=cmask, other=0.0)
        for j in tl.static_range(GROUPS * (G + 2)):     # head slot in the row: grp*(G+2) + h
            grp = j // (G + 2)
            h = j % (G + 2)
            src = mixed + t[:, None] * row_stride + j * D
            x = tl.load(src + dd[None, :], mask=mask, other=0.0)
            if h == G + 1:                             # value head: a contiguous copy
                tl.store(v + t[:, None] * (GROUPS * D) + grp * D + dd[None, :], x, mask=mask)
            else:
                xp = tl.load(src + partner[None, :], mask=mask & rot[None, :], other=0.0)
                y = (x.to(tl.float32) * c + xp.to(tl.float32) * sn).to(x.dtype)
                if h < G:
                    dst = q + t[:, None] * (GROUPS * G * D) + (grp * G + h) * D
                else:
                    dst = k + t[:, None] * (GROUPS * D) + grp * D
                tl.store(dst + dd[None, :], y, mask=mask)

    @triton.jit
    def _bwd(dmixed, dq, dk, dv, cos, sin, n_tokens, batch, cos_s_stride, cos_b_stride,
             dq_t, dq_h, dk_t, dk_h, dv_t, dv_h, GROUPS: tl.constexpr, G: tl.constexpr,
             D: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        dd = tl.arange(0, BLOCK_D)
        tmask = t < n_tokens
        mask = tmask[:, None] & (dd < D)[None, :]
        half = R // 2
        rot = dd < R
        partner = tl.where(dd < half, dd + half, dd - half)
        crow = (t // batch) * cos_s_stride + (t % batch) * cos_b_stride
        cmask = tmask[:, None] & rot[None, :]
        c = tl.load(cos + crow[:, None] + dd[None, :], mask=cmask, other=1.0)
        # the transpose of the rotation: the partner's sine, the opposite sign
        sign = tl.where(dd < half, 1.0, -1.0)
        sp = sign[None, :] * tl.load(sin + crow[:, None] + partner[None, :], mask=cmask,
                                     other=0.0)
        for j in tl.static_range(GROUPS * (G + 2)):
            grp = j // (G + 2)
            h = j % (G + 2)
            dst = dmixed + t[:, None] * (GROUPS * (G + 2) * D) + j * D + dd[None, :]
            if h == G + 1:
                x = tl.load(dv + t[:, None] * dv_t + grp * dv_h + dd[None, :], mask=mask,
                            other=0.0)
                tl.store(dst, x, mask=mask)
            else:
                if h < G:
                    src = dq + t[:, None] * dq_t + (grp * G + h) * dq_h
                else:
                    src = dk + t[:, None] * dk_t + grp * dk_h
                x = tl.load(src + dd[None, :], mask=mask, other=0.0)
                xp = tl.load(src + partner[None, :], mask=mask & rot[None, :], other=0.0)
                y = x.to(tl.float32) * c + xp.to(tl.float32) * sp
                tl.store(dst, y.to(x.dtype), mask=mask)

    _KERNELS = (_fwd, _bwd, triton.next_power_of_2)
    return _KERNELS


def triton_usable(t: Tensor) -> bool:
    """Whether the Triton kernels can run on ``t``: on a CUDA tensor, or under Triton's CPU
    interpreter (``TRITON_INTERPRET=1``, the tests)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


_BLOCK_T = 16   # tokens per program: 2048 programs at 32K tokens, 512 at 8K (CP ranks)


class _CosSinCache:
    """cos/sin (times ``mscale``) of the newest ``freqs`` tensor: every layer of a step gets
    the same ``freqs`` object, so they are computed once per step instead of once per layer
    and direction. Keyed by identity, version (the cache holds ``freqs``, so its id cannot be
    reused) and ``mscale``."""

    def __init__(self) -> None:
        self.freqs: Optional[Tensor] = None
        self.version = -1
        self.mscale = 1.0
        self.value: Optional[Tuple[Tensor, Tensor]] = None

    def get(self, freqs: Tensor, mscale: float = 1.0) -> Tuple[Tensor, Tensor]:
        if (self.freqs is not freqs or self.version != freqs._version
                or self.mscale != mscale):
            f = freqs.detach().float().squeeze(2)                 # [s, b or 1, r]
            self.value = ((f.cos() * mscale).contiguous(), (f.sin() * mscale).contiguous())
            self.freqs, self.version, self.mscale = freqs, freqs._version, mscale
        return self.value


_COS_SIN = _CosSinCache()


def _token_strides(x: Tensor) -> Tuple[Tensor, int, int]:
    """``x [s, b, h, d]`` and its (token, head) strides, with tokens ``t = s_i * b + b_i``;
    a contiguous copy when the strides do not allow that."""
    s, b = x.shape[:2]
    if x.stride(-1) != 1 or (b > 1 and x.stride(0) != b * x.stride(1)):
        x = x.contiguous()
    tok = x.stride(1) if b > 1 else x.stride(0)
    return x, tok, x.stride(2)


class _QKVSplitRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixed: Tensor, cos: Tensor, sin: Tensor, g: int, d: int):
        fwd, _, next_pow2 = _triton_kernels()
        s, b, ng, width = mixed.shape
        if mixed.stride(-1) != 1 or mixed.stride(2) != width or (
                b > 1 and mixed.stride(0) != b * mixed.stride(1)):
            mixed = mixed.contiguous()
        row_stride = mixed.stride(1) if b > 1 else mixed.stride(0)
        n = s * b
        r = cos.shape[-1]
        fb = cos.shape[1]
        q = mixed.new_empty(s, b, ng * g, d)
        k = mixed.new_empty(s, b, ng, d)
        v = mixed.new_empty(s, b, ng, d)
        grid = ((n + _BLOCK_T - 1) // _BLOCK_T,)
        fwd[grid](mixed, q, k, v, cos, sin, n, b, fb * r, r if fb > 1 else 0, row_stride,
                  GROUPS=ng, G=g, D=d, R=r, BLOCK_T=_BLOCK_T, BLOCK_D=next_pow2(d))
        ctx.save_for_backward(cos, sin)
        ctx.meta = (s, b, ng, g, d)
        return q, k, v

    @staticmethod
    def backward(ctx, dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor]):
        _, bwd, next_pow2 = _triton_kernels()
        cos, sin = ctx.saved_tensors
        s, b, ng, g, d = ctx.meta
        like = next(t for t in (dq, dk, dv) if t is not None)
        dq = like.new_zeros(s, b, ng * g, d) if dq is None else dq
        dk = like.new_zeros(s, b, ng, d) if dk is None else dk
        dv = like.new_zeros(s, b, ng, d) if dv is None else dv
        dq, dq_t, dq_h = _token_strides(dq)
        dk, dk_t, dk_h = _token_strides(dk)
        dv, dv_t, dv_h = _token_strides(dv)
        n = s * b
        r = cos.shape[-1]
        fb = cos.shape[1]
        dmixed = like.new_empty(s, b, ng, (g + 2) * d)
        grid = ((n + _BLOCK_T - 1) // _BLOCK_T,)
        bwd[grid](dmixed, dq, dk, dv, cos, sin, n, b, fb * r, r if fb > 1 else 0,
                  dq_t, dq_h, dk_t, dk_h, dv_t, dv_h, GROUPS=ng, G=g, D=d, R=r,
                  BLOCK_T=_BLOCK_T, BLOCK_D=next_pow2(d))
        return dmixed, None, None, None, None


def qkv_split_rope(mixed: Tensor, freqs: Tensor, heads_per_group: int,
                   head_dim: int, mscale: float = 1.0) -> Tuple[Tensor, Tensor, Tensor]:
    """q, k, v from megatron's QKV output ``mixed [s, b, ng, (g + 2) * d]``, q and k rotated
    by ``freqs [s, b or 1, 1, r]`` (``r`` even, ``r <= d``) with cos and sin times ``mscale``
    (YaRN's concentration factor; 1 otherwise); the Triton kernels where they can run
    (:func:`triton_usable`), else :func:`qkv_split_rope_reference`."""
    s, b, ng, width = mixed.shape
    g, d = heads_per_group, head_dim
    r = freqs.shape[-1]
    if width != (g + 2) * d:
        raise ValueError(f"QKV output of width {width} per group is not ({g} + 2) * {d}")
    if r % 2 or r > d or freqs.shape[0] != s or freqs.shape[1] not in (1, b):
        raise ValueError(f"rotary frequencies {tuple(freqs.shape)} do not fit q/k "
                         f"[{s}, {b}, heads, {d}] (need [s, b or 1, 1, even r <= d])")
    if not triton_usable(mixed):
        return qkv_split_rope_reference(mixed, freqs, g, d, mscale)
    cos, sin = _COS_SIN.get(freqs, mscale)
    return _QKVSplitRope.apply(mixed, cos, sin, g, d)
