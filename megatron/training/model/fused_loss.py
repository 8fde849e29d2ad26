"""The output layer and the language-model loss fused, over chunks of tokens.

Per token ``t`` with final-norm output ``h[t]`` and vocabulary-parallel output weight ``W``::

    loss[t] = logsumexp_v(h[t] . W[v]) - h[t] . W[label[t]]

megatron-core computes this as ``logits = h @ W^T`` for the whole sequence (``[s, b, V/tp]``
in the weight dtype), then ``vocab_parallel_cross_entropy``, which makes a float32 copy of
the logits and keeps it, as the softmax, for the backward. At 256K tokens per GPU and a
vocabulary of 32000 that is 16 GiB of bf16 logits plus their 31 GiB float32 copy.
:func:`fused_linear_cross_entropy` never holds more than one chunk of ``chunk_tokens``
tokens' logits: the forward keeps only the per-token float32 log-sum-exp, and the backward
recomputes each chunk's logits from ``h`` and ``W``.

Shapes (``N = s * b`` token rows, in the ``[s, b]`` order of megatron's activations)::

    hidden    [s, b, H]      (SP: [s/tp, b, H])  weight dtype; all-gathered over TP with SP
    weight    [V/tp, H]      this TP rank's vocabulary rows [rank*V/tp, (rank+1)*V/tp)
    labels    [b, s]         int64, global vocabulary ids (megatron's labels)
    loss      [b, s]         float32 (float64 for float64 weights)

Tensor parallelism is wired the way megatron-core's ``ColumnParallelLinear`` wires its
input: before the autograd function, ``gather_from_sequence_parallel_region`` (sequence
parallel: all-gather ``[s/tp] -> [s]`` forward, reduce-scatter of the gradient backward)
or ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward). The
function itself returns this rank's partial ``grad_h`` (its vocabulary rows' share), which
that mapping sums over TP. Inside it, per chunk of ``n`` tokens, the forward all-reduces
over TP one ``[n]`` float32 MAX (the row maxima) and one ``[2, n]`` float32 SUM (sum of
exponentials and the target logit, which only the rank owning the target contributes); the
backward does not communicate.

Memory per chunk: the weight-dtype logits (2 bytes per element in bf16) and their float32
working copy (4 bytes) exist together for a moment, after which the float32 copy is updated
in place; the backward adds the weight-dtype gradient of the logits (2 bytes). Budget
``chunk_tokens * V/tp * (2 + 4 + 4)`` bytes, e.g. 2.4 GiB for 8192 tokens and a 32000
vocabulary at TP=1, plus the float32 weight-gradient accumulator ``V/tp * H * 4`` bytes in
the backward. Saved for the backward: ``h`` (after the SP all-gather: the full ``[s, b, H]``
of this CP rank), ``W``, the labels and the ``[N]`` log-sum-exp.

The arithmetic of each chunk is megatron-core's ``VocabParallelCrossEntropy`` (subtract the
global row max, sum of exponentials, ``loss = log(sum_exp) - (target_logit - max)``, and a
target outside this rank's vocabulary rows contributes 0), done in float32 (float64 for
float64 weights: megatron-core casts even those to float32, the tests compare in float64).

Gradients in the forward (``loss_weights``, what :class:`FusedLossGPTModel` passes: the loss
mask). The training objective weighs each token's loss by its loss-mask entry (times one
scale for the whole micro-batch: 1 in bf16, the loss scale in fp16), so the forward can
compute each chunk's logit gradient ``(softmax - onehot) * weight`` while the logits exist and
turn it into the hidden-state and weight gradients at once, as Liger's fused linear
cross-entropy does: one output-layer matmul fewer per token (the backward's recompute) and no
float32 logits kept anywhere. The backward then only scales the saved gradients by the one
factor ``c`` with ``grad_loss == c * weights``; if the gradient it receives is not of that form
(another loss function), it recomputes as above, so the result is exact either way. Saved in
this mode: the gradients (``[N, H]`` in the hidden dtype, ``[V/tp, H]`` float32) besides the
tensors above. On CUDA the per-chunk statistics and gradient run as ``torch.compile``d fusions
(one pass over the bf16 logits each); on the CPU the same functions run eagerly.

Float8 (``--fp8-output-layer``, ``gemms``): each chunk's three GEMMs (the logits, the hidden
states' gradient, the weight gradient) go through
:class:`~megatron.layers.float8_gemms.Float8Gemms` as a transformer linear layer's do: the
chunk's hidden states and the weight cast with dynamic scales (e4m3), the logits' gradient
too (e5m2 with ``hybrid``); the scaled GEMM returns bf16 logits, and the statistics, the
softmax and the loss are computed from them in float32 as above. The weight gradient leaves
the GEMM in float32: the first chunk's is written into the accumulator, later chunks' are
added ``WGRAD_BLOCK_ROWS`` vocabulary rows at a time. The logits' bf16 gradient is released
once cast, so the float8 path holds no more at once than the bf16 one (the logits and their
gradient). A chunk whose token count is not a multiple of 16 runs in the weight dtype.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from torch.autograd.function import once_differentiable

from megatron.layers.float8_gemms import Float8Gemms
from megatron.layers.float8_policy import SCALED_MM_ALIGNMENT
from megatron.layers.linear_wgrad import accumulate_wgrad

DEFAULT_CHUNK_TOKENS = 8192
# float8 weight gradients after a chunk's first are added this many vocabulary rows at a time
# (a float32 temporary of WGRAD_BLOCK_ROWS x H: 128 MiB at H = 4096)
WGRAD_BLOCK_ROWS = 8192


def accumulation_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16 / fp16 / fp32 weights, float64 for float64 ones."""
    return torch.promote_types(weight_dtype, torch.float32)


