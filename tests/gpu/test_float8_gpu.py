"""Float8 linear layers on a GPU of compute capability >= 8.9 (H100/H200), real
``torch._scaled_mm`` through torchao (no emulation), bf16 operands:

* each linear kind of the 0.85B benchmark model at 8K tokens (QKV, projection, FC1, FC2 with
  the SwiGLU inside): SQNR > 20 dB of output, input gradient and the weight gradient added
  into a float32 ``main_grad``, against float64; and below 60 dB (float8 really ran); both
  recipes;
* the real GEMMs against torchao's emulation of the same casts: SQNR > 30 dB (the same
  float8 values; the two differ in accumulation order only), and, compiled, against
  torchao's own float8 linear on the same operands (the same result);
* the fused output-layer loss with its GEMMs in float8 (``--fp8-output-layer``): SQNR of
  losses and gradients against float64, peak memory not above the bf16 loss's;
* a 2-layer bf16 GPT with every linear in float8 (``--fp8-linears all``) trains 4 AdamW
  steps with finite losses, its first loss within 2 % of the bf16 model's, every compiled
  cast graph built (none fell back to eager past dynamo's recompile limit); the ``auto``
  choice times each shape and reports positive times.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.layers import linear_wgrad
from megatron.layers.float8_gemms import Float8Gemms
from megatron.layers.float8_options import MIN_CAPABILITY, Float8Options
from tests.gpu.gpt_step import BATCH, SEQ, small_gpt
from tests.unit.test_float8 import torchao_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available()
                       or torch.cuda.get_device_capability() < MIN_CAPABILITY,
                       reason="float8 GEMMs need compute capability >= 8.9"),
]
pytest.importorskip("torchao")

TOKENS, HIDDEN, FFN = 8192, 2048, 5632
KINDS = [("QKV", HIDDEN, 3072), ("proj", HIDDEN, HIDDEN), ("FC1", HIDDEN, 2 * FFN)]
RECIPES = [("hybrid", "tensorwise"), ("e4m3", "rowwise")]


def sqnr_db(got, want) -> float:
    want = want.double()
    return float(10 * torch.log10(want.pow(2).sum() / (got.double() - want).pow(2).sum()))


def _randn(*shape, seed, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()


def _param(t):
    p = torch.nn.Parameter(t)
    p.main_grad = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
    p.grad_added_to_main_grad = False
    return p


def _gemms(fmt, recipe, emulate=False):
    return Float8Gemms(Float8Options(fmt, recipe, "all", emulate=emulate))


@pytest.mark.parametrize("fmt,recipe", RECIPES)
def test_each_linear_kind_in_real_float8(fmt, recipe):
    gemms = _gemms(fmt, recipe)
    for i, (kind, n_in, n_out) in enumerate(KINDS):
        x = _randn(TOKENS, n_in, seed=3 * i).requires_grad_(True)
        w = _param(_randn(n_out, n_in, seed=3 * i + 1, scale=0.02))
        dy = _randn(TOKENS, n_out, seed=3 * i + 2)
        y = linear_wgrad.linear(x, w, None, False, False, None, gemms=gemms)
        y.backward(dy)
        xd, wd, dyd = x.detach().double(), w.detach().double(), dy.double()
        for name, got, want in (("output", y, xd @ wd.t()), ("input grad", x.grad, dyd @ wd),
                                ("weight grad", w.main_grad, dyd.t() @ xd)):
            db = sqnr_db(got, want)
            assert 20 < db < 60, f"{kind} {fmt} {recipe} {name}: {db:.1f} dB"


@pytest.mark.parametrize("fmt,recipe", RECIPES)
def test_fc2_with_swiglu_inside_in_real_float8(fmt, recipe):
    x = _randn(TOKENS, 2 * FFN, seed=20).requires_grad_(True)
    w = _param(_randn(HIDDEN, FFN, seed=21, scale=0.02))
    dy = _randn(TOKENS, HIDDEN, seed=22)
    y = linear_wgrad.swiglu_linear(x, w, gemms=_gemms(fmt, recipe))
    y.backward(dy)
    xr = x.detach().double().requires_grad_(True)
    act = F.silu(xr[:, :FFN]) * xr[:, FFN:]
    ref = act @ w.detach().double().t()
    ref.backward(dy.double())
    wgrad = dy.double().t() @ act.detach()
    for name, got, want in (("output", y, ref), ("input grad", x.grad, xr.grad),
                            ("weight grad", w.main_grad, wgrad)):
        db = sqnr_db(got, want)
        assert 20 < db < 60, f"FC2+SwiGLU {fmt} {recipe} {name}: {db:.1f} dB"


@pytest.mark.parametrize("fmt,recipe", RECIPES)
def test_weight_gradient_written_into_main_grad_equals_the_added_one(fmt, recipe):
    """The step's first float8 weight gradient goes into ``main_grad`` as the GEMM's own
    output (tensorwise: ``torch._scaled_mm(out=...)``; rowwise: copied in); it equals the
    returned product bit for bit, and the next micro-batch's is added to it."""
    gemms = _gemms(fmt, recipe)
    w = _param(_randn(3072, HIDDEN, seed=40, scale=0.02))
    w.main_grad.fill_(float("nan"))
    grads = []
    for i in range(2):
        x = _randn(TOKENS, HIDDEN, seed=41 + 2 * i).requires_grad_(True)
        dy = _randn(TOKENS, 3072, seed=42 + 2 * i)
        linear_wgrad.linear(x, w, None, False, False, None, gemms=gemms).backward(dy)
        grads.append(gemms.grad_weight(dy, x.detach(), torch.float32))
        if i == 0:
            assert torch.equal(w.main_grad, grads[0])
    assert torch.equal(w.main_grad, grads[0] + grads[1])


