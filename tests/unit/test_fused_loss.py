"""megatron.training.model.fused_loss on one process: the chunked output layer + cross entropy.

Oracles, float64 on the CPU, to 1e-12:

* megatron-core's arithmetic: ``logits = h @ W^T`` on the whole sequence, then the steps of
  ``VocabParallelCrossEntropy`` (``calculate_predicted_logits``,
  ``calculate_cross_entropy_loss``, ``prepare_gradient_calculation_operands``,
  ``calculate_gradients``) and the chain rule through the matmul for the gradients of
  ``h`` and ``W``. Only the row max is taken here rather than by its
  ``calculate_logits_max``, which casts to float32 (``vocab_parallel_cross_entropy``
  itself therefore agrees with any float64 computation to float32 rounding only; that
  comparison, under TP=2, is in tests/distributed/test_fused_loss_tp.py).
* plain ``torch.nn.functional.cross_entropy`` with autograd.

For chunks of 1 and 3 tokens (a partial last chunk), a chunk that divides the 22 tokens
exactly, and one larger than the sequence; batch 2; labels at both ends of the vocabulary
and at the boundary of a TP=2 split. Also: the bf16 dtype contract, what the forward saves,
that no full-sequence logits tensor is ever created, and the input checks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.training.model.fused_loss import (
    LinearCrossEntropy,
    chunk_bounds,
    fused_linear_cross_entropy,
    linear_cross_entropy_forward,
)

SEQ, BATCH, HIDDEN, VOCAB = 11, 2, 16, 64
TOL = dict(atol=1e-12, rtol=1e-12)


def _inputs(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) * 0.5
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    # both ends of the vocabulary and both sides of a TP=2 boundary
    labels[0, :4] = torch.tensor([0, VOCAB - 1, VOCAB // 2 - 1, VOCAB // 2])
    probe = torch.randn(BATCH, SEQ, generator=gen, dtype=torch.float64)
    return hidden.to(dtype), weight.to(dtype), labels, probe


def _fused(hidden, weight, labels, probe, chunk_tokens):
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk_tokens)
    (loss * probe.to(loss.dtype)).sum().backward()
    return loss.detach(), hidden.grad, weight.grad


def _megatron_arithmetic(hidden, weight, labels, probe):
    """megatron-core's output layer + VocabParallelCrossEntropy steps, in float64, TP=1."""
    from megatron.core.tensor_parallel.cross_entropy import (
        VocabParallelCrossEntropy as VPCE,  # megatron-core on first use
    )

    logits = torch.einsum("sbh,vh->sbv", hidden, weight)          # [s, b, V]
    target = labels.t().contiguous()                               # [b, s] -> [s, b]
    logits_max = logits.max(dim=-1).values
    mask, masked_target_1d, predicted, sum_exp, exp_logits = VPCE.calculate_predicted_logits(
        logits.clone(), target, logits_max, 0, VOCAB)
    softmax, loss = VPCE.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
    grad_2d, arange_1d, update, grad_input = VPCE.prepare_gradient_calculation_operands(
        softmax, mask)
    grad_logits = VPCE.calculate_gradients(grad_2d, arange_1d, masked_target_1d, update,
                                           grad_input, probe.t())          # [s, b, V]
    grad_hidden = torch.einsum("sbv,vh->sbh", grad_logits, weight)
    grad_weight = torch.einsum("sbv,sbh->vh", grad_logits, hidden)
    return loss.t(), grad_hidden, grad_weight


def _torch_reference(hidden, weight, labels, probe):
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    logits = torch.einsum("sbh,vh->bsv", hidden, weight)           # [b, s, V]
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                           reduction="none").view(BATCH, SEQ)
    (loss * probe).sum().backward()
    return loss.detach(), hidden.grad, weight.grad


CHUNKS = [1, 3, 11, 64]   # 22 tokens: one per chunk, 7 x 3 + 1, exactly 2 x 11, one chunk


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
@pytest.mark.parametrize("reference", [_megatron_arithmetic, _torch_reference])
def test_float64_equals_reference(chunk_tokens, reference):
    hidden, weight, labels, probe = _inputs()
    got = _fused(hidden, weight, labels, probe, chunk_tokens)
    want = reference(hidden, weight, labels, probe)
    assert got[0].shape == (BATCH, SEQ) and got[0].dtype == torch.float64
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=name)
    # the losses are real cross entropies, not a constant
    assert got[0].min() > 0 and got[0].std() > 0.1