def vocab_range(weight: torch.Tensor, tp_group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    """``[start, end)`` of the global vocabulary ids held by this rank's ``weight`` rows.

    megatron-core's ``VocabUtility.vocab_range_from_per_partition_vocab_size``: TP rank r
    holds rows ``[r * V/tp, (r + 1) * V/tp)``. ``tp_group=None``: the whole vocabulary.
    """
    rows = weight.shape[0]
    rank = 0 if tp_group is None else dist.get_rank(tp_group)
    return rank * rows, (rank + 1) * rows


def chunk_bounds(num_tokens: int, chunk_tokens: int) -> Iterator[Tuple[int, int]]:
    """``(start, end)`` of consecutive chunks of at most ``chunk_tokens`` rows."""
    for start in range(0, num_tokens, chunk_tokens):
        yield start, min(start + chunk_tokens, num_tokens)


def _all_reduce(tensor: torch.Tensor, op, group: Optional[dist.ProcessGroup]) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def _local_targets(labels: torch.Tensor, vocab: Tuple[int, int]):
    """(row of each label in this rank's logits [n] int64, whether this rank owns it [n]).

    Labels owned by another rank point at row 0 (megatron's masked target) and must be
    masked by the caller.
    """
    start, end = vocab
    owned = (labels >= start) & (labels < end)
    return (labels - start).masked_fill(~owned, 0), owned


# --------------------------------------------------------------------------- the GEMMs
def chunk_gemms(gemms: Optional[Float8Gemms], rows: int) -> Optional[Float8Gemms]:
    """``gemms`` where a chunk of ``rows`` tokens can run in float8, else None (the weight
    dtype's GEMMs): ``torch._scaled_mm`` takes dimensions that are multiples of 16, and a
    chunk's rows are the weight gradient's inner one (emulation takes any)."""
    if gemms is None or (not gemms.options.emulate and rows % SCALED_MM_ALIGNMENT):
        return None
    return gemms


def _logits(hidden: torch.Tensor, weight: torch.Tensor,
            gemms: Optional[Float8Gemms]) -> torch.Tensor:
    """[n, H] x [V/tp, H] -> [n, V/tp] logits in the weight dtype."""
    if gemms is None:
        return torch.matmul(hidden, weight.t())
    return gemms.output(hidden, weight)


def _input_and_weight_grads(handed: List[torch.Tensor], hidden: torch.Tensor,
                            weight: torch.Tensor, gemms: Optional[Float8Gemms],
                            grad_weight: Optional[torch.Tensor], written: bool,
                            need_hidden: bool = True) -> Optional[torch.Tensor]:
    """``grad_logits [n, V/tp] @ weight`` (returned, when ``need_hidden``) and
    ``grad_logits.T @ hidden`` added into the float32 ``grad_weight`` (when given; in
    float8, ``written`` False: written there, as nothing has been added yet).
    ``handed``: ``[grad_logits]``, its only reference, emptied here: in float8 the bf16
    gradient is released once cast, so the weight's cast and the GEMMs' outputs do not
    add to it (the chunk's logits and their gradient are the largest tensors of the loss)."""
    grad_logits = handed.pop()
    if gemms is None:
        if grad_weight is not None:
            accumulate_wgrad(grad_weight, grad_logits, hidden)
        return torch.matmul(grad_logits, weight) if need_hidden else None
    cast = gemms.cast_grad(grad_logits)
    del grad_logits
    grad_hidden = gemms.grad_input(cast, weight) if need_hidden else None
    if grad_weight is not None:
        gemms.add_grad_weight(cast, hidden, grad_weight, written, WGRAD_BLOCK_ROWS)
    return grad_hidden


def _weight_grad_buffer(weight: torch.Tensor, gemms: Optional[Float8Gemms],
                        first_rows: int) -> torch.Tensor:
    """The float32 (float64) accumulator of the weight gradient ``[V/tp, H]``: zeros, or
    left unfilled where the first chunk (``first_rows`` tokens) runs in float8, whose GEMM
    writes all of it."""
    fill = first_rows == 0 or chunk_gemms(gemms, first_rows) is None
    return (torch.zeros if fill else torch.empty)(
        weight.shape, dtype=accumulation_dtype(weight.dtype), device=weight.device)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor,
                  gemms: Optional[Float8Gemms] = None) -> torch.Tensor:
    """[n, H] x [V/tp, H] -> [n, V/tp] logits: one matmul in the weight dtype (or float8),
    then a fresh float32 (float64) tensor the caller may modify in place."""
    logits = _logits(hidden, weight, gemms)
    acc = accumulation_dtype(weight.dtype)
    return logits.to(acc) if logits.dtype != acc else logits


