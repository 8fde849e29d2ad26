"""``pretrain_gpt.py`` flags for long sequences train the curve of plain full recompute.

Through ``pretrain(args)`` on 2 gloo ranks, float32, the tiny Llama-style model of the parity
test, 4 steps of 4 sequences of 64 tokens, one launch for every run. Pairs that must agree:

* U2, full recompute vs + ``--recompute-keep-core-attn --recompute-cpu-offload layer_input
  core_attn``: bitwise (kept outputs are reused verbatim, offloaded tensors come back as
  copies);
* PP2 (4 micro-batches, 1F1B: several forwards open before their backwards) the same pair:
  bitwise;
* TP2 with ``--sequence-parallel``, full recompute vs + ``--mlp-tile-tokens 8`` (the MLP's 32
  local tokens in 4 tiles, each all-gathered and reduce-scattered over TP) and the offload
  flags: to 1e-6 relative (a tile's GEMMs have fewer rows; float32).

The curves must also be training curves (the loss falls), so an identical-but-broken pair
fails.
"""

from __future__ import annotations

import json
import os

import pytest

from megatron.training.cli.arguments import parse_args
from tests.harness import run_on_ranks
from tests.helpers import tiny_gpt_flags

STEPS = 4
MODEL = tiny_gpt_flags(untie_embeddings_and_output_weights=True, mock_data=True, vocab_size=255)
TRAINING = [
    "--global-batch-size", "4", "--micro-batch-size", "1", "--train-iters", str(STEPS),
    "--lr", "3e-3", "--lr-warmup-iters", "1", "--seed", "1234", "--log-interval", "10",
    "--eval-iters", "0", "--num-workers", "0", "--device", "cpu",
    "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1",
]
KEEP_OFFLOAD = ["--recompute-keep-core-attn", "--recompute-cpu-offload", "layer_input",
                "core_attn"]
RUNS = {
    "u2_full": ["--ulysses-degree", "2"],
    "u2_keep_offload": ["--ulysses-degree", "2"] + KEEP_OFFLOAD,
    "pp2_full": ["--pipeline-model-parallel-size", "2"],
    "pp2_keep_offload": ["--pipeline-model-parallel-size", "2"] + KEEP_OFFLOAD,
    "tp2sp_full": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "tp2sp_tiled": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                    "--mlp-tile-tokens", "8"] + KEEP_OFFLOAD,
}


def _train(rank, world_size, out_dir):
    from megatron.training.loop import pretrain  # megatron-core on first use

    losses = {}
    for name, flags in RUNS.items():
        result = pretrain(parse_args(MODEL + TRAINING + flags))
        assert result.iteration == STEPS, (name, result.iteration)
        losses[name] = [result.losses[i] for i in range(1, STEPS + 1)]
    if rank == 0:
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump(losses, f)


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    out = tmp_path_factory.mktemp("long_seq")
    run_on_ranks(_train, 2, str(out), timeout=600)
    with open(out / "losses.json") as f:
        return json.load(f)


@pytest.mark.parametrize("layout", ["u2", "pp2"])
def test_keep_and_offload_train_the_same_curve(losses, layout):
    full, kept = losses[f"{layout}_full"], losses[f"{layout}_keep_offload"]
    assert kept == full
    assert full[-1] < full[0] - 0.05, full


def test_tiled_mlp_with_sequence_parallel_trains_the_same_curve(losses):
    full, tiled = losses["tp2sp_full"], losses["tp2sp_tiled"]
    for a, b in zip(tiled, full):
        assert abs(a - b) <= 1e-6 * abs(b), (tiled, full)
    assert full[-1] < full[0] - 0.05, full
