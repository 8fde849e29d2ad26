"""Local kernels and the out/lse merge, against plain autograd attention in float64.

Tolerances: float64 kernels agree with the float64 autograd reference to 1e-8 (absolute and
relative). The arithmetic differs only in summation order (~1e-15 typically), but one CI-like
run in the multi-threaded pytest process saw a 2e-9 deviation of the math kernel once (not
reproduced in 2 reruns; the distributed fp64 tests, single-threaded, keep 1e-10). A wrong
schedule or mask gives errors of order 1, far above either bound. The bf16 CPU check uses
the bf16 rounding of the inputs' own scale (2e-2).
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import pytest
import torch

from megatron.usp import kernels
from megatron.usp.attention import usp_attention
from megatron.usp.kernels import (
    AttentionBackendUnavailable,
    MathKernel,
    TorchKernel,
    accum_dtype,
    available_backends,
    get_kernel,
    merge_block_,
    reduce_kv_grad,
)

F64_TOL = dict(atol=1e-8, rtol=1e-8)


def new_accumulators(like_out):
    """Empty running (out, lse) for rows shaped like ``like_out`` [b, h, s, d]: 0 and -inf,
    in the accumulation dtype the ring uses for ``like_out``'s dtype."""
    acc = accum_dtype(like_out.dtype)
    out = torch.zeros(like_out.shape, dtype=acc, device=like_out.device)
    lse = torch.full(like_out.shape[:-1], float("-inf"), dtype=acc, device=like_out.device)
    return out, lse


