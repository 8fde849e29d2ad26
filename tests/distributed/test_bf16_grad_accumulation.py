"""bf16 on CPU through gloo: the float32 gradient buffer brings DP and USP gradients closer.

At one global batch (8 sequences of 64 tokens, micro-batches of 1) DP4 accumulates 2
micro-batches per rank and U2 (DP2) 4, which is how a USP layout loses more to bf16
accumulation than DP at the same global batch. One training step's gradient
(after the DP x CP reduction and the division by the global token count) is taken from
DDP's buffer for both layouts, once with the float32 buffer (the ``--bf16`` default) and
once with ``--grad-reduce-in-bf16``; the relative L2 distance between the DP4 and U2
gradients must be smaller with the float32 buffer. CPU runs are deterministic, so the
comparison is not a matter of luck (measured: 0.0021 with float32, 0.0039 with bf16).

``--bf16`` is refused on CPU at start-up (CPU bf16 training is not a supported mode: it is
slow), so the test switches it on after ``initialize``: the model, ``Float16Module`` and
DDP buffers are then the ones a GPU run builds, and the arithmetic runs in CPU bf16 kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
from functools import partial

import torch

from megatron.training.cli.arguments import parse_args
from megatron.training.data import batch as batch_mod
from tests.harness import run_on_ranks
from tests.helpers import tiny_gpt_flags

MODEL = tiny_gpt_flags(
    untie_embeddings_and_output_weights=True, make_vocab_size_divisible_by=32,
    global_batch_size=8, micro_batch_size=1, train_iters=1, lr="1e-3", num_workers=0,
    device="cpu", seed=1234, eval_iters=0)
LAYOUTS = {"dp4": [], "u2": ["--ulysses-degree", "2"]}


def _step_gradient(layout, grad_reduce_in_bf16: bool):
    """{name: float64 gradient} of one step's global batch, from DDP's buffer (the sum over
    the loss tokens: the division by their count happens in the optimizer step)."""
    from megatron.training import loop as training  # megatron-core on first use
    from megatron.training.checkpoint.save_load import TrainState  # megatron-core on first use
    from megatron.training.initialize import initialize, shutdown  # megatron-core on first use
    from megatron.training.model.build import build_model, unwrap  # megatron-core on first use

    rt = initialize(parse_args(MODEL + layout))
    try:
        # See the module docstring: the validated CPU run, switched to bf16.
        bf16 = argparse.Namespace(**dict(vars(rt.config.args), bf16=True,
                                         grad_reduce_in_bf16=grad_reduce_in_bf16))
        config = dataclasses.replace(rt.config, args=bf16,
                                     grad_reduce_in_fp32=not grad_reduce_in_bf16)
        model = build_model(config, rt.groups)
        training._wire_grad_sync(model)
        train_iter, _ = training.build_data_iterators(config, rt, TrainState())
        model[0].zero_grad_buffer()
        step = partial(batch_mod.forward_step, training.batch_context(rt, config))
        training.forward_backward(config, step, train_iter, model, forward_only=False)
        params = dict(unwrap(model[0]).named_parameters())
        want = torch.bfloat16 if grad_reduce_in_bf16 else torch.float32
        assert all(p.dtype == torch.bfloat16 and p.main_grad.dtype == want
                   for p in params.values())
        return {name: p.main_grad.detach().double().clone() for name, p in params.items()}
    finally:
        shutdown(rt)


def _relative_distance(a, b) -> float:
    num = sum(float((a[k] - b[k]).square().sum()) for k in a)
    den = sum(float(a[k].square().sum()) for k in a)
    return (num / den) ** 0.5


def _compare_layouts(rank, world_size):
    grads = {(name, bf16): _step_gradient(flags, bf16)
             for bf16 in (False, True) for name, flags in LAYOUTS.items()}
    fp32_buffer = _relative_distance(grads["dp4", False], grads["u2", False])
    bf16_buffer = _relative_distance(grads["dp4", True], grads["u2", True])
    # Both are bf16-sized and non-zero (the layouts compute differently in bf16) ...
    assert 1e-4 < fp32_buffer < 2e-2 and 1e-4 < bf16_buffer < 2e-2, (fp32_buffer, bf16_buffer)
    # ... and the float32 buffer removes the accumulation's share of the difference.
    assert fp32_buffer < 0.75 * bf16_buffer, (fp32_buffer, bf16_buffer)


def test_float32_buffer_brings_dp_and_usp_closer():
    run_on_ranks(_compare_layouts, 4, timeout=400)
