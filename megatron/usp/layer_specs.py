"""GPT layer and block ``ModuleSpec``s with USP core attention, built on megatron-core's local spec.

USP plugs in through megatron-core's extension point: the ``core_attention`` slot of
``SelfAttentionSubmodules``. The norms (input, pre-MLP, q / k, and the block's final norm)
are :mod:`megatron.usp.norms`, which support Megatron sequence parallelism; everything else
(linear layers, MLP, bias-dropout-add) is whatever
``megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec`` returns, so upstream
changes to the local spec flow through.

megatron-core's ``DotProductAttention`` asserts ``context_parallel_size == 1``; it is replaced,
so that assert is never reached, and no other module of the local GPT spec checks the
context-parallel size (``TransformerConfig`` only checks ``cp_comm_type``'s length, which
USP ignores).

Which to use: :func:`get_usp_gpt_block_spec` for ``GPTModel(transformer_layer_spec=...)``.
Given only a layer spec, megatron-core's ``TransformerBlock`` builds its final norm from its
module-level default (``WrappedTorchNorm`` without TransformerEngine or apex), which refuses
``--sequence-parallel``; the block spec names the final norm too.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from megatron.usp.core_attention import USPAttention
from megatron.usp.kernels import BACKEND_NAMES
from megatron.usp.norms import norm_class


def usp_core_attention_spec(attention_backend: str = "auto",
                            overlap_chunks: Optional[int] = None,
                            document_kernel: str = "auto") -> ModuleSpec:
    """``ModuleSpec`` of :class:`megatron.usp.core_attention.USPAttention` with the given backend.

    ``overlap_chunks`` (``--usp-overlap-chunks``): head chunks of the all-to-all/attention
    pipeline; ``None`` lets USP attention choose (auto). It is checked against the heads when
    the layer is built, so a bad value fails at start-up. ``document_kernel``
    (``--document-attention-kernel``): the document-masked kernel used with packed documents.
    """
    if attention_backend not in BACKEND_NAMES:
        raise ValueError(
            f"--attention-backend {attention_backend!r} is not known; choose one of "
            f"{list(BACKEND_NAMES)}"
        )
    params = {"attention_backend": attention_backend}
    if document_kernel != "auto":
        params["document_kernel"] = document_kernel
    if overlap_chunks is not None:
        params["overlap_chunks"] = overlap_chunks
    return ModuleSpec(module=USPAttention, params=params)


def get_usp_gpt_layer_spec(
    attention_backend: str = "auto",
    qk_layernorm: bool = False,
    normalization: str = "RMSNorm",
    overlap_chunks: Optional[int] = None,
    document_kernel: str = "auto",
) -> ModuleSpec:
    """GPT transformer-layer spec: megatron-core's local spec with USP core attention and the
    norms of :mod:`megatron.usp.norms` (input, pre-MLP and, with ``qk_layernorm``, q / k).

    Used for every layout, U = R = 1 included (then USP attention does no communication).
    For a whole model prefer :func:`get_usp_gpt_block_spec`, which also names the final norm.

    Args:
        attention_backend: ``--attention-backend`` (``auto``, ``torch``, ``math``,
            ``flash-attn``, ``te``); resolved when the layer is built, so a missing package
            fails at model construction with the ``pip install`` command to run.
        qk_layernorm: normalise queries and keys per head (``TransformerConfig.qk_layernorm``).
        normalization: ``"RMSNorm"`` or ``"LayerNorm"`` (``--normalization``).
        overlap_chunks, document_kernel: as for :func:`usp_core_attention_spec`.
    """
    norm = norm_class(normalization)
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization)
    layer = spec.submodules
    attn = layer.self_attention
    if not isinstance(layer, TransformerLayerSubmodules) or not isinstance(
            attn.submodules, SelfAttentionSubmodules):
        raise TypeError(
            f"megatron-core's local GPT spec changed: layer / self_attention submodules are "
            f"{type(layer).__name__} / {type(attn.submodules).__name__}, expected "
            f"TransformerLayerSubmodules / SelfAttentionSubmodules")
    attn_norms = dict(q_layernorm=norm, k_layernorm=norm) if qk_layernorm else {}
    attn.submodules = dataclasses.replace(
        attn.submodules, core_attention=usp_core_attention_spec(attention_backend, overlap_chunks,
                                                               document_kernel),
        **attn_norms
    )
    spec.submodules = dataclasses.replace(layer, input_layernorm=norm, pre_mlp_layernorm=norm)
    return spec


def get_usp_gpt_block_spec(
    config,
    pp_rank: int,
    attention_backend: str = "auto",
    vp_stage: Optional[int] = None,
    overlap_chunks: Optional[int] = None,
    document_kernel: str = "auto",
) -> TransformerBlockSubmodules:
    """Decoder-block spec of one pipeline stage: its layers and the final norm, both USP's.

    ``GPTModel(transformer_layer_spec=get_usp_gpt_block_spec(...))``. Normalisation and q / k
    norms come from ``config.normalization`` / ``config.qk_layernorm`` (as megatron-core's
    ``get_gpt_decoder_block_spec`` does), so the spec cannot disagree with the config whose
    ``qk_layernorm`` also decides the TP reduction of the q / k norm gradients.

    Args:
        config: the model's ``TransformerConfig``.
        pp_rank: this rank's pipeline-parallel rank (its rank in ``USPGroups.pp``); with
            ``vp_stage`` it decides how many layers this stage builds.
        attention_backend: as for :func:`get_usp_gpt_layer_spec`.
        vp_stage: virtual pipeline stage, or None.
        overlap_chunks, document_kernel: as for :func:`usp_core_attention_spec`.
    """
    layer = get_usp_gpt_layer_spec(attention_backend, qk_layernorm=config.qk_layernorm,
                                   normalization=config.normalization,
                                   overlap_chunks=overlap_chunks,
                                   document_kernel=document_kernel)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers,
                                      layer_norm=norm_class(config.normalization))
