"""Local attention kernels behind one small interface, and the out/lse algebra that merges them.

Every distributed algorithm in Megatron-USP (the ring, the Ulysses wrapper) calls attention
only through :class:`AttentionKernel`:

* ``forward(q, k, v, causal, scale) -> (out, lse)``
* ``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``

Shapes (legend: ``b`` batch, ``h`` query heads, ``hk`` key/value heads, ``sq``/``sk`` query and
key lengths, ``d`` head dim)::

    q, dq, out, dout : [b, h,  sq, d]   dtype of the inputs
    k, v, dk, dv     : [b, hk, sk, d]   h % hk == 0 (GQA/MQA); query head i uses KV head i // (h/hk)
    lse              : [b, h,  sq]      natural-log softmax normaliser, float32
                                        (float64 when the inputs are float64)

``backward`` takes the *final* ``out`` and ``lse`` of the whole row (merged over every block the
row attends to), not the block's own: with them, ``exp(q k^T * scale - lse)`` is the row's true
probability and ``rowsum(dout * out)`` its true softmax-gradient correction, so the block's
``dq, dk, dv`` are exactly its share of the full gradient. This is what lets the ring backward
recompute nothing but the local block.

Causal convention: ``causal=True`` is only defined for square blocks (``sq == sk``), where the
top-left and bottom-right conventions coincide (query i sees keys 0..i). The ring schedule
(:mod:`megatron.usp.ring_attention`) only ever asks for causal attention on the square diagonal
block; kernels raise ``ValueError`` for a rectangular causal call rather than guess.

Fully masked rows (lse = -inf) give ``out = 0`` and zero gradients, never NaN.

Backends (``--attention-backend``):

* ``torch``: PyTorch's own fused attention ops (``torch.ops.aten``), no compile step. On CUDA,
  fp16/bf16 use the cuDNN op (``_scaled_dot_product_cudnn_attention``; on H100/H200 its causal
  forward+backward is ~1.9x the flash op's, docs/performance.md),
  falling back to ``_scaled_dot_product_flash_attention`` when cuDNN rejects a shape; fp32 uses
  the memory-efficient op (the cuDNN op silently returns wrong results for fp32 on that stack,
  so it is never given fp32); fp64 uses ``math``. On CPU it uses
  ``_scaled_dot_product_flash_attention_for_cpu`` (fp64, fp32, bf16, fp16; GQA native).
* ``math``: explicit reference implementation in float32 (float64 for float64 inputs).
* ``flash-attn``: the flash-attn package (FlashAttention-3 ``flash_attn_interface`` when
  installed, else FlashAttention-2 ``flash_attn`` >= 2.6); ``pip install flash-attn``.
* ``te``: TransformerEngine's fused (cuDNN) attention; ``pip install transformer-engine[pytorch]``.
* ``auto``: the fastest available: on CUDA the ``torch`` backend when PyTorch's cuDNN attention
  is usable, else flash-attn (3 before 2), else TransformerEngine, else ``torch``; on CPU
  ``torch``.

No kernel communicates; every function here is local to one device.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import warnings
from abc import ABC, abstractmethod
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.errors import UsageError
from megatron.usp.backend_names import BACKEND_NAMES, INSTALL_HINTS

Tensor = torch.Tensor

_INSTALL_HINTS = INSTALL_HINTS


class AttentionBackendUnavailable(UsageError, RuntimeError):
    """The requested ``--attention-backend`` cannot run here; the message says what to install."""


# --------------------------------------------------------------------------- dtype helpers
def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of lse and of the fp32 merge/gradient accumulators: float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tuple[int, int]:
    """Validate the [b, h, s, d] contract; return (h, hk)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention kernels take [b, heads, seq, dim] tensors; got q{tuple(q.shape)} "
            f"k{tuple(k.shape)} v{tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k{tuple(k.shape)} and v{tuple(v.shape)} must have the same shape")
    h, hk = q.shape[1], k.shape[1]
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or h % hk:
        raise ValueError(
            f"q{tuple(q.shape)} and k{tuple(k.shape)} disagree: batch and head dim must match "
            f"and query heads must be a multiple of key/value heads"
        )
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"causal attention is only defined here for square blocks (sq == sk); got "
            f"sq={q.shape[2]}, sk={k.shape[2]}"
        )
    return h, hk


