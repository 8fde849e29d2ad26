"""The one count of model FLOPs per training iteration (the MFU numerator).

Every place that reports TFLOP/s or MFU calls :func:`training_flops`: the training loop's
metrics, ``tools/bench_e2e.py`` and its Hugging Face peers, the zero-overhead ceiling and
the planner's cost model.

With ``h`` hidden, ``a`` query heads, ``g`` KV groups, ``d`` head dim, ``f`` MLP width,
``V`` vocabulary, ``L`` layers and 2 FLOPs per multiply-add, one token's forward pass
costs, per layer::

    QKV projection      2*h*(a + 2g)*d
    output projection   2*a*d*h
    MLP                 2*h*f*(3 if SwiGLU else 2)      (gate+up+down / up+down)

and the output layer ``2*h*V``. Core attention is counted per (query, key) pair that is
computed: ``Q.K^T`` and ``P.V`` are ``2*a*d`` FLOPs each, so ``4*a*d`` per pair and layer.
A dense causal sequence of ``S`` tokens has ``S^2/2`` pairs (:func:`causal_pairs`; the
diagonal's ``S/2`` is left out, as Megatron-LM's convention halved), a full one ``S^2``
(:func:`full_pairs`); packed documents have the sum of ``n^2/2`` over their documents, and a
sliding-window layer the pairs inside its window (:func:`window_pairs`). A model whose
layers differ counts their mean (:func:`layer_mean_pairs`): with a share ``w`` of its layers
windowed (:meth:`ModelShape.window_share`), ``(1 - w)`` of the causal pairs plus ``w`` of
the windowed ones; the training loop (per micro-batch) and the planner (per sequence of the
plan) both count so.
Backward costs twice the forward, so an iteration of ``T`` tokens and ``P`` pairs costs::

    3 * ( T * (L * (2hd(a+2g) + 2adh + 2hf*m) + 2hV)  +  L * 4ad * P )

which is Megatron-LM's ``num_floating_point_operations`` for a dense GPT with causal
attention at half. Normalisations, softmax, RoPE and the embedding lookup are not counted
(they are not matrix multiplies), nor is recomputation.
"""

from __future__ import annotations

from megatron.shapes.model import ModelShape

# The formula as the benchmark's JSON records it (B sequences of S tokens, causal,
# q = a*d).
FORMULA = ("B*S*(18*L*H*F + 12*L*H*q*(1+g/a) + 6*L*q*S + 6*H*V) "
           "(Megatron-LM, causal attention at half)")


def causal_pairs(seq_len: int, sequences: int = 1) -> float:
    """Attention pairs of ``sequences`` dense causal sequences of ``seq_len``: ``S^2/2`` each."""
    return sequences * seq_len * seq_len / 2


def full_pairs(seq_len: int, sequences: int = 1) -> float:
    """Attention pairs of ``sequences`` unmasked sequences of ``seq_len``: ``S^2`` each."""
    return float(sequences * seq_len * seq_len)


def document_pairs(lengths) -> float:
    """Attention pairs of causal documents of the given token counts: ``sum(n^2/2)``.

    A document of ``S`` tokens counts as a dense causal sequence of ``S`` (:func:`causal_pairs`).
    """
    return float(sum(int(n) * int(n) for n in lengths)) / 2


def window_pairs(lengths, window: int) -> float:
    """Attention pairs of causal documents (or sequences) of the given token counts under a
    sliding window: a query at position ``i`` sees keys ``max(0, i - window) .. i``.

    Counted as :func:`document_pairs` counts a causal document (the exact count less ``n/2``),
    so a window of ``n - 1`` or more gives ``n^2/2``: a document of ``n`` tokens has
    ``n(n+1)/2`` visible pairs up to ``n <= window + 1``, and ``window + 1`` more per token
    after that.
    """
    w = int(window)
    if w < 0:
        raise ValueError(f"window {window} must be >= 0")
    total = 0.0
    for n in map(int, lengths):
        head = min(n, w + 1)                      # tokens before the window is full
        exact = head * (head + 1) / 2 + (n - head) * (w + 1)
        total += exact - n / 2
    return total


def layer_mean_pairs(lengths, window=None, window_share: float = 0.0) -> float:
    """Attention pairs per layer, the mean over a model's layers, of causal documents (or
    sequences) of the given token counts when ``window_share`` of the layers use the left
    ``window``: ``(1 - share) *`` :func:`document_pairs` ``+ share *`` :func:`window_pairs`."""
    pairs = document_pairs(lengths)
    if window is None or window_share <= 0:
        return pairs
    return (1.0 - window_share) * pairs + window_share * window_pairs(lengths, window)


def shape_pairs(shape: ModelShape, lengths) -> float:
    """:func:`layer_mean_pairs` of ``shape``'s own window and share of window layers."""
    return layer_mean_pairs(lengths, shape.window_size, shape.window_share())


def dense_flops_per_token(shape: ModelShape) -> float:
    """Forward FLOPs of one token outside core attention: the layers' GEMMs and the logits."""
    h, a, g = shape.hidden_size, shape.num_attention_heads, shape.num_query_groups
    d, f = shape.head_dim, shape.ffn_hidden_size
    per_layer = 2 * h * (a + 2 * g) * d + 2 * a * d * h + 2 * h * f * (3 if shape.swiglu else 2)
    return shape.num_layers * per_layer + 2 * h * shape.vocab_size


def attention_flops_per_pair(shape: ModelShape) -> float:
    """Forward FLOPs of core attention per (query, key) pair over all layers: ``4*a*d*L``."""
    return 4 * shape.num_attention_heads * shape.head_dim * shape.num_layers


def training_flops(shape: ModelShape, tokens: int, attention_pairs: float) -> float:
    """Model FLOPs of one training iteration (forward + backward) over ``tokens`` tokens
    whose core attention computes ``attention_pairs`` (query, key) pairs."""
    return 3.0 * (tokens * dense_flops_per_token(shape)
                  + attention_pairs * attention_flops_per_pair(shape))


def dense_training_flops(shape: ModelShape, seq_len: int, sequences: int,
                         causal: bool = True) -> float:
    """:func:`training_flops` of ``sequences`` dense sequences of ``seq_len`` tokens."""
    pairs = (causal_pairs if causal else full_pairs)(seq_len, sequences)
    return training_flops(shape, sequences * seq_len, pairs)
