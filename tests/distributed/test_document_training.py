"""Loss parity with packed documents: DP=4 vs U2xR2 vs U1xR4 (and TP, SP, PP) with
``--reset-position-ids --reset-attention-mask --eod-mask-loss``.

The tiny Llama-style model and corpus of ``test_training_parity.py`` (CPU float32, 4 gloo
ranks, same seed and global batch, 30 steps, ``pretrain(args)``), with the three Megatron-LM
document flags on every layout. The embedded corpus has real document lengths (median ~260
tokens, 5 % under 12, a long tail): at 64 tokens per sample many samples hold a boundary,
some several, and documents continue across samples (``tests/unit/test_documents.py`` checks
that the data really has boundaries and balanced non-zigzag chunk assignments). DP=4 attends within
documents with no context parallelism at all (the reference); U2xR2 and U1xR4 (with full
recompute) shard the documents over the ring with the balanced chunk assignment of each
micro-batch; TP2xR2 with sequence parallelism rides along. Per-step losses and the final
validation loss must agree with DP=4 to 1e-5 relative.

Pipeline parallelism initialises its stages' layers from other RNG streams than one stage
does, so a PP run is compared with the PP run of the same stages without context parallelism:
PP2xU2 against PP2xDP2 (every stage reads the batch's positions and document plan).
"""

from __future__ import annotations

import json
import math
import os

import pytest

import megatron.training.data.documents as documents
from megatron.shapes import ModelShape, dense_training_flops
from megatron.training.cli.arguments import parse_args
from tests.distributed.test_training_parity import MODEL, STEPS, TOLERANCE, TRAINING, _compare_tool
from tests.harness import run_on_ranks

pytestmark = pytest.mark.slow   # CPU training runs of a minute or more

FLAGS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
LAYOUTS = {
    "dp4": ["--micro-batch-size", "1"] + FLAGS,
    "u2r2": ["--ulysses-degree", "2", "--ring-degree", "2", "--micro-batch-size", "4"] + FLAGS,
    "u1r4": ["--ring-degree", "4", "--micro-batch-size", "4",
             "--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"] + FLAGS,
    "tp2r2sp": ["--tensor-model-parallel-size", "2", "--ring-degree", "2",
                "--sequence-parallel", "--micro-batch-size", "4"] + FLAGS,
    "pp2dp2": ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2"] + FLAGS,
    "pp2u2": ["--pipeline-model-parallel-size", "2", "--ulysses-degree", "2",
              "--micro-batch-size", "2"] + FLAGS,
}
GROUPS = (["dp4", "u2r2", "u1r4", "tp2r2sp"], ["pp2dp2", "pp2u2"])


def _argv(name: str, out_dir: str):
    return MODEL + TRAINING + LAYOUTS[name] + [
        "--metrics-file", os.path.join(out_dir, f"{name}.jsonl")]


def _train_all_layouts(rank, world_size, out_dir):
    from megatron.training.loop import pretrain  # megatron-core on first use

    real, moved = documents.balance_chunks, []

    def counting(*args, **kwargs):            # the loader runs in-process (--num-workers 0)
        choice = real(*args, **kwargs)
        moved.append(not choice.is_zigzag)
        return choice

    documents.balance_chunks = counting
    for name in LAYOUTS:
        moved.clear()
        result = pretrain(parse_args(_argv(name, out_dir)))
        assert result.iteration == STEPS, (name, result.iteration)
        if name in ("u2r2", "u1r4"):          # a balanced chunk assignment really was used
            assert any(moved), (name, len(moved))


@pytest.fixture(scope="module")
def document_runs(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("documents"))
    run_on_ranks(_train_all_layouts, 4, out_dir, timeout=900)
    return out_dir