def expand_kv(x: Tensor, groups: int) -> Tensor:
    """[b, hk, s, d] -> [b, hk*groups, s, d]: KV head j serves query heads j*groups..+groups-1."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def reduce_kv_grad(dx: Tensor, groups: int) -> Tensor:
    """Inverse of :func:`expand_kv` for gradients: sum the ``groups`` copies of each KV head."""
    if groups == 1:
        return dx
    b, h, s, d = dx.shape
    acc = accum_dtype(dx.dtype)
    return dx.view(b, h // groups, groups, s, d).sum(2, dtype=acc).to(dx.dtype)


# --------------------------------------------------------------------------- out/lse algebra
# A bf16/fp16 output accumulator is merged in float32 slices of about this many elements.
MERGE_SLICE_ELEMENTS = 1 << 25


def merge_block_(acc_out: Tensor, acc_lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's normalised result into the running (out, lse) of the same rows, in place.

    Log-sum-exp rule: ``lse' = log(e^lse + e^block_lse)``,
    ``out' = e^(lse - lse') * out + e^(block_lse - lse') * block_out``. The two weights sum to
    one, so with ``w = e^(block_lse - lse')`` this is ``out' = out + w * (block_out - out)``: one
    ``lerp`` (PyTorch's lerp is accurate at both ends: w = 0 gives ``out``, w = 1 gives
    ``block_out`` exactly).

    Args:
        acc_out: [b, h, s, d] accumulator (may be a strided view), updated in place. float32
            (float64) accumulates in place; a bf16/fp16 accumulator is merged in float32 and
            rounded once, so merging two blocks gives the bits a float32 accumulator rounded at
            the end gives (what a ring of two uses, see
            :func:`megatron.usp.ring_attention.ring_accum_dtype`).
        acc_lse: [b, h, s] float32 (float64) accumulator, updated in place.
        block_out: [b, h, s, d] any float dtype; its rows with ``block_lse = -inf`` are ignored
            (even if they hold NaN).
        block_lse: [b, h, s], any float dtype.

    Rows masked in both inputs stay ``out = 0, lse = -inf``; no NaN is produced.
    Memory traffic: two passes over out-sized tensors (the NaN-safe selection of the block,
    then the lerp), plus lse-sized work. A low-precision accumulator is merged a few heads at a
    time, so its float32 temporaries stay near ``MERGE_SLICE_ELEMENTS`` elements.
    """
    block_lse = block_lse.to(acc_lse.dtype)
    new_lse = torch.logaddexp(acc_lse, block_lse)
    # Shift by 0 where both are -inf so that the weight comes out exp(-inf) = 0, not NaN.
    shift = new_lse.masked_fill(torch.isneginf(new_lse), 0.0)
    w_blk = torch.exp(block_lse - shift).unsqueeze(-1)
    acc_lse.copy_(new_lse)
    if acc_out.dtype == acc_lse.dtype:
        _lerp_merge_(acc_out, block_out, w_blk)
        return
    heads = acc_out.shape[1]
    step = max(1, MERGE_SLICE_ELEMENTS * heads // max(1, acc_out.numel()))
    for h0 in range(0, heads, step):
        part = acc_out[:, h0:h0 + step]
        wide = part.to(acc_lse.dtype)
        _lerp_merge_(wide, block_out[:, h0:h0 + step], w_blk[:, h0:h0 + step])
        part.copy_(wide)


def _lerp_merge_(acc: Tensor, block: Tensor, w_blk: Tensor) -> None:
    """``acc += w * (block - acc)`` in acc's dtype, skipping the block where ``w == 0``."""
    # Where the block has no weight take the accumulator itself: lerp then leaves the row
    # untouched, and a NaN in a fully masked block row never reaches it.
    blk = torch.where(w_blk > 0, block, acc)      # promotes a bf16 block to acc's dtype
    acc.lerp_(blk, w_blk)


# --------------------------------------------------------------------------- interface
class AttentionKernel(ABC):
    """Local attention on [b, h, s, d] tensors returning (out, lse) and (dq, dk, dv).

    See the module docstring for the full contract (shapes, lse dtype, causal convention).
    Implementations are stateless apart from cached capability probes and are safe to share.
    """

    name: str = "abstract"

    @abstractmethod
    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
                ) -> Tuple[Tensor, Tensor]:
        """out [b, h, sq, d] (q's dtype), lse [b, h, sq] (accum_dtype)."""

    @abstractmethod
    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 causal: bool, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
        """dq [b, h, sq, d], dk/dv [b, hk, sk, d] in the inputs' dtypes."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# --------------------------------------------------------------------------- math
def masked_scores(q: Tensor, k: Tensor, hidden: Optional[Tensor], scale: float) -> Tensor:
    """Scores [b, hk, g, sq, sk] in the accumulation dtype (:func:`accum_dtype`), ``-inf``
    where ``hidden`` (a boolean mask broadcastable to that shape; None: every pair visible).
    q [b, h, sq, d], k [b, hk, sk, d] with h % hk == 0 (GQA as g = h / hk query groups)."""
    acc = accum_dtype(q.dtype)
    hk = k.shape[1]
    qg = q.to(acc).unflatten(1, (hk, q.shape[1] // hk))                # [b, hk, g, sq, d]
    scores = torch.matmul(qg, k.to(acc).unsqueeze(2).transpose(-1, -2)) * scale
    if hidden is not None:
        scores.masked_fill_(hidden, float("-inf"))
    return scores


def _causal_hidden(q: Tensor, k: Tensor, causal: bool) -> Optional[Tensor]:
    if not causal:
        return None
    sq, sk = q.shape[2], k.shape[2]
    return torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu_(1)


def _probs(scores: Tensor, lse: Tensor) -> Tensor:
    """exp(scores - lse); rows with lse = -inf (masked everywhere) give 0, not NaN."""
    masked = torch.isneginf(lse).unsqueeze(-1)
    probs = torch.exp(scores - lse.masked_fill(masked.squeeze(-1), 0.0).unsqueeze(-1))
    return probs.masked_fill_(masked, 0.0)


def masked_forward(scores: Tensor, v: Tensor, out_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """Attention of :func:`masked_scores`' ``scores`` on v [b, hk, sk, d]: out [b, h, sq, d]
    in ``out_dtype`` and lse [b, h, sq] in the scores' dtype (rows that see nothing: out 0,
    lse -inf)."""
    lse = torch.logsumexp(scores, dim=-1)                              # [b, hk, g, sq]
    out = torch.matmul(_probs(scores, lse), v.to(scores.dtype).unsqueeze(2))
    return out.flatten(1, 2).to(out_dtype), lse.flatten(1, 2)


def masked_backward(scores: Tensor, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                    lse: Tensor, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`masked_forward` from the recomputed ``scores`` and the saved
    ``out``/``lse``: dq [b, h, sq, d], dk/dv [b, hk, sk, d] in the inputs' dtypes."""
    hk = k.shape[1]
    g = q.shape[1] // hk
    acc = scores.dtype
    p = _probs(scores, lse.to(acc).unflatten(1, (hk, g)))               # [b, hk, g, sq, sk]
    do = dout.to(acc).unflatten(1, (hk, g))                              # [b, hk, g, sq, d]
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)
    dp = torch.matmul(do, v.to(acc).unsqueeze(2).transpose(-1, -2))
    delta = (do * out.to(acc).unflatten(1, (hk, g))).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, k.to(acc).unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc).unflatten(1, (hk, g))).sum(2) * scale
    return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class MathKernel(AttentionKernel):
    """Explicit attention in float32 (float64 for float64 inputs); O(sq*sk) memory.

    The reference the fused kernels are tested against, and a last resort on any device.
    """

    name = "math"

    def forward(self, q, k, v, causal, scale):
        _check_inputs(q, k, v, causal)
        scores = masked_scores(q, k, _causal_hidden(q, k, causal), scale)
        return masked_forward(scores, v, q.dtype)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        _check_inputs(q, k, v, causal)
        scores = masked_scores(q, k, _causal_hidden(q, k, causal), scale)
        return masked_backward(scores, dout, q, k, v, out, lse, scale)