def forward_chunk(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                  vocab: Tuple[int, int], tp_group: Optional[dist.ProcessGroup],
                  gemms: Optional[Float8Gemms] = None):
    """Per-token (loss [n], log-sum-exp [n]) of one chunk of ``n`` tokens, both float32.

    ``hidden [n, H]``, ``labels [n]``. All-reduces over ``tp_group`` (see the module
    docstring); every TP rank returns the same values. ``gemms``: the chunk's float8 GEMMs
    (:func:`chunk_gemms`), None for the weight dtype's.
    """
    logits = _chunk_logits(hidden, weight, gemms)                # [n, V/tp] float32
    row_max = logits.max(dim=-1).values                          # [n]
    _all_reduce(row_max, dist.ReduceOp.MAX, tp_group)
    logits.sub_(row_max.unsqueeze(-1))
    local, owned = _local_targets(labels, vocab)
    target = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
    sums = torch.stack([logits.exp_().sum(dim=-1), target])     # [2, n]: sum_exp, target
    _all_reduce(sums, dist.ReduceOp.SUM, tp_group)
    log_sum_exp = torch.log(sums[0])
    return log_sum_exp - sums[1], log_sum_exp + row_max


def backward_chunk(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                   labels: torch.Tensor, lse: torch.Tensor, vocab: Tuple[int, int],
                   gemms: Optional[Float8Gemms] = None):
    """Gradient of the chunk's logits (this rank's vocabulary rows), in the weight dtype.

    ``d loss[t] / d logit[t, v] = softmax[t, v] - [v == label[t]]``, scaled by
    ``grad_loss [n]``; the -1 lands only on the rank owning the label. Returns
    ``[n, V/tp]``; no communication. The logits are recomputed with the forward's GEMMs
    (``gemms``; float8 casts are deterministic, so the same values).
    """
    probs = _chunk_logits(hidden, weight, gemms)                 # [n, V/tp] float32
    probs.sub_(lse.unsqueeze(-1)).exp_()                         # softmax over the full V
    local, owned = _local_targets(labels, vocab)
    rows = torch.arange(probs.shape[0], device=probs.device)
    probs[rows, local] -= owned.to(probs.dtype)
    probs.mul_(grad_loss.to(probs.dtype).unsqueeze(-1))
    return probs.to(weight.dtype)


