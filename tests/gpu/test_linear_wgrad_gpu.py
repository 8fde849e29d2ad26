"""GPU checks of ``--gradient-accumulation-fusion`` and FC2 with the SwiGLU inside
(:mod:`megatron.layers.linear_wgrad`), bf16 on one GPU:

* the weight gradient added into a float32 ``main_grad`` by ``torch.addmm(...,
  out_dtype=float32)``: relative error against float64 at float32's level (2e-5), at least
  10x below megatron-core's unfused path (a bf16 gradient, then added); into a bf16 buffer
  (``--grad-reduce-in-bf16``): within one bf16 rounding;
* the SwiGLU backward that rewrites the forward over its gradient: the input gradient within
  twice the plain bf16 backward's error against float64 (+1e-3), the rewritten output the
  forward kernel's bits;
* FC2 with the SwiGLU inside against the plain ops in float64;
* a 2-layer GPT step (``usp`` kernels, lean) with the fusion: loss and gradients vs ``torch``
  as the other GPT-step checks (the model's own bf16 noise).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.layers import lean_kernels as lk
from megatron.layers.linear_wgrad import accumulate_wgrad, swiglu_linear
from tests.gpu.gpt_step import one_gpt_step
from tests.helpers import rel_err


def _randn(*shape, seed=0, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()


@pytest.mark.gpu
def test_wgrad_into_float32_main_grad_on_gpu():
    dy, x = _randn(8192, 1024, seed=1), _randn(8192, 768, seed=2)
    start = torch.randn(1024, 768, device="cuda") * 50
    exact = start.double() + dy.double().t() @ x.double()
    main = start.clone()
    accumulate_wgrad(main, dy, x)
    unfused = start + (dy.t() @ x).float()            # megatron-core without apex
    err, err_unfused = rel_err(main, exact), rel_err(unfused, exact)
    assert err < 2e-5 and err * 10 < err_unfused, (err, err_unfused)
    bf16_main = start.bfloat16()
    accumulate_wgrad(bf16_main, dy, x)
    assert rel_err(bf16_main, exact) < 2 ** -8, rel_err(bf16_main, exact)


@pytest.mark.gpu
def test_swiglu_backward_refill_on_gpu():
    rows, f = 4096, 2816
    x, dy = _randn(rows, 2 * f, seed=3), _randn(rows, f, seed=4)
    forward = lk.swiglu(x)
    buf = dy.clone()
    dx = lk.swiglu_backward_refill(buf, x)
    ref = lk.swiglu_backward_math(dy.double(), x.double())
    xp = x.clone().requires_grad_(True)        # the plain bf16 path: silu(gate) * up in bf16
    (F.silu(xp[:, :f]) * xp[:, f:]).backward(dy)
    err, err_plain = rel_err(dx, ref), rel_err(xp.grad, ref)
    assert err <= 2 * err_plain + 1e-3, (err, err_plain)
    assert torch.equal(buf, forward), "the rewritten output differs from the forward's bits"


@pytest.mark.gpu
@pytest.mark.parametrize("fuse", [False, True])
def test_swiglu_linear_on_gpu(fuse):
    x, w, dy = _randn(2048, 2, 2 * 1408, seed=5), _randn(1024, 1408, seed=6, scale=0.03), \
        _randn(2048, 2, 1024, seed=7)
    xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    if fuse:
        wl.main_grad = torch.zeros_like(wl, dtype=torch.float32)
        wl.grad_added_to_main_grad = False
    out = swiglu_linear(xl, wl)
    out.backward(dy)
    xr, wr = x.double().requires_grad_(True), w.double().requires_grad_(True)
    ref = F.linear(F.silu(xr[..., :1408]) * xr[..., 1408:], wr)
    ref.backward(dy.double())
    gw = wl.main_grad if fuse else wl.grad
    assert rel_err(out, ref) < 1e-2 and rel_err(xl.grad, xr.grad) < 1e-2
    assert rel_err(gw, wr.grad) < 1e-2
    if fuse:
        assert wl.grad_added_to_main_grad is True


@pytest.mark.gpu
def test_gpt_step_with_wgrad_fusion_on_gpu():
    loss_t, grads_t = one_gpt_step("torch")
    loss_f, grads_f = one_gpt_step("usp", lean=True, fuse_wgrad=True)
    assert abs(loss_f - loss_t) <= 1e-2 * abs(loss_t)
    assert grads_t.keys() == grads_f.keys()
    for name, g in grads_t.items():
        assert rel_err(grads_f[name], g) < 5e-2, name