# --------------------------------------------------------------------------- torch (aten)
def _aten_has(*names: str) -> bool:
    return all(hasattr(torch.ops.aten, n) for n in names)


def _cudnn_attention_usable() -> bool:
    """PyTorch's cuDNN attention op exists, cuDNN >= 9 is loaded and SDPA-cuDNN is enabled."""
    if not torch.cuda.is_available() or not torch.backends.cudnn.is_available():
        return False
    if not _aten_has("_scaled_dot_product_cudnn_attention",
                     "_scaled_dot_product_cudnn_attention_backward"):
        return False
    version = torch.backends.cudnn.version() or 0
    enabled = getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)()
    return version >= 90000 and enabled and torch.cuda.get_device_capability()[0] >= 8


class TorchKernel(AttentionKernel):
    """PyTorch's fused attention ops through ``torch.ops.aten`` (see module docstring)."""

    name = "torch"

    def __init__(self) -> None:
        self._math = MathKernel()
        self._cudnn_rejected: Dict[Tuple[torch.dtype, int], str] = {}

    # ---- dispatch
    def _cuda_route(self, q: Tensor) -> str:
        if q.dtype in (torch.float16, torch.bfloat16):
            key = (q.dtype, q.shape[-1])
            if key not in self._cudnn_rejected and _cudnn_attention_usable():
                return "cudnn"
            return "flash"
        if q.dtype == torch.float32:
            return "efficient"
        return "math"

    def _route(self, q: Tensor) -> str:
        if q.device.type == "cpu":
            return "cpu"
        if q.device.type == "cuda":
            return self._cuda_route(q)
        return "math"

    def forward(self, q, k, v, causal, scale):
        _check_inputs(q, k, v, causal)
        route = self._route(q)
        if route == "cudnn":
            try:
                return _cudnn_forward(q, k, v, causal, scale)
            except RuntimeError as exc:
                self._reject_cudnn(q, exc)
                route = "flash"
        return _FORWARD[route](self, q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        _check_inputs(q, k, v, causal)
        route = self._route(q)
        if route == "cudnn":
            try:
                return _cudnn_backward(dout, q, k, v, out, lse, causal, scale)
            except RuntimeError as exc:
                self._reject_cudnn(q, exc)
                route = "flash"
        return _BACKWARD[route](self, dout, q, k, v, out, lse, causal, scale)

    def _reject_cudnn(self, q: Tensor, exc: Exception) -> None:
        key = (q.dtype, q.shape[-1])
        self._cudnn_rejected[key] = str(exc).splitlines()[0]
        warnings.warn(
            f"cuDNN attention rejected dtype={q.dtype} head_dim={q.shape[-1]} "
            f"({self._cudnn_rejected[key]}); using PyTorch's flash attention op for it",
            stacklevel=3,
        )


def _unit_last_stride(x: Tensor) -> Tensor:
    """``x`` whose last dimension is contiguous (the CPU op reads it as if it were and returns
    wrong results without an error otherwise; torch 2.13)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _cpu_forward(kernel, q, k, v, causal, scale):
    q, k, v = (_unit_last_stride(x) for x in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )
    return out, lse.to(accum_dtype(q.dtype))


def _cpu_backward(kernel, dout, q, k, v, out, lse, causal, scale):
    # The CPU op wants lse in the dtype it returned: float32 for low precision, else q's dtype.
    lse_dtype = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    q, k, v = (_unit_last_stride(x) for x in (q, k, v))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.to(lse_dtype).contiguous(),
        0.0, causal, scale=scale,
    )
    return dq, dk, dv


def cudnn_strides(x: Tensor) -> Tensor:
    """``x [b, h, s, d]`` as cuDNN gets it: unchanged when it is contiguous or a ``[b, h, s, d]``
    view of ``[b, s, h, d]`` storage (sequence-major, e.g. megatron's ``[s, 1, h, d]``), the
    two memory orders cuDNN's attention reads natively; else a contiguous copy."""
    if x.is_contiguous() or x.transpose(1, 2).is_contiguous():
        return x
    return x.contiguous()


def matching_strides(x: Tensor, like: Tensor) -> Tensor:
    """``x`` with exactly ``like``'s strides (a copy only when they differ)."""
    if x.stride() == like.stride():
        return x
    out = torch.empty_strided(like.shape, like.stride(), dtype=x.dtype, device=x.device)
    return out.copy_(x)


def _cudnn_forward(q, k, v, causal, scale):
    # cuDNN takes GQA natively, and reads head-major or sequence-major operands as they are
    # (:func:`cudnn_strides`); PyTorch allocates the output with q's strides.
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        cudnn_strides(q), cudnn_strides(k), cudnn_strides(v), None, True, 0.0, causal, False,
        scale=scale,
    )
    out, lse = res[0], res[1]                     # lse comes back [b, h, sq, 1]
    return out, lse.reshape(q.shape[:3]).float()


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    # dout must share out's strides: with mismatched strides cuDNN returns wrong gradients
    # without an error (seen on torch 2.11 + cuDNN 9.19), so it is laid out like out.
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    sq, sk = q.shape[2], k.shape[2]
    out = cudnn_strides(out)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        matching_strides(dout, out), cudnn_strides(q), cudnn_strides(k), cudnn_strides(v), out,
        lse.float().unsqueeze(-1).contiguous(), zero, zero, None, None, None, sq, sk,
        0.0, causal, scale=scale,
    )
    return dq, dk, dv