# --------------------------------------------------------------------------- gradient in forward
def _row_stats(logits: torch.Tensor, local: torch.Tensor, owned: torch.Tensor):
    """Per row of this rank's logits [n, V/tp]: (max, sum of exp(x - max), target logit or 0),
    in the accumulation dtype."""
    x = logits.to(accumulation_dtype(logits.dtype))
    row_max = x.max(dim=-1).values
    sum_exp = torch.exp(x - row_max.unsqueeze(-1)).sum(dim=-1)
    target = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
    return row_max, sum_exp, target


def _logit_grad(logits: torch.Tensor, lse: torch.Tensor, local: torch.Tensor,
                owned: torch.Tensor, row_weight: torch.Tensor) -> torch.Tensor:
    """``(softmax - onehot(label)) * weight`` per row, in the logits' dtype."""
    x = logits.to(lse.dtype)
    cols = torch.arange(x.shape[-1], device=x.device).unsqueeze(0)
    onehot = ((cols == local.unsqueeze(-1)) & owned.unsqueeze(-1)).to(x.dtype)
    return ((torch.exp(x - lse.unsqueeze(-1)) - onehot) * row_weight.unsqueeze(-1)).to(
        logits.dtype)


_COMPILED = {}


def _fused(fn, on_cuda: bool):
    """``fn`` compiled by Inductor on CUDA (one fused pass over the logits), eager elsewhere."""
    if not on_cuda:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


def forward_chunk_with_grads(hidden, weight, labels, row_weight, vocab, tp_group, grad_weight,
                             gemms: Optional[Float8Gemms] = None, written: bool = True):
    """One chunk's (loss [n], lse [n], grad_hidden [n, H]) and its weight gradient added into
    ``grad_weight [V/tp, H]`` (float32, summed in the GEMM), the gradients of
    ``sum(loss * row_weight)`` (grad_hidden this rank's partial sum over its vocabulary
    rows). Same all-reduces as :func:`forward_chunk`. ``gemms``: float8 GEMMs
    (:func:`chunk_gemms`); ``written`` False: ``grad_weight`` holds nothing yet."""
    cuda = hidden.is_cuda
    logits = _logits(hidden, weight, gemms)                      # [n, V/tp] weight dtype
    local, owned = _local_targets(labels, vocab)
    row_max, sum_exp, target = _fused(_row_stats, cuda)(logits, local, owned)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        global_max = row_max.clone()
        _all_reduce(global_max, dist.ReduceOp.MAX, tp_group)
        sums = torch.stack([sum_exp * torch.exp(row_max - global_max), target])
        _all_reduce(sums, dist.ReduceOp.SUM, tp_group)
        row_max, sum_exp, target = global_max, sums[0], sums[1]
    lse = torch.log(sum_exp) + row_max
    handed = [_fused(_logit_grad, cuda)(logits, lse, local, owned, row_weight.to(lse.dtype))]
    del logits
    grad_hidden = _input_and_weight_grads(handed, hidden, weight, gemms, grad_weight, written)
    return lse - target, lse, grad_hidden


def linear_cross_entropy_forward_with_grads(hidden, weight, labels, row_weights,
                                            chunk_tokens, tp_group,
                                            gemms: Optional[Float8Gemms] = None):
    """(loss [N], lse [N], grad_hidden [N, H], grad_weight [V/tp, H] float32) chunk by chunk."""
    acc = accumulation_dtype(weight.dtype)
    num_tokens = hidden.shape[0]
    loss = torch.empty(num_tokens, dtype=acc, device=hidden.device)
    lse = torch.empty(num_tokens, dtype=acc, device=hidden.device)
    grad_hidden = torch.empty_like(hidden)
    grad_weight = _weight_grad_buffer(weight, gemms, min(chunk_tokens, num_tokens))
    vocab = vocab_range(weight, tp_group)
    for start, end in chunk_bounds(num_tokens, chunk_tokens):
        loss[start:end], lse[start:end], grad_hidden[start:end] = forward_chunk_with_grads(
            hidden[start:end], weight, labels[start:end], row_weights[start:end], vocab,
            tp_group, grad_weight, chunk_gemms(gemms, end - start), written=start > 0)
    return loss, lse, grad_hidden, grad_weight


