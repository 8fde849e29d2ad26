"""megatron.layers.residual: the residual's gradient added inside the ``usp`` RMSNorm's backward.

Reference: the same float64 sublayers (norm, a linear layer, bias-dropout-add, twice over, as
a pre-norm transformer layer is built) with the residual's gradient left to autograd. Every
gradient must be equal to float64 rounding, and a spy checks that the norm's backward really
received the residual's gradient (so the test fails if the hand-over silently stops).
"""

from __future__ import annotations

import pytest
import torch

from megatron.layers import fused_kernels, residual
from megatron.layers import lean_kernels as lk
from megatron.layers.residual import ResidualGrad, residual_bda

TOL = dict(atol=1e-12, rtol=1e-12)
H = 16


@pytest.fixture
def handed_over(monkeypatch):
    """How many norm backwards received a residual gradient."""
    seen = []
    real = lk._rms_backward

    def spy(dy2, x2, w, offset, rstd, dres2=None):
        seen.append(dres2 is not None)
        return real(dy2, x2, w, offset, rstd, dres2)

    monkeypatch.setattr(lk, "_rms_backward", spy)
    return seen


def _sublayers(h, weights, residual_grad, refillable, fused_bda=False):
    """Two pre-norm sublayers: ``h + W @ norm(h)``, then the same with the next weights."""
    bda = residual_bda(True, fused_bda)
    for w_norm, w_lin in weights:
        if refillable:
            y, _ = lk.rms_norm(h, w_norm, 1e-5, refillable=True, residual_grad=residual_grad)
        else:
            y = lk.rms_norm(h, w_norm, 1e-5, residual_grad=residual_grad)
        h = bda((y @ w_lin, None), h, 0.0)
    return h


def _grads(residual_grad, refillable, fused_bda=False, seed=3):
    gen = torch.Generator().manual_seed(seed)
    h0 = torch.randn(6, 2, H, generator=gen, dtype=torch.float64).requires_grad_(True)
    weights = [((0.5 + torch.rand(H, generator=gen, dtype=torch.float64)).requires_grad_(True),
                (torch.randn(H, H, generator=gen, dtype=torch.float64) / 4).requires_grad_(True))
               for _ in range(2)]
    out = _sublayers(h0 * 1.0, weights, residual_grad, refillable, fused_bda)
    out.backward(torch.randn(out.shape, generator=gen, dtype=torch.float64))
    return [h0.grad] + [p.grad for pair in weights for p in pair]


@pytest.mark.parametrize("refillable,fused_bda", [(False, False), (True, False), (True, True)])
def test_the_norm_adds_the_residual_gradient_autograd_would_have_added(refillable, fused_bda,
                                                                       handed_over):
    want = _grads(residual_grad=False, refillable=refillable, fused_bda=fused_bda)
    assert handed_over == [False, False]
    handed_over.clear()
    got = _grads(residual_grad=True, refillable=refillable, fused_bda=fused_bda)
    assert handed_over == [True, True]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


def test_a_residual_no_norm_offered_and_a_second_use_take_autograds_path(handed_over):
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(4, H, generator=gen, dtype=torch.float64)
    w = torch.ones(H, dtype=torch.float64)
    bda = residual_bda(True, False)

    def run(residual_grad):
        x = h.clone().requires_grad_(True)
        y = lk.rms_norm(x, w, 1e-5, residual_grad=residual_grad)
        first = bda((y * 2.0, None), x, 0.0)          # claims the channel
        second = bda((first, None), x, 0.0)           # x again: autograd's path
        other = bda((second, None), torch.ones_like(x), 0.0)   # offered by nobody
        other.backward(torch.full_like(x, 0.5))
        return x.grad

    torch.testing.assert_close(run(True), run(False), **TOL)
    assert handed_over == [True, False]


def test_nothing_is_offered_without_an_autograd_graph():
    x = torch.randn(3, H, requires_grad=True)
    with torch.no_grad():
        assert residual.offer(x) is None
        lk.rms_norm(x, torch.ones(H), 1e-5, residual_grad=True)
    assert residual.claim(x) is None
    assert residual.offer(torch.randn(3, H)) is None          # needs no gradient
    y = fused_kernels.rms_norm(x, torch.ones(H), 1e-5, "torch", residual_grad=True)
    assert residual.claim(x) is None and y.shape == x.shape   # other kernels leave it to autograd


def test_a_gradient_that_comes_after_the_norms_backward_or_twice_raises():
    late = ResidualGrad()
    assert late.take() is None
    with pytest.raises(RuntimeError, match="after the norm's backward had run"):
        late.put(torch.ones(2))
    twice = ResidualGrad()
    twice.put(torch.ones(2))
    with pytest.raises(RuntimeError, match="handed over twice"):
        twice.put(torch.ones(2))
    assert torch.equal(twice.take(), torch.ones(2)) and twice.take() is None


def test_the_norm_module_hands_its_flag_to_the_kernel(handed_over):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.layers.norms import RMSNorm

    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2,
                               params_dtype=torch.float64)
    results = []
    for flag in (False, True):
        norm = RMSNorm(config, H, impl="usp", residual_grad=flag)
        x = torch.linspace(-2, 2, 3 * H, dtype=torch.float64).view(3, H).requires_grad_(True)
        out = residual_bda(True, False)((norm(x) * 3.0, None), x, 0.0)
        out.backward(torch.ones_like(out))
        results.append((x.grad, norm.weight.grad))
    assert handed_over == [False, True]
    for got, want in zip(*results[::-1]):
        torch.testing.assert_close(got, want, **TOL)
