"""Gradient precision under --bf16: float32 accumulation and reduction by default.

Megatron-LM forces ``accumulate_allreduce_grads_in_fp32`` under ``--bf16``; so does this
project now, with ``--grad-reduce-in-bf16`` (Megatron-LM's name) as the opt-out. Checked
here: the flags' validation, the DDP config they map to, the help text, the planner's
memory model following the choice, and the arithmetic behind the default (a float32
buffer keeps what a bf16 buffer rounds away when micro-batch gradients are added up).
"""

from __future__ import annotations

import pytest
import torch

import megatron.planner as planner
from megatron.training.cli.arguments import ArgumentsError, build_parser, parse_args, validate_args
from megatron.training.cli.auto_layout import resolve_auto_layout
from megatron.training.model.build import ddp_config_from_args, grad_buffer_dtype
from tests.helpers import tiny_gpt_flags

BASE = tiny_gpt_flags(llama=False, num_attention_heads=8, train_iters=10, lr="1e-3",
                      mock_data=True, vocab_size=1000)


def _valid(extra, cuda=True):
    return validate_args(parse_args(BASE + extra), 4, cuda_available=cuda)


@pytest.mark.parametrize("extra,cuda,fp32", [
    (["--bf16"], True, True),                                          # the new default
    (["--bf16", "--accumulate-allreduce-grads-in-fp32"], True, True),  # Megatron-LM's flag
    (["--bf16", "--grad-reduce-in-bf16"], True, False),                # the opt-out
    ([], True, True),                                                  # float32 on GPU
    ([], False, True),                                                 # float32 on CPU
])
def test_gradient_buffer_dtype(extra, cuda, fp32):
    config = _valid(extra, cuda)
    assert config.grad_reduce_in_fp32 is fp32
    assert config.flag_values()["accumulate_allreduce_grads_in_fp32"] is fp32
    assert grad_buffer_dtype(config) == (torch.float32 if fp32 else torch.bfloat16)
    assert ddp_config_from_args(config).grad_reduce_in_fp32 is fp32
    # validating again (what resolve_auto_layout does) gives the same answer
    assert validate_args(config.args, 4, cuda_available=cuda).grad_reduce_in_fp32 is fp32


def test_float32_runs_are_unchanged_by_the_default():
    """CPU (float32) runs had a float32 buffer before the change and have one now."""
    config = _valid([], cuda=False)
    assert config.params_dtype == "float32" and ddp_config_from_args(config).grad_reduce_in_fp32


@pytest.mark.parametrize("extra,cuda,message", [
    (["--grad-reduce-in-bf16"], True, "--grad-reduce-in-bf16 needs --bf16"),
    (["--grad-reduce-in-bf16"], False, "--grad-reduce-in-bf16 needs --bf16"),
    (["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"], True,
     "exclude one another"),
])
def test_conflicting_precision_flags_are_refused(extra, cuda, message):
    with pytest.raises(ArgumentsError, match=message):
        _valid(extra, cuda)


def test_help_states_the_cost_and_the_saving():
    text = " ".join(build_parser().format_help().split())
    start = text.index("--grad-reduce-in-bf16 with --bf16")
    entry = text[start:start + 700]
    assert "2 bytes per parameter of gradient buffer" in entry
    assert "2 instead of 4 bytes per parameter" in entry
    assert "costs accuracy" in entry and "micro-batches per rank" in entry
    assert "the default, as in Megatron-LM" in text


def test_planner_counts_the_gradient_buffer_the_run_has(monkeypatch):
    """'auto' degrees: the memory model's gradient bytes follow the flags (4 by default)."""
    seen = []
    real = planner.choose_layout

    def spy(*a, **kw):
        seen.append((kw["assumptions"].main_grad_bytes, kw["assumptions"].grad_reduce_bytes))
        return real(*a, **kw)

    monkeypatch.setattr(planner, "choose_layout", spy)
    for extra in ([], ["--grad-reduce-in-bf16"]):
        args = parse_args(["--num-layers", "16", "--hidden-size", "2048",
                           "--num-attention-heads", "16", "--seq-length", "65536",
                           "--train-iters", "10", "--lr", "1e-4", "--mock-data",
                           "--vocab-size", "32000", "--ulysses-degree", "auto",
                           "--ring-degree", "auto", "--gpus-per-node", "8", "--bf16", *extra])
        resolve_auto_layout(validate_args(args, 16, cuda_available=True), 32000, "NVIDIA H200")
    assert seen == [(4, 4), (2, 2)]
    assert planner.DEFAULT_ASSUMPTIONS.main_grad_bytes == 4


def test_float32_buffer_keeps_what_bf16_accumulation_loses():
    """Why the default: micro-batch gradients (bf16, as autograd hands them over) added into
    a float32 buffer stay within one final bf16 rounding of the exact sum; added into a bf16
    buffer each addition rounds, and small contributions vanish against a large sum."""
    gen = torch.Generator().manual_seed(0)
    micro = [torch.randn(4096, generator=gen, dtype=torch.float64).to(torch.bfloat16)
             for _ in range(8)]
    exact = torch.stack([g.double() for g in micro]).sum(0)
    fp32_buf = torch.zeros(4096, dtype=torch.float32)
    bf16_buf = torch.zeros(4096, dtype=torch.bfloat16)
    for g in micro:
        fp32_buf.add_(g)
        bf16_buf.add_(g)
    err32 = (fp32_buf.double() - exact).norm() / exact.norm()
    err16 = (bf16_buf.double() - exact).norm() / exact.norm()
    assert err32 < 1e-6           # 8 bf16 terms sum exactly in float32
    assert err16 > 1e-3           # several bf16 roundings of a running sum (2^-9 each)
    # swamping: a gradient below half a bf16 ulp of the running sum is lost entirely
    big = torch.full((1,), 256.0, dtype=torch.bfloat16)
    small = torch.full((1,), 0.5, dtype=torch.bfloat16)
    assert (big + small).item() == 256.0
    assert (big.float() + small).item() == 256.5
