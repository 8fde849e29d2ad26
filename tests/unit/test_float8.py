"""Float8 linear layers (torchao emulation on the CPU): the flags' checks, the recipe's dtypes,
the per-shape choice from injected timings, and the SQNR of every linear kind's output, input
gradient and weight gradient (into ``main_grad``) against float64.

SQNR floor 20 dB: one e4m3 rounding (3 mantissa bits) of both operands gives about 28 dB on
Gaussian data and e5m2 gradients (2 bits) about 24 dB; a GEMM that left float8 out gives
> 60 dB, which the tests also refuse, so they fail if float8 is silently skipped.
"""

from __future__ import annotations

import argparse
import shutil

import pytest
import torch

from megatron.layers import linear_wgrad
from megatron.layers.float8_gemms import Float8Gemms, float8_linear_config
from megatron.layers.float8_options import (
    Float8Options,
    device_problem,
    recipe_problem,
)
from megatron.layers.float8_policy import (
    LinearShape,
    Timing,
    choose_float8,
    float8_eligible,
    keep_host_ahead,
    report_lines,
)
from megatron.training.cli.errors import ArgumentsError
from megatron.training.cli.fp8_args import fp8_options
from megatron.training.model import fused_loss
from megatron.training.model.fused_loss import fused_linear_cross_entropy

pytest.importorskip("torchao")

SQNR_FLOOR_DB = 20.0
SQNR_CEILING_DB = 60.0   # above this the GEMM was not rounded to float8
RECIPES = [("hybrid", "tensorwise"), ("e4m3", "tensorwise"), ("e4m3", "rowwise")]


def sqnr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    noise = (got.double() - want).pow(2).sum()
    return float(10 * torch.log10(want.pow(2).sum() / noise))


def _emulated(fmt: str, recipe: str) -> Float8Options:
    return Float8Options(format=fmt, recipe=recipe, linears="all", emulate=True)


# --------------------------------------------------------------------------- flags
@pytest.mark.parametrize("recipe", ["delayed", "mxfp8", "blockwise"])
def test_transformer_engine_recipes_are_refused_naming_the_valid_ones(recipe):
    msg = recipe_problem("hybrid", recipe)
    assert msg.startswith(f"--fp8-recipe {recipe}") and "tensorwise or rowwise" in msg


def test_rowwise_needs_e4m3_and_the_supported_pairs_pass():
    assert "--fp8-format e4m3" in recipe_problem("hybrid", "rowwise")
    for fmt, recipe in RECIPES:
        assert recipe_problem(fmt, recipe) is None


def test_device_problems_name_the_cause():
    assert "pip install torchao" in device_problem("cuda", (9, 0), False, torchao_ok=False)
    assert "pip install torchao" in device_problem("cpu", None, True, torchao_ok=False)
    assert "--fp8-emulate" in device_problem("cpu", None, False, torchao_ok=True)
    assert "8.0" in device_problem("cuda", (8, 0), False, torchao_ok=True)
    assert device_problem("cuda", (8, 9), False, torchao_ok=True) is None
    assert device_problem("cuda", (9, 0), False, torchao_ok=True) is None
    assert device_problem("cpu", None, True, torchao_ok=True) is None


