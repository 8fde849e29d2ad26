"""megatron.layers.linear_wgrad on one CPU process: the weight gradient added into ``main_grad``
(float64 exact against autograd of the plain ops; bf16 operands summed in float32 as the
GEMM does), megatron-core's DDP handshake (``grad_added_to_main_grad``, the stand-in
gradient, ``zero_out_wgrad``), FC2 with the SwiGLU inside (its backward rebuilds the SwiGLU
output over the output gradient), and the layer-spec switch. The TP / sequence-parallel
paths are tests/distributed/test_linear_wgrad_tp.py; the bf16 GPU check is
tests/gpu/test_fused_kernels_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron.layers import lean_kernels as lk
from megatron.layers import linear_wgrad as lw

TOL = dict(atol=1e-12, rtol=1e-12)


def _ddp_weight(shape, dtype=torch.float64, main_dtype=None, seed=0):
    """A weight as megatron-core's DDP leaves it: ``main_grad`` (zeros) and the flag."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, dtype=dtype, generator=g).requires_grad_(True)
    w.main_grad = torch.zeros(shape, dtype=main_dtype or dtype)
    w.grad_added_to_main_grad = False
    return w


def test_accumulate_wgrad_adds_the_product():
    g = torch.Generator().manual_seed(1)
    dy, x = torch.randn(7, 5, dtype=torch.float64, generator=g), torch.randn(
        7, 3, dtype=torch.float64, generator=g)
    main = torch.randn(5, 3, dtype=torch.float64, generator=g)
    want = main + dy.t() @ x
    lw.accumulate_wgrad(main, dy, x)
    torch.testing.assert_close(main, want, **TOL)


def test_bf16_operands_are_summed_in_float32_without_a_bf16_rounding():
    """The point of the fusion: megatron-core's unfused path rounds each weight gradient to
    bf16 before adding it; the fused one adds the float32 sums."""
    g = torch.Generator().manual_seed(2)
    dy = torch.randn(256, 16, generator=g).bfloat16()
    x = torch.randn(256, 8, generator=g).bfloat16()
    exact = dy.double().t() @ x.double()
    main = torch.zeros(16, 8)
    lw.accumulate_wgrad(main, dy, x)
    fused_err = (main.double() - exact).abs().max().item()
    unfused_err = ((dy.t() @ x).float().double() - exact).abs().max().item()
    assert fused_err < 1e-5 * exact.abs().max().item(), fused_err
    assert unfused_err > 10 * fused_err, (unfused_err, fused_err)
    bf16_main = torch.zeros(16, 8, dtype=torch.bfloat16)
    lw.accumulate_wgrad(bf16_main, dy, x)     # --grad-reduce-in-bf16: one rounding to bf16
    torch.testing.assert_close(bf16_main.double(), exact, atol=0.0,
                               rtol=2 ** -8 * 1.01)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_linear_equals_autograd_and_fills_main_grad(bias, fused):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2, 5, dtype=torch.float64, generator=g)
    w = _ddp_weight((4, 5)) if fused else torch.randn(4, 5, dtype=torch.float64,
                                                      generator=g).requires_grad_(True)
    b = torch.randn(4, dtype=torch.float64, generator=g).requires_grad_(True) if bias else None
    dy = torch.randn(6, 2, 4, dtype=torch.float64, generator=g)

    xl = x.clone().requires_grad_(True)
    for _ in range(2):                 # two micro-batches accumulate
        lw.linear(xl, w, b, False, False, None).backward(dy)
    xr, wr = x.clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    br = b.detach().clone().requires_grad_(True) if bias else None
    for _ in range(2):
        F.linear(xr, wr, br).backward(dy)
    torch.testing.assert_close(xl.grad, xr.grad, **TOL)
    if bias:
        torch.testing.assert_close(b.grad, br.grad, **TOL)
    if fused:
        torch.testing.assert_close(w.main_grad, wr.grad, **TOL)
        assert w.grad_added_to_main_grad is True
        assert w.grad is not None and w.grad.shape == w.shape   # the stand-in, for DDP's hook
    else:
        torch.testing.assert_close(w.grad, wr.grad, **TOL)


def test_zero_out_wgrad_gets_a_zero_stand_in_and_fsdp_params_are_left_alone():
    w = _ddp_weight((3, 2))
    w.zero_out_wgrad = True
    x = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    lw.linear(x, w, None, False, False, None).sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w.grad))
    assert w.main_grad.abs().sum() > 0
    fsdp = _ddp_weight((3, 2))
    fsdp.__fsdp_param__ = True
    assert not lw.fuses_into_main_grad(fsdp)
    lw.linear(x, fsdp, None, False, False, None).sum().backward()
    assert torch.equal(fsdp.main_grad, torch.zeros_like(fsdp.main_grad))
    assert fsdp.grad.abs().sum() > 0


def test_swiglu_backward_refill_writes_the_forward_over_the_gradient():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 12, dtype=torch.float64, generator=g)
    dy = torch.randn(9, 6, dtype=torch.float64, generator=g)
    want_dx = lk.swiglu_backward_math(dy, x)
    buf = dy.clone()
    dx = lk.swiglu_backward_refill(buf, x)
    torch.testing.assert_close(dx, want_dx, **TOL)
    torch.testing.assert_close(buf, F.silu(x[:, :6]) * x[:, 6:], **TOL)


