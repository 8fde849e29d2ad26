"""megatron-core's core-attention module computed with USP: :class:`USPAttention`.

It fills the ``core_attention`` slot of megatron-core's ``SelfAttentionSubmodules``
(:mod:`megatron.training.model.layer_specs` builds the spec) and calls :func:`megatron.usp.attention.usp_attention`
with the Ulysses and Ring groups it finds in the ``pg_collection`` it is given.

Packed documents reach it as megatron-core's ``packed_seq_params``: :class:`DocumentParams`
(a ``PackedSeqParams`` with ``qkv_format="sbhd"``, so megatron-core's attention passes it
through untouched) carries the micro-batch's document ring plan. It is an argument of the
model's forward, so activation recompute and pipeline schedules with several micro-batches in
flight each see their own (no module state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from megatron.usp.attention import make_schedule, resolve_overlap_chunks, usp_attention
from megatron.usp.document_choice import get_document_kernel
from megatron.usp.document_ring import DocumentRingPlan
from megatron.usp.kernels import get_kernel
from megatron.usp.ulysses import group_size

Tensor = torch.Tensor


@dataclass
class DocumentParams(PackedSeqParams):
    """megatron-core's ``packed_seq_params`` carrying a micro-batch's document mask.

    ``qkv_format`` is ``"sbhd"`` (the tensors keep megatron's [s, b, h, d]; megatron-core only
    reshapes for ``"thd"``); ``max_seqlen_q``/``max_seqlen_kv`` are the full sequence length
    (what megatron-core's RoPE sizes its table by); ``plan`` is this rank's
    :class:`~megatron.usp.document_ring.DocumentRingPlan`.
    """

    plan: Optional[DocumentRingPlan] = None

    @classmethod
    def for_plan(cls, plan: DocumentRingPlan) -> "DocumentParams":
        return cls(qkv_format="sbhd", max_seqlen_q=plan.seq_len, max_seqlen_kv=plan.seq_len,
                   plan=plan)


class USPAttention(MegatronModule):
    """megatron-core core attention computed with USP (Ulysses x zigzag Ring).

    Drop-in for ``DotProductAttention`` / ``TEDotProductAttention`` in the
    ``core_attention`` slot of ``SelfAttentionSubmodules``; constructed with the keyword
    arguments megatron-core 0.16.1's ``Attention`` passes, plus ``attention_backend``,
    ``overlap_chunks``, ``document_kernel`` (from the ModuleSpec params; see
    :func:`usp_attention`) and ``document_costs_group`` (the gloo group over which ``auto``'s
    cost table is agreed, :class:`~megatron.usp.document_choice.AutoDocumentKernel`).
    ``overlap_chunks`` is resolved and checked against the heads per TP rank here, at
    model construction, so a bad value fails at start-up.

    Forward contract (megatron-core's): query [s, b, np, hn], key/value [s, b, ng, hn] for
    this rank's tokens (order of :mod:`megatron.usp.token_order`), RoPE already applied;
    returns [s, b, np*hn]. ``np``/``ng`` are the heads on this TP rank (megatron splits
    heads over TP first, and hands one KV head per rank when KV heads < TP).

    Groups: Ulysses and Ring groups come from ``pg_collection.hcp`` (= [ulysses, ring],
    as :func:`megatron.usp.parallel_state.initialize_usp_parallel` builds it). Without
    ``hcp``, the context-parallel group ``pg_collection.cp`` is used as a pure ring
    (U = 1); with context-parallel size 1 nothing is communicated.

    Masks: ``AttnMaskType.causal`` or ``no_mask``; ``attention_mask`` tensors are not
    read (the mask type defines the mask, as TEDotProductAttention does for these
    types). A :class:`DocumentParams` in ``packed_seq_params`` confines attention to
    documents as well (``--reset-attention-mask``); other packed formats are refused. Dropout is rejected: an attention-dropout mask would have to be drawn
    identically for a block whichever rank computes it (ring position dependent), and
    no RNG scheme for that is implemented; modern LLM pretraining uses 0.

    Sliding window: ``config.window_size = (left, 0)`` with megatron-core's per-layer rule
    (``is_layer_window_attention(window_size, window_attn_skip_freq, layer_number)``): a
    window layer attends to keys ``i - left <= j <= i`` (:func:`layer_window`), a full layer
    runs unchanged.

    Softmax scale: ``softmax_scale`` or 1/sqrt(hn). ``apply_query_key_layer_scaling``
    does not change the result in megatron (it divides the scale by the layer number
    and multiplies it back inside the softmax), so it is ignored.

    ``recompute_keep`` (``--recompute-keep-core-attn``, full recompute): the forward keeps
    the output and the recompute reuses it instead of running attention again
    (:mod:`megatron.memory.kept_attention`).
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
        overlap_chunks: Optional[int] = None,
        recompute_keep=None,
        document_kernel: str = "auto",
        document_costs_group=None,
    ):
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.softmax_scale = softmax_scale
        self.current_max_attn_logits = None
        _check_supported(config, attn_mask_type, attention_type, attention_dropout)
        self.window = layer_window(config, self.layer_number)
        if self.window is not None and not _is_causal(attn_mask_type):
            raise ValueError(f"--window-size {self.window} needs causal attention (megatron-core's "
                             f"window_size = (left, 0)); drop --window-size for {attn_mask_type}")
        self.ulysses_group, self.ring_group = _groups_from(pg_collection)
        self.kernel = get_kernel(attention_backend)
        self.document_kernel = get_document_kernel(document_kernel, self.kernel,
                                                   document_costs_group,
                                                   layers_sharing_blocks(config, self.window))
        self.overlap_chunks = _overlap_chunks_for(config, pg_collection, self.ulysses_group,
                                                  self.ring_group, overlap_chunks)
        # The keeper comes from the object the spec passes (activation memory sits above
        # this package), so sequence parallelism never imports it.
        self.keeper = recompute_keep.make_keeper() if recompute_keep is not None else None

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
        plan = None
        if packed_seq_params is not None:
            if not isinstance(packed_seq_params, DocumentParams):
                raise NotImplementedError(
                    "USP attention takes packed documents as DocumentParams (what get_batch "
                    "builds for --reset-attention-mask), not megatron-core's THD "
                    "packed_seq_params"
                )
            plan = packed_seq_params.plan
        if attention_bias is not None:
            raise NotImplementedError("USP attention does not support an attention_bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = _is_causal(mask_type)
        call_args = dict(ulysses_group=self.ulysses_group, ring_group=self.ring_group,
                         causal=causal, softmax_scale=self.softmax_scale, backend=self.kernel,
                         overlap_chunks=self.overlap_chunks, documents=plan,
                         document_kernel=self.document_kernel, window=self.window)
        if self.keeper is not None and self.training:
            out = self.keeper(query, key, value, make_schedule(query, key, **call_args))
        else:
            out = usp_attention(query, key, value, **call_args)
        s, b = out.shape[:2]
        return out.view(s, b, -1)

def layer_window(config, layer_number: int) -> Optional[int]:
    """The left window of layer ``layer_number`` (1-based, global), or None for a full layer.

    megatron-core's fields: ``window_size = (left, 0)`` (None: no window) and
    ``window_attn_skip_freq`` (None: every layer; int N: layers with number % N != 0; a list:
    1 marks a window layer), decided by megatron-core's own ``is_layer_window_attention``.
    Raises ValueError naming ``--window-size`` for a window this attention cannot run.
    """
    window_size = getattr(config, "window_size", None)
    if window_size is None:
        return None
    left, right = tuple(window_size)
    if right != 0 or not isinstance(left, int) or left < 1:
        raise ValueError(f"--window-size {tuple(window_size)} is not supported: USP attention "
                         f"takes a causal left window (left >= 1, right 0), e.g. "
                         f"--window-size 4096")
    if not is_layer_window_attention(window_size, config.window_attn_skip_freq, layer_number):
        return None
    return left


def layers_sharing_blocks(config, window: Optional[int]) -> int:
    """How many layers of one pipeline stage attend with this layer's window (None: full),
    i.e. reuse the micro-batch's document blocks and their kernel choices: the model's layers
    of that window spread evenly over ``pipeline_model_parallel_size`` stages, at least 1."""
    layers = int(getattr(config, "num_layers", 1) or 1)
    same = sum(1 for n in range(1, layers + 1) if layer_window(config, n) == window)
    stages = max(1, int(getattr(config, "pipeline_model_parallel_size", 1) or 1))
    return max(1, -(-same // stages))


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
    if getattr(config, "qk_clip", False):
        raise NotImplementedError(
            "USP attention does not report max attention logits; drop --qk-clip"
        )
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        raise NotImplementedError(
            f"USP attention supports --softmax-type vanilla only, got {config.softmax_type}"
        )

def _overlap_chunks_for(config, pg_collection, ulysses, ring, requested) -> int:
    """Resolve ``overlap_chunks`` for this layer's heads per TP rank (megatron's split)."""
    tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    tp = group_size(tp_group) if tp_group is not None else config.tensor_model_parallel_size
    heads = config.num_attention_heads // tp
    kv_heads = max(1, (config.num_query_groups or config.num_attention_heads) // tp)
    return resolve_overlap_chunks(heads, kv_heads, group_size(ulysses), group_size(ring),
                                  requested)

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
