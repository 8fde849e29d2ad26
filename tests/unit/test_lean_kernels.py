"""megatron.layers.lean_kernels: RMSNorm and SwiGLU (forward, backward, refill in place) against
PyTorch's own functions in float64 on the CPU path, the drop-and-refill hook on a consumer
layer, bad shapes refused by name, and (where Triton is installed) the Triton kernels under
Triton's CPU interpreter in float32 against float64 references. The bf16 GPU check is
tests/gpu/test_fused_kernels_gpu.py."""

from __future__ import annotations

import importlib.util
import textwrap
import weakref

import pytest
import torch
import torch.nn.functional as F

from megatron.layers import lean_kernels as lk
from tests.harness import run_under_triton_interpreter

TOL = dict(atol=1e-12, rtol=1e-12)


def _grads(fn, *inputs, seed=1):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    dout = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("shape,offset", [((5, 2, 12), 0.0), ((7, 33), 1.0), ((1, 1, 8), 0.0)])
def test_rms_norm_equals_torch_forward_and_backward(shape, offset):
    x = torch.randn(*shape, dtype=torch.float64)
    w = 0.5 + torch.rand(shape[-1], dtype=torch.float64)
    got, got_g = _grads(lambda a, b: lk.rms_norm(a, b, 1e-5, offset), x, w)
    want, want_g = _grads(lambda a, b: F.rms_norm(a, (shape[-1],), b + offset, 1e-5), x, w)
    torch.testing.assert_close(got, want, **TOL)
    for g, h in zip(got_g, want_g):
        torch.testing.assert_close(g, h, **TOL)


@pytest.mark.parametrize("shape", [(5, 2, 12), (3, 10), (1, 2)])
def test_swiglu_equals_megatrons_forward_and_backward(shape):
    x = torch.randn(*shape, dtype=torch.float64)

    def ref(t):
        gate, up = torch.chunk(t, 2, dim=-1)
        return F.silu(gate) * up

    got, (gx,) = _grads(lk.swiglu, x)
    want, (wx,) = _grads(ref, x)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(gx, wx, **TOL)


def test_non_contiguous_input_and_weight_without_grad():
    x = torch.randn(12, 6, dtype=torch.float64).t()              # [6, 12], strided
    w = torch.rand(12, dtype=torch.float64) + 0.5
    xl = x.clone().requires_grad_(True)
    y = lk.rms_norm(xl, w, 1e-6)
    y.sum().backward()
    xr = x.clone().requires_grad_(True)
    F.rms_norm(xr, (12,), w, 1e-6).sum().backward()
    torch.testing.assert_close(xl.grad, xr.grad, **TOL)
    g = torch.randn(6, 24, dtype=torch.float64)[:, ::2]           # strided SwiGLU input
    torch.testing.assert_close(lk.swiglu(g), F.silu(g[:, :6]) * g[:, 6:], **TOL)


def test_drop_until_backward_refills_before_the_consumer_needs_it():
    """The consumer (a matmul, as the linear layers) keeps the dropped RMSNorm output for its
    weight gradient: dropping and refilling must give the plain run's gradients, and the
    storage must be empty between the forward and the backward."""
    torch.manual_seed(0)
    x = torch.randn(9, 16, dtype=torch.float64)
    w_norm = torch.rand(16, dtype=torch.float64) + 0.5
    w_lin = torch.randn(16, 5, dtype=torch.float64)

    def run(drop: bool):
        xl, wn, wl = (t.clone().requires_grad_(True) for t in (x, w_norm, w_lin))
        y, refill = lk.rms_norm(xl, wn, 1e-5, refillable=True)
        kept = y.detach().clone()
        out = y @ wl
        if drop:
            lk.drop_until_backward(y, out, refill)
            assert y.untyped_storage().nbytes() == 0
        out.pow(2).sum().backward()
        assert torch.equal(y.detach(), kept)           # refilled to the same bits
        # Once the backward is through, nothing but this test holds the refilled output,
        # though the graph (and its hooks) lives on with ``out``.
        alive = weakref.ref(y)
        del y, refill
        assert alive() is None and out.grad_fn is not None
        return [xl.grad, wn.grad, wl.grad]

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want, **TOL)


def test_bad_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match=r"weight \(8,\) does not fit input \(3, 6\)"):
        lk.rms_norm(torch.randn(3, 6), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="must be even"):
        lk.swiglu(torch.randn(3, 7))


_INTERPRETED = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.nn.functional as F
    from megatron.layers import lean_kernels as lk
    torch.manual_seed(0)

    def close(a, b, what):
        err = (a.double() - b).abs().max().item()
        assert err < 2e-5 * max(1.0, b.abs().max().item()), (what, err)

    for rows, h, offset in [(13, 48, 0.0), (4, 32, 1.0), (9, 20, 0.0)]:
        x = torch.randn(rows, h, requires_grad=True)
        w = (torch.rand(h) + 0.5).requires_grad_(True)
        assert lk.triton_usable(x)
        y, refill = lk.rms_norm(x, w, 1e-5, offset, refillable=True)
        x64, w64 = (t.detach().double().requires_grad_(True) for t in (x, w))
        ref = F.rms_norm(x64, (h,), w64 + offset, 1e-5)
        close(y, ref, "rms fwd")
        dy = torch.randn(rows, h)
        y.backward(dy)
        ref.backward(dy.double())
        close(x.grad, x64.grad, "rms dx")
        close(w.grad, w64.grad, "rms dw")
        kept = y.detach().clone()
        y.detach().zero_()
        refill()
        assert torch.equal(y.detach(), kept), "rms refill"
        # the residual's gradient read by the backward kernel and added to dx
        rstd = torch.rsqrt(x.detach().pow(2).mean(-1) + 1e-5)
        dres = torch.randn(rows, h)
        dx, dw = lk._rms_backward(dy, x.detach(), w.detach(), offset, rstd, dres)
        close(dx, x64.grad + dres.double(), "rms dx + residual")
        close(dw, w64.grad, "rms dw with residual")

    for rows, f in [(3, 1100), (5, 24)]:
        x = torch.randn(rows, 2 * f, requires_grad=True)
        y = lk.swiglu(x)
        x64 = x.detach().double().requires_grad_(True)
        ref = F.silu(x64[:, :f]) * x64[:, f:]
        close(y, ref, "glu fwd")
        dy = torch.randn(rows, f)
        y.backward(dy)
        ref.backward(dy.double())
        close(x.grad, x64.grad, "glu dx")
        kept = y.detach().clone()
        # the backward that rewrites its forward over the gradient (FC2's backward)
        buf = dy.clone()
        dx = lk.swiglu_backward_refill(buf, x.detach())
        close(dx, lk.swiglu_backward_math(dy.double(), x.detach().double()), "glu dx, refill")
        assert torch.equal(buf, kept), "glu refill in the backward"
    print("kernels ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernels_under_the_interpreter():
    assert "kernels ok" in run_under_triton_interpreter(_INTERPRETED)
