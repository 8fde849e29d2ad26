"""megatron-core's ``GPTModel`` whose training loss is :mod:`megatron.training.model.fused_loss`.

Used by :func:`megatron.training.model.build.build_gpt_model` under
``--fused-linear-cross-entropy``. It subclasses
:class:`~megatron.training.model.gpt_model.USPGPTModel` (``GPTModel`` with RoPE from
``position_ids``; one model class hierarchy) and overrides ``_postprocess``
(megatron-core's own step after the decoder) for one case only: labels given, no
multi-token prediction, no inference context, last pipeline stage. There it does what
``GPTModel._postprocess`` does up to the output layer (the output weight is the shared
embedding weight when input and output embeddings are tied, else the output layer's own;
the output layer's tensor-parallel group and sequence-parallel setting), and then computes
the per-token losses ``[b, s]`` chunk by chunk instead of ``output_layer`` plus
``compute_language_model_loss``. Every other call (no labels, inference, a middle stage)
goes to ``GPTModel._postprocess`` unchanged. Parameters, their names and checkpoints are
``GPTModel``'s.
"""

from __future__ import annotations

from megatron.training.model.fused_loss import fused_linear_cross_entropy
from megatron.training.model.gpt_model import USPGPTModel


class FusedLossGPTModel(USPGPTModel):
    """``USPGPTModel`` (same arguments) plus ``loss_chunk_tokens``, tokens per loss chunk."""

    def __init__(self, *args, loss_chunk_tokens: int, **kwargs):
        if loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens={loss_chunk_tokens} must be >= 1")
        super().__init__(*args, **kwargs)
        if self.mtp_process or self.config.mtp_num_layers is not None:
            raise ValueError("the fused output-layer loss does not compute multi-token "
                             "prediction losses; build a GPTModel instead")
        if self.config.defer_embedding_wgrad_compute:
            raise ValueError("the fused output-layer loss computes the output weight "
                             "gradient itself; defer_embedding_wgrad_compute must be off")
        self.loss_chunk_tokens = loss_chunk_tokens
        self.output_gemms = None

    def output_float8_shape(self):
        """``(in, out)`` of the output layer's GEMMs on this rank, ``(H, V/tp)``: the same on
        every pipeline stage (the float8 choice is agreed by all ranks), the output weight's
        shape on the last."""
        return self.config.hidden_size, self.vocab_size // self.config.tensor_model_parallel_size

    def run_output_in_float8(self, gemms) -> None:
        """Run the output layer's GEMMs through ``gemms`` (float8), or in the weight dtype
        (None); :func:`megatron.layers.float8_policy.apply_float8` decides."""
        self.output_gemms = gemms

    def _uses_fused_loss(self, labels, mtp_in_postprocess, inference_context) -> bool:
        return (self.post_process and labels is not None and not mtp_in_postprocess
                and inference_context is None)

    def _output_weight(self):
        """The weight megatron's ``_postprocess`` hands the output layer ([V/tp, H])."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.output_layer.weight

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                     rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None,
                     decoder_input=None, attention_mask=None, inference_params=None,
                     packed_seq_params=None, sequence_len_offset=None,
                     runtime_gather_output=None, extra_block_kwargs=None,
                     inference_context=None):
        """Per-token losses [b, s] (float32) from the final-norm output [s, b, H].

        With sequence parallelism ``hidden_states`` is this TP rank's ``[s/tp, b, H]``.
        Outside the fused case: ``GPTModel._postprocess``.
        """
        if not self._uses_fused_loss(labels, mtp_in_postprocess, inference_context):
            return super()._postprocess(
                hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=mtp_in_postprocess,
                loss_mask=loss_mask, decoder_input=decoder_input,
                attention_mask=attention_mask, inference_params=inference_params,
                packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                runtime_gather_output=runtime_gather_output,
                extra_block_kwargs=extra_block_kwargs, inference_context=inference_context)
        weight = self._output_weight()
        layer = self.output_layer
        expected = (layer.output_size_per_partition, layer.input_size)
        if tuple(weight.shape) != expected:
            raise RuntimeError(f"output weight {tuple(weight.shape)}, expected {expected}")
        return fused_linear_cross_entropy(
            hidden_states, weight, labels, chunk_tokens=self.loss_chunk_tokens,
            tp_group=layer.tp_group, sequence_parallel=layer.sequence_parallel,
            loss_weights=loss_mask, gemms=self.output_gemms)
