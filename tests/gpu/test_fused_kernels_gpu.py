"""GPU checks of ``--fused-kernels`` (RMSNorm, SwiGLU, RoPE, the fused QKV split + RoPE, this
project's ``usp`` kernels with their drop-and-refill path): each
implementation against a float64 reference on the same bf16 inputs, forward and input gradients, within twice the
error of the plain PyTorch path in bf16 (plus 1e-3 of slack for bf16's rounding step), and
a whole GPT forward/backward whose losses and gradients agree between ``torch`` and each
fused implementation to bf16 training accuracy.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.layers.qkv_rope import qkv_split_rope, qkv_split_rope_reference
from megatron.training.optim import grad_clip
from tests.gpu.gpt_step import one_gpt_step
from tests.helpers import rel_err

IMPLS = ["compile", "liger"]
NORM_GLU_IMPLS = IMPLS + ["usp"]      # RMSNorm and SwiGLU also have this project's kernels


def _available(impl: str) -> bool:
    from megatron.layers.fused_kernels import liger_importable  # megatron-core on first use

    return impl != "liger" or liger_importable()


def _check(fn_impl, fn_torch, fn_ref, inputs, extra=()):
    """Same inputs and output gradients for all three; each run gets its own copies (Liger's
    RoPE rotates its inputs and its incoming gradients in place)."""
    douts = None

    def run(fn, xs):
        nonlocal douts
        leaves = [x.clone().requires_grad_(True) for x in xs]
        out = fn(*leaves, *extra)
        outs = out if isinstance(out, tuple) else (out,)
        if douts is None:
            gen = torch.Generator(device="cuda").manual_seed(1)
            douts = [torch.randn(o.shape, generator=gen, device="cuda").bfloat16() for o in outs]
        torch.autograd.backward(outs, [d.clone().to(o.dtype) for d, o in zip(douts, outs)])
        return [o.detach().clone() for o in outs], [x.grad for x in leaves]

    outs_t, grads_t = run(fn_torch, inputs)
    outs, grads = run(fn_impl, inputs)
    outs_r, grads_r = run(fn_ref, [x.double() for x in inputs])
    for got, base, ref in list(zip(outs, outs_t, outs_r)) + list(zip(grads, grads_t, grads_r)):
        assert got.dtype == base.dtype and got.shape == base.shape
        err, err_t = rel_err(got, ref), rel_err(base, ref)
        assert err_t < 2e-2, err_t                   # the plain bf16 path is itself right
        assert err <= 2 * err_t + 1e-3, (err, err_t)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", NORM_GLU_IMPLS)
def test_rms_norm_on_gpu(impl):
    from megatron.layers import fused_kernels as fk  # megatron-core on first use

    if not _available(impl):
        pytest.skip("liger-kernel is not installed")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 2048, generator=gen, device="cuda").bfloat16()
    w = (1 + 0.1 * torch.randn(2048, generator=gen, device="cuda")).bfloat16()
    _check(lambda x, w: fk.rms_norm(x, w, 1e-5, impl),
           lambda x, w: fk.rms_norm(x, w, 1e-5, "torch"),
           lambda x, w: fk.rms_norm_torch(x, w, 1e-5), [x, w])


@pytest.mark.gpu
def test_rms_norm_backward_adds_the_residual_gradient_on_gpu():
    """The ``usp`` RMSNorm backward with the residual's gradient read in
    (megatron.layers.residual): against float64, at least as close as the backward followed by
    autograd's bf16 addition, which rounds twice."""
    from megatron.layers import lean_kernels as lk  # megatron-core on first use

    gen = torch.Generator(device="cuda").manual_seed(2)
    x, dy, dres = (torch.randn(8192, 2048, generator=gen, device="cuda").bfloat16()
                   for _ in range(3))
    w = (1 + 0.1 * torch.randn(2048, generator=gen, device="cuda")).bfloat16()
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-5)
    fused, dw = lk._rms_backward(dy, x, w, 0.0, rstd, dres)
    plain, dw_plain = lk._rms_backward(dy, x, w, 0.0, rstd)
    ref, dw_ref = lk.rms_norm_backward_math(dy.double(), x.double(), w.double(), 0.0,
                                            rstd.double(), dres.double())
    assert torch.equal(dw, dw_plain)
    assert rel_err(dw, dw_ref) < 1e-5
    assert rel_err(fused, ref) <= rel_err(plain + dres, ref) + 1e-6
    assert rel_err(fused, ref) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("impl", NORM_GLU_IMPLS)
