"""Loss parity with a hybrid local/global model: DP=4 vs U2xR2 vs U1xR4 (and TP, SP, PP,
packed documents).

The tiny Llama-style model and corpus of ``test_training_parity.py`` (CPU float32, 4 gloo
ranks, same seed and global batch, 30 steps, ``pretrain(args)``) with ``--window-size 12
--window-attn-skip-freq 2``: layer 1 attends to a window of 12 keys (in 64 tokens, so it
reaches past a ring chunk of 8 on U1xR4 and of 16 on U2xR2), layer 2 to everything. Per-step
losses and the final validation loss must agree with DP=4 to 1e-5 relative, and differ from
the same DP=4 run without a window (the window really changes the model). TP2xR2 with
sequence parallelism rides along; PP2xU2 is compared with PP2xDP2 (a PP run draws its stages'
weights from other RNG streams, as in ``test_document_training.py``), which also checks that
the per-layer rule reads megatron-core's global layer numbers on each stage; U1xR4 with packed
documents is compared with DP4 with packed documents (the window inside each document).
"""

from __future__ import annotations

import os

import pytest

from megatron.training.cli.arguments import parse_args
from tests.distributed.test_training_parity import MODEL, STEPS, TOLERANCE, TRAINING, _compare_tool
from tests.harness import run_on_ranks

pytestmark = pytest.mark.slow   # CPU training runs of a minute or more

WINDOW = ["--window-size", "12", "--window-attn-skip-freq", "2"]
DOCUMENTS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
LAYOUTS = {
    "dp4": ["--micro-batch-size", "1"] + WINDOW,
    "u2r2": ["--ulysses-degree", "2", "--ring-degree", "2", "--micro-batch-size", "4"] + WINDOW,
    "u1r4": ["--ring-degree", "4", "--micro-batch-size", "4",
             "--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1", "--window-size", "(12,0)",
             "--window-attn-skip-freq", "[1,0]"],
    "dp4-full": ["--micro-batch-size", "1"],
    "tp2r2sp": ["--tensor-model-parallel-size", "2", "--ring-degree", "2",
                "--sequence-parallel", "--micro-batch-size", "4"] + WINDOW,
    "pp2dp2": ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2"] + WINDOW,
    "pp2u2": ["--pipeline-model-parallel-size", "2", "--ulysses-degree", "2",
              "--micro-batch-size", "2"] + WINDOW,
    "dp4docs": ["--micro-batch-size", "1"] + WINDOW + DOCUMENTS,
    "u1r4docs": ["--ring-degree", "4", "--micro-batch-size", "4"] + WINDOW + DOCUMENTS,
}
GROUPS = (["dp4", "u2r2", "u1r4", "tp2r2sp"], ["pp2dp2", "pp2u2"], ["dp4docs", "u1r4docs"])


def _train_all_layouts(rank, world_size, out_dir):
    from megatron.training.loop import pretrain  # megatron-core on first use

    for name, layout in LAYOUTS.items():
        argv = MODEL + TRAINING + layout + ["--metrics-file", os.path.join(out_dir, f"{name}.jsonl")]
        result = pretrain(parse_args(argv))
        assert result.iteration == STEPS, (name, result.iteration)


@pytest.fixture(scope="module")
def window_runs(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("window"))
    run_on_ranks(_train_all_layouts, 4, out_dir, timeout=900)
    return out_dir


def _series(tool, out_dir, names, kind="train"):
    return [tool.load_series(os.path.join(out_dir, f"{name}.jsonl"), kind=kind, label=name)
            for name in names]


@pytest.mark.parametrize("group", GROUPS, ids=["no-pp", "pp", "documents"])
def test_window_layouts_agree_per_step(window_runs, group):
    tool = _compare_tool()
    cmp = tool.compare(_series(tool, window_runs, group))
    assert cmp.iterations == list(range(1, STEPS + 1)) and not cmp.missing
    worst, label, iteration = cmp.max_divergence()
    assert worst <= TOLERANCE, (
        f"{label} diverges from {group[0]} by {worst:.3e} at iteration {iteration}\n"
        + tool.format_table(cmp))


@pytest.mark.parametrize("group", GROUPS, ids=["no-pp", "pp", "documents"])
def test_window_layouts_agree_on_validation(window_runs, group):
    tool = _compare_tool()
    series = _series(tool, window_runs, group, kind="valid")
    assert tool.compare(series).max_divergence()[0] <= TOLERANCE


def test_the_window_changes_the_model(window_runs):
    tool = _compare_tool()
    worst = tool.compare(_series(tool, window_runs, ["dp4", "dp4-full"])).max_divergence()[0]
    assert worst > 100 * TOLERANCE
