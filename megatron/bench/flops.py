"""FLOP counting of the attention benchmark.

Attention (``tools/bench_attention.py``), the convention of ``../shared/anchors.md`` and of
FlashAttention's benchmarks: with ``b`` batch, ``h`` query heads, ``S`` sequence length,
``d`` head dim::

    forward          F_fwd = 4 * b * h * S^2 * d * (1/2 if causal else 1)
    forward+backward 3.5 * F_fwd          (backward = 2.5 forward: dQ, dK, dV, dP and the
                                           recomputed QK^T)

With a sliding window (``--window W``, causal only) the forward counts ``4 * b * h * d`` per
(query, key) pair inside the window, the pairs of :func:`megatron.shapes.window_pairs` (a
window of ``S - 1`` or more gives the causal count), and forward+backward 3.5x that.

Counts are for the whole problem; a per-GPU rate divides by the number of GPUs that share it.

The whole model's count (``tools/bench_e2e.py``, the ceiling, the peers, the training logs
and the planner) is the one in :mod:`megatron.shapes.flops`, so none can disagree.
"""

from __future__ import annotations

from megatron.shapes import window_pairs
from megatron.usp.kernels import attention_flops

# The backward of attention does 2.5x the forward's matmul work (anchors.md convention).
FWD_BWD_FACTOR = 3.5


def attention_fwd_flops(batch: int, heads: int, seq_len: int, head_dim: int,
                        causal: bool) -> float:
    """Forward FLOPs of attention over the whole sequence: ``4*b*h*S^2*d`` (x1/2 causal)."""
    return attention_flops(batch, heads, seq_len, seq_len, head_dim, causal)


def attention_fwd_bwd_flops(batch: int, heads: int, seq_len: int, head_dim: int,
                            causal: bool) -> float:
    """Forward+backward FLOPs of attention over the whole sequence: 3.5x the forward."""
    return FWD_BWD_FACTOR * attention_fwd_flops(batch, heads, seq_len, head_dim, causal)


def window_attention_fwd_flops(batch: int, heads: int, seq_len: int, head_dim: int,
                               window: int) -> float:
    """Forward FLOPs of causal attention under a sliding window of ``window`` keys:
    ``4*b*h*d`` per visible pair (:func:`megatron.shapes.window_pairs`)."""
    return 4.0 * batch * heads * head_dim * window_pairs([seq_len], window)


def window_attention_fwd_bwd_flops(batch: int, heads: int, seq_len: int, head_dim: int,
                                   window: int) -> float:
    """Forward+backward FLOPs of windowed causal attention: 3.5x the forward."""
    return FWD_BWD_FACTOR * window_attention_fwd_flops(batch, heads, seq_len, head_dim, window)


def tflops_per_gpu(flops: float, seconds: float, num_gpus: int) -> float:
    """TFLOP/s of each of ``num_gpus`` GPUs sharing ``flops`` of work done in ``seconds``."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds}")
    return flops / seconds / num_gpus / 1e12