def _flash_op_forward(kernel, q, k, v, causal, scale):
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, False, scale=scale
    )
    return res[0], res[1].float()


def _flash_op_backward(kernel, dout, q, k, v, out, lse, causal, scale):
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
        lse.float().contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset,
        scale=scale,
    )
    return dq, dk, dv


def _efficient_forward(kernel, q, k, v, causal, scale):
    g = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.contiguous(), expand_kv(k, g).contiguous(), expand_kv(v, g).contiguous(), None, True,
        0.0, causal, scale=scale,
    )[:2]
    return out, lse[..., : q.shape[2]].float()   # lse is padded to a multiple of 32


def _efficient_backward(kernel, dout, q, k, v, out, lse, causal, scale):
    g = q.shape[1] // k.shape[1]
    sq = q.shape[2]
    pad = (-sq) % 32
    lse_p = F.pad(lse.float(), (0, pad)).contiguous()
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q.contiguous(), expand_kv(k, g).contiguous(),
        expand_kv(v, g).contiguous(), None, out.contiguous(), lse_p, zero, zero, 0.0,
        [True, True, True, False], causal, scale=scale,
    )[:3]
    return dq, reduce_kv_grad(dk, g), reduce_kv_grad(dv, g)


def _math_forward(kernel, q, k, v, causal, scale):
    return kernel._math.forward(q, k, v, causal, scale)


