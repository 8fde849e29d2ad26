"""Model shapes, their presets and their FLOP count: the floor every other package reads.

* :mod:`.model`   :class:`ModelShape` and Megatron's sizing rules (the SwiGLU MLP width,
  the vocabulary padding);
* :mod:`.presets` :data:`PRESETS`, the one table of named models;
* :mod:`.flops`   :func:`training_flops`, the one MFU numerator;
* :mod:`.flags`   a shape as ``pretrain_gpt.py`` flags;
* :mod:`.rope`    :class:`RopeScaling`, RoPE scaling for context extension;
* :mod:`.window`  the sliding window's fields, spellings, check and per-layer rule.

Standard library only: nothing here imports torch or another package of this project.
"""

from megatron.shapes.flops import (
    causal_pairs,
    dense_training_flops,
    document_pairs,
    full_pairs,
    layer_mean_pairs,
    shape_pairs,
    training_flops,
    window_pairs,
)
from megatron.shapes.model import (
    ModelShape,
    attention_shape,
    default_ffn_hidden_size,
    padded_vocab_size,
)
from megatron.shapes.presets import PRESETS, get_preset
from megatron.shapes.rope import RopeScaling

__all__ = [
    "ModelShape",
    "PRESETS",
    "RopeScaling",
    "attention_shape",
    "causal_pairs",
    "default_ffn_hidden_size",
    "dense_training_flops",
    "document_pairs",
    "full_pairs",
    "get_preset",
    "layer_mean_pairs",
    "padded_vocab_size",
    "shape_pairs",
    "training_flops",
    "window_pairs",
]
