"""megatron-core's ``SelfAttention`` with RoPE applied by :mod:`megatron.layers.fused_kernels`.

megatron-core applies RoPE inside ``Attention.forward`` through ``apply_rotary_pos_emb``,
whose only fused path is TransformerEngine's; it has no slot for another kernel. This
subclass fills the layer spec's ``self_attention`` module slot (the extension point for the
attention block) and changes one thing: on the training path (no inference context, no
packed THD sequences, a config the fused kernel serves) it takes ``rotary_pos_emb`` away
from ``Attention.forward`` and rotates q and k itself, right after the QKV projection
(:meth:`get_query_key_value_tensors`), with the ``--fused-kernels`` implementation.
Everything else, including every other call, is megatron-core's code.

YaRN: cos and sin are multiplied by its concentration factor, read from the config exactly as
megatron-core's attention reads it (``_yarn_get_concentration_factor_from_config``; 1 without
YaRN), so every ``--fused-kernels`` choice rotates as megatron-core does.

The frequencies are the same tensor megatron-core would have used: ``[s, b or 1, 1, r]``
float32 for this rank's tokens in the token order (megatron-core's
``RotaryEmbedding`` picks each context-parallel rank's positions), so the fused kernel
follows the load-balanced token order with no assumption that positions run 0..S-1.

Recompute safety: the frequencies are held for the duration of one ``forward`` call only
(set on entry, cleared on exit), and a recomputed forward receives them again as an
argument, so activation recompute and several micro-batches in flight under pipeline
parallelism never see another call's positions.
"""

from __future__ import annotations

from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp

from megatron.layers import fused_kernels, qkv_rope


class USPSelfAttention(SelfAttention):
    """``SelfAttention`` (same constructor, plus ``rope_impl``) with fused RoPE."""

    def __init__(self, *args, rope_impl: str = "torch", **kwargs):
        super().__init__(*args, **kwargs)
        if rope_impl not in fused_kernels.KERNEL_IMPLS:
            raise ValueError(f"rope_impl {rope_impl!r}; use one of "
                             f"{list(fused_kernels.KERNEL_IMPLS)}")
        self.rope_impl = rope_impl
        self._unsupported = fused_kernels.rope_supported(self.config)
        self._mscale = _yarn_get_concentration_factor_from_config(self.config)
        self._rope_freqs = None

    def _takes_rope(self, rotary_pos_emb, kwargs) -> bool:
        if self.rope_impl == "torch" or self._unsupported or rotary_pos_emb is None:
            return False
        if kwargs.get("inference_context") is not None or kwargs.get("inference_params"):
            return False
        packed = kwargs.get("packed_seq_params")
        if packed is not None and getattr(packed, "qkv_format", None) == "thd":
            return False
        if isinstance(rotary_pos_emb, tuple):
            q_emb, k_emb = rotary_pos_emb
            return q_emb is not None and q_emb is k_emb
        return True

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        """``SelfAttention.forward``; see the module docstring for what changes."""
        if not self._takes_rope(rotary_pos_emb, kwargs):
            return super().forward(hidden_states, attention_mask, *args,
                                   rotary_pos_emb=rotary_pos_emb, **kwargs)
        freqs = rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb
        self._rope_freqs = freqs
        try:
            return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=None,
                                   **kwargs)
        finally:
            self._rope_freqs = None

    def _splits_with_rope(self, output_gate: bool) -> bool:
        """Whether :func:`megatron.layers.qkv_rope.qkv_split_rope` can replace megatron-core's
        split + RoPE: no output gate, no q/k norms, every TP rank holds whole query groups."""
        def plain(norm) -> bool:
            return norm is None or isinstance(norm, IdentityOp)

        return (self.rope_impl == "usp" and not output_gate and not self.config.test_mode
                and plain(self.q_layernorm) and plain(self.k_layernorm)
                and self.config.num_query_groups >= self.world_size)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    output_gate: bool = False, split_qkv: bool = True):
        """megatron-core's q, k, v ``[s, b, heads, d]``, then q and k rotated when this
        call's forward took the frequencies (``usp``: split and rotated in one kernel from
        megatron-core's unsplit QKV output)."""
        freqs = self._rope_freqs
        if freqs is not None and split_qkv and self._splits_with_rope(output_gate):
            mixed, _ = super().get_query_key_value_tensors(hidden_states, key_value_states,
                                                           split_qkv=False)
            per_group = (self.num_attention_heads_per_partition
                         // self.num_query_groups_per_partition)
            return qkv_rope.qkv_split_rope(mixed, freqs, per_group,
                                           self.hidden_size_per_attention_head, self._mscale)
        out = super().get_query_key_value_tensors(hidden_states, key_value_states,
                                                  output_gate=output_gate, split_qkv=split_qkv)
        if freqs is None:
            return out
        if not split_qkv:
            raise RuntimeError("fused RoPE needs split q, k, v (fused_single_qkv_rope is off)")
        query, key = out[0], out[-2]
        # "usp" where the fused split does not apply (output gate, q/k norms, TP > groups):
        # megatron-core's split, then the plain rotation
        impl = "torch" if self.rope_impl == "usp" else self.rope_impl
        query, key = fused_kernels.rope(query, key, freqs, impl, self._mscale)
        return (query,) + tuple(out[1:-2]) + (key, out[-1])
