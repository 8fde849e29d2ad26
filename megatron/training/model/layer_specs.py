"""GPT layer and block ``ModuleSpec``s with USP core attention, built on megatron-core's local spec.

USP plugs in through megatron-core's extension point: the ``core_attention`` slot of
``SelfAttentionSubmodules``. The norms (input, pre-MLP, q / k, and the block's final norm)
are :mod:`megatron.layers.norms`, which support Megatron sequence parallelism; everything else
(linear layers, MLP, bias-dropout-add) is whatever
``megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec`` returns, so upstream
changes to the local spec flow through.

megatron-core's ``DotProductAttention`` asserts ``context_parallel_size == 1``; it is replaced,
so that assert is never reached, and no other module of the local GPT spec checks the
context-parallel size (``TransformerConfig`` only checks ``cp_comm_type``'s length, which
USP ignores).

Kernels around attention (``fused_kernels``, ``--fused-kernels`` resolved by
:func:`megatron.layers.fused_kernels.resolve_fused_kernels`): the norms get it as their ``impl``;
RoPE is applied by :class:`megatron.layers.self_attention.USPSelfAttention`, which fills the
``self_attention`` slot; with ``fused_swiglu`` the MLP's ``activation_func`` submodule is
:class:`megatron.layers.fused_kernels.SwiGLU` (megatron-core builds and calls it when
``config.use_te_activation_func`` is set, which :mod:`megatron.training.model.build` does exactly
then). With ``torch`` everything is as in megatron-core's local spec (its own RoPE and its
TorchScript-fused SwiGLU on GPU).

Elementwise outputs not kept (``lean_norms`` / ``lean_swiglu``, ``--recompute-modules
layernorm`` / ``swiglu``): the norms before QKV and FC1 move into those linear layers
(:class:`~megatron.layers.fused_linears.NormColumnParallelLinear`, the norm slots become
``IdentityOp``), the SwiGLU into FC2 (:class:`~megatron.layers.fused_linears.SwiGLURowParallelLinear`,
the activation slot passes FC1's output through); each recomputes its elementwise op in the backward.

The residual's gradient (``usp`` RMSNorm): the input and pre-MLP norms (or the linear layers
they moved into) add the gradient their input receives as the sublayer's residual inside their
backward kernel, handed over by the bias-dropout-add slots
(:func:`megatron.layers.residual.residual_bda`); see :mod:`megatron.layers.residual`.

Weight gradients into ``main_grad`` (``fuse_wgrad``, ``--gradient-accumulation-fusion``): the
four linear layers of each layer become this project's subclasses of megatron-core's
(:func:`with_wgrad_fusion`, :mod:`megatron.layers.linear_wgrad`).

Which to use: :func:`get_usp_gpt_block_spec` for ``GPTModel(transformer_layer_spec=...)``.
Given only a layer spec, megatron-core's ``TransformerBlock`` builds its final norm from its
module-level default (``WrappedTorchNorm`` without TransformerEngine or apex), which refuses
``--sequence-parallel``; the block spec names the final norm too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from megatron.layers.fused_kernels import FUSED_KERNEL_CHOICES, SwiGLU, op_impl
from megatron.layers.fused_linears import (
    NormColumnParallelLinear,
    PassThroughActivation,
    SwiGLURowParallelLinear,
    USPColumnParallelLinear,
    USPRowParallelLinear,
)
from megatron.layers.norms import norm_class
from megatron.layers.residual import residual_bda
from megatron.layers.self_attention import USPSelfAttention
from megatron.memory.kept_attention import RecomputeKeep
from megatron.memory.tiled_mlp import tiled_mlp_class
from megatron.usp.core_attention import USPAttention
from megatron.usp.kernels import BACKEND_NAMES


def usp_core_attention_spec(attention_backend: str = "auto",
                            overlap_chunks: Optional[int] = None,
                            recompute_keep: Optional[RecomputeKeep] = None,
                            document_kernel: str = "auto",
                            document_costs_group: Any = None) -> ModuleSpec:
    """``ModuleSpec`` of :class:`megatron.usp.core_attention.USPAttention` with the given backend.

    ``overlap_chunks`` (``--usp-overlap-chunks``): head chunks of the all-to-all/attention
    pipeline; ``None`` lets USP attention choose (auto). It is checked against the heads when
    the layer is built, so a bad value fails at start-up. ``recompute_keep``
    (``--recompute-keep-core-attn``): see :mod:`megatron.memory.kept_attention`.
    ``document_kernel`` (``--document-attention-kernel``): the document-masked kernel used with
    packed documents; ``document_costs_group``: the gloo group of the ranks that read the same
    micro-batch, over which ``auto``'s cost table is agreed
    (:class:`~megatron.usp.document_choice.AutoDocumentKernel`).
    """
    if attention_backend not in BACKEND_NAMES:
        raise ValueError(
            f"--attention-backend {attention_backend!r} is not known; choose one of "
            f"{list(BACKEND_NAMES)}"
        )
    params = {"attention_backend": attention_backend}
    if document_kernel != "auto":
        params["document_kernel"] = document_kernel
    if document_costs_group is not None:
        params["document_costs_group"] = document_costs_group
    if overlap_chunks is not None:
        params["overlap_chunks"] = overlap_chunks
    if recompute_keep is not None:
        params["recompute_keep"] = recompute_keep
    return ModuleSpec(module=USPAttention, params=params)


_WGRAD_FUSED = {ColumnParallelLinear: USPColumnParallelLinear,
                RowParallelLinear: USPRowParallelLinear}


def with_usp_linear(linear, fuse_wgrad: bool) -> ModuleSpec:
    """The spec of a linear-layer slot (a class or a ``ModuleSpec``) as this project's
    subclass of megatron-core's parallel linear layer, which can add the weight gradient into
    ``main_grad`` by the GEMM (``fuse_wgrad``, :mod:`megatron.layers.linear_wgrad`) and run
    its GEMMs in float8 (:mod:`megatron.layers.float8_policy`)."""
    module, params = ((linear.module, dict(linear.params or {}))
                      if isinstance(linear, ModuleSpec) else (linear, {}))
    module = _WGRAD_FUSED.get(module, module)
    if not (isinstance(module, type) and issubclass(module, tuple(_WGRAD_FUSED.values()))):
        raise TypeError(f"--gradient-accumulation-fusion / --fp8-format: the linear layer "
                        f"{module!r} of the layer spec is not one of megatron-core's parallel "
                        f"linear layers")
    return ModuleSpec(module=module, params={**params, "fuse_wgrad": fuse_wgrad})


def with_wgrad_fusion(linear) -> ModuleSpec:
    """:func:`with_usp_linear` with the weight gradient added into ``main_grad``."""
    return with_usp_linear(linear, fuse_wgrad=True)


def norm_spec(normalization: str, fused_kernels: str = "torch") -> ModuleSpec:
    """``ModuleSpec`` of the :mod:`megatron.layers.norms` class for ``normalization``."""
    return ModuleSpec(module=norm_class(normalization), params={"impl": fused_kernels})


@dataclass(frozen=True)
class LayerSpecOptions:
    """What the run chooses for every layer of the spec (the flags in brackets).

    Attributes:
        attention_backend: ``--attention-backend`` (``auto``, ``torch``, ``math``,
            ``flash-attn``, ``te``); resolved when the layer is built, so a missing package
            fails at model construction with the ``pip install`` command to run.
        overlap_chunks, recompute_keep, document_kernel: as for
            :func:`usp_core_attention_spec`.
        fused_kernels: the resolved ``--fused-kernels`` (``torch``, ``compile``, ``liger``,
            ``usp``) for the norms, RoPE and, with a fused SwiGLU, the MLP activation.
        lean_norms, lean_swiglu: the norm outputs / the SwiGLU output are not kept (module
            docstring; ``--recompute-modules layernorm`` / ``swiglu``); ``lean_swiglu`` also
            needs ``use_te_activation_func``.
        mlp_tile_tokens: ``--mlp-tile-tokens``: the MLP runs over tiles of this many local
            tokens (:mod:`megatron.memory.tiled_mlp`); ``None`` leaves megatron-core's MLP.
        mlp_tp_group: the TP group of the tiled MLP's linears. ``TransformerLayer`` passes
            ``pg_collection.tp`` only to megatron-core's own ``MLP`` class (for others it logs
            "Unknown MLP type ... default kwargs"), so the tiled MLP gets it from its spec.
        fuse_wgrad: ``--gradient-accumulation-fusion``: QKV, the projection, FC1 and FC2 add
            their weight gradients into ``main_grad`` (:func:`with_wgrad_fusion`).
        document_costs_group: as for :func:`usp_core_attention_spec`.
        float8_linears: ``--fp8-format``: those four are this project's linear layers (with
            or without ``fuse_wgrad``), which can run in float8 once the model is built
            (:func:`megatron.layers.float8_policy.apply_float8`).
    """

    attention_backend: str = "auto"
    overlap_chunks: Optional[int] = None
    fused_kernels: str = "torch"
    lean_norms: bool = False
    lean_swiglu: bool = False
    mlp_tile_tokens: Optional[int] = None
    recompute_keep: Optional[RecomputeKeep] = None
    mlp_tp_group: Any = None
    document_kernel: str = "auto"
    fuse_wgrad: bool = False
    document_costs_group: Any = None
    float8_linears: bool = False


def get_usp_gpt_layer_spec(
    options: LayerSpecOptions = LayerSpecOptions(),
    qk_layernorm: bool = False,
    normalization: str = "RMSNorm",
    fused_swiglu: bool = False,
) -> ModuleSpec:
    """GPT transformer-layer spec: megatron-core's local spec with USP core attention and the
    norms of :mod:`megatron.layers.norms` (input, pre-MLP and, with ``qk_layernorm``, q / k).

    Used for every layout, U = R = 1 included (then USP attention does no communication).
    For a whole model prefer :func:`get_usp_gpt_block_spec`, which also names the final norm.

    Args:
        options: the run's choices for every layer (:class:`LayerSpecOptions`).
        qk_layernorm: normalise queries and keys per head (``TransformerConfig.qk_layernorm``).
        normalization: ``"RMSNorm"`` or ``"LayerNorm"`` (``--normalization``).
        fused_swiglu: put :class:`~megatron.layers.fused_kernels.SwiGLU` in the MLP's
            ``activation_func`` slot (the config must set ``use_te_activation_func``).
    """
    o = options
    fused_kernels = o.fused_kernels
    if fused_kernels not in FUSED_KERNEL_CHOICES[1:]:
        raise ValueError(f"fused_kernels {fused_kernels!r}: pass a resolved choice, one of "
                         f"{list(FUSED_KERNEL_CHOICES[1:])}")
    norm_impl = op_impl(fused_kernels, "rms_norm")
    norm = norm_spec(normalization, norm_impl)
    # the input and pre-MLP norms add their input's residual gradient in their backward
    residual_grad = normalization == "RMSNorm" and norm_impl == "usp"
    stream_norm = (ModuleSpec(module=norm.module, params={**norm.params, "residual_grad": True})
                   if residual_grad else norm)
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
        attn.submodules, core_attention=usp_core_attention_spec(
            o.attention_backend, o.overlap_chunks, o.recompute_keep, o.document_kernel,
            o.document_costs_group),
        **attn_norms
    )
    attn.module = USPSelfAttention
    attn.params = dict(attn.params or {}, rope_impl=op_impl(fused_kernels, "rope"))
    mlp = layer.mlp
    if o.lean_swiglu:
        mlp.submodules = dataclasses.replace(
            mlp.submodules, activation_func=PassThroughActivation,
            linear_fc2=ModuleSpec(module=SwiGLURowParallelLinear,
                                  params={"swiglu_impl": op_impl(fused_kernels, "swiglu")}))
    elif fused_swiglu:
        mlp.submodules = dataclasses.replace(
            mlp.submodules, activation_func=ModuleSpec(
                module=SwiGLU, params={"impl": op_impl(fused_kernels, "swiglu")}))
    if o.lean_norms:
        normed_linear = ModuleSpec(module=NormColumnParallelLinear,
                                   params={"norm_impl": norm_impl,
                                           **({"residual_grad": True} if residual_grad else {})})
        attn.submodules = dataclasses.replace(attn.submodules, linear_qkv=normed_linear)
        mlp.submodules = dataclasses.replace(mlp.submodules, linear_fc1=normed_linear)
        spec.submodules = dataclasses.replace(layer, input_layernorm=IdentityOp,
                                              pre_mlp_layernorm=IdentityOp)
    else:
        spec.submodules = dataclasses.replace(layer, input_layernorm=stream_norm,
                                              pre_mlp_layernorm=stream_norm)
    if residual_grad:
        spec.submodules = dataclasses.replace(spec.submodules, self_attn_bda=residual_bda,
                                              mlp_bda=residual_bda)
    if o.fuse_wgrad or o.float8_linears:
        def ours(linear):
            return with_usp_linear(linear, o.fuse_wgrad)

        attn.submodules = dataclasses.replace(
            attn.submodules, linear_qkv=ours(attn.submodules.linear_qkv),
            linear_proj=ours(attn.submodules.linear_proj))
        mlp.submodules = dataclasses.replace(
            mlp.submodules, linear_fc1=ours(mlp.submodules.linear_fc1),
            linear_fc2=ours(mlp.submodules.linear_fc2))
    if o.mlp_tile_tokens is not None:
        mlp = spec.submodules.mlp
        spec.submodules.mlp = dataclasses.replace(
            mlp, module=tiled_mlp_class(mlp.module),
            params={**mlp.params, "tile_tokens": o.mlp_tile_tokens, "tp_group": o.mlp_tp_group})
    return spec


def get_usp_gpt_block_spec(
    config,
    pp_rank: int,
    options: LayerSpecOptions = LayerSpecOptions(),
    vp_stage: Optional[int] = None,
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
        options: as for :func:`get_usp_gpt_layer_spec`; the MLP activation is the fused
            SwiGLU exactly when ``config.use_te_activation_func`` is set (and not
            ``options.lean_swiglu``).
        vp_stage: virtual pipeline stage, or None.
    """
    if options.lean_swiglu and not config.use_te_activation_func:
        raise ValueError("lean_swiglu moves the SwiGLU into FC2: the config must set "
                         "use_te_activation_func so that the MLP calls its (identity) "
                         "activation slot")
    layer = get_usp_gpt_layer_spec(options, qk_layernorm=config.qk_layernorm,
                                   normalization=config.normalization,
                                   fused_swiglu=config.use_te_activation_func)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers,
                                      layer_norm=norm_spec(config.normalization,
                                                           op_impl(options.fused_kernels,
                                                                   "rms_norm")))
