"""A float64 stand-in for PyTorch's flash varlen op, for the CPU tests.

Every caller of the op goes through :mod:`megatron.usp.flash_varlen`; the ``fake_flash``
fixture (tests/unit/conftest.py) replaces its op lookup and its ``usable`` check with the
functions here, so the layouts, the cumulative lengths, the lse shapes and the mask arguments
of each caller are checked without a GPU. The stand-in follows flash-attn's documented
convention: per sequence, masks aligned at the bottom-right corner, ``-1`` for no limit on a
window side, ``is_causal`` the limit ``j <= i + sk - sq``.
"""

from __future__ import annotations

import torch


def flash_visible(sq: int, sk: int, causal: bool, left: int, right: int) -> torch.Tensor:
    """[sq, sk] boolean: flash-attn's mask of one sequence."""
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    diag = i + sk - sq
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    if causal:
        visible &= j <= diag
    return visible


def _sequences(q, k, v, cu_q, cu_k, causal, left, right, scale):
    """Per varlen sequence: out [T, h, d] and lse [h, T] by a float64 masked softmax."""
    outs, lses = [], []
    g = q.shape[1] // k.shape[1]
    for a, b, c, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(),
                          cu_k[1:].tolist()):
        qs = q[a:b].transpose(0, 1).double()
        ks, vs = (x[c:e].transpose(0, 1).repeat_interleave(g, 0).double() for x in (k, v))
        scores = qs @ ks.transpose(-1, -2) * scale
        scores = scores.masked_fill(~flash_visible(b - a, e - c, causal, left, right),
                                    float("-inf"))
        lses.append(torch.logsumexp(scores, -1))
        outs.append((torch.softmax(scores, -1).nan_to_num(0.0) @ vs).transpose(0, 1))
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1).float()


def forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale,
            window_size_left=-1, window_size_right=-1):
    """The op's forward: (out, lse, rng state, unused, debug mask)."""
    assert dropout == 0.0 and not debug
    out, lse = _sequences(q, k, v, cu_q, cu_k, causal, window_size_left, window_size_right,
                          scale)
    return out, lse, None, None, None


def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng, unused,
             *, scale, window_size_left=-1, window_size_right=-1):
    """The op's backward: (dq, dk, dv) in the inputs' dtype, from the rows' final ``out`` and
    ``lse`` [h, Tq] (a row may take keys from several calls, as in flash-attn)."""
    assert dropout == 0.0 and lse.dtype == torch.float32
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    for a, b, c, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(),
                          cu_k[1:].tolist()):
        qs, do, o = (x[a:b].transpose(0, 1).double() for x in (q, dout, out))     # [h, sq, d]
        ks, vs = (x[c:e].transpose(0, 1).repeat_interleave(g, 0).double() for x in (k, v))
        scores = qs @ ks.transpose(-1, -2) * scale
        visible = flash_visible(b - a, e - c, causal, window_size_left, window_size_right)
        probs = torch.exp(scores - lse[:, a:b, None].double()) * visible
        d_probs = do @ vs.transpose(-1, -2)
        d_scores = probs * (d_probs - (do * o).sum(-1, keepdim=True)) * scale
        dq[a:b] += (d_scores @ ks).transpose(0, 1)
        dk[c:e] += (d_scores.transpose(-1, -2) @ qs).unflatten(0, (-1, g)).sum(1).transpose(0, 1)
        dv[c:e] += (probs.transpose(-1, -2) @ do).unflatten(0, (-1, g)).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
