"""``tools/bench_fused_kernels.py``: the ``--fused-kernels`` implementations side by side.

For a model preset (:data:`megatron.bench.models.MODELS`) and a number of tokens ``N`` it times,
forward and backward together (median of CUDA-event timed repeats), each implementation of
:mod:`megatron.layers.fused_kernels` on the model's shapes, and measures its error against a
float64 reference computed from the same bf16 inputs:

* ``rms_norm``: ``x [N, H]``, weight ``[H]`` (trained: its gradient is timed and checked);
* ``swiglu``: FC1's output ``[N, 2F]`` -> ``[N, F]``;
* ``rope``: q ``[N, 1, a, d]`` and k ``[N, 1, g, d]`` (batch 1) with the float32 frequencies
  of positions ``0..N-1`` (RoPE base 10000), the shape megatron-core hands attention.

Implementations: ``torch``, ``compile``, ``usp`` (this project's Triton kernels,
:mod:`megatron.layers.lean_kernels` and :mod:`megatron.layers.qkv_rope`), ``liger`` (when
installed), and megatron-core's own
(``megatron``: its TorchScript ``bias_swiglu_impl`` for SwiGLU, ``apply_rotary_pos_emb`` for
RoPE; for RMSNorm megatron-core's local spec is ``torch``). Errors are
``max |out - ref| / max |ref|`` over the forward output and the input gradient(s). The JSON
lists every (op, impl) with ``fwd_bwd_ms``, ``gbps`` (bytes that must move over the time)
and ``rel_err_out`` / ``rel_err_grad``; the table prints the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from megatron.bench import report
from megatron.bench.models import MODELS
from megatron.bench.timing import median_ms_alone
from megatron.layers import fused_kernels as fk
from megatron.layers.qkv_rope import qkv_split_rope, qkv_split_rope_reference

Tensor = torch.Tensor


@dataclass
class OpResult:
    op: str
    impl: str
    tokens: int
    fwd_bwd_ms: Optional[float] = None
    gbps: Optional[float] = None
    rel_err_out: Optional[float] = None
    rel_err_grad: Optional[float] = None
    status: str = "ok"
    note: Optional[str] = None


def _rel(a: Tensor, ref: Tensor) -> float:
    a, ref = a.detach().double(), ref.detach()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def rope_freqs(tokens: int, dim: int, base: float = 10000.0, device=None,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """megatron-core's frequencies for positions 0..N-1: ``[N, 1, 1, dim]`` (float32 as
    megatron-core makes them; float64 for exact tests)."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=dtype, device=device) / dim))
    f = torch.outer(torch.arange(tokens, dtype=dtype, device=device), inv)
    return torch.cat((f, f), dim=-1)[:, None, None, :]


def _megatron_swiglu(x: Tensor) -> Tensor:
    return bias_swiglu_impl(x, None)


def _megatron_rope_pair(q: Tensor, k: Tensor, freqs: Tensor) -> Tuple[Tensor, Tensor]:
    return (_apply_rotary_pos_emb_bshd(q, freqs, rotary_interleaved=False),
            _apply_rotary_pos_emb_bshd(k, freqs, rotary_interleaved=False))


def _megatron_split(mixed: Tensor, g: int, d: int):
    """megatron-core's split of the QKV output (``SelfAttention.get_query_key_value_tensors``):
    strided q, k, v views, q reshaped (a copy)."""
    s, b, ng = mixed.shape[:3]
    q, k, v = torch.split(mixed, [g * d, d, d], dim=3)
    return q.reshape(s, b, ng * g, d), k, v


def _split_then_rope(impl: str, g: int, d: int) -> Callable:
    def fn(mixed: Tensor, freqs: Tensor):
        q, k, v = _megatron_split(mixed, g, d)
        q, k = fk.rope(q, k, freqs, impl)
        return q, k, v.contiguous()          # the attention kernel's copy of v
    return fn


def _qkv_impls(available: Sequence[str], g: int, d: int) -> Dict[str, Callable]:
    table = {f"split+{i}": _split_then_rope(i, g, d) for i in available if i != "usp"}
    table["usp"] = lambda mixed, freqs: qkv_split_rope(mixed, freqs, g, d)
    return table


def _impls(op: str, available: Sequence[str], shape=None) -> Dict[str, Callable]:
    if op == "qkv_rope":
        g = shape.num_attention_heads // shape.num_query_groups
        return _qkv_impls(available, g, shape.head_dim)
    table = {
        "rms_norm": {i: (lambda impl: lambda x, w: fk.rms_norm(x, w, 1e-5, impl))(i)
                     for i in available},
        "swiglu": {i: (lambda impl: lambda x: fk.swiglu(x, impl))(i) for i in available},
        # RoPE's "usp" kernel is the fused QKV split (op qkv_rope), not a rotation of q, k
        "rope": {i: (lambda impl: lambda q, k, f: fk.rope(q, k, f, impl))(i)
                 for i in available if i != "usp"},
    }[op]
    if op == "swiglu":
        table["megatron"] = _megatron_swiglu
    if op == "rope":
        table["megatron"] = _megatron_rope_pair
    return table