def test_chunk_bounds_cover_every_token_once():
    assert list(chunk_bounds(22, 3))[-1] == (21, 22)
    for n, c in ((22, 1), (22, 3), (22, 11), (22, 64), (0, 4)):
        rows = [i for start, end in chunk_bounds(n, c) for i in range(start, end)]
        assert rows == list(range(n))
        assert all(0 < end - start <= c for start, end in chunk_bounds(n, c))


def test_bf16_contract():
    """bf16 in: bf16 logits per chunk, float32 losses and softmax, bf16 gradients.

    Reference: the same bf16 logits (one matmul on the whole sequence, as megatron's output
    layer does), upcast to float32, and float32 cross entropy: the loss agrees to float32
    rounding when the chunk's logits are the same bf16 numbers, and the gradients to bf16
    rounding of the logits' gradient.
    """
    hidden, weight, labels, probe = _inputs(torch.bfloat16)
    loss, grad_hidden, grad_weight = _fused(hidden, weight, labels, probe, chunk_tokens=5)
    assert loss.dtype == torch.float32
    assert grad_hidden.dtype == torch.bfloat16 and grad_weight.dtype == torch.bfloat16

    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    logits = torch.einsum("sbh,vh->bsv", h, w).float()
    ref = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                          reduction="none").view(BATCH, SEQ)
    (ref * probe.float()).sum().backward()
    torch.testing.assert_close(loss, ref.detach(), atol=1e-5, rtol=1e-6)   # observed: equal
    # bf16 gradients: within two bf16 ulps (2^-7 relative each; observed: one ulp)
    torch.testing.assert_close(grad_hidden.float(), h.grad.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(grad_weight.float(), w.grad.float(), atol=1e-2, rtol=1e-2)
    # and close to the float64 truth of the bf16 inputs: bf16 logits (|logit| < 12) carry
    # 2^-9 relative rounding (observed 7e-3)
    exact = _torch_reference(hidden.double(), weight.double(), labels, probe)[0]
    torch.testing.assert_close(loss.double(), exact, atol=5e-2, rtol=2e-2)


def test_saves_only_inputs_and_log_sum_exp():
    hidden, weight, labels, _ = _inputs()
    h = hidden.reshape(-1, HIDDEN).clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    flat = labels.t().reshape(-1)
    loss = LinearCrossEntropy.apply(h, w, flat, 3, None)
    saved = loss.grad_fn.saved_tensors
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == sorted([(SEQ * BATCH, HIDDEN), (VOCAB, HIDDEN), (SEQ * BATCH,),
                             (SEQ * BATCH,)])
    lse = [t for t in saved if t.is_floating_point() and t.dim() == 1]
    assert len(lse) == 1
    torch.testing.assert_close(lse[0], torch.logsumexp(h.detach() @ w.detach().t(), dim=-1),
                               **TOL)
    _, lse_direct = linear_cross_entropy_forward(h.detach(), w.detach(), flat, 3, None)
    torch.testing.assert_close(lse_direct, lse[0], rtol=0, atol=0)


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor any op produces (number of elements) and its shape."""

    def __init__(self):
        super().__init__()
        self.largest = (0, ())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest[0]:
                self.largest = (t.numel(), tuple(t.shape))
        return out


@pytest.mark.parametrize("chunk_tokens", [1, 3])
def test_never_creates_full_sequence_logits(chunk_tokens):
    """Forward and backward: no op output reaches the [s*b, V] logits' size (1408 elements
    here); the largest tensors are the weight gradient [V, H] and the hidden gradient."""
    hidden, weight, labels, probe = _inputs()
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    with _LargestOutput() as mode:
        loss = fused_linear_cross_entropy(h, w, labels, chunk_tokens=chunk_tokens)
        (loss * probe).sum().backward()
    full_logits = SEQ * BATCH * VOCAB
    assert mode.largest[0] <= max(VOCAB * HIDDEN, SEQ * BATCH * HIDDEN,
                                  chunk_tokens * VOCAB) < full_logits, mode.largest
    # the unchunked computation does create them (the check can see them)
    with _LargestOutput() as mode:
        _torch_reference(hidden, weight, labels, probe)
    assert mode.largest[0] >= full_logits


def test_frozen_weight_and_frozen_hidden():
    hidden, weight, labels, probe = _inputs()
    _, want_h, want_w = _torch_reference(hidden, weight, labels, probe)
    h = hidden.clone().requires_grad_(True)
    (fused_linear_cross_entropy(h, weight, labels, chunk_tokens=4) * probe).sum().backward()
    torch.testing.assert_close(h.grad, want_h, **TOL)
    w = weight.clone().requires_grad_(True)
    (fused_linear_cross_entropy(hidden, w, labels, chunk_tokens=4) * probe).sum().backward()
    torch.testing.assert_close(w.grad, want_w, **TOL)


def test_no_grad_forward_equals_training_forward():
    hidden, weight, labels, _ = _inputs()
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=4)
    torch.testing.assert_close(loss, _torch_reference(hidden, weight, labels,
                                                      torch.ones(BATCH, SEQ,
                                                                 dtype=torch.float64))[0],
                               **TOL)


@pytest.mark.parametrize("kwargs,match", [
    (dict(chunk_tokens=0), "chunk_tokens=0 must be >= 1"),
    (dict(chunk_tokens=-3), "chunk_tokens=-3 must be >= 1"),
    (dict(sequence_parallel=True), "sequence_parallel needs the tensor-parallel group"),
])
def test_rejects_bad_arguments(kwargs, match):
    hidden, weight, labels, _ = _inputs()
    with pytest.raises(ValueError, match=match):
        fused_linear_cross_entropy(hidden, weight, labels, **kwargs)


def test_rejects_mismatched_labels_and_dtypes():
    hidden, weight, labels, _ = _inputs()
    with pytest.raises(ValueError, match=r"expected \[b, s\] = \[2, 11\]"):
        fused_linear_cross_entropy(hidden, weight, labels.t())
    with pytest.raises(ValueError, match="needs one dtype"):
        fused_linear_cross_entropy(hidden.float(), weight, labels)


def _weighted(hidden, weight, labels, weights, grad, chunk_tokens):
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk_tokens,
                                      loss_weights=weights)
    loss.backward(grad)
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk_tokens", [3, 64])
@pytest.mark.parametrize("case", ["mask", "scaled_mask", "weights", "other_gradient",
                                  "all_masked"])
def test_gradients_computed_in_forward_equal_reference(chunk_tokens, case):
    """``loss_weights``: the forward computes the gradients of ``sum(loss * weights)``; the
    backward scales them when the incoming gradient is ``c * weights`` and recomputes
    otherwise. Every case equals the float64 reference for the gradient actually received."""
    hidden, weight, labels, probe = _inputs()
    gen = torch.Generator().manual_seed(7)
    mask = (torch.rand(BATCH, SEQ, generator=gen) > 0.3).double()
    weights = {"weights": torch.rand(BATCH, SEQ, generator=gen, dtype=torch.float64),
               "all_masked": torch.zeros(BATCH, SEQ, dtype=torch.float64)}.get(case, mask)
    grad = {"mask": mask, "scaled_mask": 0.25 * mask, "weights": 3.0 * weights,
            "other_gradient": probe, "all_masked": weights}[case]
    got = _weighted(hidden, weight, labels, weights, grad, chunk_tokens)
    want = _torch_reference(hidden, weight, labels, grad)
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=name)


def test_gradients_in_forward_only_when_gradients_are_wanted():
    from megatron.training.model import fused_loss  # megatron-core on first use

    hidden, weight, labels, _ = _inputs()
    calls = []
    real = fused_loss.linear_cross_entropy_forward_with_grads

    def spy(*args):
        calls.append(1)
        return real(*args)

    fused_loss.linear_cross_entropy_forward_with_grads = spy
    try:
        with torch.no_grad():
            loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens=4,
                                              loss_weights=torch.ones(BATCH, SEQ))
        assert not calls and loss.shape == (BATCH, SEQ)
        _weighted(hidden, weight, labels, torch.ones(BATCH, SEQ, dtype=torch.float64),
                  torch.ones(BATCH, SEQ, dtype=torch.float64), 4)
        assert calls
    finally:
        fused_loss.linear_cross_entropy_forward_with_grads = real
    with pytest.raises(ValueError, match="loss_weights"):
        fused_linear_cross_entropy(hidden, weight, labels, loss_weights=torch.ones(SEQ, BATCH))


def test_common_scale():
    from megatron.training.model.fused_loss import common_scale  # megatron-core on first use

    w = torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert common_scale(0.5 * w, w) == 0.5
    assert common_scale(torch.tensor([0.1, 1.0, 1.0, 0.0]), w) is None
    assert common_scale(torch.zeros(4), torch.zeros(4)) == 0.0
    assert common_scale(torch.ones(4), torch.zeros(4)) is None
    w2 = torch.tensor([[0.0, 2.0], [0.5, 0.0]])          # [b, s], the largest weight inside
    assert common_scale(3.0 * w2, w2) == 3.0
    off = 3.0 * w2
    off[1, 0] += 0.25                                    # one token off the common scale
    assert common_scale(off, w2) is None