def common_scale(grad_loss: torch.Tensor, row_weights: torch.Tensor) -> Optional[float]:
    """``c`` with ``grad_loss == c * row_weights`` (to float32 rounding), or None.

    One device-to-host read per call (the backward needs to know whether the gradients the
    forward computed apply), of the four numbers it decides by at once: each read waits for
    the queued work, and the GPU idles while the host then queues the backward. (Indexing
    with a 0-dim tensor would be a read of its own: the index is taken as a Python int.)"""
    g = grad_loss.reshape(-1)
    w = row_weights.reshape(-1).to(g.dtype)
    idx = torch.argmax(w.abs()).view(1)
    c = (g.index_select(0, idx) / w.index_select(0, idx))[0]
    peak, scale, c, err = torch.stack([w.abs().max(), g.abs().max(), c,
                                       (g - c * w).abs().max()]).tolist()
    if peak == 0.0:
        return 0.0 if scale == 0.0 else None
    return c if err <= 1e-6 * scale + 1e-30 else None


def linear_cross_entropy_forward(hidden: torch.Tensor, weight: torch.Tensor,
                                 labels: torch.Tensor, chunk_tokens: int,
                                 tp_group: Optional[dist.ProcessGroup],
                                 gemms: Optional[Float8Gemms] = None):
    """(loss [N], log-sum-exp [N]) for ``hidden [N, H]``, ``labels [N]``, chunk by chunk."""
    acc = accumulation_dtype(weight.dtype)
    num_tokens = hidden.shape[0]
    loss = torch.empty(num_tokens, dtype=acc, device=hidden.device)
    lse = torch.empty(num_tokens, dtype=acc, device=hidden.device)
    vocab = vocab_range(weight, tp_group)
    for start, end in chunk_bounds(num_tokens, chunk_tokens):
        loss[start:end], lse[start:end] = forward_chunk(
            hidden[start:end], weight, labels[start:end], vocab, tp_group,
            chunk_gemms(gemms, end - start))
    return loss, lse