def _flags(**kw):
    base = dict(fp8_format=None, fp8_recipe=None, fp8_linears=None, fp8_emulate=False,
                fp8_output_layer=False, fused_linear_cross_entropy=False,
                use_megatron_fsdp=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_fp8_options_from_flags():
    assert fp8_options(_flags(), "cpu", None) is None
    got = fp8_options(_flags(fp8_format="hybrid", fp8_emulate=True), "cpu", None)
    assert got == Float8Options("hybrid", "tensorwise", "auto", True)
    got = fp8_options(_flags(fp8_format="e4m3", fp8_recipe="rowwise", fp8_linears="all"),
                      "cuda", (9, 0))
    assert (got.recipe, got.linears, got.emulate) == ("rowwise", "all", False)
    with pytest.raises(ArgumentsError, match="--fp8-linears needs --fp8-format"):
        fp8_options(_flags(fp8_linears="all"), "cpu", None)
    with pytest.raises(ArgumentsError, match="--fp8-recipe delayed"):
        fp8_options(_flags(fp8_format="hybrid", fp8_recipe="delayed"), "cuda", (9, 0))
    with pytest.raises(ArgumentsError, match="compute capability"):
        fp8_options(_flags(fp8_format="hybrid"), "cuda", (8, 6))


def test_the_output_layer_flag_needs_float8_and_the_fused_loss():
    with pytest.raises(ArgumentsError, match="^--fp8-output-layer needs --fp8-format; add"):
        fp8_options(_flags(fp8_output_layer=True, fused_linear_cross_entropy=True), "cpu", None)
    with pytest.raises(ArgumentsError, match="add --fused-linear-cross-entropy"):
        fp8_options(_flags(fp8_format="hybrid", fp8_emulate=True, fp8_output_layer=True),
                    "cpu", None)
    got = fp8_options(_flags(fp8_format="hybrid", fp8_emulate=True, fp8_output_layer=True,
                             fused_linear_cross_entropy=True), "cpu", None)
    assert got.output_layer
    assert not fp8_options(_flags(fp8_format="hybrid", fp8_emulate=True), "cpu",
                           None).output_layer


def test_recipe_dtypes():
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    hybrid = float8_linear_config(_emulated("hybrid", "tensorwise"))
    assert (hybrid.cast_config_input.target_dtype, hybrid.cast_config_weight.target_dtype,
            hybrid.cast_config_grad_output.target_dtype,
            hybrid.cast_config_grad_output_for_grad_weight.target_dtype) == (e4m3, e4m3, e5m2,
                                                                             e5m2)
    assert hybrid.emulate
    plain = float8_linear_config(_emulated("e4m3", "tensorwise"))
    assert plain.cast_config_grad_output.target_dtype == e4m3
    assert plain.cast_config_grad_output_for_grad_weight.target_dtype == e4m3
    rowwise = float8_linear_config(_emulated("e4m3", "rowwise"))
    assert rowwise.cast_config_input.scaling_granularity.value == "axiswise"


# --------------------------------------------------------------------------- choice
def test_choice_keeps_float8_only_where_faster_by_the_margin():
    opts = Float8Options("hybrid", "tensorwise", "auto", emulate=False, margin=0.05)
    wins, marginal, loses = (LinearShape(4096, 1024, 3072), LinearShape(4096, 1024, 1024),
                             LinearShape(512, 256, 256))
    odd = LinearShape(4095, 1024, 1024)
    timings = {wins: Timing(1.0, 0.6), marginal: Timing(1.0, 0.97), loses: Timing(1.0, 1.3)}
    got = choose_float8([wins, marginal, loses, odd], opts, timings)
    assert got == {wins: True, marginal: False, loses: False, odd: False}
    forced = choose_float8([wins, loses, odd], Float8Options(linears="all"))
    assert forced == {wins: True, loses: True, odd: False}
    assert float8_eligible(odd, emulate=True)


def test_choice_is_made_on_device_time_when_the_host_keeps_ahead():
    """A shape whose float8 calls cost the host more than the GPU still runs in float8 when
    the layer's linears together keep the GPU the slower side (the host's time hides)."""
    opts = Float8Options(linears="auto", margin=0.05)
    qkv, fc1 = LinearShape(8192, 4096, 6144), LinearShape(8192, 4096, 28672)
    timings = {qkv: Timing(1.53e-3, 1.25e-3, 0.21e-3, 1.27e-3),   # host > device alone
               fc1: Timing(7.55e-3, 5.08e-3, 0.29e-3, 1.43e-3)}
    assert choose_float8([qkv, fc1], opts, timings) == {qkv: True, fc1: True}


def test_float8_is_given_back_where_the_host_would_fall_behind():
    """Small shapes: float8 wins on the GPU but its host cost exceeds what the layer's GPU
    work hides; float8 goes back first where it saves the least GPU time per host time."""
    opts = Float8Options(linears="auto", margin=0.05)
    a, b = LinearShape(1024, 512, 512), LinearShape(1024, 512, 2048)
    timings = {a: Timing(0.30e-3, 0.20e-3, 0.2e-3, 1.2e-3),    # saves 0.1 ms for 1.0 ms host
               b: Timing(1.00e-3, 0.60e-3, 0.2e-3, 1.0e-3)}    # saves 0.4 ms for 0.8 ms host
    # both in float8: host 2.2 ms > device 0.8 ms; without a: host 1.2 > device 0.9; neither
    assert choose_float8([a, b], opts, timings) == {a: False, b: False}
    roomy = {a: timings[a], b: Timing(3.0e-3, 1.5e-3, 0.2e-3, 1.0e-3)}
    # both: host 2.2 > device 1.7; without a (0.1 ms per ms of host, b: 1.9): 1.2 <= 1.8
    assert choose_float8([a, b], opts, roomy) == {a: False, b: True}
    assert keep_host_ahead({a: True}, {a: Timing(1e-3, 5e-4)}) == {a: True}  # host unmeasured


def test_report_names_each_kind_and_its_timing():
    opts = Float8Options(linears="auto")
    qkv, fc2 = LinearShape(4096, 1024, 3072), LinearShape(4096, 2816, 1024)
    lines = report_lines([("QKV", qkv), ("FC2", fc2)], {qkv: True, fc2: False},
                         {qkv: Timing(1e-3, 6e-4, 2e-4, 9e-4), fc2: Timing(1e-3, 2e-3)}, opts)
    assert lines[0].startswith("fp8 (tensorwise hybrid, --fp8-linears auto): 1 of 2")
    assert "QKV" in lines[1] and ("float8 (high 1.000 ms, float8 0.600 ms; host 0.200 / "
                                  "0.900 ms)") in lines[1]
    assert "FC2" in lines[2] and "high precision" in lines[2]


# --------------------------------------------------------------------------- numerics
def _reference_grads(x, weight, dy):
    xd, wd, dyd = x.double(), weight.double(), dy.double()
    return xd @ wd.t(), dyd @ wd, dyd.reshape(-1, dyd.shape[-1]).t() @ xd.reshape(
        -1, xd.shape[-1])


def _param(t):
    p = torch.nn.Parameter(t)
    p.main_grad = torch.zeros(t.shape, dtype=torch.float32)
    p.grad_added_to_main_grad = False
    return p


def _assert_sqnr(pairs, what):
    for name, got, want in pairs:
        db = sqnr_db(got, want)
        assert SQNR_FLOOR_DB < db < SQNR_CEILING_DB, f"{what} {name}: {db:.1f} dB"


# (kind, in, out): this project's QKV, projection, FC1 and FC2 shapes of a small layer
KINDS = [("QKV", 64, 96), ("proj", 64, 64), ("FC1", 64, 256), ("FC2", 128, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,recipe", RECIPES)
def test_every_linear_kind_in_float8_within_20_db(fmt, recipe, dtype):
    gemms = Float8Gemms(_emulated(fmt, recipe))
    gen = torch.Generator().manual_seed(3)
    for kind, n_in, n_out in KINDS:
        x = torch.randn(16, 2, n_in, generator=gen).to(dtype).requires_grad_(True)
        weight = _param((torch.randn(n_out, n_in, generator=gen) * 0.05).to(dtype))
        dy = torch.randn(16, 2, n_out, generator=gen).to(dtype)
        y = linear_wgrad.linear(x, weight, None, False, False, None, gemms=gemms)
        y.backward(dy)
        assert weight.grad_added_to_main_grad and y.dtype == dtype
        want = _reference_grads(x.detach(), weight.detach(), dy)
        _assert_sqnr([("output", y, want[0]), ("input grad", x.grad, want[1]),
                      ("weight grad", weight.main_grad, want[2])], f"{kind} {fmt} {recipe}")


@pytest.mark.parametrize("fmt,recipe", RECIPES)
def test_fc2_with_swiglu_inside_in_float8_within_20_db(fmt, recipe):
    gemms = Float8Gemms(_emulated(fmt, recipe))
    gen = torch.Generator().manual_seed(5)
    ffn, hidden = 64, 48
    x = torch.randn(16, 2, 2 * ffn, generator=gen, requires_grad=True)
    weight = _param(torch.randn(hidden, ffn, generator=gen) * 0.05)
    dy = torch.randn(16, 2, hidden, generator=gen)
    y = linear_wgrad.swiglu_linear(x, weight, fuse_wgrad=True, gemms=gemms)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_(True)
    gate, up = x64.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    want = act @ weight.detach().double().t()
    want.backward(dy.double())
    wgrad = dy.double().reshape(-1, hidden).t() @ act.detach().reshape(-1, ffn)
    _assert_sqnr([("output", y, want), ("input grad", x.grad, x64.grad),
                  ("weight grad", weight.main_grad, wgrad)], f"FC2+SwiGLU {fmt} {recipe}")


def test_weight_gradient_accumulates_in_float32():
    """Two micro-batches add into one float32 main_grad; the float8 GEMM's float32 output is
    added, never rounded to bf16 on the way (bf16 operands)."""
    gemms = Float8Gemms(_emulated("hybrid", "tensorwise"))
    gen = torch.Generator().manual_seed(9)
    weight = _param((torch.randn(32, 64, generator=gen) * 0.05).to(torch.bfloat16))
    total = torch.zeros(32, 64, dtype=torch.float64)
    for _ in range(2):
        x = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
        dy = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
        linear_wgrad.linear(x, weight, None, False, False, None, gemms=gemms).backward(dy)
        total += dy.double().t() @ x.double()
        single = gemms.grad_weight(dy, x, torch.float32)
        assert single.dtype == torch.float32
        # not a bf16 value: the float32 output keeps bits bf16 would drop
        assert not torch.equal(single, single.to(torch.bfloat16).float())
    assert weight.main_grad.dtype == torch.float32
    assert sqnr_db(weight.main_grad, total) > SQNR_FLOOR_DB


@pytest.mark.parametrize("fmt,recipe", RECIPES)
def test_the_first_weight_gradient_is_written_into_main_grad_then_added(fmt, recipe):
    """While ``grad_added_to_main_grad`` is False (DDP zeroed ``main_grad``), the float8
    weight gradient is written there (as ``out``, no temporary); afterwards it is added. Both
    give what the GEMM returns on its own: the first micro-batch's gradient exactly, the
    second's sum as ``add_`` makes it."""
    gemms = Float8Gemms(_emulated(fmt, recipe))
    gen = torch.Generator().manual_seed(17)
    weight = _param((torch.randn(32, 64, generator=gen) * 0.05).to(torch.bfloat16))
    weight.main_grad.fill_(float("nan"))      # written, not added to: nothing of this survives
    grads = []
    for _ in range(2):
        x = torch.randn(48, 64, generator=gen).to(torch.bfloat16)
        dy = torch.randn(48, 32, generator=gen).to(torch.bfloat16)
        linear_wgrad.linear(x, weight, None, False, False, None, gemms=gemms).backward(dy)
        grads.append(gemms.grad_weight(dy, x, torch.float32))
        if len(grads) == 1:
            assert weight.grad_added_to_main_grad
            assert torch.equal(weight.main_grad, grads[0])
    assert torch.equal(weight.main_grad, grads[0] + grads[1])


def test_scaled_mm_into_out_is_the_product():
    """``scaled_mm(..., out=t)`` fills ``t`` with the product it would return (emulated on
    the CPU; the real GEMM's direct write is checked on a GPU)."""
    gemms = Float8Gemms(_emulated("hybrid", "tensorwise"))
    gen = torch.Generator().manual_seed(19)
    dy, x = torch.randn(40, 24, generator=gen), torch.randn(40, 16, generator=gen)
    want = gemms.grad_weight(dy, x, torch.float32)
    out = torch.full((24, 16), 7.0)
    got = gemms.grad_weight(dy, x, torch.float32, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, want)


def test_without_wgrad_fusion_the_weight_gradient_is_returned():
    """``--no-gradient-accumulation-fusion``: the float8 weight gradient comes back as the
    weight's ``.grad`` (its dtype) and ``main_grad`` is left to DDP's hook."""
    gemms = Float8Gemms(_emulated("hybrid", "tensorwise"))
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(32, 64, generator=gen, requires_grad=True)
    weight = _param(torch.randn(48, 64, generator=gen) * 0.05)
    dy = torch.randn(32, 48, generator=gen)
    linear_wgrad.linear(x, weight, None, False, False, None, fuse_wgrad=False,
                        gemms=gemms).backward(dy)
    assert not weight.grad_added_to_main_grad and not weight.main_grad.any()
    _assert_sqnr([("weight grad", weight.grad, dy.double().t() @ x.detach().double())],
                 "unfused")


def test_layer_spec_gives_the_four_linears_our_classes_for_float8():
    """``float8_linears`` without ``fuse_wgrad``: QKV, projection, FC1 and FC2 are this
    project's linear classes (which can run in float8), their gradients returned."""
    from megatron.layers.fused_linears import _WgradIntoMainGrad  # megatron-core on first use
    from megatron.training.model.layer_specs import (  # megatron-core on first use
        LayerSpecOptions,
        get_usp_gpt_layer_spec,
    )

    for lean in (False, True):
        layer = get_usp_gpt_layer_spec(LayerSpecOptions(
            float8_linears=True, lean_norms=lean, lean_swiglu=lean)).submodules
        attn, mlp = layer.self_attention.submodules, layer.mlp.submodules
        for slot in (attn.linear_qkv, attn.linear_proj, mlp.linear_fc1, mlp.linear_fc2):
            assert issubclass(slot.module, _WgradIntoMainGrad), slot
            assert slot.params["fuse_wgrad"] is False, slot
    qkv = get_usp_gpt_layer_spec(LayerSpecOptions()).submodules.self_attention.submodules \
        .linear_qkv          # without float8 or fusion: megatron-core's own class
    assert not issubclass(getattr(qkv, "module", qkv), _WgradIntoMainGrad), qkv


# --------------------------------------------------------------------------- against torchao
def torchao_linear(options: Float8Options, x: torch.Tensor, weight: torch.Tensor,
                   dy: torch.Tensor):
    """Output, input gradient and weight gradient of ``x @ weight.T`` through torchao's own
    float8 linear (``matmul_with_hp_or_float8_args``, its casts and its float8 ``mm``): the
    reference for :class:`Float8Gemms`."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args  # optional
    from torchao.float8.float8_training_tensor import (  # optional: torchao
        LinearMMConfig,
        ScaledMMConfig,
    )

    config = float8_linear_config(options)
    mm_config = LinearMMConfig(*(
        ScaledMMConfig(config.emulate, g.use_fast_accum, False, config.pad_inner_dim)
        for g in (config.gemm_config_output, config.gemm_config_grad_input,
                  config.gemm_config_grad_weight)))
    x = x.detach().requires_grad_(True)
    weight_t = weight.detach().t().requires_grad_(True)
    y = matmul_with_hp_or_float8_args.apply(x, weight_t, mm_config, config)
    y.backward(dy)
    return y.detach(), x.grad, weight_t.grad.t()


@pytest.mark.parametrize("fmt,recipe", RECIPES)
def test_each_gemm_is_torchaos_float8_linear(fmt, recipe):
    """The three GEMMs (one function of plain tensors, compiled on CUDA) compute what
    torchao's float8 linear computes from the same operands: same casts, same layouts'
    values, same scales (float32 operands, so every output is float32 on both sides)."""
    options = _emulated(fmt, recipe)
    gemms = Float8Gemms(options)
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(48, 80, generator=gen) * 7
    x[3, 5] = 1e4                                       # an outlier sets a row's scale
    weight = torch.randn(64, 80, generator=gen) * 0.05
    dy = torch.randn(48, 64, generator=gen)
    want = torchao_linear(options, x, weight, dy)
    got = (gemms.output(x, weight), gemms.grad_input(dy, weight),
           gemms.grad_weight(dy, x, torch.float32))
    for name, g, w in zip(("output", "input grad", "weight grad"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=name)


def test_the_cast_function_compiles_on_cuda_only():
    from megatron.layers import float8_gemms

    assert float8_gemms._cast_function(torch.device("cpu")) is float8_gemms.float8_operands
    compiled = float8_gemms._cast_function(torch.device("cuda", 0))
    assert compiled is not float8_gemms.float8_operands
    assert float8_gemms._cast_function(torch.device("cuda", 1)) is compiled    # once
    # torchao's guard against the Triton float8 store miscompile is on before it compiles
    patch = pytest.importorskip("torchao.float8._inductor_patch")
    assert patch._PATCHED


def test_a_tensorwise_output_gradient_is_cast_once_for_both_backward_gemms(monkeypatch):
    """Tensorwise: one amax and one scaled cast of the output gradient serve the input- and
    the weight-gradient GEMM (their layouts differ, their values and scale do not); rowwise
    scales them along different axes: two casts."""
    from megatron.layers import float8_gemms

    real = float8_gemms.scaled_float8_bits
    for recipe, fmt, want in (("tensorwise", "e4m3", 1), ("tensorwise", "hybrid", 1),
                              ("rowwise", "e4m3", 2)):
        calls = []
        monkeypatch.setattr(float8_gemms, "scaled_float8_bits",
                            lambda *a, seen=calls, **k: seen.append(a[1]) or real(*a, **k))
        gemms = Float8Gemms(_emulated(fmt, recipe))
        grad = gemms.cast_grad(torch.randn(32, 16))
        assert len(calls) == want, (recipe, fmt, calls)
        gi_bits, gi_scale = grad.for_grad_input
        gw_bits, gw_scale = grad.for_grad_weight
        assert gi_bits.shape == (32, 16) and gi_bits.is_contiguous()
        assert gw_bits.shape == (16, 32) and gw_bits.is_contiguous()      # [out, n] row-major
        if want == 1:
            assert torch.equal(gw_bits.view(torch.uint8), gi_bits.t().view(torch.uint8))
            assert torch.equal(gw_scale, gi_scale)
        gemms.grad_input(grad, torch.randn(16, 8) * 0.1)
        assert grad.for_grad_input is None                     # released once used


@pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "g++", "clang")),
                    reason="torch.compile on the CPU needs a C compiler")
@pytest.mark.parametrize("fmt,recipe", [("hybrid", "tensorwise"), ("e4m3", "rowwise")])
def test_the_compiled_casts_are_the_eager_ones(fmt, recipe, monkeypatch):
    """The three GEMMs with the cast function compiled (what CUDA runs; here compiled for the
    CPU, emulated) on two shapes give the eager casts' values."""
    from megatron.layers import float8_gemms

    gemms = Float8Gemms(_emulated(fmt, recipe))
    compiled = float8_gemms.compiled_casts()
    gen = torch.Generator().manual_seed(23)
    for n, n_in, n_out in ((64, 32, 48), (96, 48, 32)):
        x = torch.randn(n, n_in, generator=gen).bfloat16()
        w = (torch.randn(n_out, n_in, generator=gen) * 0.05).bfloat16()
        dy = torch.randn(n, n_out, generator=gen).bfloat16()
        results = []
        for cast in (float8_gemms.float8_operands, compiled):
            monkeypatch.setattr(float8_gemms, "_cast_function", lambda device, f=cast: f)
            results.append((gemms.output(x, w), gemms.grad_input(dy, w),
                            gemms.grad_weight(dy, x, torch.float32)))
        for name, want, got in zip(("output", "grad_input", "grad_weight"), *results):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                       msg=f"{name} {n}x{n_in}->{n_out}")


@pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "g++", "clang")),
                    reason="torch.compile on the CPU needs a C compiler")