def _math_backward(kernel, dout, q, k, v, out, lse, causal, scale):
    return kernel._math.backward(dout, q, k, v, out, lse, causal, scale)


_FORWARD = {"cpu": _cpu_forward, "flash": _flash_op_forward, "efficient": _efficient_forward,
            "math": _math_forward}
_BACKWARD = {"cpu": _cpu_backward, "flash": _flash_op_backward, "efficient": _efficient_backward,
             "math": _math_backward}


# --------------------------------------------------------------------------- flash-attn
def _signature_params(fn) -> List[str]:
    """Parameter names of a (possibly torch.library-wrapped) function."""
    target = getattr(fn, "_init_fn", fn)
    try:
        return list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return []


def _pick_lse(results, b: int, h: int, s: int) -> Tensor:
    """The float32 [b, h, s] tensor among a kernel's return values (versions reorder them)."""
    for t in results:
        if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape[:3]) == (
            b, h, s
        ) and t.dim() in (3, 4):
            return t.reshape(b, h, s)
    raise RuntimeError("could not find the softmax lse among the flash-attn forward outputs")


class FlashAttnKernel(AttentionKernel):
    """flash-attn's internal forward/backward (v3 ``flash_attn_interface`` or v2 >= 2.6).

    flash-attn works on [b, s, h, d]; the adapter passes transposed views (last dim
    contiguous, which is all flash-attn requires) and transposes results back. GQA native.
    fp16/bf16 on CUDA only.
    """

    name = "flash-attn"

    def __init__(self) -> None:
        self.version, self._fwd, self._bwd = _import_flash_attn()
        self._bwd_params = _signature_params(self._bwd)

    def _check(self, q: Tensor) -> None:
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"--attention-backend flash-attn needs fp16/bf16 CUDA tensors, got {q.dtype} on "
                f"{q.device}; use --attention-backend torch"
            )

    def forward(self, q, k, v, causal, scale):
        _check_inputs(q, k, v, causal)
        self._check(q)
        qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))      # [b, s, h, d] views
        if self.version == 3:
            res = self._fwd(qs, ks, vs, softmax_scale=scale, causal=causal)
        else:
            res = self._fwd(qs, ks, vs, dropout_p=0.0, softmax_scale=scale, causal=causal,
                            window_size_left=-1, window_size_right=-1, softcap=0.0,
                            alibi_slopes=None, return_softmax=False)
        out = res[0]
        b, s, h, _ = out.shape
        return out.transpose(1, 2), _pick_lse(res[1:], b, h, s)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        _check_inputs(q, k, v, causal)
        self._check(q)
        qs, ks, vs, os_, dos = (x.transpose(1, 2) for x in (q, k, v, out, dout))
        dq = torch.empty(qs.shape, dtype=q.dtype, device=q.device)
        dk = torch.empty(ks.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(vs.shape, dtype=v.dtype, device=v.device)
        lse = lse.float().contiguous()
        if self.version == 3:
            causal_kw = "is_causal" if "is_causal" in self._bwd_params else "causal"
            self._bwd(dos, qs, ks, vs, os_, lse, dq=dq, dk=dk, dv=dv, softmax_scale=scale,
                      **{causal_kw: causal})
        else:
            self._bwd(dos, qs, ks, vs, os_, lse, dq, dk, dv, dropout_p=0.0, softmax_scale=scale,
                      causal=causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                      alibi_slopes=None, deterministic=False, rng_state=None)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _import_flash_attn():
    """(major version, forward, backward) of the installed flash-attn; 3 preferred."""
    if importlib.util.find_spec("flash_attn_interface") is not None:
        mod = importlib.import_module("flash_attn_interface")
        return 3, mod._flash_attn_forward, mod._flash_attn_backward
    if importlib.util.find_spec("flash_attn") is None:
        raise AttentionBackendUnavailable(
            f"--attention-backend flash-attn: flash-attn is not installed; "
            f"{_INSTALL_HINTS['flash-attn']}; or use --attention-backend torch"
        )
    pkg = importlib.import_module("flash_attn")
    version = tuple(int(p) for p in pkg.__version__.split(".")[:2] if p.isdigit())
    if version < (2, 6):
        raise AttentionBackendUnavailable(
            f"--attention-backend flash-attn needs flash-attn >= 2.6 (found {pkg.__version__}); "
            f"pip install -U 'flash-attn>=2.6' --no-build-isolation"
        )
    mod = importlib.import_module("flash_attn.flash_attn_interface")
    return 2, mod._flash_attn_forward, mod._flash_attn_backward


# --------------------------------------------------------------------------- TransformerEngine
class TEKernel(AttentionKernel):
    """TransformerEngine >= 2.0 fused attention (cuDNN ``F16_arbitrary_seqlen`` backend).

    Called through ``transformer_engine.pytorch.cpp_extensions.fused_attn_fwd/bwd`` with TE's
    ``qkv_layout="bshd_bshd_bshd"`` (transposed views of our [b, h, s, d]); softmax statistics
    come back as [b, h, s, 1] and are given back, with the global lse, to the backward. GQA native.
    """

    name = "te"

    def __init__(self) -> None:
        self._te = _import_te()

    def _check(self, q: Tensor) -> None:
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"--attention-backend te needs fp16/bf16 CUDA tensors, got {q.dtype} on "
                f"{q.device}; use --attention-backend torch"
            )

    def _common(self, q: Tensor, k: Tensor, causal: bool):
        """(sq, sk, cumulative q lengths, cumulative kv lengths, TE mask name)."""
        self._check(q)
        b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
        cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=q.device)
        return sq, sk, cu_q, cu_k, "causal" if causal else "no_mask"

    def forward(self, q, k, v, causal, scale):
        _check_inputs(q, k, v, causal)
        sq, sk, cu_q, cu_k, mask = self._common(q, k, causal)
        fa = self._te
        qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        out, aux = fa.fused_attn_fwd(
            True, sq, sk, cu_q, cu_k, qs, ks, vs, q.dtype, fa.F16_BACKEND,
            attn_scale=scale, dropout=0.0, qkv_layout="bshd_bshd_bshd",
            attn_bias_type="no_bias", attn_mask_type=mask,
        )
        lse = aux[0].reshape(q.shape[:3]).float()
        return out.view(qs.shape).transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        _check_inputs(q, k, v, causal)
        sq, sk, cu_q, cu_k, mask = self._common(q, k, causal)
        fa = self._te
        qs, ks, vs, os_, dos = (x.transpose(1, 2).contiguous() for x in (q, k, v, out, dout))
        aux = [lse.float().unsqueeze(-1).contiguous(),
               torch.zeros(2, dtype=torch.int64, device=q.device)]
        res = fa.fused_attn_bwd(
            sq, sk, cu_q, cu_k, qs, ks, vs, os_, dos, q.dtype, fa.te_dtype(q.dtype), aux,
            fa.F16_BACKEND, attn_scale=scale, dropout=0.0, qkv_layout="bshd_bshd_bshd",
            attn_bias_type="no_bias", attn_mask_type=mask,
        )
        dq, dk, dv = res[:3]
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class _TEFunctions:
    """The few TransformerEngine entry points the adapter uses, resolved once."""

    def __init__(self) -> None:
        fused = importlib.import_module("transformer_engine.pytorch.cpp_extensions.fused_attn")
        tex = importlib.import_module("transformer_engine_torch")
        consts = importlib.import_module("transformer_engine.pytorch.constants")
        self.fused_attn_fwd = fused.fused_attn_fwd
        self.fused_attn_bwd = fused.fused_attn_bwd
        self.F16_BACKEND = tex.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen
        self._te_dtype = consts.TE_DType

    def te_dtype(self, dtype: torch.dtype):
        return self._te_dtype[dtype]


