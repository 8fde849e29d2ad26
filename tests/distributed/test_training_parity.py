"""Loss parity gate: DP=4 vs U2xR2 vs U1xR4 vs U4xR1 vs TP2xU2 (without and with Megatron
sequence parallelism, the latter also with ``--fused-kernels usp``) train the same loss curve;
so does U2xR2 accumulating 8 micro-batches per step instead of 2 (its first 10 steps).

A tiny Llama-style model (RMSNorm, SwiGLU, RoPE, GQA 4 query heads / 2 KV heads, untied
output layer, no biases) on the built-in default corpus, CPU float32, 4 gloo ranks, the
same seed and global batch (8 sequences of 64 tokens), 30 steps, through
``pretrain(args)`` (the importable main of ``pretrain_gpt.py``), every layout in one
launch. The per-step losses of each layout, read back from its metrics file, must agree
with the DP=4 run to 1e-5 relative (``tools/compare_loss.py``'s comparison); so must the
final validation loss. ``pretrain_gpt.py`` also runs as a real ``torchrun`` subprocess (U2
on 2 processes, the same global batch) and is compared the same way, with the tool's
command line.

Why 1e-5 is a fair bound in float32: every layout computes the same sums in a different
order (sequence shards, all-reduce trees), a relative rounding noise of ~1e-7 per step
that Adam does not amplify over 30 steps at this learning rate (observed: <= 2e-7).
``--make-vocab-size-divisible-by 32`` keeps the padded vocabulary at 8000 for TP=1 and
TP=2 (Megatron's default padding to 128*TP would give TP=2 a different softmax), and
CPU initialisation makes the initial weights independent of TP.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from megatron.training.cli.arguments import parse_args
from tests.harness import run_on_ranks
from tests.helpers import free_port, tiny_gpt_flags

pytestmark = pytest.mark.slow   # CPU training runs of a minute or more

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 30
TOLERANCE = 1e-5

MODEL = tiny_gpt_flags(untie_embeddings_and_output_weights=True,
                       make_vocab_size_divisible_by=32)
TRAINING = [
    "--global-batch-size", "8", "--train-iters", str(STEPS), "--lr", "2e-3",
    "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "3",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234",
    "--log-interval", "10", "--eval-interval", str(STEPS), "--eval-iters", "1",
    "--num-workers", "0", "--device", "cpu",
]
# name -> layout flags; micro-batches differ (the loss is a mean over tokens, so the
# micro-batch size does not change it) so that every run accumulates 2 micro-batches.
# Features that must not change the numbers ride along on some layouts: full and selective
# activation recompute (core_attn; mlp), the distributed optimizer (ZeRO-1) and
# both communication overlaps.
LAYOUTS = {
    "dp4": ["--micro-batch-size", "1"],
    "u2r2": ["--ulysses-degree", "2", "--ring-degree", "2", "--micro-batch-size", "4"],
    "u1r4": ["--ring-degree", "4", "--micro-batch-size", "4",
             "--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"],
    "u4r1": ["--ulysses-degree", "4", "--micro-batch-size", "4",
             "--recompute-granularity", "selective", "--use-distributed-optimizer",
             "--overlap-grad-reduce", "--overlap-param-gather"],
    # Selective recompute of the MLP only (the attention output is kept, so no second
    # attention forward): megatron-core's recompute_modules.
    "tp2u2": ["--tensor-model-parallel-size", "2", "--ulysses-degree", "2",
              "--micro-batch-size", "4", "--use-distributed-optimizer",
              "--recompute-granularity", "selective", "--recompute-modules", "mlp"],
    # Norms, residuals and dropout on 16 of each CP rank's 32 tokens; the norm-weight
    # gradients are summed over TP by finalize_model_grads. The norm outputs and the SwiGLU
    # product are recomputed in the backward (the layer spec's layernorm / swiglu recompute:
    # norms inside QKV / FC1, SwiGLU inside FC2).
    "tp2u2sp": ["--tensor-model-parallel-size", "2", "--ulysses-degree", "2",
                "--sequence-parallel", "--micro-batch-size", "4",
                "--recompute-granularity", "selective", "--recompute-modules", "layernorm",
                "swiglu"],
    # The same with this project's kernels (--fused-kernels usp, auto's choice on CUDA; their
    # plain-math path on the CPU: the norm and SwiGLU outputs dropped and refilled in place,
    # RoPE fused with the QKV split). Pipeline stages would initialise their layers from
    # another point of the RNG stream, so PP is compared within its own layout
    # (tests/distributed/test_fused_loss_training.py style: tests/distributed/
    # test_usp_kernels_training.py).
    "tp2u2sp_usp": ["--tensor-model-parallel-size", "2", "--ulysses-degree", "2",
                    "--sequence-parallel", "--micro-batch-size", "4", "--fused-kernels", "usp",
                    "--recompute-granularity", "selective", "--recompute-modules",
                    "layernorm", "swiglu"],
}

# Layouts run for their first ACCUMULATION_STEPS steps only (--exit-interval; the schedule
# is the 30-step one): U2xR2 with micro-batches of one sequence accumulates 8 per step, what
# a USP layout has at a DP run's global batch. The loss normalisation, the token count and
# the gradient scaling must not depend on the micro-batch count.
ACCUMULATION_STEPS = 10
SHORT_LAYOUTS = {
    "u2r2acc8": ["--ulysses-degree", "2", "--ring-degree", "2", "--micro-batch-size", "1",
                 "--exit-interval", str(ACCUMULATION_STEPS)],
}


def _compare_tool():
    spec = importlib.util.spec_from_file_location(
        "compare_loss", os.path.join(ROOT, "tools", "compare_loss.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _argv(name: str, out_dir: str):
    return MODEL + TRAINING + {**LAYOUTS, **SHORT_LAYOUTS}[name] + [
        "--metrics-file", os.path.join(out_dir, f"{name}.jsonl")]


def _train_all_layouts(rank, world_size, out_dir):
    from megatron.training.loop import pretrain  # megatron-core on first use

    for name in LAYOUTS:
        result = pretrain(parse_args(_argv(name, out_dir)))
        assert result.iteration == STEPS, (name, result.iteration)
        assert sorted(result.losses) == list(range(1, STEPS + 1))
    for name in SHORT_LAYOUTS:
        result = pretrain(parse_args(_argv(name, out_dir)))
        assert sorted(result.losses) == list(range(1, ACCUMULATION_STEPS + 1)), name


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("parity"))
    run_on_ranks(_train_all_layouts, 4, out_dir, timeout=600)
    return out_dir


def test_layouts_agree_per_step(parity_runs):
    tool = _compare_tool()
    series = [tool.load_series(os.path.join(parity_runs, f"{name}.jsonl"), label=name)
              for name in LAYOUTS]
    cmp = tool.compare(series)
    assert cmp.iterations == list(range(1, STEPS + 1))
    assert not cmp.missing
    worst, label, iteration = cmp.max_divergence()
    assert worst <= TOLERANCE, (
        f"{label} diverges from DP=4 by {worst:.3e} at iteration {iteration}\n"
        + tool.format_table(cmp))
    # The curve must be a training curve, not a constant: the loss falls.
    dp = series[0].values
    assert dp[STEPS] < dp[1] - 0.5, (dp[1], dp[STEPS])


def test_micro_batch_count_does_not_change_the_curve(parity_runs):
    tool = _compare_tool()
    series = [tool.load_series(os.path.join(parity_runs, f"{name}.jsonl"), label=name)
              for name in ["dp4", *SHORT_LAYOUTS]]
    cmp = tool.compare(series)
    assert cmp.iterations == list(range(1, ACCUMULATION_STEPS + 1))
    worst, label, iteration = cmp.max_divergence()
    assert worst <= TOLERANCE, (
        f"{label} diverges from DP=4 by {worst:.3e} at iteration {iteration}\n"
        + tool.format_table(cmp))


def test_layouts_agree_on_validation(parity_runs):
    tool = _compare_tool()
    series = [tool.load_series(os.path.join(parity_runs, f"{name}.jsonl"), kind="valid",
                               label=name) for name in LAYOUTS]
    cmp = tool.compare(series)
    assert cmp.iterations == [STEPS]
    assert cmp.max_divergence()[0] <= TOLERANCE


def test_metrics_records_are_complete(parity_runs):
    with open(os.path.join(parity_runs, "u2r2.jsonl")) as f:
        records = [json.loads(line) for line in f]
    run = [r for r in records if r["kind"] == "run"]
    assert run and run[0]["layout"] == "TP1 U2 R2 DP1 PP1" and run[0]["world_size"] == 4
    train = [r for r in records if r["kind"] == "train"]
    assert [r["iteration"] for r in train] == list(range(1, STEPS + 1))
    assert [r["consumed_samples"] for r in train] == [8 * i for i in range(1, STEPS + 1)]
    for r in train:
        assert r["grad_norm"] > 0 and r["lr"] > 0 and r["tokens_per_s"] > 0
        assert r["tflops_per_gpu"] > 0 and r["mfu"] is None and r["mem_gib"] > 0
        assert r["skipped"] is False


def test_torchrun_subprocess_matches(parity_runs, tmp_path):
    """pretrain_gpt.py under torchrun, U2 on 2 processes (same global batch, so the same
    curve), reproduces the in-process DP=4 curve."""
    metrics = str(tmp_path / "torchrun_u2.jsonl")
    argv = MODEL + TRAINING + ["--ulysses-degree", "2", "--micro-batch-size", "4",
                               "--metrics-file", metrics]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), os.path.join(ROOT, "pretrain_gpt.py")] + argv
    proc = subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"iteration {STEPS:8d}/{STEPS:8d}" in proc.stdout
    png = str(tmp_path / "parity.png")
    tool = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "compare_loss.py"),
         os.path.join(parity_runs, "dp4.jsonl"), metrics, "--tolerance", str(TOLERANCE),
         "--png", png], capture_output=True, text=True, timeout=120)
    assert tool.returncode == 0, tool.stdout + tool.stderr
    assert "OK: the curves agree" in tool.stdout
    assert os.path.getsize(png) > 10_000