def reference(q, k, v, causal, scale):
    """Independent attention on [b, h, s, d] with autograd-able ops (expanded KV heads)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def _inputs(b, h, hk, sq, sk, d, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def mk(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    return mk(b, h, sq, d), mk(b, hk, sk, d), mk(b, hk, sk, d), mk(b, h, sq, d)


KERNELS = [MathKernel(), TorchKernel()]
SHAPES = [  # (h, hk, d)
    (4, 4, 64),
    (8, 2, 128),
    (4, 1, 64),
]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("h,hk,d", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_kernel_matches_reference(kernel, h, hk, d, causal):
    q, k, v, dout = _inputs(2, h, hk, 24, 24, d)
    scale = 1 / math.sqrt(d)
    out, lse = kernel.forward(q, k, v, causal, scale)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(qr, kr, vr, causal, scale)
    ref_out.backward(dout)
    assert lse.dtype == torch.float64 and lse.shape == (2, h, 24)
    torch.testing.assert_close(out, ref_out.detach(), **F64_TOL)
    torch.testing.assert_close(lse, ref_lse.detach(), **F64_TOL)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, scale)
    assert dk.shape == k.shape and dv.shape == v.shape
    torch.testing.assert_close(dq, qr.grad, **F64_TOL)
    torch.testing.assert_close(dk, kr.grad, **F64_TOL)
    torch.testing.assert_close(dv, vr.grad, **F64_TOL)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_inputs_with_a_strided_last_dimension(kernel):
    """q, k, v whose head dimension is every other element of a wider tensor: the same
    results as their contiguous copies (PyTorch's CPU op alone reads them wrong)."""
    wide = [torch.randn(2, n, 24, 128, generator=torch.Generator().manual_seed(n),
                        dtype=torch.float64) for n in (8, 2, 2)]
    q, k, v = (x[..., ::2] for x in wide)
    dout = torch.randn(2, 8, 24, 64, dtype=torch.float64)
    for causal in (True, False):
        out, lse = kernel.forward(q, k, v, causal, 0.125)
        ref_out, ref_lse = kernel.forward(*(x.contiguous() for x in (q, k, v)), causal, 0.125)
        torch.testing.assert_close(out, ref_out, **F64_TOL)
        grads = kernel.backward(dout, q, k, v, out, lse, causal, 0.125)
        want = kernel.backward(dout, *(x.contiguous() for x in (q, k, v)), ref_out, ref_lse,
                               causal, 0.125)
        for got, ref in zip(grads, want):
            torch.testing.assert_close(got, ref, **F64_TOL)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_blocks_merged_by_lse_equal_whole_row(kernel):
    """Split the keys in two blocks: merged forward and per-block backward (with the global
    out/lse) reproduce attention over all keys -- the identity ring attention rests on."""
    q, k, v, dout = _inputs(2, 8, 2, 16, 40, 64, seed=1)
    scale = 0.11
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = reference(qr, kr, vr, False, scale)
    ref_out.backward(dout)

    acc_out, acc_lse = new_accumulators(q)
    parts = [(0, 13), (13, 40)]
    for lo, hi in parts:
        o, lse = kernel.forward(q, k[:, :, lo:hi], v[:, :, lo:hi], False, scale)
        merge_block_(acc_out, acc_lse, o, lse)
    torch.testing.assert_close(acc_out, ref_out.detach(), **F64_TOL)
    torch.testing.assert_close(acc_lse, ref_lse.detach(), **F64_TOL)

    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for lo, hi in parts:
        a, b, c = kernel.backward(dout, q, k[:, :, lo:hi], v[:, :, lo:hi], acc_out, acc_lse,
                                  False, scale)
        dq += a
        dk[:, :, lo:hi] += b
        dv[:, :, lo:hi] += c
    torch.testing.assert_close(dq, qr.grad, **F64_TOL)
    torch.testing.assert_close(dk, kr.grad, **F64_TOL)
    torch.testing.assert_close(dv, vr.grad, **F64_TOL)


def test_merge_fully_masked_rows_give_zeros_not_nan():
    b, h, s, d = 1, 2, 4, 3
    acc_out, acc_lse = new_accumulators(torch.zeros(b, h, s, d))
    blk_out = torch.randn(b, h, s, d)
    blk_lse = torch.randn(b, h, s)
    # Row 0: masked in every block (its block output is even NaN, as some kernels give).
    blk_out[:, :, 0] = float("nan")
    blk_lse[:, :, 0] = float("-inf")
    merge_block_(acc_out, acc_lse, blk_out, blk_lse)
    blk2_out, blk2_lse = torch.full_like(blk_out, float("nan")), torch.full_like(blk_lse, -math.inf)
    merge_block_(acc_out, acc_lse, blk2_out, blk2_lse)     # a block masked for every row
    assert not torch.isnan(acc_out).any() and not torch.isnan(acc_lse).any()
    assert torch.equal(acc_out[:, :, 0], torch.zeros(b, h, d))
    assert torch.isneginf(acc_lse[:, :, 0]).all()
    torch.testing.assert_close(acc_out[:, :, 1:], blk_out[:, :, 1:])
    torch.testing.assert_close(acc_lse[:, :, 1:], blk_lse[:, :, 1:])


def test_merge_low_precision_block_into_float32_accumulator():
    """bf16 block outputs fold into float32 accumulators (strided row views, as the ring's
    'back' rows) like the log-sum-exp formula evaluated in float64, to float32 rounding."""
    gen = torch.Generator().manual_seed(4)
    b, h, s, d = 2, 3, 8, 16
    acc_out = torch.randn(b, h, 2 * s, d, generator=gen)
    acc_lse = torch.randn(b, h, 2 * s, generator=gen)
    blk_out = torch.randn(b, h, s, d, generator=gen).bfloat16()
    blk_lse = torch.randn(b, h, s, generator=gen)
    rows = slice(s, 2 * s)
    lse0, out0 = acc_lse[:, :, rows].double(), acc_out[:, :, rows].double()
    want_lse = torch.logaddexp(lse0, blk_lse.double())
    want = (torch.exp(lse0 - want_lse).unsqueeze(-1) * out0
            + torch.exp(blk_lse.double() - want_lse).unsqueeze(-1) * blk_out.double())
    front = acc_out[:, :, :s].clone()
    merge_block_(acc_out[:, :, rows], acc_lse[:, :, rows], blk_out, blk_lse)
    assert acc_out.dtype == torch.float32
    torch.testing.assert_close(acc_out[:, :, rows].double(), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(acc_lse[:, :, rows].double(), want_lse, atol=1e-6, rtol=1e-6)
    assert torch.equal(acc_out[:, :, :s], front)        # rows outside the view untouched


def test_math_kernel_fully_masked_rows():
    """A row whose final lse is -inf (masked in every block) gets zero gradients, not NaN."""
    q, k, v, dout = _inputs(1, 2, 2, 4, 4, 8)
    kernel = MathKernel()
    out, lse = kernel.forward(q, k, v, True, 0.5)
    assert torch.isfinite(out).all()
    lse_masked = lse.clone()
    lse_masked[:, :, 0] = float("-inf")
    out_masked = out.clone()
    out_masked[:, :, 0] = 0
    dq, dk, dv = kernel.backward(dout, q, k, v, out_masked, lse_masked, True, 0.5)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert torch.equal(dq[:, :, 0], torch.zeros_like(dq[:, :, 0]))


def test_torch_kernel_bf16_close_to_fp64():
    q, k, v, dout = _inputs(2, 4, 2, 32, 32, 64, seed=3)
    kernel = TorchKernel()
    out, lse = kernel.forward(*(t.bfloat16() for t in (q, k, v)), True, 0.125)
    ref_out, ref_lse = reference(q, k, v, True, 0.125)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-2, rtol=2e-2)


def test_rectangular_causal_is_rejected():
    q, k, v, _ = _inputs(1, 2, 2, 4, 8, 8)
    for kernel in KERNELS:
        with pytest.raises(ValueError, match="square"):
            kernel.forward(q, k, v, True, 1.0)


def test_reduce_kv_grad_sums_groups():
    x = torch.arange(2 * 6 * 1 * 1, dtype=torch.float32).view(2, 6, 1, 1)
    red = reduce_kv_grad(x, 3)
    assert red.shape == (2, 2, 1, 1)
    assert red[0, 0, 0, 0].item() == 0 + 1 + 2 and red[1, 1, 0, 0].item() == 9 + 10 + 11


def test_get_kernel_names_and_errors():
    assert {"auto", "torch", "math"} <= set(available_backends())
    assert get_kernel("auto").name == "torch"          # CPU: PyTorch's CPU kernel
    assert get_kernel("math").name == "math"
    assert get_kernel("torch") is get_kernel("torch")
    with pytest.raises(ValueError, match="--attention-backend 'flashy'.*auto"):
        get_kernel("flashy")


def test_unavailable_backends_say_what_to_install():
    if importlib.util.find_spec("flash_attn") is None and importlib.util.find_spec(
        "flash_attn_interface"
    ) is None:
        with pytest.raises(AttentionBackendUnavailable, match="pip install flash-attn"):
            get_kernel("flash-attn")
    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(AttentionBackendUnavailable,
                           match=r"pip install .*transformer-engine\[pytorch\]"):
            get_kernel("te")
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here; its absence cannot be tested")


# --------------------------------------------------------------------------- optional adapters
# flash-attn and TransformerEngine need CUDA and are not installed in CI, so their adapters are
# exercised against stand-in modules with the real packages' signatures (flash-attn 2.8
# ``flash_attn.flash_attn_interface``, flash-attn 3 ``flash_attn_interface``, TE 2.x
# ``cpp_extensions.fused_attn``) and their documented shapes ([b, s, h, d]; TE softmax stats
# [b, h, s, 1]), computing with the math kernel. This checks the adapters' argument names,
# transposes and lse handling, not the packages themselves.
import importlib.machinery  # noqa: E402
import types  # noqa: E402

_EXACT = MathKernel()


def _bshd_forward(q, k, v, scale, causal):
    out, lse = _EXACT.forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              causal, scale)
    return out.transpose(1, 2).contiguous(), lse.float()


