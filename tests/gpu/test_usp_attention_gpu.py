"""USP attention and its local kernels on GPUs, against fp32 / fp64 references.

The checks live in ``tools/gpu_attention_check.py`` (also runnable with torchrun); see its
docstring. Pass criterion: for out, dq, dk, dv the USP relative L2 error is at most twice the
single-GPU bf16 kernel's own error on the same inputs.

* ``test_usp_attention_gpu``: 2 GPUs (torchrun, NCCL), layouts U2xR1 and U1xR2, causal,
  bf16, S in {8K, 32K, 64K}, 32 query heads with 32 and 8 KV heads, head dim 128.
* ``test_torch_kernel_routes_on_gpu``: each CUDA route of the ``torch`` kernel (cuDNN, flash,
  memory-efficient fp32) on ring-shaped blocks against float64.

The tool's CPU smoke run (same functions, 2 gloo ranks, bf16, S = 256) and its argument
parsing are tested in ``tests/distributed/test_usp_attention.py``: the conftest skips every
test under ``tests/gpu`` when CUDA is absent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron.usp import kernels
from megatron.usp.attention import usp_attention
from megatron.usp.kernels import MathKernel, get_kernel, merge_block_
from tests.helpers import rel_err
from tests.unit.test_kernels import new_accumulators

_TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "gpu_attention_check.py")


def load_check_tool():
    """Import tools/gpu_attention_check.py (tools/ is not a package)."""
    if "gpu_attention_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_attention_check", _TOOL)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_attention_check"] = module     # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["gpu_attention_check"]


def assert_passed(results):
    bad = [r for r in results if not r.passed]
    assert not bad, "USP error above 2x the kernel's own error:\n" + "\n".join(
        f"U{r.ulysses}xR{r.ring} S={r.seq_len} h={r.heads}/{r.kv_heads}: {r.errors}" for r in bad
    )


@pytest.mark.gpu
def test_usp_attention_gpu(tmp_path):
    """Runs the tool under torchrun in fresh processes.

    Not through tests/harness.py: the harness forks, and on torch 2.11 a parent that has
    called ``torch.cuda.is_available()`` (as conftest.py does) cannot use CUDA in forked
    children ("Cannot re-initialize CUDA in forked subprocess").
    """
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    out_path = tmp_path / "gpu_attention.json"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (repo, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", _TOOL, "--out", str(out_path), "--layouts", "2x1", "1x2",
           "--timing-iters", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert out_path.exists(), f"no summary written:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report = json.loads(out_path.read_text())
    assert len(report["cases"]) == 12
    bad = [c for c in report["cases"] if not c["passed"]]
    assert not bad and proc.returncode == 0, json.dumps(bad, indent=1) + proc.stdout[-4000:]


# --------------------------------------------------------------------------- local kernels
def _routes():
    kernel = kernels.TorchKernel()
    routes = {
        "flash": (torch.bfloat16, lambda *a: kernels._flash_op_forward(kernel, *a),
                  lambda *a: kernels._flash_op_backward(kernel, *a)),
        "efficient": (torch.float32, lambda *a: kernels._efficient_forward(kernel, *a),
                      lambda *a: kernels._efficient_backward(kernel, *a)),
        "dispatch-bf16": (torch.bfloat16, kernel.forward, kernel.backward),
    }
    if kernels._cudnn_attention_usable():
        routes["cudnn"] = (torch.bfloat16, kernels._cudnn_forward, kernels._cudnn_backward)
    return routes


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["cudnn", "flash", "efficient", "dispatch-bf16"])
def test_torch_kernel_routes_on_gpu(route):
    """Each CUDA route of the torch backend on ring-shaped blocks (row/column halves, global
    out/lse in the backward) against the math kernel in float64 on the same values.

    Tolerance: relative L2 error 2e-2 for bf16 (8 mantissa bits), 1e-4 for fp32."""
    routes = _routes()
    if route not in routes:
        pytest.skip("cuDNN attention is not usable here")
    dtype, fwd, bwd = routes[route]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, h, hk, s, d = 2, 8, 2, 1024, 128
    q, k, v, dout = (torch.randn(b, n, s, d, generator=gen, device="cuda").to(dtype)
                     for n in (h, hk, hk, h))
    scale = d ** -0.5
    exact = MathKernel()
    ref_out, ref_lse = exact.forward(q.double(), k.double(), v.double(), True, scale)
    ref_grads = exact.backward(dout.double(), q.double(), k.double(), v.double(), ref_out,
                               ref_lse, True, scale)
    half = s // 2
    # diagonal blocks (causal, square) + the off-diagonal block (back rows x front columns)
    acc_out, acc_lse = new_accumulators(q)
    for rows, cols, causal in ((slice(0, half), slice(0, half), True),
                               (slice(half, s), slice(half, s), True),
                               (slice(half, s), slice(0, half), False)):
        o, lse = fwd(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal, scale)
        merge_block_(acc_out[:, :, rows], acc_lse[:, :, rows], o, lse)
    assert rel_err(acc_out, ref_out) < tol
    assert (acc_lse.double() - ref_lse).abs().max().item() < 50 * tol
    out = acc_out.to(dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device="cuda") for t in (q, k, v))
    for rows, cols, causal in ((slice(0, half), slice(0, half), True),
                               (slice(half, s), slice(half, s), True),
                               (slice(half, s), slice(0, half), False)):
        gq, gk, gv = bwd(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                         out[:, :, rows], acc_lse[:, :, rows], causal, scale)
        dq[:, :, rows] += gq
        dk[:, :, cols] += gk
        dv[:, :, cols] += gv
    for got, want in zip((dq, dk, dv), ref_grads):
        assert rel_err(got, want) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_local_attention_on_sequence_major_tensors_on_gpu(batch, causal):
    """U = R = 1: ``usp_attention`` hands cuDNN megatron's ``[s, b, h, d]`` tensors as they are
    (q contiguous, k and v views into one QKV projection buffer). out, dq, dk, dv against
    float64 within 2x the error of the head-major cuDNN call on the same values."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    s, h, hk, d = 4096, 16, 4, 128
    q = torch.randn(s, batch, h, d, generator=gen, device="cuda").bfloat16()
    kv = torch.randn(s, batch, hk, 2 * d, generator=gen, device="cuda").bfloat16()
    k, v = kv[..., :d], kv[..., d:]                          # strided views, like megatron's
    dout = torch.randn(s, batch, h, d, generator=gen, device="cuda").bfloat16()
    scale = d ** -0.5

    def heads(x):
        return x.permute(1, 2, 0, 3).contiguous()

    exact = MathKernel()
    qd, kd, vd = (heads(x).double() for x in (q, k, v))
    ref_out, ref_lse = exact.forward(qd, kd, vd, causal, scale)
    ref = (ref_out,) + exact.backward(heads(dout).double(), qd, kd, vd, ref_out, ref_lse,
                                      causal, scale)
    kernel = get_kernel("auto")
    b_out, b_lse = kernel.forward(heads(q), heads(k), heads(v), causal, scale)
    base = (b_out,) + kernel.backward(heads(dout), heads(q), heads(k), heads(v), b_out, b_lse,
                                      causal, scale)
    qq = q.detach().clone().requires_grad_()
    kvv = kv.detach().clone().requires_grad_()
    out = usp_attention(qq, kvv[..., :d], kvv[..., d:], ulysses_group=None, ring_group=None,
                        causal=causal)
    assert out.shape == q.shape and out.is_contiguous()
    out.backward(dout)
    dk, dv = kvv.grad[..., :d], kvv.grad[..., d:]
    got = (heads(out), heads(qq.grad), heads(dk), heads(dv))
    for g, b_, r in zip(got, base, ref):
        assert rel_err(g, r) <= 2 * rel_err(b_, r) + 1e-3, (rel_err(g, r), rel_err(b_, r))
