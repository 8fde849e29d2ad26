"""The models the benchmarks train, and how ``pretrain_gpt.py`` is told about them.

Shapes come from the one preset table (:data:`megatron.shapes.PRESETS`); a
:class:`BenchModel` adds what the benchmarks choose for a preset beyond its shape: the
fused output layer and loss (``--fused-linear-cross-entropy``, over chunks of tokens, so no
full-sequence logits: at 256K tokens and V = 32000 those would take 16 GiB bf16 + 31 GiB
fp32) and the RoPE base. All are Llama-style: RMSNorm, SwiGLU, RoPE, GQA, untied, no biases.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional

from megatron.shapes import PRESETS, ModelShape


@dataclass(frozen=True)
class BenchModel:
    """A preset's shape and the benchmark's choices for it."""

    shape: ModelShape
    fused_loss: bool = False
    loss_chunk_tokens: Optional[int] = None   # --linear-cross-entropy-chunk-tokens
    rotary_base: Optional[int] = None         # --rotary-base (pretrain_gpt.py's default 10000)

    def sliced(self, num_layers: Optional[int]) -> "BenchModel":
        """The first ``num_layers`` layers of the model (None: all of them)."""
        if num_layers is None:
            return self
        return replace(self, shape=replace(self.shape, num_layers=num_layers))

    def record(self) -> Dict:
        """The model as the benchmark's JSON records it (its ``config.shape``)."""
        s = self.shape
        return {"num_layers": s.num_layers, "hidden_size": s.hidden_size,
                "num_attention_heads": s.num_attention_heads,
                "num_query_groups": s.num_query_groups, "kv_channels": s.head_dim,
                "ffn_hidden_size": s.ffn_hidden_size, "vocab_size": s.vocab_size,
                **{k: v for k, v in asdict(self).items() if k != "shape"}}


MODELS: Dict[str, BenchModel] = {
    "llama-0.85b": BenchModel(PRESETS["llama-0.85b"], fused_loss=True),
    # a 2048-token loss chunk keeps Llama-3's 128256-wide logits at 2.4 GiB
    "llama3-8b": BenchModel(PRESETS["llama3-8b"], fused_loss=True, loss_chunk_tokens=2048,
                            rotary_base=500000),
    "tiny": BenchModel(PRESETS["tiny"]),
}


def model_flags(model: BenchModel) -> List[str]:
    """Megatron-LM flags of a Llama-style model (RMSNorm, SwiGLU, RoPE, GQA, untied, no bias),
    plus ``--fused-linear-cross-entropy`` for the models that set ``fused_loss``.

    ``--vocab-size`` is one less than the model's vocabulary: the NullTokenizer of
    ``--mock-data`` adds the end-of-document id, so the embedding has exactly
    ``shape.vocab_size`` rows (a multiple of 128: no padding).
    """
    shape = model.shape
    flags = [
        "--num-layers", str(shape.num_layers), "--hidden-size", str(shape.hidden_size),
        "--ffn-hidden-size", str(shape.ffn_hidden_size),
        "--num-attention-heads", str(shape.num_attention_heads),
        "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(shape.vocab_size - 1),
        "--swiglu",
    ]
    if shape.num_query_groups != shape.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(shape.num_query_groups)]
    if shape.head_dim * shape.num_attention_heads != shape.hidden_size:
        flags += ["--kv-channels", str(shape.head_dim)]
    if model.fused_loss:
        flags += ["--fused-linear-cross-entropy"]
    if model.loss_chunk_tokens is not None:
        flags += ["--linear-cross-entropy-chunk-tokens", str(model.loss_chunk_tokens)]
    if model.rotary_base is not None:
        flags += ["--rotary-base", str(model.rotary_base)]
    return flags