def _bshd_backward(dout, q, k, v, out, lse, scale, causal):
    grads = _EXACT.backward(dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2),
                            v.transpose(1, 2), out.transpose(1, 2), lse, causal, scale)
    return [g.transpose(1, 2) for g in grads]


def _module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__dict__.update(attrs)
    return mod


def _fa2_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                 window_size_right, softcap, alibi_slopes, return_softmax):
    assert dropout_p == 0 and window_size_left == -1 and softcap == 0 and q.stride(-1) == 1
    out, lse = _bshd_forward(q, k, v, softmax_scale, causal)
    return out, lse, torch.empty(0), torch.empty(2, dtype=torch.int64)


def _fa2_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                  causal, window_size_left, window_size_right, softcap, alibi_slopes,
                  deterministic, rng_state=None):
    assert softmax_lse.shape == q.shape[:1] + (q.shape[2], q.shape[1])
    for dst, g in zip((dq, dk, dv), _bshd_backward(dout, q, k, v, out, softmax_lse,
                                                   softmax_scale, causal)):
        dst.copy_(g)
    return torch.empty(0)


def _fa3_forward(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None,
                 cu_seqlens_k=None, cu_seqlens_k_new=None, seqused_q=None, seqused_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, page_table=None, kv_batch_idx=None,
                 leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None,
                 q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                 causal=False, window_size_left=-1, window_size_right=-1, attention_chunk=0,
                 softcap=0.0, rotary_interleaved=True, scheduler_metadata=None, num_splits=1,
                 pack_gqa=None, sm_margin=0):
    out, lse = _bshd_forward(q, k, v, softmax_scale, causal)
    return out, lse, torch.empty(0), torch.empty(0)


