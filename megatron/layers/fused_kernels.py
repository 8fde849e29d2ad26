"""Kernels for the work around attention: RMSNorm, SwiGLU and RoPE, one switch for all three.

``--fused-kernels`` picks the implementation of these per-token layers (the layer spec
:mod:`megatron.training.model.layer_specs` wires them in through megatron-core's slots: the norm slots,
the MLP's ``activation_func`` submodule, and :class:`megatron.layers.self_attention.USPSelfAttention`
for RoPE):

``torch``
    Plain PyTorch: ``F.rms_norm``; ``silu(gate) * up`` on the two halves of FC1's output;
    megatron-core's own unfused RoPE (``t * cos + rotate_half(t) * sin``). Runs anywhere; the
    CPU test suite's reference.
``usp``
    This project's Triton kernels: :mod:`megatron.layers.lean_kernels` (RMSNorm and SwiGLU, one
    kernel each way, writing into given outputs, so the lean layers of
    :mod:`megatron.layers.fused_linears` refill their dropped outputs in place) and
    :mod:`megatron.layers.qkv_rope` (megatron's QKV split and RoPE on the layer's per-token
    frequencies in one pass each way). On the CPU the same functions run plain PyTorch math,
    so the path is the same everywhere. Faster than ``liger``
    end to end on one H200 (docs/kernels.md).
``liger``
    Liger's Triton kernels (``pip install liger-kernel``, CUDA only): the fused gate-up
    ``LigerFusedGateUpSiLUMulFunction`` (reads both halves of FC1's ``[.., 2F]`` output in
    place, recomputes ``silu`` in the backward instead of keeping it) and
    ``LigerRopeFunction`` (one kernel for q and k, cos/sin from the layer's own per-token
    frequencies, so it follows the load-balanced token order's positions); RMSNorm stays
    PyTorch's (faster on H200 than ``LigerRMSNormFunction``, which :func:`rms_norm_liger`
    still wraps).
``compile``
    ``torch.compile`` of the plain functions (Inductor fuses each into one or two Triton
    kernels).
``auto``
    ``usp`` on CUDA (Triton ships with PyTorch's CUDA wheels), else ``torch``. Which one won,
    op by op, on an H200 is measured by ``tools/bench_fused_kernels.py`` and, end to end, by
    ``tools/bench_e2e.py`` (docs/performance.md).

The names, the per-op table and :func:`resolve_fused_kernels` live in the torch-free
:mod:`megatron.usp.backend_names` (``--help`` and start-up checks import no torch).

Every implementation computes the same function: the tests check ``compile``, ``usp`` (its
plain path in float64, its Triton kernels under Triton's CPU interpreter in float32) and the
plain path against float64 references on the CPU, and ``liger`` and ``usp`` against
``torch`` in bf16 on a GPU within bf16's own error. :func:`resolve_fused_kernels` is pure (it only asks whether
packages are importable) so that ``validate_args`` can refuse an impossible choice at
start-up, naming the flag.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from megatron.layers import lean_kernels
from megatron.usp.backend_names import (  # noqa: F401  (re-exported: the choices live there)
    FUSED_KERNEL_CHOICES,
    KERNEL_IMPLS,
    LIGER_INSTALL,
    OP_IMPL,
    FusedKernelsUnavailable,
    liger_importable,
    op_impl,
    resolve_fused_kernels,
)

Tensor = torch.Tensor


# --------------------------------------------------------------------------- plain math
def rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (PyTorch's kernel)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def swiglu_torch(x: Tensor) -> Tensor:
    """``[.., 2F] -> [.., F]``: ``silu(x[.., :F]) * x[.., F:]`` (megatron's GLU order:
    gate first, linear second)."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def _rotate_half(t: Tensor) -> Tensor:
    first, second = torch.chunk(t, 2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rope_torch(t: Tensor, freqs: Tensor, mscale: float = 1.0) -> Tensor:
    """RoPE (rotate-half convention) of ``t [s, b, h, d]`` with ``freqs [s, b or 1, 1, r]``
    (``r <= d`` rotated dims; the rest pass through), cos and sin times ``mscale`` (YaRN's
    concentration factor), in ``t``'s dtype: megatron-core's unfused bshd path."""
    rot, rest = t[..., :freqs.shape[-1]], t[..., freqs.shape[-1]:]
    cos, sin = (freqs.cos() * mscale).to(t.dtype), (freqs.sin() * mscale).to(t.dtype)
    out = rot * cos + _rotate_half(rot) * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


# --------------------------------------------------------------------------- Liger
def _liger_ops():
    import torch.distributed.tensor  # noqa: F401  (liger's rms_norm reads DTensor on torch 2.11)
    from liger_kernel.ops import (
        LigerFusedGateUpSiLUMulFunction,
        LigerRMSNormFunction,
        LigerRopeFunction,
    )  # optional: liger-kernel

    return LigerRMSNormFunction, LigerFusedGateUpSiLUMulFunction, LigerRopeFunction


def rms_norm_liger(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """Liger's RMSNorm with scale ``weight + offset``."""
    rms, _, _ = _liger_ops()
    # Llama casting (float32 statistics, weight applied in the input dtype), out of place:
    # megatron's recompute keeps references to the norm's input.
    return rms.apply(x, weight, eps, offset, "llama", False, None)


def swiglu_liger(x: Tensor) -> Tensor:
    _, glu, _ = _liger_ops()
    shape = x.shape
    out = glu.apply(x.reshape(-1, shape[-1]), False)
    return out.view(*shape[:-1], shape[-1] // 2)


def rope_liger(q: Tensor, k: Tensor, freqs: Tensor,
               mscale: float = 1.0) -> Tuple[Tensor, Tensor]:
    """Liger's RoPE of q ``[s, b, h, d]`` and k ``[s, b, hk, d]`` with megatron's ``freqs``
    (cos and sin times ``mscale``).

    Liger takes ``[b, h, s, d]`` views of ``[b, s, h, d]`` storage and cos/sin
    ``[b or 1, s, r]``; it rotates contiguous copies (or q itself when q is already laid out
    that way, batch 1) and returns them. float32 cos/sin: the products are formed in float32
    and rounded once.
    """
    _, _, rope = _liger_ops()
    s, b = q.shape[:2]
    f = freqs.squeeze(2).transpose(0, 1)                      # [b or 1, s, r]
    cos, sin = (f.cos() * mscale).contiguous(), (f.sin() * mscale).contiguous()
    q_bhsd = q.permute(1, 2, 0, 3)                            # [b, h, s, d] view
    k_bhsd = k.permute(1, 2, 0, 3)
    q_out, k_out = rope.apply(q_bhsd, k_bhsd, cos, sin)
    return q_out.permute(2, 0, 1, 3), k_out.permute(2, 0, 1, 3)   # back to [s, b, h, d]


# --------------------------------------------------------------------------- compile
@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False, fullgraph=True)


def _rope_pair_torch(q: Tensor, k: Tensor, freqs: Tensor,
                     mscale: float = 1.0) -> Tuple[Tensor, Tensor]:
    return rope_torch(q, freqs, mscale), rope_torch(k, freqs, mscale)


# --------------------------------------------------------------------------- the switch
def rms_norm(x: Tensor, weight: Tensor, eps: float, impl: str, offset: float = 0.0,
             residual_grad: bool = False) -> Tensor:
    """RMSNorm of ``x`` over its last dimension with scale ``weight + offset`` (``offset`` 1
    for megatron's zero-centred gamma). ``residual_grad``: with ``usp``, ``x``'s gradient as
    a residual is added inside the norm's backward (:mod:`megatron.layers.residual`); the
    other kernels leave that addition to autograd."""
    if impl == "liger":
        return rms_norm_liger(x, weight, eps, offset)
    if impl == "usp":
        return lean_kernels.rms_norm(x, weight, eps, offset, residual_grad=residual_grad)
    gamma = weight + offset if offset else weight
    if impl == "compile":
        return _compiled(rms_norm_torch)(x, gamma, eps)
    return rms_norm_torch(x, gamma, eps)


def swiglu(x: Tensor, impl: str) -> Tensor:
    if impl == "liger":
        return swiglu_liger(x)
    if impl == "usp":
        return lean_kernels.swiglu(x)
    if impl == "compile":
        return _compiled(swiglu_torch)(x)
    return swiglu_torch(x)


def rope(q: Tensor, k: Tensor, freqs: Tensor, impl: str,
         mscale: float = 1.0) -> Tuple[Tensor, Tensor]:
    """RoPE of q and k (``[s, b, heads, d]``) with per-token ``freqs [s, b or 1, 1, r]``,
    cos and sin times ``mscale`` (YaRN's concentration factor; 1 otherwise)."""
    if impl == "liger":
        return rope_liger(q, k, freqs, mscale)
    if impl == "compile":
        return _compiled(_rope_pair_torch)(q, k, freqs, mscale)
    return _rope_pair_torch(q, k, freqs, mscale)


class SwiGLU(MegatronModule):
    """The MLP's activation submodule (megatron-core's ``MLPSubmodules.activation_func`` slot,
    used with ``config.use_te_activation_func``): ``[s, b, 2F/tp] -> [s, b, F/tp]``.

    FC1 is column-parallel, so each TP rank holds gate and up columns of the same F/tp
    features side by side, and the activation needs no communication. A ``MegatronModule``
    (no parameters) because the MLP asks each child for its ``sharded_state_dict``.
    """

    def __init__(self, config, impl: str = "torch"):
        super().__init__(config=config)
        if impl not in KERNEL_IMPLS:
            raise ValueError(f"SwiGLU impl {impl!r}; use one of {list(KERNEL_IMPLS)}")
        self.impl = impl

    def forward(self, x: Tensor) -> Tensor:
        return swiglu(x, self.impl)

    def extra_repr(self) -> str:
        return f"impl={self.impl}"


def rope_supported(config) -> Optional[str]:
    """Why the fused RoPE path cannot serve ``config`` (then megatron-core's own path runs),
    or None."""
    if getattr(config, "rotary_interleaved", False):
        return "--rotary-interleaved"
    if getattr(config, "multi_latent_attention", False):
        return "multi-latent attention"
    if getattr(config, "mrope_section", None) is not None:
        return "mRoPE"
    return None
