"""``--fused-kernels``: the choice (pure), and the plain kernels against independent float64
formulas (the CPU path; the GPU tests compare liger / compile with these)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.layers import fused_kernels as fk
from megatron.training.cli.arguments import ArgumentsError, parse_args, validate_args
from megatron.usp import backend_names
from tests.helpers import tiny_gpt_flags


@pytest.mark.parametrize("name,cuda,liger,triton,want", [
    ("auto", False, True, True, "torch"), ("auto", True, True, True, "usp"),
    ("auto", True, True, False, "torch"), ("usp", True, False, True, "usp"),
    ("usp", False, False, False, "usp"), ("torch", True, True, True, "torch"),
    ("compile", True, False, True, "compile"), ("liger", True, True, True, "liger"),
])
def test_resolve(monkeypatch, name, cuda, liger, triton, want):
    monkeypatch.setattr(backend_names, "liger_importable", lambda: liger)
    monkeypatch.setattr(backend_names, "triton_importable", lambda: triton)
    assert fk.resolve_fused_kernels(name, cuda) == want


@pytest.mark.parametrize("name,cuda,liger,needle", [
    ("liger", False, True, "--fused-kernels torch"), ("compile", False, True, "CUDA GPU"),
    ("liger", True, False, "pip install liger-kernel"), ("fast", True, True, "choose one of"),
    ("usp", True, True, "pip install triton"),
])
def test_resolve_refuses(monkeypatch, name, cuda, liger, needle):
    monkeypatch.setattr(backend_names, "liger_importable", lambda: liger)
    monkeypatch.setattr(backend_names, "triton_importable", lambda: False)
    with pytest.raises(fk.FusedKernelsUnavailable, match="--fused-kernels") as info:
        fk.resolve_fused_kernels(name, cuda)
    assert needle in str(info.value)


def test_validate_args_resolves_and_refuses():
    base = tiny_gpt_flags(llama=False, micro_batch_size=1, global_batch_size=1, train_iters=1,
                          lr="1e-3")
    config = validate_args(parse_args(base), 1, cuda_available=False)
    assert config.args.fused_kernels == "auto" and config.fused_kernels_impl == "torch"
    with pytest.raises(ArgumentsError, match="--fused-kernels liger"):
        validate_args(parse_args(base + ["--fused-kernels", "liger"]), 1, cuda_available=False)


def test_rms_norm_plain_matches_formula():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=gen, dtype=torch.float64)
    w = torch.randn(16, generator=gen, dtype=torch.float64)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(fk.rms_norm(x, w, 1e-5, "torch"), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fk.rms_norm(x, w, 1e-5, "torch", offset=1.0),
                               x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * (w + 1),
                               rtol=1e-12, atol=1e-12)


def test_swiglu_plain_matches_formula():
    x = torch.randn(4, 2, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    gate, up = x[..., :6], x[..., 6:]
    want = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(fk.swiglu(x, "torch"), want, rtol=1e-12, atol=1e-12)
    from megatron.core.transformer.transformer_config import (
        TransformerConfig,  # megatron-core on first use
    )

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    module = fk.SwiGLU(config=config, impl="torch")
    torch.testing.assert_close(module(x), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="impl"):
        fk.SwiGLU(config=config, impl="auto")
    assert list(module.parameters()) == []


def _rotate_pairs(t: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Independent RoPE: dims i and i + d/2 rotated by angle pos * base^(-2i/d)."""
    d = t.shape[-1]
    out = t.clone()
    for i in range(d // 2):
        theta = positions.double() * base ** (-2 * i / d)            # [s, b]
        c, s = torch.cos(theta)[..., None], torch.sin(theta)[..., None]
        a, b = t[..., i], t[..., i + d // 2]
        out[..., i] = a * c[..., 0] - b * s[..., 0]
        out[..., i + d // 2] = b * c[..., 0] + a * s[..., 0]
    return out


@pytest.mark.parametrize("batch_positions", [False, True])
def test_rope_plain_follows_given_positions(batch_positions):
    """Positions in the load-balanced order (chunks 0 and 3 of 4), or different per row."""
    from megatron.bench.fused_kernels_bench import rope_freqs  # megatron-core on first use

    gen = torch.Generator().manual_seed(2)
    s, b, d, base = 8, 2, 8, 10000.0
    table = rope_freqs(16, d, dtype=torch.float64)                                # [16, 1, 1, d]
    pos = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])
    positions = pos[:, None].expand(s, b)
    freqs = table[pos]                                                # [s, 1, 1, d]
    if batch_positions:
        other = torch.tensor([5, 9, 2, 7, 0, 11, 3, 4])
        freqs = torch.cat([freqs, table[other]], dim=1)               # [s, 2, 1, d]
        positions = torch.stack([pos, other], dim=1)
    q = torch.randn(s, b, 4, d, generator=gen, dtype=torch.float64)
    k = torch.randn(s, b, 2, d, generator=gen, dtype=torch.float64)
    q_rot, k_rot = fk.rope(q, k, freqs, "torch")
    pos4 = positions[..., None]
    torch.testing.assert_close(q_rot, _rotate_pairs(q, pos4, base), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(k_rot, _rotate_pairs(k, pos4, base), rtol=1e-10, atol=1e-10)
    assert math.isclose(float(q_rot.norm()), float(q.norm()), rel_tol=1e-12)


def test_rope_partial_rotary_leaves_the_rest():
    from megatron.bench.fused_kernels_bench import rope_freqs  # megatron-core on first use

    freqs = rope_freqs(4, 4, dtype=torch.float64)                                 # rotate 4 of 8 dims
    q = torch.randn(4, 1, 2, 8, dtype=torch.float64)
    q_rot, _ = fk.rope(q, q[:, :, :1], freqs, "torch")
    torch.testing.assert_close(q_rot[..., 4:], q[..., 4:])


def test_rope_supported_names_unsupported_configs():
    class Cfg:
        rotary_interleaved = False
        multi_latent_attention = False
        mrope_section = None

    assert fk.rope_supported(Cfg()) is None
    cfg = Cfg()
    cfg.rotary_interleaved = True
    assert fk.rope_supported(cfg) == "--rotary-interleaved"