def _fa3_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None,
                  sequed_q=None, sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None,
                  dk=None, dv=None, softmax_scale=None, is_causal=False, window_size_left=-1,
                  window_size_right=-1, softcap=0.0, deterministic=False, sm_margin=0):
    for dst, g in zip((dq, dk, dv), _bshd_backward(dout, q, k, v, out, softmax_lse,
                                                   softmax_scale, is_causal)):
        dst.copy_(g)
    return torch.empty(0)


def _te_fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v,
            fake_dtype, fused_attention_backend, attn_bias=None, cu_seqlens_q_padded=None,
            cu_seqlens_kv_padded=None, page_table_k=None, page_table_v=None, s_quantizer=None,
            o_quantizer=None, attn_scale=None, dropout=0.0, fast_zero_fill=True,
            qkv_layout="sbh3d", attn_bias_type="no_bias", attn_mask_type="padding",
            window_size=(-1, -1), rng_gen=None):
    assert qkv_layout == "bshd_bshd_bshd" and fused_attention_backend == "F16_arbitrary"
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q[-1] == q.shape[0] * q.shape[1]
    out, lse = _bshd_forward(q, k, v, attn_scale, attn_mask_type == "causal")
    return out, [lse.unsqueeze(-1), torch.zeros(2, dtype=torch.int64)]


def _te_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, o, d_o,
            fake_dtype, dqkv_dtype, aux_ctx_tensors, fused_attention_backend,
            cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, s_quantizer=None,
            dp_quantizer=None, dqkv_quantizer=None, attn_scale=None, dropout=0.0,
            fast_zero_fill=True, qkv_layout="sbh3d", attn_bias_type="no_bias",
            attn_mask_type="padding", window_size=(-1, -1), deterministic=False):
    stats = aux_ctx_tensors[0]
    assert stats.shape == (q.shape[0], q.shape[2], q.shape[1], 1) and dqkv_dtype == "te:" + str(
        q.dtype)
    return (*_bshd_backward(d_o, q, k, v, o, stats[..., 0], attn_scale,
                            attn_mask_type == "causal"), None)