def linear_cross_entropy_backward(grad_loss: torch.Tensor, hidden: torch.Tensor,
                                  weight: torch.Tensor, labels: torch.Tensor,
                                  lse: torch.Tensor, chunk_tokens: int,
                                  tp_group: Optional[dist.ProcessGroup],
                                  need_hidden: bool = True, need_weight: bool = True,
                                  gemms: Optional[Float8Gemms] = None):
    """(grad_hidden [N, H] in the hidden dtype, grad_weight [V/tp, H] in the weight dtype).

    ``grad_hidden`` is this TP rank's partial sum over its vocabulary rows; the weight
    gradient is accumulated in float32 over the chunks (inside each chunk's GEMM) and cast
    once. Either is None when not needed.
    """
    vocab = vocab_range(weight, tp_group)
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = (_weight_grad_buffer(weight, gemms, min(chunk_tokens, hidden.shape[0]))
                   if need_weight else None)
    for start, end in chunk_bounds(hidden.shape[0], chunk_tokens):
        h_chunk = hidden[start:end]                              # [n, H]
        g8 = chunk_gemms(gemms, end - start)
        handed = [backward_chunk(grad_loss[start:end], h_chunk, weight, labels[start:end],
                                 lse[start:end], vocab, g8)]
        part = _input_and_weight_grads(handed, h_chunk, weight, g8, grad_weight, start > 0,
                                       need_hidden)
        if need_hidden:
            grad_hidden[start:end] = part
    if need_weight:
        grad_weight = grad_weight.to(weight.dtype)
    return grad_hidden, grad_weight


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token loss [N] of ``hidden [N, H]`` through ``weight [V/tp, H]``; see the module.

    Saves ``hidden``, ``weight``, ``labels`` and the float32 log-sum-exp; with
    ``row_weights`` (and gradients wanted) also the gradients computed in the forward.
    ``gemms``: the output layer's float8 GEMMs, None for the weight dtype's.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, tp_group, row_weights=None,
                gemms=None):
        ctx.chunk_tokens, ctx.tp_group, ctx.gemms = chunk_tokens, tp_group, gemms
        ctx.precomputed = row_weights is not None and any(ctx.needs_input_grad[:2])
        if ctx.precomputed:
            loss, lse, grad_hidden, grad_weight = linear_cross_entropy_forward_with_grads(
                hidden, weight, labels, row_weights, chunk_tokens, tp_group, gemms)
            ctx.save_for_backward(hidden, weight, labels, lse, row_weights, grad_hidden,
                                  grad_weight)
            return loss
        loss, lse = linear_cross_entropy_forward(hidden, weight, labels, chunk_tokens, tp_group,
                                                 gemms)
        ctx.save_for_backward(hidden, weight, labels, lse)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse = ctx.saved_tensors[:4]
        if ctx.precomputed:
            row_weights, grad_hidden, grad_weight = ctx.saved_tensors[4:]
            c = common_scale(grad_loss, row_weights)
            if c is not None:
                if c != 1.0:
                    grad_hidden, grad_weight = grad_hidden * c, grad_weight * c
                return (grad_hidden if ctx.needs_input_grad[0] else None,
                        grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None,
                        None, None, None, None, None)
        grad_hidden, grad_weight = linear_cross_entropy_backward(
            grad_loss.contiguous(), hidden, weight, labels, lse, ctx.chunk_tokens,
            ctx.tp_group, need_hidden=ctx.needs_input_grad[0],
            need_weight=ctx.needs_input_grad[1], gemms=ctx.gemms)
        return grad_hidden, grad_weight, None, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                               labels: torch.Tensor, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                               tp_group: Optional[dist.ProcessGroup] = None,
                               sequence_parallel: bool = False,
                               loss_weights: Optional[torch.Tensor] = None,
                               gemms: Optional[Float8Gemms] = None) -> torch.Tensor:
    """Per-token losses ``[b, s]`` of the output layer ``weight`` applied to ``hidden``.

    ``hidden [s, b, H]`` (``[s/tp, b, H]`` with ``sequence_parallel``), ``weight [V/tp, H]``
    (this rank's vocabulary shard over ``tp_group``; ``tp_group=None``: the whole
    vocabulary, no communication), ``labels [b, s]``. Equals megatron-core's
    ``output_layer`` followed by ``compute_language_model_loss`` (see the module docstring
    for the TP wiring, the communication and the memory). ``loss_weights [b, s]`` (the loss
    mask): how the objective weighs each loss, up to one common factor; given, the gradients
    are computed in the forward (module docstring), with the same result. ``gemms``: run
    the output layer's three GEMMs in float8 (:class:`~megatron.layers.float8_gemms.
    Float8Gemms`; a chunk whose rows ``torch._scaled_mm`` cannot take stays in the weight
    dtype); the float8 weight gradient is accumulated in float32 like the bf16 one.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden states are {hidden.dtype} but the output weight is "
                         f"{weight.dtype}; the output layer needs one dtype")
    if tp_group is not None:
        if sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=True, group=tp_group)   # [s, b, H]
        else:
            hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    elif sequence_parallel:
        raise ValueError("sequence_parallel needs the tensor-parallel group (tp_group)")
    seq, batch, hidden_size = hidden.shape
    if tuple(labels.shape) != (batch, seq):
        raise ValueError(f"labels {tuple(labels.shape)} do not match the hidden states "
                         f"[s={seq}, b={batch}, H]: expected [b, s] = [{batch}, {seq}]")
    rows = hidden.reshape(seq * batch, hidden_size)                  # [N, H], N = s*b
    flat_labels = labels.t().reshape(seq * batch)                    # [b, s] -> [N]
    flat_weights = None
    if loss_weights is not None:
        if tuple(loss_weights.shape) != (batch, seq):
            raise ValueError(f"loss_weights {tuple(loss_weights.shape)} must be [b, s] = "
                             f"[{batch}, {seq}] like the labels")
        flat_weights = loss_weights.t().reshape(seq * batch).detach()
    loss = LinearCrossEntropy.apply(rows, weight, flat_labels, chunk_tokens, tp_group,
                                    flat_weights, gemms)
    return loss.view(seq, batch).t().contiguous()                   # [N] -> [b, s]