@pytest.mark.parametrize("group", GROUPS, ids=["no-pp", "pp"])
def test_document_layouts_agree_per_step(document_runs, group):
    tool = _compare_tool()
    series = [tool.load_series(os.path.join(document_runs, f"{name}.jsonl"), label=name)
              for name in group]
    cmp = tool.compare(series)
    assert cmp.iterations == list(range(1, STEPS + 1)) and not cmp.missing
    worst, label, iteration = cmp.max_divergence()
    assert worst <= TOLERANCE, (
        f"{label} diverges from {group[0]} by {worst:.3e} at iteration {iteration}\n"
        + tool.format_table(cmp))
    first = series[0].values
    assert first[STEPS] < first[1] - 0.5, (first[1], first[STEPS])


@pytest.mark.parametrize("group", GROUPS, ids=["no-pp", "pp"])
def test_document_layouts_agree_on_validation(document_runs, group):
    tool = _compare_tool()
    series = [tool.load_series(os.path.join(document_runs, f"{name}.jsonl"), kind="valid",
                               label=name) for name in group]
    assert tool.compare(series).max_divergence()[0] <= TOLERANCE


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _flops_per_iteration(records):
    """Each train record's FLOPs (TFLOP/s per GPU x step time x GPUs) and its count label."""
    world = next(r for r in records if r["kind"] == "run")["world_size"]
    return [(r["tflops_per_gpu"] * 1e12 * r["step_time_s"] * world, r["flops_count"])
            for r in records if r["kind"] == "train"]


def test_every_layout_counts_the_documents_work(document_runs):
    """MFU counts the pairs the documents compute (fewer than dense), the same on every
    layout: DP ranks add their micro-batches, CP ranks share theirs, PP's last stage reports."""
    records = {name: _records(os.path.join(document_runs, f"{name}.jsonl")) for name in LAYOUTS}
    reference = _flops_per_iteration(records["dp4"])
    for name, recs in records.items():
        flops = _flops_per_iteration(recs)
        assert [label for _, label in flops] == ["documents"] * STEPS, name
        for (got, _), (want, _) in zip(flops, reference):
            assert abs(got - want) <= 1e-5 * want, (name, got, want)
    a = next(r for r in records["dp4"] if r["kind"] == "run")["args"]
    shape = ModelShape(num_layers=a["num_layers"], hidden_size=a["hidden_size"],
                       num_attention_heads=a["num_attention_heads"],
                       num_query_groups=a["num_query_groups"],
                       ffn_hidden_size=a["ffn_hidden_size"], vocab_size=a["padded_vocab_size"],
                       kv_channels=a["kv_channels"], swiglu=a["swiglu"])
    dense = dense_training_flops(shape, a["seq_length"], a["global_batch_size"])
    # a batch of samples that are each one document costs the dense count (to the rounding of
    # the recorded rates); a batch with boundaries costs less
    assert all(f <= dense * (1 + 1e-6) for f, _ in reference), (reference[:3], dense)
    assert any(f < dense * (1 - 1e-4) for f, _ in reference), (reference, dense)


def test_every_step_records_its_new_attention_shapes(document_runs):
    """Packed documents: each train record says how many attention shapes the step ran
    batched for the first time in the process (``new_plan_shapes``: on a GPU the steps that
    built cuDNN plans), on every layout. The layouts train one after another in the same
    processes, so the first (dp4) meets the first shapes: its first step has some."""
    for name in LAYOUTS:
        counts = [r["new_plan_shapes"] for r in
                  _records(os.path.join(document_runs, f"{name}.jsonl")) if r["kind"] == "train"]
        assert len(counts) == STEPS and all(isinstance(c, int) and c >= 0 for c in counts), \
            (name, counts)
        if name == "dp4":
            assert counts[0] > 0, counts


