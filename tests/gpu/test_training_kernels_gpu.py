"""GPU checks of the split causal forward and the fused loss.

* ``split_causal_forward`` (a ring of one splits long causal forwards into three half-size
  cuDNN calls merged in bf16) against float64 attention: relative L2 error of out within the
  2e-2 bf16 bound of ``test_torch_kernel_routes_on_gpu``, and within 2x the error of one
  unsplit cuDNN call on the same inputs.
* ``fused_linear_cross_entropy`` on bf16 weights (chunks of 4096 tokens) against the
  unfused path (bf16 logits, float32 cross-entropy, autograd): losses to 1e-5 relative,
  gradients of hidden states and weight to 1e-2 relative L2 (bf16 products summed in a
  different order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.usp.kernels import MathKernel, get_kernel
from megatron.usp.ring_attention import split_causal_forward
from tests.helpers import rel_err


@pytest.mark.gpu
def test_split_causal_forward_on_gpu():
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, h, hk, s, d = 1, 8, 2, 4096, 128
    q = torch.randn(b, h, s, d, generator=gen, device="cuda").bfloat16()
    kv = torch.randn(2, b, hk, s, d, generator=gen, device="cuda").bfloat16()
    scale, kernel = d ** -0.5, get_kernel("auto")
    ref_out, ref_lse = MathKernel().forward(q.double(), kv[0].double(), kv[1].double(), True,
                                            scale)
    out, lse = split_causal_forward(q, kv, kernel, scale)
    whole, _ = kernel.forward(q, kv[0], kv[1], True, scale)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    err, err_whole = rel_err(out, ref_out), rel_err(whole, ref_out)
    assert err < 2e-2 and err <= 2 * err_whole, (err, err_whole)
    assert (lse.double() - ref_lse).abs().max().item() < 1e-2


@pytest.mark.gpu
def test_fused_linear_cross_entropy_on_gpu():
    from megatron.training.model.fused_loss import (
        fused_linear_cross_entropy,  # megatron-core on first use
    )

    gen = torch.Generator(device="cuda").manual_seed(0)
    s, b, hidden, vocab = 6144, 2, 1024, 32000
    h = (torch.randn(s, b, hidden, generator=gen, device="cuda") * 0.5).bfloat16()
    w = (torch.randn(vocab, hidden, generator=gen, device="cuda") * 0.05).bfloat16()
    labels = torch.randint(0, vocab, (b, s), generator=gen, device="cuda")
    grad = torch.rand(b, s, generator=gen, device="cuda")

    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h1, w1, labels, chunk_tokens=4096)
    loss.backward(grad)

    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    logits = torch.matmul(h2, w2.t()).float()                            # [s, b, V]
    ref = F.cross_entropy(logits.reshape(s * b, vocab), labels.t().reshape(-1),
                          reduction="none").view(s, b).t()
    ref.backward(grad)

    assert loss.dtype == torch.float32 and loss.shape == (b, s)
    assert rel_err(loss, ref) < 1e-5
    assert rel_err(h1.grad, h2.grad) < 1e-2 and rel_err(w1.grad, w2.grad) < 1e-2


@pytest.mark.gpu
def test_fused_linear_cross_entropy_gradients_in_forward_on_gpu():
    """``loss_weights`` (the loss mask): gradients computed in the forward by the compiled
    chunk kernels, against the unfused path, to the same tolerances as above."""
    from megatron.training.model.fused_loss import (
        fused_linear_cross_entropy,  # megatron-core on first use
    )

    gen = torch.Generator(device="cuda").manual_seed(0)
    s, b, hidden, vocab = 6144, 2, 1024, 32000
    h = (torch.randn(s, b, hidden, generator=gen, device="cuda") * 0.5).bfloat16()
    w = (torch.randn(vocab, hidden, generator=gen, device="cuda") * 0.05).bfloat16()
    labels = torch.randint(0, vocab, (b, s), generator=gen, device="cuda")
    mask = (torch.rand(b, s, generator=gen, device="cuda") > 0.2).float()

    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h1, w1, labels, chunk_tokens=4096, loss_weights=mask)
    (loss * mask).sum().backward()

    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    logits = torch.matmul(h2, w2.t()).float()
    ref = F.cross_entropy(logits.reshape(s * b, vocab), labels.t().reshape(-1),
                          reduction="none").view(s, b).t()
    (ref * mask).sum().backward()
    assert rel_err(loss, ref) < 1e-5
    assert rel_err(h1.grad, h2.grad) < 1e-2 and rel_err(w1.grad, w2.grad) < 1e-2
