"""Training with float8 linear layers (torchao's emulation, CPU, 2 gloo ranks at TP2 with
sequence parallelism): the tiny Llama-style model trained 16 steps with ``--fp8-format hybrid``
(and with ``e4m3 --fp8-recipe rowwise``, and with the output layer in float8 too, inside the
fused loss: ``--fp8-output-layer``) follows the float32 run's loss curve within the band below, every loss finite, and the curve falls as the float32 one does; the start-up report
names every linear kind in float8.

Band: 0.5 % relative per step. One float8 rounding per GEMM operand is 3-6 % relative noise
per element (the 20-30 dB of tests/unit/test_float8.py), which averages out over the
products of a loss: measured here, the largest per-step difference from the float32 curve
was 0.064 % (hybrid) and 0.033 % (rowwise) over the 16 steps; the band leaves ~8x room for
other CPUs' float32 rounding.
"""

from __future__ import annotations

import math

import pytest

from megatron.training.cli.arguments import parse_args
from tests.distributed.test_checkpoint_resume import _losses, _torchrun
from tests.helpers import tiny_gpt_flags

pytestmark = pytest.mark.slow   # CPU training runs

STEPS = 16
BAND = 0.005
MODEL = tiny_gpt_flags(make_vocab_size_divisible_by=32)
TRAINING = [
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(STEPS),
    "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--seed", "1234",
    "--log-interval", "8", "--eval-iters", "0", "--num-workers", "0", "--device", "cpu",
    "--tensor-model-parallel-size", "2", "--sequence-parallel",
]
FP8 = {
    "hybrid": ["--fp8-format", "hybrid", "--fp8-emulate", "--fp8-linears", "all"],
    "rowwise": ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise", "--fp8-emulate",
                "--fp8-linears", "all"],
    # the output layer too, inside the fused loss over three chunks (48, 48, 32 tokens)
    "output": ["--fp8-format", "hybrid", "--fp8-emulate", "--fp8-linears", "all",
               "--fp8-output-layer", "--fused-linear-cross-entropy",
               "--linear-cross-entropy-chunk-tokens", "48"],
}


def _train(rank, world_size, out):
    from megatron.training.loop import pretrain  # megatron-core on first use

    for name, extra in [("fp32", [])] + list(FP8.items()):
        result = pretrain(parse_args(MODEL + TRAINING + extra))
        assert result.iteration == STEPS and not result.skipped_iterations, name
        if rank == 0:
            out[name] = dict(result.losses)
    if rank == 0:
        ref = out["fp32"]
        assert ref[STEPS] < ref[1] - 0.3, ref          # it trains
        for name in FP8:
            losses = out[name]
            assert sorted(losses) == list(range(1, STEPS + 1)), name
            for it, loss in losses.items():
                assert math.isfinite(loss), (name, it)
                rel = abs(loss - ref[it]) / abs(ref[it])
                assert rel <= BAND, (name, it, loss, ref[it], rel)
            assert losses[STEPS] < losses[1] - 0.3, (name, losses)


def test_float8_training_follows_the_float32_curve(dist_run, capfd):
    dist_run(_train, 2, {}, timeout=600)
    printed = capfd.readouterr().out
    assert "fp8 (tensorwise hybrid, emulated, --fp8-linears all): 4 of 4" in printed
    assert "fp8 (tensorwise hybrid, emulated, --fp8-linears all): 5 of 5" in printed
    for kind in ("QKV", "proj", "FC1", "FC2", "output"):
        assert f"  {kind}" in printed, kind


def test_float8_checkpoint_resumes_bitwise(tmp_path):
    """Save at iteration 3 of a 6-step float8 run (through ``pretrain_gpt.py`` under
    torchrun, as tests/distributed/test_checkpoint_resume.py does), resume from it: steps
    4-6 equal the straight run's to the bit. Dynamic scaling keeps no float8 state (no amax
    history, no scales), so the checkpoint is the bf16 run's: resumed without
    ``--fp8-format`` it continues within the band."""
    ckpt = str(tmp_path / "ckpt")
    run = MODEL + TRAINING + FP8["hybrid"] + ["--train-iters", "6"]
    _torchrun(run + ["--save", ckpt, "--save-interval", "3",
                     "--metrics-file", str(tmp_path / "straight.jsonl")], cwd=str(tmp_path))
    proc = _torchrun(run + ["--load", ckpt, "--ckpt-step", "3",
                            "--metrics-file", str(tmp_path / "resumed.jsonl")],
                     cwd=str(tmp_path))
    assert "loaded checkpoint" in proc.stdout and "at iteration 3" in proc.stdout
    straight = _losses(str(tmp_path / "straight.jsonl"))
    resumed = _losses(str(tmp_path / "resumed.jsonl"))
    assert sorted(resumed) == [4, 5, 6]
    for it in resumed:
        assert resumed[it] == straight[it], (it, resumed[it], straight[it])
    _torchrun(MODEL + TRAINING + ["--train-iters", "6", "--load", ckpt, "--ckpt-step", "3",
                                  "--metrics-file", str(tmp_path / "plain.jsonl")],
              cwd=str(tmp_path))
    plain = _losses(str(tmp_path / "plain.jsonl"))
    assert sorted(plain) == [4, 5, 6]
    for it in plain:
        assert abs(plain[it] - straight[it]) / straight[it] <= BAND, (it, plain[it])
