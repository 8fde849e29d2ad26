"""``--fused-kernels usp`` trains the same loss curve as ``--fused-kernels torch`` on pipeline
layouts, with the norms and SwiGLU dropped and recomputed (``--recompute-modules layernorm
swiglu``) both ways.

The tiny model and data of tests/distributed/test_training_parity.py (CPU float32, 4 gloo
ranks, the built-in corpus, global batch 8 x 64 tokens, same seed), 12 steps through
``pretrain(args)``, each layout once per choice. With ``torch`` the lean layers recompute
through megatron-core's ``CheckpointWithoutOutput`` and RoPE is megatron's split + rotation;
with ``usp`` they are :mod:`megatron.layers.lean_kernels` (their plain-math path on the CPU:
outputs dropped after the linear layer and refilled in place from its gradient hook; the
residual's gradient added in the norms' backward, :mod:`megatron.layers.residual`) and
:mod:`megatron.layers.qkv_rope`. Layouts: two pipeline stages x U2, and two pipeline stages x
TP2 with Megatron sequence parallelism, and two stages x U2 again with the outputs kept (no
lean layers: the norms are modules of their own) (the layout-parity gate covers U x R and TP without
PP; pipeline stages initialise their layers from another point of the RNG stream, so they
are compared with themselves here).

Tolerance: per-step training and validation losses equal to 1e-5 relative (the layout gate's
bound): both compute the same float32 functions with different rounding (the RMSNorm's
statistics, SwiGLU rounded once instead of twice). Spies check that ``usp`` really went
through the refill, the fused split and the residual hand-over on every rank, and ``torch``
did not.
"""

from __future__ import annotations

import pytest

from megatron.layers import lean_kernels, qkv_rope
from megatron.training.cli.arguments import parse_args
from tests.distributed.test_fused_loss_training import MODEL, STEPS, TRAINING, assert_same_curve

TOLERANCE = 1e-5
LEAN = ["--recompute-granularity", "selective", "--recompute-modules", "layernorm", "swiglu",
        "--untie-embeddings-and-output-weights"]
LAYOUTS = {
    "pp2u2": ["--pipeline-model-parallel-size", "2", "--ulysses-degree", "2",
              "--micro-batch-size", "2"],
    "pp2tp2sp": ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                 "--sequence-parallel", "--micro-batch-size", "2"],
}
KEPT = "pp2u2, outputs kept"     # no --recompute-modules: the norms are modules of their own
LAYOUTS[KEPT] = LAYOUTS["pp2u2"] + LEAN[-1:]


def _train_both_ways(rank, world_size, out):
    from megatron.training.loop import pretrain  # megatron-core on first use

    calls = {"refill": 0, "qkv": 0, "residual": 0}
    real_drop, real_split = lean_kernels.drop_until_backward, qkv_rope.qkv_split_rope
    real_backward = lean_kernels._rms_backward

    def backward(*args):
        calls["residual"] += len(args) > 5 and args[5] is not None
        return real_backward(*args)

    def drop(*args, **kwargs):
        calls["refill"] += 1
        return real_drop(*args, **kwargs)

    def split(*args, **kwargs):
        calls["qkv"] += 1
        return real_split(*args, **kwargs)

    lean_kernels.drop_until_backward, qkv_rope.qkv_split_rope = drop, split
    lean_kernels._rms_backward = backward
    for name, layout in LAYOUTS.items():
        for choice in ("torch", "usp"):
            calls.update(refill=0, qkv=0, residual=0)
            lean = [] if name == KEPT else LEAN
            result = pretrain(parse_args(MODEL + TRAINING + lean + layout
                                         + ["--fused-kernels", choice]))
            assert result.iteration == STEPS, (name, choice, result.iteration)
            used = ((calls["refill"] > 0) is bool(lean) and calls["qkv"] > 0
                    and calls["residual"] > 0)
            assert used is (choice == "usp"), (name, choice, calls)
            if rank == 0:
                out[(name, choice)] = (dict(result.losses), dict(result.valid_losses))
    if rank == 0:
        _check(out)


def _check(runs):
    for name in LAYOUTS:
        assert_same_curve(name, runs[(name, "torch")], runs[(name, "usp")], TOLERANCE)


@pytest.mark.slow
def test_usp_kernels_train_the_same_curve(dist_run):
    dist_run(_train_both_ways, 4, {}, timeout=600)
