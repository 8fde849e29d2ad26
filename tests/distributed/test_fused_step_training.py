"""The optimizer step with the token division, the clip and the non-finite skip inside
PyTorch's fused Adam (``grad_clip.scaled_in_adam``, the default) trains the same loss curve
as megatron-core's order: ``finalize_model_grads``-style division of the grads by the global
number of loss tokens (``scale_gradients``), clipping by the norm of the divided grads, then
the step.

The tiny model, data and training flags of tests/distributed/test_fused_loss_training.py
(CPU float32, 4 gloo ranks, 12 steps with ``--clip-grad 1.0``, which clips most of the early
steps), each layout trained twice through ``pretrain(args)``: as it runs by default, and with
``grad_clip.fused_adams`` answering None, which sends the step through megatron-core's order.
Layouts: ``u2r2`` (context parallel, DP 1) and ``pp2u2`` (the token count comes from the
last pipeline stage: ``reduce_lm_loss`` broadcasts it, as ``finalize_model_grads`` did) and
``dp2tp2`` (the norm summed over TP and the grads over DP); ``--adam-eps 1e-5`` makes the
update depend on the grads' scale. Tolerance: 2e-6 relative per
step; the two orders differ in float32 rounding only (``g / (N / c)`` against
``(g / N) * c``). A spy checks that the default went through ``scaled_in_adam`` on every
step and the other way never did.
"""

from __future__ import annotations

import pytest

from megatron.training.cli.arguments import parse_args
from megatron.training.optim import grad_clip
from tests.distributed.test_fused_loss_training import MODEL, STEPS, TRAINING, assert_same_curve

TOLERANCE = 2e-6
# Adam's eps near the size of the per-element grads: with the default 1e-8 Adam is blind to a
# constant factor on the grads (a wrong division would train the same curve to ~1e-6).
EPS = ["--adam-eps", "1e-5"]
LAYOUTS = {
    "u2r2": ["--ulysses-degree", "2", "--ring-degree", "2", "--micro-batch-size", "4"],
    "pp2u2": ["--pipeline-model-parallel-size", "2", "--ulysses-degree", "2",
              "--micro-batch-size", "2", "--untie-embeddings-and-output-weights"],
    "dp2tp2": ["--tensor-model-parallel-size", "2", "--micro-batch-size", "2"],
}


def _train_both_ways(rank, world_size, out):
    from megatron.training.loop import pretrain  # megatron-core on first use

    entered = []
    real_scaled, real_fused = grad_clip.scaled_in_adam, grad_clip.fused_adams

    def spy(*args, **kwargs):
        entered.append(1)
        return real_scaled(*args, **kwargs)

    grad_clip.scaled_in_adam = spy
    try:
        for name, layout in LAYOUTS.items():
            for in_kernel in (True, False):
                entered.clear()
                grad_clip.fused_adams = real_fused if in_kernel else (lambda optimizer: None)
                result = pretrain(parse_args(MODEL + TRAINING + EPS + layout))
                assert result.iteration == STEPS and not result.skipped_iterations, name
                assert len(entered) == (STEPS if in_kernel else 0), (name, len(entered))
                if rank == 0:
                    out[(name, in_kernel)] = (dict(result.losses), dict(result.valid_losses))
    finally:
        grad_clip.scaled_in_adam, grad_clip.fused_adams = real_scaled, real_fused
    if rank == 0:
        for name in LAYOUTS:
            assert_same_curve(name, out[(name, False)], out[(name, True)], TOLERANCE)


@pytest.mark.slow
def test_step_in_the_fused_kernel_trains_megatron_cores_curve(dist_run):
    dist_run(_train_both_ways, 4, {}, timeout=600)