def test_the_compiled_cast_is_the_eager_one_bit_for_bit():
    """The compiled function (what CUDA runs), here compiled for the CPU, on two shapes of one
    graph (dynamic shapes) and both granularities."""
    from torchao.float8.config import ScalingGranularity  # optional: torchao

    from megatron.layers.float8_gemms import scaled_float8_bits

    compiled = torch.compile(scaled_float8_bits, dynamic=True)
    for shape in ((64, 32), (96, 48)):
        t = torch.randn(*shape, dtype=torch.bfloat16) * 3
        for granularity, axis, pow2 in ((ScalingGranularity.TENSORWISE, None, False),
                                        (ScalingGranularity.AXISWISE, -1, True)):
            for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                got = compiled(t, dtype, granularity, axis, pow2)
                want = scaled_float8_bits(t, dtype, granularity, axis, pow2)
                assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
                assert torch.equal(got[1], want[1])


@pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "g++", "clang")),
                    reason="torch.compile on the CPU needs a C compiler")
def test_one_compiled_graph_per_shape_and_call_site(monkeypatch):
    """Through a linear layer's forward and backward, with and without the input's gradient
    and on two shapes, the compiled cast function builds one graph per tensor shapes and call
    site (a linear: the forward's input and weight, the backward's output gradient in both
    layouts with the weight and the input: two per shape) and never falls back to eager: the
    tensors' autograd flags never multiply the graphs, and a model's shapes stay below the
    recompile limit (dynamo's default, 8, would run every cast past the eighth graph
    eagerly)."""
    import torch._dynamo

    from megatron.layers import float8_gemms

    torch._dynamo.reset()
    compiled = float8_gemms.compiled_casts()
    monkeypatch.setattr(float8_gemms, "_cast_function", lambda device: compiled)
    torch._dynamo.utils.counters.clear()
    gemms = Float8Gemms(_emulated("hybrid", "tensorwise"))
    gen = torch.Generator().manual_seed(29)
    for n, n_in, n_out in ((64, 32, 48), (96, 48, 64)):
        for input_grad in (True, False):
            x = torch.randn(n, n_in, generator=gen).bfloat16().requires_grad_(input_grad)
            weight = _param((torch.randn(n_out, n_in, generator=gen) * 0.05).bfloat16())
            dy = torch.randn(n, n_out, generator=gen).bfloat16()
            linear_wgrad.linear(x, weight, None, False, False, None, gemms=gemms).backward(dy)
            assert weight.grad_added_to_main_grad
    stats = dict(torch._dynamo.utils.counters["stats"])
    assert stats["unique_graphs"] == 4, stats
    assert not torch._dynamo.utils.counters["frames"].get("recompile_limit"), \
        dict(torch._dynamo.utils.counters["frames"])
    torch._dynamo.reset()


