"""``--ulysses-degree auto`` with ``--reset-attention-mask`` plans the run's packed documents:
megatron-core's mock documents with ``--mock-data``, the training split's lengths read from
the ``.idx`` files with ``--data-path``; without the flag, dense sequences. The plan is the one
``tools/plan_parallel.py --docs`` gives for the same documents."""

from __future__ import annotations

import contextlib
import io
import json
import types
from dataclasses import replace

import numpy as np
import pytest

import megatron.planner as planner
from megatron.planner import Documents, Workload, estimate, get_hardware
from megatron.planner import documents as pdocs
from megatron.planner.cost_model import Layout
from megatron.training.cli.arguments import parse_args, validate_args
from megatron.training.cli.auto_layout import resolve_auto_layout, run_documents
from megatron.training.data import document_lengths as dl
from megatron.training.data.tokenizer import NullTokenizer
from tests.helpers import load_tool

SEQ = 131072


def _flags(seq_length, extra=()):
    """The 0.85B Llama-style model (``llama-0.85b``) with 'auto' degrees, global batch 8."""
    return ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16",
            "--group-query-attention", "--num-query-groups", "4", "--ffn-hidden-size", "5632",
            "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--seq-length", str(seq_length), "--train-iters", "10", "--lr", "1e-4",
            "--vocab-size", "32000", "--ulysses-degree", "auto", "--ring-degree", "auto",
            "--global-batch-size", "8", "--gpus-per-node", "8",
            "--use-distributed-optimizer", *extra]


def _config(seq_length=SEQ, extra=("--mock-data",), world=8):
    return validate_args(parse_args(_flags(seq_length, extra)), world, cuda_available=True)


def _spy(monkeypatch):
    """Record each plan ``choose_layout`` returns, with the documents it was given."""
    seen = []
    real = planner.choose_layout

    def spy(*a, **kw):
        plan = real(*a, **kw)
        seen.append((kw["documents"], plan))
        return plan

    monkeypatch.setattr(planner, "choose_layout", spy)
    return seen


def _write(prefix, lengths, eod=999):
    from megatron.core.datasets.indexed_dataset import (  # megatron-core on first use
        IndexedDatasetBuilder,
    )

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for n in lengths:
        builder.add_document(np.asarray([1] * (n - 1) + [eod], dtype=np.uint16), [n])
    builder.finalize(prefix + ".idx")
    return prefix


# ------------------------------------------------------------------ which documents
def test_without_reset_attention_mask_the_plan_is_dense(monkeypatch):
    seen = _spy(monkeypatch)
    config = _config(extra=("--mock-data", "--reset-position-ids"))
    assert run_documents(config) is None
    _, reasons = resolve_auto_layout(config, 32000, "NVIDIA H200")
    assert seen[0][0] is None and seen[0][1].estimate.flops_count == "dense causal"
    assert not any("packed documents" in r for r in reasons)


def test_mock_data_plans_megatron_cores_mock_documents():
    """megatron-core's MockGPTLowLevelDataset draws lengths uniform in 1..4095: the uniform:4k
    mix, named in the plan's reasons."""
    from megatron.core.datasets.gpt_dataset import (  # megatron-core on first use
        MockGPTLowLevelDataset,
    )

    mock = MockGPTLowLevelDataset(types.SimpleNamespace(vocab_size=32001, eod=32000))
    lengths = np.asarray(mock.sequence_lengths)
    assert lengths.min() == 1 and lengths.max() == 4095 and abs(lengths.mean() - 2048) < 20
    assert dl.mock_mix() == ("uniform:4k", 4096)
    docs = run_documents(_config(extra=("--mock-data", "--reset-attention-mask")),
                         tokenizer=NullTokenizer(32000))
    assert docs == Documents(mix="uniform:4k", label="megatron-core's mock documents (uniform:4k)")
    planned = pdocs.packed_lengths(docs, SEQ, pdocs.plan_samples(1))
    assert min(planned) >= 1 and max(planned) <= 4095


