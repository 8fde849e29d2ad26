"""Sliding-window local attention of one (query block, key block) pair.

The window follows megatron-core / TransformerEngine / flash-attn: ``window_size = (left, 0)``,
and a block of ``sq`` queries on ``sk`` keys is aligned at its bottom-right corner, so query
row ``i`` sees key column ``j`` iff::

    j >= i + sk - sq - left          and, when causal,   j <= i + sk - sq

(for a square causal block: ``i - left <= j <= i``). Shapes are those of
:class:`megatron.usp.kernels.AttentionKernel`::

    q, dq, out, dout : [b, h,  sq, d]
    k, v, dk, dv     : [b, hk, sk, d]     h % hk == 0 (GQA / MQA)
    lse              : [b, h,  sq]        float32 (float64 for float64 inputs)

Rows that see no key give ``out = 0``, ``lse = -inf`` and zero gradients.

Where it runs: on CUDA with fp16/bf16 and PyTorch's flash op, the op's own window
(``torch.ops.aten._flash_attention_forward`` / ``_backward`` with ``window_size_left`` /
``window_size_right``; blocks outside the window are skipped by the kernel), called in its
varlen form with ``b`` sequences of equal length (:mod:`megatron.usp.flash_varlen`).
Elsewhere (the CPU, fp32, fp64) an explicit masked product in float32 (float64 for float64):
exact, O(sq*sk) memory. Window tiles take this path whatever ``--attention-backend`` is (the
flash-attn and TransformerEngine adapters take no window yet). No communication.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from megatron.usp import flash_varlen
from megatron.usp.kernels import masked_backward, masked_forward, masked_scores

Tensor = torch.Tensor


def window_mask(sq: int, sk: int, causal: bool, left: int, device=None) -> Tensor:
    """[sq, sk] boolean mask of the module docstring's convention (True: visible)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    diag = i + (sk - sq)
    visible = j >= diag - left
    if causal:
        visible &= j <= diag
    return visible


def flash_window_usable(q: Tensor) -> bool:
    """PyTorch's flash op with a window can run on ``q`` (CUDA, fp16/bf16)."""
    return flash_varlen.usable(q)


# --------------------------------------------------------------------------- masked product
def _scores(q: Tensor, k: Tensor, causal: bool, left: int, scale: float) -> Tensor:
    visible = window_mask(q.shape[2], k.shape[2], causal, left, q.device)     # [sq, sk]
    return masked_scores(q, k, ~visible, scale)                             # [b, hk, g, sq, sk]


def _masked_forward(q, k, v, causal, left, scale):
    return masked_forward(_scores(q, k, causal, left, scale), v, q.dtype)


def _masked_backward(dout, q, k, v, out, lse, causal, left, scale):
    scores = _scores(q, k, causal, left, scale)
    return masked_backward(scores, dout, q, k, v, out, lse, scale)


# --------------------------------------------------------------------------- flash op
_CU: Dict[Tuple[torch.device, int, int, int], Tuple[Tensor, Tensor]] = {}


def _cumulative(device, b: int, sq: int, sk: int) -> Tuple[Tensor, Tensor]:
    """(cu_q, cu_k) of a varlen call of ``b`` equal sequences (cached)."""
    key = (device, b, sq, sk)
    if key not in _CU:
        steps = torch.arange(b + 1, dtype=torch.int32, device=device)
        _CU[key] = (steps * sq, steps * sk)
    return _CU[key]


def _tokens(x: Tensor) -> Tensor:
    """[b, h, s, d] -> the varlen op's [b*s, h, d] (a copy when not already so laid out)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _flash_forward(q, k, v, causal, left, scale):
    b, h, sq, d = q.shape
    sk = k.shape[2]
    cu_q, cu_k = _cumulative(q.device, b, sq, sk)
    out, lse = flash_varlen.forward(_tokens(q), _tokens(k), _tokens(v), cu_q, cu_k, sq, sk,
                                    causal, scale, left)
    out = out.unflatten(0, (b, sq)).transpose(1, 2)                  # [b, h, sq, d]
    lse = lse.unflatten(1, (b, sq)).transpose(0, 1)                  # [h, b*sq] -> [b, h, sq]
    return out, lse.float()


def _flash_backward(dout, q, k, v, out, lse, causal, left, scale):
    b, h, sq, d = q.shape
    sk = k.shape[2]
    cu_q, cu_k = _cumulative(q.device, b, sq, sk)
    lse_t = lse.float().transpose(0, 1).reshape(h, b * sq).contiguous()
    grads = flash_varlen.backward(_tokens(dout), _tokens(q), _tokens(k), _tokens(v),
                                  _tokens(out), lse_t, cu_q, cu_k, sq, sk, causal, scale, left)
    return tuple(g.unflatten(0, (b, -1)).transpose(1, 2) for g in grads)


# --------------------------------------------------------------------------- entry points
def window_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, left: int, scale: float
                   ) -> Tuple[Tensor, Tensor]:
    """out [b, h, sq, d] (q's dtype), lse [b, h, sq] (accum dtype) under the window ``left``."""
    if flash_window_usable(q):
        return _flash_forward(q, k, v, causal, left, scale)
    return _masked_forward(q, k, v, causal, left, scale)


def window_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    causal: bool, left: int, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv in the inputs' dtypes; ``out`` / ``lse`` are the rows' final (merged) ones."""
    if flash_window_usable(q):
        return _flash_backward(dout, q, k, v, out, lse, causal, left, scale)
    return _masked_backward(dout, q, k, v, out, lse, causal, left, scale)