def test_the_casts_take_few_calls(monkeypatch):
    """Each call of the cast function costs the host a compiled call: a linear layer makes
    two per forward and backward (the forward's operands; the backward's output gradient,
    weight and input), FC2 with its SwiGLU three (its input, the SwiGLU output, is rebuilt
    between the backward's GEMMs), and the values are the ones each GEMM's own casts give."""
    from megatron.layers import float8_gemms

    calls = []

    def counting(tensors, uses):
        calls.append(len(tensors))
        return float8_gemms.float8_operands(tensors, uses)

    monkeypatch.setattr(float8_gemms, "_cast_function", lambda device: counting)
    gemms = Float8Gemms(_emulated("hybrid", "tensorwise"))
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(64, 32, generator=gen, requires_grad=True)
    weight = _param(torch.randn(48, 32, generator=gen) * 0.05)
    dy = torch.randn(64, 48, generator=gen)
    linear_wgrad.linear(x, weight, None, False, False, None, gemms=gemms).backward(dy)
    assert calls == [2, 3]
    torch.testing.assert_close(x.grad, gemms.grad_input(dy, weight), rtol=0, atol=0)
    torch.testing.assert_close(weight.main_grad, gemms.grad_weight(dy, x.detach(),
                                                                   torch.float32),
                               rtol=0, atol=0)
    calls.clear()
    h = torch.randn(64, 96, generator=gen, requires_grad=True)
    w2 = _param(torch.randn(32, 48, generator=gen) * 0.05)
    linear_wgrad.swiglu_linear(h, w2, gemms=gemms).backward(torch.randn(64, 32, generator=gen))
    assert calls == [2, 2, 1]