def _case(op: str, shape, tokens: int, device):
    """(inputs needing grad, extra inputs, float64 reference fn, bytes moved per fwd+bwd)."""
    bf16 = torch.bfloat16
    h, f, a, g, d = (shape.hidden_size, shape.ffn_hidden_size, shape.num_attention_heads,
                     shape.num_query_groups, shape.head_dim)
    if op == "rms_norm":
        x = torch.randn(tokens, h, device=device, dtype=bf16)
        w = (1 + 0.1 * torch.randn(h, device=device)).to(bf16)
        # The weight is trained, so its gradient is part of the backward (a reduction over
        # the tokens). fwd: read x, write y; bwd: read x, dy, write dx
        return [x, w], [], lambda x64, w64: fk.rms_norm_torch(x64, w64, 1e-5), 5 * x.numel() * 2
    if op == "swiglu":
        x = torch.randn(tokens, 2 * f, device=device, dtype=bf16)
        # fwd: read 2F, write F; bwd: read 2F and dF, write 2F
        return [x], [], fk.swiglu_torch, 7 * tokens * f * 2
    if op == "qkv_rope":
        per = a // g
        mixed = torch.randn(tokens, 1, g, (per + 2) * d, device=device, dtype=bf16)
        freqs = rope_freqs(tokens, d, device=device)
        # fwd: read the QKV output, write q, k, v; bwd: read dq, dk, dv, write its gradient
        return ([mixed], [freqs],
                lambda m64, f64: qkv_split_rope_reference(m64, f64, per, d),
                4 * mixed.numel() * 2)
    q = torch.randn(tokens, 1, a, d, device=device, dtype=bf16)
    k = torch.randn(tokens, 1, g, d, device=device, dtype=bf16)
    freqs = rope_freqs(tokens, d, device=device)
    return [q, k], [freqs], fk._rope_pair_torch, 4 * (q.numel() + k.numel()) * 2


def run_op(op: str, impl: str, fn: Callable, shape, tokens: int, repeats: int) -> OpResult:
    device = torch.device("cuda", torch.cuda.current_device())
    res = OpResult(op, impl, tokens)
    grads_in, extra, ref_fn, nbytes = _case(op, shape, tokens, device)
    leaves = [t.clone().requires_grad_(True) for t in grads_in]
    try:
        out = fn(*leaves, *extra)
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot run is reported, not fatal
        res.status, res.note = "error", f"{type(exc).__name__}: {str(exc)[:200]}"
        return res
    outs = out if isinstance(out, tuple) else (out,)
    douts = [torch.randn_like(o) for o in outs]
    # Clones: an implementation may rotate its incoming gradient in place (Liger's RoPE).
    torch.autograd.backward(outs, [d.clone() for d in douts])
    ref_leaves = [t.detach().double().requires_grad_(True) for t in grads_in]
    ref_extra = [e.double() for e in extra]
    ref_out = ref_fn(*ref_leaves, *ref_extra)
    ref_outs = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    torch.autograd.backward(ref_outs, [d.double() for d in douts])
    res.rel_err_out = max(_rel(o, r) for o, r in zip(outs, ref_outs))
    res.rel_err_grad = max(_rel(t.grad, r.grad) for t, r in zip(leaves, ref_leaves))

    def step():
        # No copies inside the timed step: an in-place kernel drifts its inputs, which does
        # not change its time.
        xs = [t.detach().requires_grad_(True) for t in grads_in]
        o = fn(*xs, *extra)
        torch.autograd.backward(o if isinstance(o, tuple) else (o,), douts)

    res.fwd_bwd_ms = median_ms_alone(step, warmup=3, iters=repeats)
    res.gbps = nbytes / (res.fwd_bwd_ms / 1e3) / 1e9
    return res


def run(shape, tokens: int, repeats: int, impls: Sequence[str]) -> List[OpResult]:
    out = []
    for op in ("rms_norm", "swiglu", "rope", "qkv_rope"):
        for impl, fn in _impls(op, impls, shape).items():
            out.append(run_op(op, impl, fn, shape, tokens, repeats))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="bench_fused_kernels.py",
                                description="RMSNorm, SwiGLU and RoPE kernels side by side.")
    p.add_argument("--model", default="llama-0.85b", choices=list(MODELS))
    p.add_argument("--tokens", default="32768", help="comma-separated token counts")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("the kernels are timed on a CUDA GPU; none is visible")
    impls = ["torch", "compile", "usp"] + (["liger"] if fk.liger_importable() else [])
    results: List[OpResult] = []
    for tokens in (int(t) for t in ns.tokens.split(",")):
        results += run(MODELS[ns.model].shape, tokens, ns.repeats, impls)
    print(f"{'op':9} {'impl':9} {'tokens':>7} {'ms':>8} {'GB/s':>7} {'err out':>9} "
          f"{'err grad':>9}")
    for r in results:
        if r.status != "ok":
            print(f"{r.op:9} {r.impl:9} {r.tokens:7d} {r.status}: {r.note}")
            continue
        print(f"{r.op:9} {r.impl:9} {r.tokens:7d} {r.fwd_bwd_ms:8.3f} {r.gbps:7.0f} "
              f"{r.rel_err_out:9.2e} {r.rel_err_grad:9.2e}")
    if ns.out:
        meta = report.run_metadata(["tools/bench_fused_kernels.py"] + list(argv or sys.argv[1:]),
                                   torch.device("cuda", 0), 1)
        with open(ns.out, "w") as fh:
            json.dump({"tool": "bench_fused_kernels", "metadata": meta,
                       "results": [asdict(r) for r in results]}, fh, indent=1)
    return 0
