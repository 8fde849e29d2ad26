"""megatron-core's ``GPTModel`` whose rotary embedding follows the batch's ``position_ids``.

megatron-core's ``GPTModel`` ignores ``position_ids`` for RoPE: it builds the table for
positions ``0..S-1`` and slices it for the CP rank's zigzag chunks. That is wrong for packed
documents with ``--reset-position-ids`` (positions restart after each EOD) and for a non-zigzag
chunk assignment (:mod:`megatron.usp.token_order`). :class:`USPGPTModel` overrides
``_preprocess`` (megatron-core's step before the decoder) and, whenever ``position_ids`` are
given (the first and last pipeline stages always; every stage with packed documents), builds
the rotary embedding per token from them::

    position_ids [b, s_local] (global or per-document positions, in the token order)
      -> rotary_pos_emb [s_local, b, 1, d]   float32 angles ``position * inv_freq``, halves
                                             repeated (or interleaved) as megatron-core's
                                             ``RotaryEmbedding.get_emb`` lays them out

the format megatron-core's ``apply_rotary_pos_emb`` takes for [s, b, h, d] tensors. For the
default zigzag order (positions ``0..S-1`` sliced by CP rank) the angles are the same float32
products megatron-core computes, so the result is bit-identical
(``tests/unit/test_gpt_model.py``); that is why this path is used for every run, not only with
``--reset-position-ids``. Without ``position_ids`` (a middle pipeline stage of a run without
documents) megatron-core's own table is used. Other position embeddings (learned absolute,
none) are megatron-core's; multi-latent attention and mRoPE keep megatron-core's path.

RoPE scaling (:mod:`megatron.shapes.rope`) changes only the frequencies, so it reaches every
token through this path too: llama3 through megatron-core's scaled ``inv_freq``, linear
interpolation through its ``seq_len_interpolation_factor``, YaRN through
:func:`rope_inv_freq` (``YarnRotaryEmbedding``'s blend of its two frequency sets). YaRN's
concentration factor on cos and sin is applied where the rotation is (megatron-core's
attention, or :mod:`megatron.layers.self_attention`), as megatron-core applies it.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

Tensor = torch.Tensor


def rope_inv_freq(rotary) -> Tensor:
    """The inverse frequencies ``[r/2]`` (float32) that ``rotary.get_emb`` multiplies the
    positions by: ``RotaryEmbedding.inv_freq`` (llama3 scaling already applied), or for a
    ``YarnRotaryEmbedding`` its interpolated and original frequencies blended by the ramp
    between its correction dimensions (megatron-core's own helpers, so the same float32
    values)."""
    from megatron.core.models.common.embeddings import (
        yarn_rotary_pos_embedding as yarn,  # megatron-core's YaRN, only with --position-embedding-type yarn
    )

    if not isinstance(rotary, yarn.YarnRotaryEmbedding):
        return rotary.inv_freq
    low, high = yarn._yarn_find_correction_range(
        rotary.beta_fast, rotary.beta_slow, rotary.dim, rotary.rotary_base,
        rotary.original_max_position_embeddings, rotary.correction_range_round_to_int)
    extra = rotary.inv_freq_extra
    keep = 1.0 - yarn._yarn_linear_ramp_mask(low, high, rotary.dim // 2,
                                             device=extra.device).to(dtype=torch.float32)
    return rotary.inv_freq_inter.to(extra.device) * (1 - keep) + extra * keep


def rotary_freqs_from_positions(rotary, position_ids: Tensor) -> Tensor:
    """Per-token RoPE angles ``[s, b, 1, d]`` from ``position_ids [b, s]`` (module docstring).

    ``rotary`` is megatron-core's ``RotaryEmbedding`` or ``YarnRotaryEmbedding`` (its
    frequencies, interpolation factor and interleaving are used as ``get_emb`` uses them).
    """
    inv_freq = rope_inv_freq(rotary).to(position_ids.device)
    seq = position_ids.t().to(inv_freq.dtype)                    # [s, b]
    if rotary.seq_len_interpolation_factor is not None:
        seq = seq * (1 / rotary.seq_len_interpolation_factor)
    freqs = seq.unsqueeze(-1) * inv_freq                         # [s, b, d/2]
    if not rotary.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
    return emb.unsqueeze(2)                                      # [s, b, 1, d]


class USPGPTModel(GPTModel):
    """``GPTModel`` (same arguments, parameters and checkpoints) with per-token RoPE."""

    def _uses_position_rope(self, position_ids) -> bool:
        return (position_ids is not None and self.position_embedding_type in ("rope", "yarn")
                and not self.config.multi_latent_attention)

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        """megatron-core's ``_preprocess``, with ``rotary_pos_emb`` built from ``position_ids``."""
        out = super()._preprocess(input_ids=input_ids, position_ids=position_ids,
                                  decoder_input=decoder_input,
                                  inference_context=inference_context,
                                  packed_seq_params=packed_seq_params, padding_mask=padding_mask)
        if not self._uses_position_rope(position_ids) or inference_context is not None:
            return out
        rotary = rotary_freqs_from_positions(self.rotary_pos_emb, position_ids)
        return (out[0], rotary) + tuple(out[2:])
