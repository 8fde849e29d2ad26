"""USP core attention: Ulysses all-to-all x load-balanced ring attention (USP, Algorithm 1).

Two entry points:

* :func:`usp_attention` -- functional, torch only (no megatron-core import), for benchmarks
  and tests;
* :class:`USPAttention` -- megatron-core's core-attention module (built from the layer
  ``ModuleSpec`` by :func:`megatron.usp.layer_specs.get_usp_gpt_layer_spec`). It is defined
  on first access so that importing this module does not import megatron-core.

Data flow on one rank (Ulysses group of size U, Ring group of size R, legend in
:mod:`megatron.usp.ulysses` and :mod:`megatron.usp.ring_attention`)::

    q [s, b, h, d], k/v [s, b, hk, d]        local tokens: chunks c and 2CP-1-c (layout.py)
      -- Ulysses all-to-all (Q, K, V in one collective), zigzag block permutation -->
    q_h [b, h/U, U*s, d], kv_h [2, b, hk'/U, U*s, d]     ring rank r's super-chunks r, 2R-1-r
      -- zigzag ring attention over the Ring group (K/V travel, LSE merge in fp32) -->
    out_h [b, h/U, U*s, d]
      -- inverse permutation, Ulysses all-to-all -->
    out [s, b, h, d]                          same tokens as the input

No rank ever holds the full-sequence K/V: after the all-to-all a rank holds U*s = S/R tokens of
hk'/U KV heads, and the ring passes such blocks along. Backward runs the ring backward
(dK/dV travel the ring back to their owner) and then the reverse all-to-alls.

Communication per rank and layer (element counts; see the modules for the derivation):
Ulysses forward ``(U-1)/U * s*b*(2h + 2hk')*d`` (Q, K, V in, output back), Ring forward
``(R-1) * 2*b*(hk'/U)*(S/R)*d``; backward doubles the Ulysses volume and sends
``(R-1) + R`` K/V-sized messages on the ring (the dK/dV ones in float32).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.distributed as dist

from megatron.usp.kernels import AttentionKernel, get_kernel
from megatron.usp.ring_attention import ring_attention
from megatron.usp.ulysses import group_size, out_heads_to_seq, qkv_seq_to_heads

Tensor = torch.Tensor


def usp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    ulysses_group: Optional[dist.ProcessGroup],
    ring_group: Optional[dist.ProcessGroup],
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    backend: Union[str, AttentionKernel] = "auto",
) -> Tensor:
    """Unified sequence-parallel attention on this rank's tokens; differentiable.

    Args:
        q: [s, b, h, d] queries of the local tokens (RoPE applied), in the layout of
            :mod:`megatron.usp.layout` (chunks c and 2CP-1-c, c = u + U*r).
        k, v: [s, b, hk, d]; ``h % hk == 0``; hk and U must divide one another.
        ulysses_group: the Ulysses group (U adjacent ranks), or ``None`` for U = 1.
        ring_group: the Ring group (R ranks strided by U), or ``None`` for R = 1.
        causal: causal (True) or full (False) attention over the whole sequence.
        softmax_scale: defaults to 1/sqrt(d).
        backend: ``--attention-backend`` name or an :class:`AttentionKernel`.
    Returns:
        [s, b, h, d] attention output of the local tokens, q's dtype: what single-device
        attention on the whole sequence gives for these tokens.
    Communication: see the module docstring (one all-to-all in, one out, R-1 ring steps).
    """
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"usp_attention takes q [s, b, h, d] and k, v [s, b, hk, d]; got q{tuple(q.shape)} "
            f"k{tuple(k.shape)} v{tuple(v.shape)}"
        )
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"q{tuple(q.shape)} and k{tuple(k.shape)} must share tokens, batch and head dim, "
            f"and query heads must be a multiple of KV heads"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    kernel = get_kernel(backend)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    ring = ring_group if group_size(ring_group) > 1 else None
    q_h, kv_h = qkv_seq_to_heads(q, k, v, ulysses_group)   # [b,h/U,S/R,d], [2,b,hk'/U,S/R,d]
    out_h = ring_attention(q_h, kv_h, ring, kernel, causal, scale)   # [b, h/U, S/R, d]
    return out_heads_to_seq(out_h, ulysses_group)                     # [s, b, h, d]


# --------------------------------------------------------------------------- megatron module
def _build_usp_attention_class():
    """Define USPAttention (imports megatron-core; called once, on first access)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule

    class USPAttention(MegatronModule):
        """megatron-core core attention computed with USP (Ulysses x zigzag Ring).

        Drop-in for ``DotProductAttention`` / ``TEDotProductAttention`` in the
        ``core_attention`` slot of ``SelfAttentionSubmodules``; constructed with the keyword
        arguments megatron-core 0.16.1's ``Attention`` passes, plus ``attention_backend``
        (from the ModuleSpec params).

        Forward contract (megatron-core's): query [s, b, np, hn], key/value [s, b, ng, hn] for
        this rank's tokens (layout of :mod:`megatron.usp.layout`), RoPE already applied;
        returns [s, b, np*hn]. ``np``/``ng`` are the heads on this TP rank (megatron splits
        heads over TP first, and hands one KV head per rank when KV heads < TP).

        Groups: Ulysses and Ring groups come from ``pg_collection.hcp`` (= [ulysses, ring],
        as :func:`megatron.usp.parallel_state.initialize_usp_parallel` builds it). Without
        ``hcp``, the context-parallel group ``pg_collection.cp`` is used as a pure ring
        (U = 1); with context-parallel size 1 nothing is communicated.

        Masks: ``AttnMaskType.causal`` or ``no_mask``; ``attention_mask`` tensors are not
        read (the mask type defines the mask, as TEDotProductAttention does for these
        types). Dropout is rejected: an attention-dropout mask would have to be drawn
        identically for a block whichever rank computes it (ring position dependent), and
        no RNG scheme for that is implemented; modern LLM pretraining uses 0.

        Softmax scale: ``softmax_scale`` or 1/sqrt(hn). ``apply_query_key_layer_scaling``
        does not change the result in megatron (it divides the scale by the layer number
        and multiplies it back inside the softmax), so it is ignored.
        """

        def __init__(
            self,
            config,
            layer_number: int,
            attn_mask_type,
            attention_type: str = "self",
            attention_dropout: Optional[float] = None,
            softmax_scale: Optional[float] = None,
            cp_comm_type: Optional[str] = None,
            pg_collection=None,
            attention_backend: str = "auto",
        ):
            super().__init__(config=config)
            self.layer_number = max(1, layer_number)
            self.attn_mask_type = attn_mask_type
            self.attention_type = attention_type
            self.softmax_scale = softmax_scale
            self.current_max_attn_logits = None
            _check_supported(config, attn_mask_type, attention_type, attention_dropout)
            self.ulysses_group, self.ring_group = _groups_from(pg_collection)
            self.kernel = get_kernel(attention_backend)

        def forward(
            self,
            query: Tensor,
            key: Tensor,
            value: Tensor,
            attention_mask: Optional[Tensor],
            attn_mask_type=None,
            attention_bias: Optional[Tensor] = None,
            packed_seq_params=None,
        ) -> Tensor:
            """[s, b, np, hn] x [s, b, ng, hn] -> [s, b, np*hn] (see class docstring)."""
            if packed_seq_params is not None:
                raise NotImplementedError(
                    "USP attention does not support packed sequences (THD, packed_seq_params); "
                    "drop --reset-attention-mask / packed datasets, or use --ulysses-degree 1 "
                    "--ring-degree 1 with TransformerEngine attention"
                )
            if attention_bias is not None:
                raise NotImplementedError("USP attention does not support an attention_bias")
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            causal = _is_causal(mask_type)
            out = usp_attention(
                query, key, value, ulysses_group=self.ulysses_group,
                ring_group=self.ring_group, causal=causal, softmax_scale=self.softmax_scale,
                backend=self.kernel,
            )
            s, b = out.shape[:2]
            return out.view(s, b, -1)

    def _is_causal(mask_type) -> bool:
        if mask_type == AttnMaskType.causal:
            return True
        if mask_type == AttnMaskType.no_mask:
            return False
        raise NotImplementedError(
            f"USP attention supports attn_mask_type causal or no_mask, got {mask_type}"
        )

    def _check_supported(config, attn_mask_type, attention_type, attention_dropout) -> None:
        _is_causal(attn_mask_type)
        if attention_type != "self":
            raise NotImplementedError(
                f"USP attention implements self-attention only (got attention_type="
                f"{attention_type!r})"
            )
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout and dropout > 0:
            raise ValueError(
                f"--attention-dropout {dropout} is not supported with USP attention (no RNG "
                f"scheme makes a block's dropout mask independent of which rank computes it); "
                f"pass --attention-dropout 0.0"
            )
        if getattr(config, "window_size", None) is not None:
            raise NotImplementedError(
                "USP attention does not support sliding-window attention (--window-size); "
                "drop --window-size"
            )
        if getattr(config, "qk_clip", False):
            raise NotImplementedError(
                "USP attention does not report max attention logits; drop --qk-clip"
            )
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(
                f"USP attention supports --softmax-type vanilla only, got {config.softmax_type}"
            )

    def _groups_from(pg_collection):
        """(ulysses, ring) groups; None for a group of one."""
        if pg_collection is None:
            return None, None
        hcp = getattr(pg_collection, "hcp", None)
        cp = getattr(pg_collection, "cp", None)
        cp_size = group_size(cp) if cp is not None else 1
        if hcp:
            if len(hcp) != 2:
                raise ValueError(
                    f"pg_collection.hcp must be [ulysses_group, ring_group], got {len(hcp)} groups"
                )
            ulysses, ring = hcp
            if group_size(ulysses) * group_size(ring) != cp_size:
                raise ValueError(
                    f"Ulysses ({group_size(ulysses)}) x Ring ({group_size(ring)}) group sizes "
                    f"do not multiply to the context-parallel size {cp_size}"
                )
        else:
            ulysses, ring = None, cp
        return (ulysses if group_size(ulysses) > 1 else None,
                ring if group_size(ring) > 1 else None)

    USPAttention.__module__ = __name__
    USPAttention.__qualname__ = "USPAttention"
    return USPAttention


_LAZY = {}


def __getattr__(name: str):
    """Build :class:`USPAttention` (and import megatron-core) only when it is asked for."""
    if name == "USPAttention":
        if name not in _LAZY:
            _LAZY[name] = _build_usp_attention_class()
        return _LAZY[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