def test_swiglu_on_gpu(impl):
    from megatron.layers import fused_kernels as fk  # megatron-core on first use

    if not _available(impl):
        pytest.skip("liger-kernel is not installed")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 1, 2 * 5632, generator=gen, device="cuda").bfloat16()
    _check(lambda x: fk.swiglu(x, impl), lambda x: fk.swiglu(x, "torch"), fk.swiglu_torch, [x])


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("mscale", [1.0, 1.1386])
def test_rope_on_gpu(impl, batch, mscale):
    """Positions in a load-balanced order (chunks 0 and 3 of 4) and, for batch 2, per-row
    positions: the kernel must follow the frequencies it is given; with YaRN's factor on cos
    and sin too."""
    from megatron.bench.fused_kernels_bench import rope_freqs
    from megatron.layers import fused_kernels as fk

    if not _available(impl):
        pytest.skip("liger-kernel is not installed")
    gen = torch.Generator(device="cuda").manual_seed(0)
    s, total = 2048, 4096
    table = rope_freqs(total, 128, device="cuda")                      # [S, 1, 1, d]
    pos = torch.cat([torch.arange(0, 1024), torch.arange(3072, 4096)]).cuda()
    freqs = table[pos]                                                 # [s, 1, 1, d]
    if batch == 2:
        other = torch.randperm(total, generator=torch.Generator().manual_seed(2))[:s].cuda()
        freqs = torch.cat([freqs, table[other]], dim=1)                # [s, 2, 1, d]
    q = torch.randn(s, batch, 16, 128, generator=gen, device="cuda").bfloat16()
    k = torch.randn(s, batch, 4, 128, generator=gen, device="cuda").bfloat16()
    _check(lambda q, k: fk.rope(q, k, freqs, impl, mscale),
           lambda q, k: fk.rope(q, k, freqs, "torch", mscale),
           lambda q, k: fk._rope_pair_torch(q, k, freqs, mscale), [q, k])


@pytest.mark.gpu
@pytest.mark.parametrize("mscale", [1.0, 1.1386])       # 1.1386: YaRN's factor at 4x
@pytest.mark.parametrize("batch,heads,groups,rot", [(1, 16, 4, 128), (2, 16, 4, 128),
                                                   (1, 8, 8, 64), (1, 32, 1, 128)])
def test_qkv_split_rope_on_gpu(batch, heads, groups, rot, mscale):
    """megatron.layers.qkv_rope's Triton kernel (split + RoPE of the QKV output) in bf16 against
    megatron's split with the plain rotation, both against float64; load-balanced positions
    (chunks 0 and 3 of 4), per-row positions for batch 2, partial rotation (rot < d), MHA
    and MQA as well as GQA, and YaRN's factor on cos and sin."""
    from megatron.bench.fused_kernels_bench import rope_freqs
    from megatron.layers import fused_kernels as fk

    gen = torch.Generator(device="cuda").manual_seed(0)
    s, total, d = 2048, 4096, 128
    table = rope_freqs(total, rot, device="cuda")
    pos = torch.cat([torch.arange(0, 1024), torch.arange(3072, 4096)]).cuda()
    freqs = table[pos]
    if batch == 2:
        other = torch.randperm(total, generator=torch.Generator().manual_seed(2))[:s].cuda()
        freqs = torch.cat([freqs, table[other]], dim=1)
    per = heads // groups
    mixed = torch.randn(s, batch, groups, (per + 2) * d, generator=gen,
                        device="cuda").bfloat16()

    def plain(m):                        # megatron's split, then its unfused rotation
        q, k, v = torch.split(m, [per * d, d, d], dim=3)
        q = q.reshape(s, batch, heads, d)
        return fk.rope_torch(q, freqs, mscale), fk.rope_torch(k, freqs, mscale), v

    out = qkv_split_rope(mixed, freqs, per, d, mscale)
    assert all(t.is_contiguous() for t in out)
    _check(lambda m: qkv_split_rope(m, freqs, per, d, mscale), plain,
           lambda m: qkv_split_rope_reference(m, freqs.double(), per, d, mscale), [mixed])


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_gpt_step_with_fused_kernels_on_gpu(impl, tmp_path):
    """A 2-layer GPT (RMSNorm, SwiGLU, RoPE, GQA) in bf16: loss and gradients of ``impl`` vs
    ``torch``, same weights and tokens (the bf16 model's own noise: 1e-2 relative)."""
    if not _available(impl):
        pytest.skip("liger-kernel is not installed")
    loss_t, grads_t = one_gpt_step("torch")
    loss_f, grads_f = one_gpt_step(impl)
    assert abs(loss_f - loss_t) <= 1e-2 * abs(loss_t)
    assert grads_t.keys() == grads_f.keys()
    for name, g in grads_t.items():
        assert rel_err(grads_f[name], g) < 5e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("lean", [False, True])