def _install_fakes(monkeypatch, which):
    mods = {}
    if which == "fa2":
        mods["flash_attn"] = _module("flash_attn", __version__="2.8.3")
        mods["flash_attn.flash_attn_interface"] = _module(
            "flash_attn.flash_attn_interface", _flash_attn_forward=_fa2_forward,
            _flash_attn_backward=_fa2_backward)
    elif which == "fa3":
        mods["flash_attn_interface"] = _module(
            "flash_attn_interface", _flash_attn_forward=_fa3_forward,
            _flash_attn_backward=_fa3_backward)
    else:
        backend_enum = types.SimpleNamespace(NVTE_F16_arbitrary_seqlen="F16_arbitrary")
        mods["transformer_engine"] = _module("transformer_engine")
        mods["transformer_engine_torch"] = _module("transformer_engine_torch",
                                                   NVTE_Fused_Attn_Backend=backend_enum)
        mods["transformer_engine.pytorch.cpp_extensions.fused_attn"] = _module(
            "fused_attn", fused_attn_fwd=_te_fwd, fused_attn_bwd=_te_bwd)
        te_dtypes = {d: "te:" + str(d) for d in (torch.float64, torch.bfloat16)}
        mods["transformer_engine.pytorch.constants"] = _module("constants", TE_DType=te_dtypes)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    if which != "fa3":   # hide an installed flash-attn 3 so that the v2 path is taken
        monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    # the adapters insist on fp16/bf16 CUDA tensors; the stand-ins compute in float64 on CPU
    monkeypatch.setattr(kernels.FlashAttnKernel, "_check", lambda self, q: None)
    monkeypatch.setattr(kernels.TEKernel, "_check", lambda self, q: None)


@pytest.mark.parametrize("which", ["fa2", "fa3", "te"])
@pytest.mark.parametrize("causal", [True, False])
def test_optional_adapters_against_stand_ins(monkeypatch, which, causal):
    _install_fakes(monkeypatch, which)
    kernel = kernels.TEKernel() if which == "te" else kernels.FlashAttnKernel()
    if which != "te":
        assert kernel.version == (3 if which == "fa3" else 2)
    q, k, v, dout = _inputs(2, 8, 2, 16, 16, 32, seed=5)
    scale = 0.2
    out, lse = kernel.forward(q, k, v, causal, scale)
    ref_out, ref_lse = reference(q, k, v, causal, scale)
    torch.testing.assert_close(out, ref_out, **F64_TOL)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)   # float32 lse
    grads = kernel.backward(dout, q, k, v, out, lse, causal, scale)
    want = _EXACT.backward(dout, q, k, v, out, lse, causal, scale)
    for got, exp in zip(grads, want):
        assert got.shape == exp.shape
        torch.testing.assert_close(got, exp, **F64_TOL)


def test_functional_path_imports_without_megatron_core():
    """Benchmarks and tools/gpu_attention_check.py use usp_attention with only torch."""
    code = (
        "import sys; sys.modules['megatron.core'] = None\n"
        "from megatron.usp.attention import usp_attention\n"
        "import megatron.usp.kernels, megatron.usp.ring_attention, megatron.usp.ulysses\n"
        "assert not any(m.startswith('megatron.core') and sys.modules[m] is not None "
        "for m in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_single_rank_usp_attention_on_sequence_major_views(batch, causal):
    """U = R = 1 runs the kernel on [b, h, s, d] views of megatron's [s, b, h, d] tensors (k, v
    strided views of one buffer): float64 out and gradients equal the reference."""
    gen = torch.Generator().manual_seed(5)
    s, h, hk, d = 32, 4, 2, 16
    q = torch.randn(s, batch, h, d, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(s, batch, hk, 2 * d, generator=gen, dtype=torch.float64,
                     requires_grad=True)
    dout = torch.randn(s, batch, h, d, generator=gen, dtype=torch.float64)
    out = usp_attention(q, kv[..., :d], kv[..., d:], ulysses_group=None, ring_group=None,
                        causal=causal)
    assert out.is_contiguous() and out.shape == q.shape
    out.backward(dout)

    def heads(x):
        return x.permute(1, 2, 0, 3)

    refs = [t.detach().clone().requires_grad_() for t in (q, kv)]
    want, _ = reference(heads(refs[0]), heads(refs[1][..., :d]), heads(refs[1][..., d:]),
                        causal, d ** -0.5)
    want.backward(heads(dout))
    torch.testing.assert_close(heads(out), want.detach(), **F64_TOL)
    torch.testing.assert_close(q.grad, refs[0].grad, **F64_TOL)
    torch.testing.assert_close(kv.grad, refs[1].grad, **F64_TOL)