def _import_te() -> _TEFunctions:
    if importlib.util.find_spec("transformer_engine") is None:
        raise AttentionBackendUnavailable(
            f"--attention-backend te: TransformerEngine is not installed; {_INSTALL_HINTS['te']}; "
            f"or use --attention-backend torch"
        )
    try:
        return _TEFunctions()
    except (ImportError, AttributeError) as exc:
        raise AttentionBackendUnavailable(
            f"--attention-backend te needs TransformerEngine >= 2.0 with PyTorch support "
            f"({exc}); {_INSTALL_HINTS['te']}"
        ) from exc


# --------------------------------------------------------------------------- registry
_KERNELS: Dict[str, AttentionKernel] = {}


def _flash_attn_installed() -> bool:
    return (importlib.util.find_spec("flash_attn_interface") is not None
            or importlib.util.find_spec("flash_attn") is not None)


def _te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def available_backends() -> List[str]:
    """Backend names that can run in this process (detected lazily; nothing is imported).

    ``flash-attn`` and ``te`` are listed only when CUDA is available and the package is
    installed; ``torch`` and ``math`` always run; ``auto`` resolves to one of them.
    """
    names = ["auto", "torch", "math"]
    if torch.cuda.is_available():
        if _flash_attn_installed():
            names.append("flash-attn")
        if _te_installed():
            names.append("te")
    return names


