"""GPT layer ``ModuleSpec`` with USP core attention, built on megatron-core's local spec.

USP plugs in through megatron-core's extension point: the ``core_attention`` slot of
``SelfAttentionSubmodules``. Everything else (linear layers, norms, MLP, bias-dropout-add) is
whatever ``megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec`` returns, so
upstream changes to the local spec flow through.

megatron-core's ``DotProductAttention`` asserts ``context_parallel_size == 1``; it is replaced,
so that assert is never reached, and no other module of the local GPT spec checks the
context-parallel size (``TransformerConfig`` only checks ``cp_comm_type``'s length, which
USP ignores).
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron.usp.kernels import BACKEND_NAMES


def usp_core_attention_spec(attention_backend: str = "auto") -> ModuleSpec:
    """``ModuleSpec`` of :class:`megatron.usp.attention.USPAttention` with the given backend."""
    from megatron.usp.attention import USPAttention

    if attention_backend not in BACKEND_NAMES:
        raise ValueError(
            f"--attention-backend {attention_backend!r} is not known; choose one of "
            f"{list(BACKEND_NAMES)}"
        )
    return ModuleSpec(module=USPAttention, params={"attention_backend": attention_backend})


def get_usp_gpt_layer_spec(
    attention_backend: str = "auto",
    qk_layernorm: bool = False,
    normalization: str = "RMSNorm",
) -> ModuleSpec:
    """GPT transformer-layer spec: megatron-core's local spec with USP core attention.

    Used for every layout, U = R = 1 included (then USP attention does no communication).

    Args:
        attention_backend: ``--attention-backend`` (``auto``, ``torch``, ``math``,
            ``flash-attn``, ``te``); resolved when the layer is built, so a missing package
            fails at model construction with the ``pip install`` command to run.
        qk_layernorm: normalise queries and keys per head (``--qk-layernorm``).
        normalization: ``"RMSNorm"`` or ``"LayerNorm"`` (``--normalization``).
    """
    if normalization not in ("RMSNorm", "LayerNorm"):
        raise ValueError(
            f"--normalization {normalization!r} is not supported; use RMSNorm or LayerNorm"
        )
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization=normalization)
    attn = spec.submodules.self_attention
    if not isinstance(attn.submodules, SelfAttentionSubmodules):
        raise TypeError(
            f"megatron-core's local GPT spec changed: self_attention submodules are "
            f"{type(attn.submodules).__name__}, expected SelfAttentionSubmodules"
        )
    attn.submodules = dataclasses.replace(
        attn.submodules, core_attention=usp_core_attention_spec(attention_backend)
    )
    return spec