# --------------------------------------------------------------------------- output layer
def _output_layer_grads(hidden, weight, labels, loss_weights, gemms, chunk_tokens):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(h, w, labels, chunk_tokens=chunk_tokens,
                                      loss_weights=loss_weights, gemms=gemms)
    (loss * torch.linspace(0.5, 1.5, loss.numel()).view_as(loss).to(loss.dtype)).sum().backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("fmt,recipe", RECIPES)
def test_output_layer_in_float8_within_20_db(fmt, recipe, weighted, monkeypatch):
    """The fused loss with its three GEMMs in float8 (three chunks, the later chunks' weight
    gradients added in blocks of 40 vocabulary rows) against the float64 loss: the losses,
    the hidden states' and the weight's gradients within 20-60 dB, in both of the loss's
    modes (gradients computed in the forward, or recomputed in the backward)."""
    monkeypatch.setattr(fused_loss, "WGRAD_BLOCK_ROWS", 40)
    gen = torch.Generator().manual_seed(21)
    seq, batch, hidden_size, vocab = 48, 2, 64, 96
    hidden = torch.randn(seq, batch, hidden_size, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.3).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    weights = torch.ones(batch, seq) if weighted else None
    want = _output_layer_grads(hidden.double(), weight.double(), labels, weights, None, 32)
    got = _output_layer_grads(hidden, weight, labels, weights,
                              Float8Gemms(_emulated(fmt, recipe)), 32)
    assert got[2].dtype == torch.bfloat16
    _assert_sqnr(zip(("loss", "hidden grad", "weight grad"), got, want),
                 f"output layer {fmt} {recipe} weighted={weighted}")


