"""``--fused-linear-cross-entropy`` trains the same loss curve as megatron-core's output layer
plus ``vocab_parallel_cross_entropy``.

The tiny Llama-style model and data of tests/distributed/test_training_parity.py (CPU float32,
4 gloo ranks, the built-in corpus, global batch 8 x 64 tokens, same seed), 12 steps through
``pretrain(args)``, each layout once without and once with the flag; chunks of 24 tokens, so
every micro-batch ends in a partial chunk. Layouts:

* ``u2r2_tied``: context parallel U2 x R2, input and output embeddings tied (the output
  weight is the embedding's, ``shared_embedding_or_output_weight()``);
* ``tp2u2sp``: TP2 x U2 with Megatron sequence parallelism (the hidden states are
  all-gathered over TP before the loss and its gradient reduce-scattered; the target
  logit comes from the TP rank owning it);
* ``pp2u2``: two pipeline stages x U2 (the first stage's ``_postprocess`` is megatron's,
  returning hidden states; the last computes the loss). Untied: tied embeddings across
  pipeline stages do not build on the CPU (megatron-core moves the shared copy with
  ``.cuda()``).

Tolerance: per-step training and validation losses equal to 2e-6 relative. Both paths
compute the same float32 numbers in a different order (chunked matmuls, the weight
gradient summed over chunks), a relative rounding noise of ~1e-7 per step that Adam does
not amplify over 12 steps at this learning rate (observed: most steps bit-equal, the others
<= 1.2e-7); the layout-parity gate allows 1e-5 between different layouts. A spy on the
fused function checks that the flag really routes the loss through it (and that the
default does not).
"""

from __future__ import annotations

import pytest

from megatron.training.cli.arguments import parse_args
from tests.helpers import tiny_gpt_flags

STEPS = 12
CHUNK = 24
TOLERANCE = 2e-6

MODEL = tiny_gpt_flags(make_vocab_size_divisible_by=32)
TRAINING = [
    "--global-batch-size", "8", "--train-iters", str(STEPS), "--lr", "2e-3",
    "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "3",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234",
    "--log-interval", "6", "--eval-interval", str(STEPS), "--eval-iters", "1",
    "--num-workers", "0", "--device", "cpu",
]
LAYOUTS = {
    "u2r2_tied": ["--ulysses-degree", "2", "--ring-degree", "2", "--micro-batch-size", "4"],
    "tp2u2sp": ["--tensor-model-parallel-size", "2", "--ulysses-degree", "2",
                "--sequence-parallel", "--micro-batch-size", "4",
                "--untie-embeddings-and-output-weights"],
    "pp2u2": ["--pipeline-model-parallel-size", "2", "--ulysses-degree", "2",
              "--micro-batch-size", "2", "--untie-embeddings-and-output-weights"],
}
FUSED = ["--fused-linear-cross-entropy", "--linear-cross-entropy-chunk-tokens", str(CHUNK)]


def _train_both_ways(rank, world_size, out):
    import megatron.training.model.fused_loss_model as fused_loss_model  # megatron-core on first use
    from megatron.training.loop import pretrain  # megatron-core on first use

    calls = []
    real = fused_loss_model.fused_linear_cross_entropy

    def spy(*args, **kwargs):
        calls.append(kwargs["chunk_tokens"])
        return real(*args, **kwargs)

    fused_loss_model.fused_linear_cross_entropy = spy
    for name, layout in LAYOUTS.items():
        for fused in (False, True):
            calls.clear()
            result = pretrain(parse_args(MODEL + TRAINING + layout
                                         + (FUSED if fused else [])))
            assert result.iteration == STEPS, (name, fused, result.iteration)
            # every loss-computing rank went through the fused function, and only then
            last_stage = "--pipeline-model-parallel-size" not in layout or rank >= 2
            assert (len(calls) > 0) is (fused and last_stage), (name, fused, len(calls))
            assert set(calls) <= {CHUNK}
            if rank == 0:
                out[(name, fused)] = (dict(result.losses), dict(result.valid_losses))
    if rank == 0:
        _check(out)


def assert_same_curve(name, base, other, tolerance):
    """``base`` and ``other`` are (per-step losses, validation losses) of one layout trained
    two ways for STEPS steps: equal to ``tolerance`` relative, and a falling curve."""
    (plain, plain_valid), (fused, fused_valid) = base, other
    assert sorted(plain) == sorted(fused) == list(range(1, STEPS + 1)), name
    assert sorted(plain_valid) == sorted(fused_valid) == [STEPS], name
    for it in plain:
        rel = abs(fused[it] - plain[it]) / abs(plain[it])
        assert rel <= tolerance, (name, it, fused[it], plain[it], rel)
    rel = abs(fused_valid[STEPS] - plain_valid[STEPS]) / abs(plain_valid[STEPS])
    assert rel <= tolerance, f"{name} validation: {rel:.2e}"
    assert plain[STEPS] < plain[1] - 0.3, (name, plain[1], plain[STEPS])   # it trains


def _check(runs):
    for name in LAYOUTS:
        assert_same_curve(name, runs[(name, False)], runs[(name, True)], TOLERANCE)


@pytest.mark.slow
def test_fused_loss_trains_the_same_curve(dist_run):
    dist_run(_train_both_ways, 4, {}, timeout=600)
