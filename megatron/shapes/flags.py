"""A model shape as ``pretrain_gpt.py`` flags (``tools/model_flags.py`` prints them)."""

from __future__ import annotations

from typing import List

from megatron.shapes.model import ModelShape
from megatron.shapes.window import window_flags


def shape_flags(shape: ModelShape, vocab: bool = False) -> List[str]:
    """The flags that give ``pretrain_gpt.py`` this shape.

    Layers, hidden size, MLP width, heads; KV groups when fewer than the heads
    (``--group-query-attention``); ``--kv-channels`` when the head dim is not ``h/a``;
    ``--swiglu``; ``--untie-embeddings-and-output-weights``; the position embedding, the
    norm and ``--disable-bias-linear``; the sliding window (``--window-size`` and, when not
    every layer has it, ``--window-attn-skip-freq``); and with ``vocab`` ``--vocab-size``
    (otherwise the tokenizer decides it). A pattern is one word, ``[1,0,1,0]``: quote it
    for a shell. The sequence length is the run's choice, not the shape's.
    """
    flags = ["--num-layers", str(shape.num_layers), "--hidden-size", str(shape.hidden_size),
             "--ffn-hidden-size", str(shape.ffn_hidden_size),
             "--num-attention-heads", str(shape.num_attention_heads)]
    if shape.num_query_groups != shape.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(shape.num_query_groups)]
    if shape.head_dim * shape.num_attention_heads != shape.hidden_size:
        flags += ["--kv-channels", str(shape.head_dim)]
    if shape.swiglu:
        flags.append("--swiglu")
    if shape.untied_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    flags += ["--position-embedding-type", shape.position_embedding_type,
              "--normalization", shape.normalization]
    if not shape.add_bias_linear:
        flags.append("--disable-bias-linear")
    flags += window_flags(shape.window_size, shape.window_attn_skip_freq)
    if vocab:
        flags += ["--vocab-size", str(shape.vocab_size)]
    return flags