def test_output_layer_weight_gradient_in_blocks_is_the_whole(monkeypatch):
    """Blocks of vocabulary rows add what one GEMM of all rows adds."""
    gemms = Float8Gemms(_emulated("hybrid", "tensorwise"))
    gen = torch.Generator().manual_seed(4)
    grad, rows = torch.randn(32, 96, generator=gen), torch.randn(32, 64, generator=gen)
    whole = torch.randn(96, 64, generator=gen)
    blocks = whole.clone()
    gemms.add_grad_weight(gemms.cast_grad(grad), rows, whole, written=True, block_rows=96)
    gemms.add_grad_weight(gemms.cast_grad(grad), rows, blocks, written=True, block_rows=40)
    torch.testing.assert_close(blocks, whole, rtol=1e-6, atol=1e-6)
    written = torch.full((96, 64), float("nan"))
    gemms.add_grad_weight(gemms.cast_grad(grad), rows, written, written=False, block_rows=40)
    assert torch.equal(written, gemms.grad_weight(grad, rows, torch.float32))


def test_a_chunk_scaled_mm_cannot_take_stays_in_the_weight_dtype():
    real = Float8Gemms(Float8Options(linears="all"))
    emulated = Float8Gemms(_emulated("hybrid", "tensorwise"))
    assert fused_loss.chunk_gemms(real, 8192) is real
    assert fused_loss.chunk_gemms(real, 8200) is None       # not a multiple of 16
    assert fused_loss.chunk_gemms(emulated, 8200) is emulated
    assert fused_loss.chunk_gemms(None, 8192) is None