def _resolve_auto() -> str:
    if not torch.cuda.is_available() or _cudnn_attention_usable():
        return "torch"
    if _flash_attn_installed():
        return "flash-attn"
    if _te_installed():
        return "te"
    return "torch"


_CONSTRUCTORS = {"torch": TorchKernel, "math": MathKernel, "flash-attn": FlashAttnKernel,
                 "te": TEKernel}


def get_kernel(name: str = "auto") -> AttentionKernel:
    """The kernel for ``--attention-backend name`` (one shared instance per backend).

    Raises:
        ValueError: unknown name (the message lists the valid ones).
        AttentionBackendUnavailable: the backend's package is missing; the message gives the
            ``pip install`` command.
    """
    if isinstance(name, AttentionKernel):
        return name
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"--attention-backend {name!r} is not known; choose one of {list(BACKEND_NAMES)} "
            f"(auto picks the fastest available)"
        )
    resolved = _resolve_auto() if name == "auto" else name
    if resolved not in _KERNELS:
        _KERNELS[resolved] = _CONSTRUCTORS[resolved]()
    return _KERNELS[resolved]


def attention_flops(b: int, h: int, sq: int, sk: int, d: int, causal: bool) -> float:
    """Forward matmul FLOPs of one attention call (4*b*h*sq*sk*d, halved for causal)."""
    flops = 4.0 * b * h * sq * sk * d
    return flops / 2 if causal else flops