# --------------------------------------------------------------------------- empty shards
# Every document is 3 tokens and 61 EODs, 64 tokens: GPTDataset's samples (64 tokens plus
# one, each starting 64 after the last) are whole documents, so every micro-batch has its
# loss tokens in the first 3 positions and EODs (no loss with --eod-mask-loss) in the other
# 61. Any chunk assignment cuts chunks of at least 4 tokens (load_balance.MIN_CHUNK_TOKENS),
# so one CP rank holds the 3 and the other three hold only EODs: no loss token.
EMPTY_VOCAB, EMPTY_STEPS = 96, 6
EMPTY_LAYOUTS = {
    "dp4": ["--micro-batch-size", "1"],
    "u2r2": ["--ulysses-degree", "2", "--ring-degree", "2", "--micro-batch-size", "4"],
    "u1r4": ["--ring-degree", "4", "--micro-batch-size", "2"],
    "u2r2-fused-loss": ["--ulysses-degree", "2", "--ring-degree", "2", "--micro-batch-size",
                        "4", "--fused-linear-cross-entropy"],
}


def _write_mostly_eod_dataset(prefix: str) -> None:
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(256):
        doc = np.concatenate([rng.integers(0, EMPTY_VOCAB, 3), np.full(61, EMPTY_VOCAB)])
        builder.add_document(doc.astype(np.int32), [64])
    builder.finalize(prefix + ".idx")


def _train_with_empty_shards(rank, world_size, prefix, out_dir):
    import torch
    import torch.distributed as dist

    import megatron.training.data.batch as batch
    from megatron.training.cli.arguments import parse_args
    from megatron.training.loop import pretrain

    real, empty = batch.loss_func, []

    def counting(loss_mask, output_tensor, **kwargs):
        empty.append(int(loss_mask.sum()) == 0)
        return real(loss_mask, output_tensor, **kwargs)

    batch.loss_func = counting
    common = [a for a in MODEL if a != "--make-vocab-size-divisible-by"
              and a != "32"] + FLAGS + [
        "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size",
        str(EMPTY_VOCAB), "--split", "100,0,0", "--eval-iters", "0", "--global-batch-size",
        "4", "--train-iters", str(EMPTY_STEPS), "--lr", "2e-3", "--clip-grad", "1.0",
        "--log-interval", "1", "--num-workers", "0", "--device", "cpu", "--seed", "1234"]
    for name, layout in EMPTY_LAYOUTS.items():
        empty.clear()
        pretrain(parse_args(common + layout + [
            "--metrics-file", os.path.join(out_dir, f"{name}.jsonl")]))
        seen = torch.tensor([sum(empty), len(empty)])
        dist.all_reduce(seen)
        # DP ranks always see loss tokens; on CP 4 some ranks' shards never do.
        assert (seen[0] > 0) == (name != "dp4"), (name, seen.tolist())


def test_a_cp_rank_without_loss_tokens_trains_like_dp(tmp_path):
    """A CP rank whose shard of a packed micro-batch is all EOD (no loss token under
    --eod-mask-loss) contributes zero to the loss sum and to the token count; the step
    divides by the global count, so loss and grad norm equal DP's per step to 1e-5."""
    import json

    from tests.harness import run_on_ranks

    prefix = str(tmp_path / "mostly_eod_text_document")
    _write_mostly_eod_dataset(prefix)
    run_on_ranks(_train_with_empty_shards, 4, prefix, str(tmp_path), timeout=600)

    def series(name):
        with open(tmp_path / f"{name}.jsonl") as f:
            records = [json.loads(line) for line in f]
        return [(r["lm_loss"], r["grad_norm"]) for r in records if r["kind"] == "train"]

    reference = series("dp4")
    assert len(reference) == EMPTY_STEPS
    for name in EMPTY_LAYOUTS:
        for step, ((loss, norm), (want_loss, want_norm)) in enumerate(
                zip(series(name), reference), 1):
            assert math.isfinite(loss) and math.isfinite(norm), (name, step, loss, norm)
            assert abs(loss - want_loss) <= TOLERANCE * abs(want_loss), (name, step, loss,
                                                                          want_loss)
            assert abs(norm - want_norm) <= TOLERANCE * abs(want_norm), (name, step, norm,
                                                                          want_norm)