@pytest.mark.parametrize("vocab, eod", [(1001, 1000), (32000, 2), (50, 0), (32001, 32000)])
def test_mock_documents_are_cut_where_the_mask_cuts_them(vocab, eod):
    """A mock document holds ids (j+1) % vocab and ends with the EOD; an EOD id inside it
    ends a document for --reset-attention-mask too: the cut lengths are the segments of
    megatron-core's own tokens."""
    from megatron.core.datasets.gpt_dataset import (  # megatron-core on first use
        MockGPTLowLevelDataset,
    )

    mock = MockGPTLowLevelDataset(types.SimpleNamespace(vocab_size=vocab, eod=eod))
    for i in range(40):
        tokens = np.asarray(mock[i])
        ends = np.flatnonzero(tokens == eod) + 1
        segments = np.diff(np.concatenate([[0], ends])).tolist()
        assert dl.cut_at_inner_eods([len(tokens)], vocab, eod) == segments


def test_a_small_vocabulary_cuts_the_planned_mock_documents():
    """NullTokenizer(1000) (EOD 1000, vocabulary 1001) puts the EOD id inside mock documents
    longer than 1000 tokens: the plan's documents are the mix's, cut there."""
    config = _config(extra=("--mock-data", "--reset-attention-mask"))
    docs = run_documents(config, tokenizer=NullTokenizer(1000))
    assert docs.lengths is not None and max(docs.lengths) <= 1001
    assert "cut at the EOD id 1000" in docs.name()
    whole = pdocs.packed_lengths(Documents(mix="uniform:4k"), SEQ, pdocs.plan_samples(1))
    assert sum(docs.lengths) == sum(whole) and len(docs.lengths) > len(whole)


def test_real_data_plans_the_training_splits_lengths(tmp_path, monkeypatch):
    """--data-path: documents of the train split only (--split), drawn with --seed from the
    .idx, enough to fill the plan's samples; the same on every call (every rank)."""
    rng = np.random.default_rng(3)
    train = rng.integers(200, 4000, 300).tolist()
    prefix = _write(str(tmp_path / "d"), train + [7777] * 100)  # the valid split: 7777s
    extra = ("--data-path", prefix, "--split", "75,25,0", "--reset-attention-mask")
    seq = 32768
    docs = run_documents(_config(seq, extra))
    assert docs.label == "the training data's lengths"
    assert set(docs.lengths) <= set(train)
    need = pdocs.plan_tokens(seq, 1)
    assert need <= sum(docs.lengths) < need + 4000
    assert docs == run_documents(_config(seq, extra))
    assert docs != run_documents(_config(seq, extra + ("--seed", "7")))
    seen = _spy(monkeypatch)
    _, reasons = resolve_auto_layout(_config(seq, extra), 32000, "NVIDIA H200")
    assert seen[0][0] == docs
    packed = pdocs.packed_lengths(docs, seq, pdocs.plan_samples(1))
    line = [r for r in reasons if r.startswith("packed documents: ")]
    median = np.median(packed) / 1024
    assert line and line[0].startswith(
        f"packed documents: the training data's lengths, median {median:.1f}K, "
        f"{len(packed)} documents in 4 samples of {seq}")


def test_a_blend_draws_each_prefix_by_its_weight(tmp_path):
    a = _write(str(tmp_path / "a"), [512] * 200)
    b = _write(str(tmp_path / "b"), [2048] * 200)
    tokens = 1 << 18
    lengths = dl.training_document_lengths(["0.75", a, "0.25", b], "100,0,0", 1, tokens)
    share = lengths[lengths == 512].sum() / lengths.sum()
    assert abs(share - 0.75) < 0.01 and lengths.sum() >= tokens
    # unweighted prefixes: by the train splits' tokens (b holds 4x a's)
    lengths = dl.training_document_lengths([a, b], "100,0,0", 1, tokens)
    assert abs(lengths[lengths == 512].sum() / lengths.sum() - 0.2) < 0.01


def test_a_train_split_without_tokens_is_refused_naming_split(tmp_path):
    prefix = _write(str(tmp_path / "d"), [100] * 4)
    with pytest.raises(ValueError, match="--split 1,99,0: the train split of"):
        dl.training_document_lengths([prefix], "1,99,0", 1, 1000)