def test_gpt_step_with_usp_kernels_on_gpu(lean):
    """``--fused-kernels usp`` (megatron.layers.lean_kernels, qkv_rope), the norm and SwiGLU
    outputs kept or (``lean``) dropped after the linear layers and refilled in place before
    their backward: loss and gradients vs ``torch`` as above."""
    loss_t, grads_t = one_gpt_step("torch")
    loss_f, grads_f = one_gpt_step("usp", lean=lean)
    assert abs(loss_f - loss_t) <= 1e-2 * abs(loss_t)
    assert grads_t.keys() == grads_f.keys()
    for name, g in grads_t.items():
        assert rel_err(grads_f[name], g) < 5e-2, name


@pytest.mark.gpu
def test_fused_adam_switch_on_gpu():
    """``use_fused_adam`` turns megatron-core's torch AdamW to the fused kernel: the same
    update as the foreach implementation to float32 rounding."""
    from megatron.training.loop import use_fused_adam  # megatron-core on first use

    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(1000, 300, generator=gen, device="cuda"),
              torch.randn(300, generator=gen, device="cuda")]
    grads = [torch.randn(p.shape, generator=gen, device="cuda") for p in params]

    class Wrapped:                                   # megatron's optimizers hold .optimizer
        def __init__(self, opt):
            self.optimizer = opt

    results = []
    for fused in (False, True):
        ps = [p.clone().requires_grad_() for p in params]
        opt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
        if fused:
            assert use_fused_adam(Wrapped(opt)) == 1
            assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
        for _ in range(3):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
        results.append([p.detach() for p in ps])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    cpu = torch.optim.AdamW([torch.zeros(3, requires_grad=True)])
    assert use_fused_adam(Wrapped(cpu)) == 1                 # the CPU has the fused kernel too
    mixed = torch.optim.AdamW([torch.zeros(3, requires_grad=True),
                               torch.zeros(3, device="cuda", requires_grad=True)])
    assert use_fused_adam(Wrapped(mixed)) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_step_scaled_in_fused_adam_on_gpu(clip):
    """``grad_clip.scaled_in_adam`` on CUDA: the fused kernel's division by num_tokens / clip
    coefficient equals dividing and clipping first, then the default AdamW (to float32
    rounding); with ``ok`` false nothing changes, moments and step included."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1000, 300), (300,)]
    start = [torch.randn(s, generator=gen, device="cuda") for s in shapes]
    n = torch.tensor(37.0, device="cuda")
    config = SimpleNamespace(clip_grad=clip, use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
    runs = {}
    for fused in (True, False):
        ps = [p.clone().requires_grad_() for p in start]
        opt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, eps=1e-3, fused=fused,
                                foreach=False if fused else None)
        sub = SimpleNamespace(optimizer=opt, config=config, grad_scaler=None)
        g2 = torch.Generator(device="cuda").manual_seed(1)
        for step in range(3):
            raw = [(step + 1) * 40 * torch.randn(s, generator=g2, device="cuda") for s in shapes]
            norm = torch.stack([(g / n).norm() for g in raw]).norm()
            if fused:
                for p, g in zip(ps, raw):
                    p.grad = g.clone()
                with grad_clip.scaled_in_adam(sub, [opt], n, norm, torch.isfinite(norm)):
                    opt.step()
            else:
                coeff = min(1.0, clip / (norm.item() + 1e-6)) if clip > 0 else 1.0
                for p, g in zip(ps, raw):
                    p.grad = g / n * coeff
                opt.step()
        runs[fused] = (ps, opt)
    for a, b, p0 in zip(runs[True][0], runs[False][0], start):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
        assert (a.detach() - p0).abs().max() > 1e-3
    ps, opt = runs[True]
    before = [p.detach().clone() for p in ps]
    state = {k: v.clone() for k, v in opt.state[ps[0]].items()}
    for p in ps:
        p.grad = torch.full_like(p, float("nan"))
    bad = torch.tensor(float("nan"), device="cuda")
    with grad_clip.scaled_in_adam(SimpleNamespace(optimizer=opt, config=config), [opt], n,
                                  bad, torch.isfinite(bad)):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before))
    assert all(torch.equal(v, state[k]) for k, v in opt.state[ps[0]].items())
