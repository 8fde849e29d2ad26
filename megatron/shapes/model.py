"""The shape of a decoder-only GPT, in megatron-core's words: :class:`ModelShape`.

One frozen type serves every reader: the layout rules (heads, KV groups, layers), the
planner's parameter and memory counts, the benchmarks' model flags and the FLOP count
(:mod:`megatron.shapes.flops`). Parameter counts follow megatron-core's GPT layer (no
biases, RMSNorm weights only):

* attention: ``h*(a*d + 2*g*d)`` for the fused QKV projection plus ``a*d*h`` for the
  output projection (``d`` the head dim, ``a`` query heads, ``g`` KV groups);
* MLP: ``3*h*f`` for SwiGLU (gate, up, down), ``2*h*f`` otherwise;
* two norms of ``h`` per layer; embeddings ``V*h``, plus ``V*h`` again when the output
  layer is untied; a final norm of ``h``.

A sliding window (megatron-core's ``window_size`` and ``window_attn_skip_freq``,
:mod:`megatron.shapes.window`) changes which attention pairs the layers compute, not their
parameters.

Standard library only: every floor of the codebase may import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Tuple, Union

from megatron.shapes.window import window_marks, window_problems


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's default MLP width: ``4h``, or ``int(8h/3 / 64) * 64`` with SwiGLU.

    SwiGLU has three matrices instead of two; 2/3 of ``4h`` keeps the MLP's parameters at
    ``8h^2``, rounded down to a multiple of 64 for the GEMMs.
    """
    if swiglu:
        return int((4 * hidden_size * 2 / 3) / 64) * 64
    return 4 * hidden_size


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's vocabulary padding: up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Shape of a GPT model (keyword arguments only: the old types disagreed on order).

    Attributes:
        name: label in reports and plans.
        num_layers: transformer layers ``L``.
        hidden_size: ``h``.
        num_attention_heads: query heads ``a``.
        num_query_groups: KV heads ``g``; None means multi-head attention (``g = a``).
        ffn_hidden_size: MLP width ``f``; None means Megatron's default
            (:func:`default_ffn_hidden_size`).
        vocab_size: rows of the embedding (the padded vocabulary); None where the
            tokenizer decides it later (FLOP and parameter counts need it).
        kv_channels: head dim ``d``; None means ``h / a``.
        swiglu: gated MLP with three matrices (Llama) instead of two (GPT).
        untied_embeddings: the output layer has its own ``V*h`` weights.
        normalization: ``RMSNorm`` (Llama: a weight per norm) or ``LayerNorm`` (GPT: a
            weight and a bias).
        position_embedding_type: ``rope`` (Llama) or ``learned_absolute`` (GPT: a table of
            positions x ``h``, sized by the run's sequence length, so not counted here).
        add_bias_linear: biases on the linear layers (GPT) or none (Llama).
        window_size: the sliding window's left ``W`` (megatron-core's ``window_size = (W,
            0)``: a query sees itself and the ``W`` keys before it); None: full attention.
        window_attn_skip_freq: megatron-core's pattern of window layers: None (every layer),
            an int ``N`` (layers with ``layer_number % N != 0``) or one 0 / 1 per layer
            (1: window), kept as a tuple (the shape is frozen); only with ``window_size``.

    Only the defaults are filled in here; whether the numbers fit together is asked of
    :meth:`problems` (the layout rules report bad head counts naming the flag instead).
    """

    name: str = "model"
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    vocab_size: Optional[int] = None
    kv_channels: Optional[int] = None
    swiglu: bool = True
    untied_embeddings: bool = True
    normalization: str = "RMSNorm"
    position_embedding_type: str = "rope"
    add_bias_linear: bool = False
    window_size: Optional[int] = None
    window_attn_skip_freq: Optional[Union[int, Tuple[int, ...]]] = None

    def __post_init__(self) -> None:
        # Megatron's defaults, filled in once so that every reader sees the same numbers.
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.ffn_hidden_size is None and isinstance(self.hidden_size, int):
            object.__setattr__(self, "ffn_hidden_size",
                               default_ffn_hidden_size(self.hidden_size, self.swiglu))
        if isinstance(self.window_attn_skip_freq, list):
            object.__setattr__(self, "window_attn_skip_freq", tuple(self.window_attn_skip_freq))

    # ------------------------------------------------------------------ derived sizes
    @property
    def kv_heads(self) -> int:
        return self.num_query_groups

    @property
    def head_dim(self) -> int:
        """``d``: ``--kv-channels`` when given, else ``h / a``."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def kv_ratio(self) -> float:
        """``g/a``: KV projection width relative to the query width."""
        return self.num_query_groups / self.num_attention_heads

    def window_marks(self) -> Tuple[int, ...]:
        """One mark per layer, first layer first: 1 where the layer has the sliding window
        (megatron-core's rule, :func:`megatron.shapes.window.is_window_layer`)."""
        return window_marks(self.window_size, self.window_attn_skip_freq, self.num_layers)

    def window_share(self) -> float:
        """The share of the layers that have the sliding window (0.0 without one)."""
        if self.window_size is None:
            return 0.0
        return sum(self.window_marks()) / self.num_layers

    def problems(self) -> List[str]:
        """What makes this shape unusable for counting, one message per problem (empty: fine)."""
        out = []
        for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                    "ffn_hidden_size", "vocab_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                out.append(f"{key}={value!r} must be an integer >= 1")
        if out:
            return out
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            out.append(f"hidden_size {self.hidden_size} is not divisible by "
                       f"num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups:
            out.append(f"num_attention_heads {self.num_attention_heads} is not divisible by "
                       f"num_query_groups {self.num_query_groups}; use a divisor of "
                       f"{self.num_attention_heads}")
        out += window_problems(self.window_size, self.window_attn_skip_freq, self.num_layers)
        return out

    # ------------------------------------------------------------------ parameters
    def attention_params_per_layer(self) -> int:
        """Fused QKV ``h*(a*d + 2*g*d)`` plus the output projection ``a*d*h``."""
        h, d = self.hidden_size, self.head_dim
        q = self.num_attention_heads * d
        return h * (q + 2 * self.num_query_groups * d) + q * h

    def mlp_params_per_layer(self) -> int:
        """``3*h*f`` with SwiGLU, ``2*h*f`` without."""
        return (3 if self.swiglu else 2) * self.hidden_size * self.ffn_hidden_size

    def norm_params_per_layer(self) -> int:
        """Two norms (a weight each, and a bias each for LayerNorm); replicated over TP."""
        return 2 * self._norm_params()

    def bias_params_per_layer(self) -> int:
        """With ``add_bias_linear``: QKV, projection, FC1 (two with SwiGLU) and FC2."""
        if not self.add_bias_linear:
            return 0
        qkv = (self.num_attention_heads + 2 * self.num_query_groups) * self.head_dim
        fc1 = self.ffn_hidden_size * (2 if self.swiglu else 1)
        return qkv + self.hidden_size + fc1 + self.hidden_size

    def _norm_params(self) -> int:
        return self.hidden_size * (2 if self.normalization == "LayerNorm" else 1)

    def params_per_layer(self) -> int:
        return (self.attention_params_per_layer() + self.mlp_params_per_layer()
                + self.norm_params_per_layer() + self.bias_params_per_layer())

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def output_params(self) -> int:
        """Output-layer weights held separately from the embedding (0 when tied)."""
        return self.vocab_size * self.hidden_size if self.untied_embeddings else 0

    def total_params(self) -> int:
        return (self.num_layers * self.params_per_layer() + self.embedding_params()
                + self.output_params() + self._norm_params())

    def to_dict(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def attention_shape(heads: int, kv_heads: Optional[int], head_dim: int) -> ModelShape:
    """Attention alone as a one-layer shape (an MLP and a vocabulary of width 1), for the
    layout rules and the cost of one attention call."""
    return ModelShape(name="attention", num_layers=1, hidden_size=heads * head_dim,
                      num_attention_heads=heads, num_query_groups=kv_heads,
                      ffn_hidden_size=1, vocab_size=1)