# ------------------------------------------------------------------ the plan
def _plan_parallel_json(argv):
    cli = load_tool("plan_parallel")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv + ["--json"]) == 0
    return json.loads(out.getvalue())


def test_the_mock_document_plan_is_plan_parallels_docs_plan(monkeypatch):
    """One source of truth: the run's plan and prediction are plan_parallel.py --docs
    uniform:4k's for the same model, cluster and fixed degrees."""
    seen = _spy(monkeypatch)
    resolve_auto_layout(_config(extra=("--mock-data", "--reset-attention-mask")), 32000,
                        "NVIDIA H200")
    plan = seen[0][1]
    cli = _plan_parallel_json(["--model", "llama-0.85b", "--seq-length", str(SEQ), "--gpus", "8",
                               "--gpus-per-node", "8", "--hardware", "h200",
                               "--global-batch-size", "8", "--docs", "uniform:4k",
                               "--tensor-model-parallel-size", "1",
                               "--pipeline-model-parallel-size", "1", "--zero-stage", "1",
                               "--recompute", "none", "--plain-cross-entropy", "--top", "1"])
    best = cli["plans"][0]
    assert cli["workload"]["documents"] == "uniform:4k"
    assert (best["ulysses_degree"], best["ring_degree"]) == (plan.ulysses_degree,
                                                             plan.ring_degree)
    assert best["predicted_step_time_s"] == plan.predicted_step_time_s


def test_explicit_lengths_cost_what_their_mix_costs():
    """A mix and its own lengths given explicitly are one workload to the cost model."""
    model, h200 = planner.load_model("llama-0.85b"), get_hardware("h200")
    mix = Documents(mix="lognormal")
    given = Documents(lengths=pdocs.packed_lengths(mix, 65536, pdocs.plan_samples(1)))
    for lay in (Layout.of(1, 2, 4, 1, 1, 1), Layout.of(1, 8, 1, 1, 1, 1)):
        a, b = (estimate(Workload(model, 65536, 8, 8, 1, 8, d), lay, h200) for d in (mix, given))
        assert a.step_time_s == b.step_time_s and a.volumes == b.volumes


def test_documents_choose_another_layout_than_dense_sequences(monkeypatch):
    """llama-0.85b at 128K on 8 H200s: dense sequences take Ulysses (attention dominates,
    its all-to-all is the cheaper axis), mock documents (at most 4K tokens, most of them on
    one ring rank) a Ring with almost nothing to move, and a step several times shorter."""
    seen = _spy(monkeypatch)
    for extra in ((), ("--reset-attention-mask",)):
        resolve_auto_layout(_config(extra=("--mock-data", *extra)), 32000, "NVIDIA H200")
    (_, dense), (_, docs) = seen
    assert (dense.ulysses_degree, dense.ring_degree) != (docs.ulysses_degree,
                                                         docs.ring_degree)
    assert docs.predicted_step_time_s < dense.predicted_step_time_s / 4


def test_window_layers_are_planned_with_the_documents(monkeypatch):
    """--window-size with --reset-attention-mask: the plan costs the window layers on the
    same documents, as the planner does for a windowed model and its mix."""
    seen = _spy(monkeypatch)
    window = ("--window-size", "1024", "--window-attn-skip-freq", "2")
    resolve_auto_layout(_config(extra=("--mock-data", "--reset-attention-mask", *window)),
                        32000, "NVIDIA H200")
    resolve_auto_layout(_config(extra=("--mock-data", "--reset-attention-mask")), 32000,
                        "NVIDIA H200")
    (_, windowed), (_, full) = seen
    model = planner.load_model("llama-0.85b")
    w = Workload(replace(model, window_size=1024, window_attn_skip_freq=2), SEQ, 8, 8, 1, 8,
                 Documents(mix="uniform:4k"))
    unfused_loss = replace(planner.DEFAULT_ASSUMPTIONS, loss_chunk_tokens=None)
    expected = estimate(w, windowed.estimate.layout, get_hardware("h200"), unfused_loss)
    assert windowed.predicted_step_time_s == expected.step_time_s
    assert windowed.estimate.model_flops_per_step < full.estimate.model_flops_per_step
