"""PyTorch's flash varlen attention op: the one place that calls it.

``torch.ops.aten._flash_attention_forward`` / ``_backward`` (CUDA builds, fp16/bf16) compute
attention over sequences packed one after another, each query sequence against its own key
sequence::

    q, dq, out, dout : [Tq, h,  d]    cu_q [n + 1] int32: where each query sequence starts
    k, v, dk, dv     : [Tk, hk, d]    cu_k [n + 1] int32: the same for keys (h % hk == 0)
    lse              : [h, Tq]        float32

Masks are per sequence and aligned at its bottom-right corner (flash-attn's convention): in a
sequence of ``sq`` queries on ``sk`` keys, causal query ``i`` sees key ``j <= i + sk - sq``;
a left window ``W`` (megatron-core's ``window_size = (W, 0)``) also needs
``j >= i + sk - sq - W``. A windowed call is made as ``torch.nn.attention.varlen`` makes it:
``is_causal`` off and the causal limit as the window's right side 0 (``-1``: no limit), so
the kernel skips the blocks outside the band.

The document kernels (:mod:`megatron.usp.document_kernels`, :mod:`megatron.usp.packed_documents`)
and the window kernel (:mod:`megatron.usp.window_kernel`) call the op only through
:func:`forward` and :func:`backward`, and ask :func:`usable` first. No communication.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

Tensor = torch.Tensor

_EXTRAS: Dict[torch.device, Tuple[Tensor, Tensor]] = {}


def available() -> bool:
    """PyTorch's flash varlen ops exist (CUDA builds) and CUDA is up."""
    return (torch.cuda.is_available() and hasattr(torch.ops.aten, "_flash_attention_forward")
            and hasattr(torch.ops.aten, "_flash_attention_backward"))


def usable(q: Tensor) -> bool:
    """The op can run on ``q``: a CUDA fp16/bf16 tensor, with the op :func:`available`."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and available()


def ops():
    """The forward and backward ops (looked up per call: CPU builds lack them)."""
    return torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward


def _mask_args(causal: bool, window: Optional[int]) -> Tuple[bool, dict]:
    """(is_causal, window keyword arguments) of a call (module docstring)."""
    if window is None:
        return causal, {}
    return False, {"window_size_left": window, "window_size_right": 0 if causal else -1}


def _extras(device: torch.device) -> Tuple[Tensor, Tensor]:
    """The rng state and the unused tensor the backward takes (no dropout), per device."""
    if device not in _EXTRAS:
        _EXTRAS[device] = (torch.zeros(2, dtype=torch.uint64, device=device),
                           torch.empty(0, device=device))
    return _EXTRAS[device]


def forward(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
            max_k: int, causal: bool, scale: float, window: Optional[int] = None
            ) -> Tuple[Tensor, Tensor]:
    """out [Tq, h, d] (q's dtype) and lse [h, Tq] float32 of the packed sequences."""
    is_causal, window_args = _mask_args(causal, window)
    res = ops()[0](q, k, v, cu_q, cu_k, max_q, max_k, 0.0, is_causal, False, scale=scale,
                   **window_args)
    return res[0], res[1]


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool, scale: float,
             window: Optional[int] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """dq [Tq, h, d], dk, dv [Tk, hk, d] in the inputs' dtype; ``lse`` [h, Tq] float32."""
    is_causal, window_args = _mask_args(causal, window)
    rng, unused = _extras(q.device)
    dq, dk, dv = ops()[1](dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, is_causal,
                          rng, unused, scale=scale, **window_args)[:3]
    return dq, dk, dv