@pytest.mark.parametrize("fuse", [False, True])
def test_swiglu_linear_equals_autograd_of_the_plain_ops(fuse):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 2, 12, dtype=torch.float64, generator=g)
    w = _ddp_weight((7, 6))
    dy = torch.randn(5, 2, 7, dtype=torch.float64, generator=g)
    xl = x.clone().requires_grad_(True)
    out = lw.swiglu_linear(xl, w, fuse_wgrad=fuse)
    out.backward(dy)
    xr, wr = x.clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    ref = F.linear(F.silu(xr[..., :6]) * xr[..., 6:], wr)
    ref.backward(dy)
    torch.testing.assert_close(out.detach(), ref.detach(), **TOL)
    torch.testing.assert_close(xl.grad, xr.grad, **TOL)
    got_w = w.main_grad if fuse else w.grad
    torch.testing.assert_close(got_w, wr.grad, **TOL)
    assert w.grad_added_to_main_grad is fuse


def test_swiglu_linear_keeps_only_its_input():
    """Nothing of the SwiGLU's output width is saved for the backward."""
    x = torch.randn(8, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    out = lw.swiglu_linear(x * 1.0, w)
    saved = out.grad_fn.saved_tensors
    assert sorted(tuple(t.shape) for t in saved) == [(3, 6), (8, 12)]


def test_bad_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match=r"input \(4, 10\) does not fit weight \(3, 6\)"):
        lw.swiglu_linear(torch.randn(4, 10), torch.randn(3, 6))
    with pytest.raises(ValueError, match="exclude each other"):
        lw.linear(torch.randn(2, 3), torch.randn(4, 3), None, True, True, None)


def test_spec_switch_maps_megatrons_linears_and_refuses_others():
    from megatron.core.tensor_parallel.layers import (  # megatron-core on first use
        ColumnParallelLinear,
        RowParallelLinear,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec  # megatron-core on first use

    from megatron.layers import fused_linears as fl  # megatron-core on first use
    from megatron.training.model.layer_specs import (
        LayerSpecOptions,
        get_usp_gpt_layer_spec,
        with_wgrad_fusion,
    )  # megatron-core on first use

    assert with_wgrad_fusion(ColumnParallelLinear).module is fl.USPColumnParallelLinear
    assert with_wgrad_fusion(RowParallelLinear).params == {"fuse_wgrad": True}
    kept = with_wgrad_fusion(ModuleSpec(module=fl.SwiGLURowParallelLinear,
                                        params={"swiglu_impl": "usp"}))
    assert kept.module is fl.SwiGLURowParallelLinear
    assert kept.params == {"swiglu_impl": "usp", "fuse_wgrad": True}
    with pytest.raises(TypeError, match="gradient-accumulation-fusion"):
        with_wgrad_fusion(torch.nn.Linear)
    for lean in (False, True):
        layer = get_usp_gpt_layer_spec(LayerSpecOptions(
            fused_kernels="torch", lean_norms=lean, lean_swiglu=lean, fuse_wgrad=True)
        ).submodules
        attn, mlp = layer.self_attention.submodules, layer.mlp.submodules
        for slot in (attn.linear_qkv, attn.linear_proj, mlp.linear_fc1, mlp.linear_fc2):
            assert slot.params["fuse_wgrad"] is True
            assert issubclass(slot.module, (fl.USPColumnParallelLinear, fl.USPRowParallelLinear))


@pytest.mark.parametrize("op", ["linear", "swiglu_linear"])
def test_ddp_skips_its_addition_under_a_non_reentrant_checkpoint(op):
    """The tiled MLP runs each tile under ``torch.utils.checkpoint(use_reentrant=False)``,
    whose backward hands the Function the recomputed saved tensors: another Python object
    than the parameter. DDP's hook reads ``grad_added_to_main_grad`` from the parameter, so
    the flag must be set there, or it adds the uninitialised stand-in to ``main_grad``."""
    w = _ddp_weight((4, 3))
    w.register_post_accumulate_grad_hook(_ddp_hook)
    x = torch.randn(4, 6 if op == "swiglu_linear" else 3, dtype=torch.float64)
    fn = ((lambda t: lw.swiglu_linear(t, w)) if op == "swiglu_linear"
          else (lambda t: lw.linear(t, w, None, False, False, None)))
    tiles = [checkpoint(fn, tile.clone().requires_grad_(True), use_reentrant=False)
             for tile in x.split(2)]
    torch.cat(tiles).sum().backward()
    wr = w.detach().clone().requires_grad_(True)
    (F.linear(F.silu(x[:, :3]) * x[:, 3:], wr) if op == "swiglu_linear"
     else F.linear(x, wr)).sum().backward()
    torch.testing.assert_close(w.main_grad, wr.grad, **TOL)


def _ddp_hook(param):
    """megatron-core's DDP backward hook: add the gradient unless the layer did, drop it."""
    if param.grad is not None and not param.grad_added_to_main_grad:
        param.main_grad.add_(param.grad)
    param.grad = None