@pytest.mark.parametrize("fmt,recipe", RECIPES)
def test_real_gemms_match_torchaos_emulation(fmt, recipe):
    x, w = _randn(TOKENS, HIDDEN, seed=30), _randn(3072, HIDDEN, seed=31, scale=0.02)
    dy = _randn(TOKENS, 3072, seed=32)
    real, emulated = _gemms(fmt, recipe), _gemms(fmt, recipe, emulate=True)
    for name, call in (("output", lambda g: g.output(x, w)),
                       ("input grad", lambda g: g.grad_input(dy, w)),
                       ("weight grad", lambda g: g.grad_weight(dy, x, torch.float32))):
        db = sqnr_db(call(real), call(emulated))
        assert db > 30, f"{fmt} {recipe} {name}: real vs emulated {db:.1f} dB"


@pytest.mark.parametrize("fmt,recipe", RECIPES)
def test_output_layer_in_real_float8(fmt, recipe):
    """The fused output-layer loss with its GEMMs in real float8 (``--fp8-output-layer``),
    a 32K vocabulary over three chunks of 4K tokens (the later chunks' weight gradients added
    in blocks): losses, hidden-state and weight gradients within 20-60 dB of float64's, and
    the chunk's peak memory no higher than the bf16 loss's."""
    from megatron.training.model.fused_loss import fused_linear_cross_entropy

    seq, hidden, vocab = 3 * 4096, HIDDEN, 32768
    h = _randn(seq, 1, hidden, seed=50)
    w = _randn(vocab, hidden, seed=51, scale=0.02)
    labels = torch.randint(0, vocab, (1, seq), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(52))
    weights = torch.ones(1, seq, device="cuda")

    def run(h_, w_, gemms):
        h_, w_ = h_.detach().requires_grad_(True), w_.detach().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fused_linear_cross_entropy(h_, w_, labels, chunk_tokens=4096,
                                          loss_weights=weights, gemms=gemms)
        loss.sum().backward()
        torch.cuda.synchronize()
        return loss.detach(), h_.grad, w_.grad, torch.cuda.max_memory_allocated() - base

    want = run(h.double(), w.double(), None)
    _, _, _, bf16_peak = run(h, w, None)
    got = run(h, w, _gemms(fmt, recipe))
    for name, g, ref in zip(("loss", "hidden grad", "weight grad"), got, want):
        db = sqnr_db(g, ref)
        assert 20 < db < 60, f"{fmt} {recipe} output layer {name}: {db:.1f} dB"
    assert got[3] <= bf16_peak, (got[3], bf16_peak)


def _train(float8: str, steps: int = 4):
    """Losses of ``steps`` AdamW steps of the 2-layer bf16 GPT of tests/gpu/gpt_step.py,
    with its linears in float8 (``float8``: ``all`` or ``auto``) or not (``off``); and the
    start-up report."""
    from megatron.layers.float8_policy import apply_float8  # megatron-core on first use
    from megatron.training.model.layer_specs import (
        LayerSpecOptions,  # megatron-core on first use
    )

    options = LayerSpecOptions(fused_kernels="usp", lean_norms=True, lean_swiglu=True,
                               float8_linears=float8 != "off")
    with small_gpt(True, options) as (model, (tokens_, labels, positions)):
        report = []
        if float8 != "off":
            tokens = {k: SEQ * BATCH for k in ("QKV", "proj", "FC1", "FC2")}
            report = apply_float8([model], Float8Options(linears=float8), tokens,
                                  torch.device("cuda"), torch.bfloat16, None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(steps):
            loss = model(tokens_, positions, None, labels=labels).float().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        return losses, report


def test_gpt_trains_with_float8_linears():
    import torch._dynamo

    ref, _ = _train("off", steps=1)
    torch._dynamo.utils.counters.clear()
    losses, report = _train("all")
    # the casts compiled (static shapes, a graph per shape and kind) and none ran eagerly
    frames = dict(torch._dynamo.utils.counters["frames"])
    assert frames.get("total", 0) >= 5 and frames.get("ok") == frames["total"], frames
    assert all(math.isfinite(v) for v in losses), losses
    assert abs(losses[0] - ref[0]) / ref[0] < 0.02, (losses[0], ref[0])
    assert losses[-1] < losses[0], losses
    assert report[0].startswith("fp8 (tensorwise hybrid, --fp8-linears all): 4 of 4"), report
    _, auto = _train("auto", steps=1)
    assert all("high " in line and "float8 " in line for line in auto[1:]), auto


@pytest.mark.parametrize("fmt,recipe", RECIPES)
def test_compiled_gemms_are_torchaos_float8_linear(fmt, recipe):
    """On CUDA the casts run as one compiled function; each GEMM gives what torchao's own float8
    linear (eager casts, its float8 mm) gives on the same bf16 operands. torchao's weight
    gradient leaves in bf16, ours in float32, so that one agrees to bf16's rounding."""
    x, w = _randn(TOKENS, HIDDEN, seed=40), _randn(3072, HIDDEN, seed=41, scale=0.02)
    dy = _randn(TOKENS, 3072, seed=42)
    gemms = _gemms(fmt, recipe)
    want = torchao_linear(gemms.options, x, w, dy)
    got = (gemms.output(x, w), gemms.grad_input(dy, w), gemms.grad_weight(dy, x, torch.float32))
    for name, g, ref, floor in zip(("output", "input grad", "weight grad"), got, want,
                                   (60, 60, 45)):
        db = sqnr_db(g, ref)
        assert db > floor, f"{fmt} {recipe} {name}: compiled vs torchao {db:.1f} dB"
