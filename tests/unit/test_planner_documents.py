"""The planner on packed documents (``--docs MIX``): the documents' pairs for attention time
and FLOPs (the training loop's count), the document ring's traffic under the loader's chunk
assignment, the document flags in the printed command, and the effect on the 0.85B model."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from megatron.planner import PlannerError, Workload, get_hardware, plan_layouts
from megatron.planner import documents as pdocs
from megatron.planner.cost_model import Layout, document_layers, estimate
from megatron.planner.plan import plan_from
from megatron.shapes import PRESETS, ModelShape, shape_pairs, training_flops
from megatron.training.cli.arguments import parse_args, validate_args
from megatron.training.data.batch import attention_pairs
from megatron.training.loop import flops_count_label
from megatron.usp import load_balance as lb
from megatron.usp.document_ring import build_document_ring_plan
from tests.helpers import load_tool

H200 = get_hardware("h200")
TINY = ModelShape(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                  ffn_hidden_size=512, vocab_size=1000, swiglu=True)
RUN = ["--lr", "1e-4", "--train-iters", "10", "--mock-data", "--eval-iters", "0"]


def _cli():
    return load_tool("plan_parallel")


@pytest.mark.parametrize("mix", ["fixed:0", "fixed:two", "gaussian", "lognormal,fixed:2k", ""])
def test_a_bad_mix_is_refused_in_one_line_naming_docs(mix, capsys):
    assert _cli().main(["--model", "llama-0.85b", "--seq-length", "8192", "--gpus", "8",
                        "--docs", mix]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--docs" in err and "fixed:2k" in err


def test_the_corpus_mix_is_refused_where_the_corpus_is_missing(monkeypatch):
    from megatron.bench import document_bench

    monkeypatch.setattr(document_bench, "corpus_lengths", lambda: None)
    for cached in (pdocs.packed_lengths, pdocs.packed_samples, pdocs.sample_lengths):
        cached.cache_clear()
    with pytest.raises(PlannerError, match="--docs corpus: the embedded corpus"):
        estimate(Workload(TINY, 4096, 1, 8, documents="corpus"), Layout.of(1, 1, 1, 1, 1),
                 H200)
    for cached in (pdocs.packed_lengths, pdocs.packed_samples, pdocs.sample_lengths):
        cached.cache_clear()


def test_samples_are_packed_as_the_loader_packs_them():
    """Documents back to back, one cut at a sample end continuing in the next sample."""
    rows = pdocs.sample_lengths(pdocs.Documents("fixed:3k"), 8192, 3)
    assert rows == ((3072, 3072, 2048), (1024, 3072, 3072, 1024), (2048, 3072, 3072))
    assert all(sum(r) == 16384 for r in pdocs.sample_lengths(pdocs.Documents("lognormal"),
                                                             16384, 4))


@pytest.mark.parametrize("window, freq", [(None, None), (512, [1, 0, 1, 1])])
@pytest.mark.parametrize("mix", ["lognormal", "uniform:4k", "fixed:2k"])
def test_plan_flops_are_the_training_loops_count_of_the_same_documents(mix, window, freq):
    """One count: for the planner's own samples (a global batch of exactly them), its FLOPs
    per step are what the training loop counts from their segment ids (and, without a
    window, bench_e2e's sum of n^2/2 over the documents)."""
    model = replace(TINY, window_size=window, window_attn_skip_freq=freq)
    s, samples = 8192, pdocs.plan_samples(1)
    w = Workload(model, s, 1, 8, 1, samples, documents=mix)
    e = estimate(w, Layout.of(1, 1, 1, 1, 1), H200)
    seg = torch.from_numpy(pdocs.packed_samples(pdocs.Documents(mix), s, samples))
    full = {"tokens": torch.zeros_like(seg), "segment_ids": seg}
    pairs = attention_pairs(full, True, window, model.window_share())
    assert e.model_flops_per_step == training_flops(model, samples * s, pairs)
    assert e.flops_count == "documents"
    if window is None:
        from megatron.bench.e2e.documents import TrainedBatches

        rows = [np.asarray(r) for r in pdocs.sample_lengths(pdocs.Documents(mix), s, samples)]
        batches = TrainedBatches(None, None, rows, samples, 0)
        assert e.model_flops_per_step == training_flops(model, samples * s,
                                                        batches.pairs_per_iteration()[0])
    dense = estimate(replace(w, documents=None), Layout.of(1, 1, 1, 1, 1), H200)
    assert dense.model_flops_per_step == training_flops(model, samples * s,
                                                        samples * shape_pairs(model, [s]))
    assert e.model_flops_per_step < dense.model_flops_per_step


@pytest.mark.parametrize("mix", ["lognormal", "uniform:4k", "fixed:3k"])
@pytest.mark.parametrize("ulysses, ring", [(1, 4), (2, 2)])
def test_ring_rank_kv_tokens_are_the_document_rings_own(mix, ulysses, ring):
    """The per-ring-rank K/V count is what the document ring's plan of each rank sends and
    receives, under the loader's assignment."""
    seg = lb.segments_from_lengths(pdocs.sample_lengths(pdocs.Documents(mix), 8192 * 2, 1)[0],
                                   8192, 2)
    bal = lb.balance_chunks(seg, ulysses, ring)
    counts = lb.ring_rank_kv_tokens(seg, ring, bal.assignment)
    for r in range(ring):
        plan = build_document_ring_plan(seg, r, ring, bal.assignment)
        assert counts[0, r] == plan.kv_tokens_sent()
        assert counts[1, r] == sum(plan.recv_tokens(i) for i in range(1, ring)
                                   if plan.receives(i))
    assert counts[0].sum() == counts[1].sum() == lb.ring_kv_tokens(seg, ring, bal.assignment)


def test_document_ring_moves_less_than_the_whole_ring():
    """Short documents stay on their ring rank (nothing moves); long ones move their
    crossing part; the dense ring moves whole blocks."""
    model, s = PRESETS["llama-0.85b"], 65536
    lay = Layout.of(1, 1, 4, 2, 1, 1)
    vol = {mix: estimate(Workload(model, s, 8, 8, documents=mix), lay, H200).volumes["ring_p2p"]
           for mix in (None, "lognormal", "fixed:2k")}
    assert vol["fixed:2k"] == 0.0 < vol["lognormal"] < vol[None]
    full, windowed = document_layers(Workload(model, s, 8, 8, documents="lognormal"), lay, None)
    assert windowed is None and 0 < full.halo.received < 3 * s / 4
    assert 0.0 <= full.spread < 0.05 and 2048 < full.kernel_tokens < s


def test_the_printed_command_runs_documents():
    """The plan's flags carry the document flags, and pretrain_gpt.py's validation accepts
    them with a ranked layout of the documents' plan."""
    model = PRESETS["llama-0.85b"]
    result = plan_layouts(Workload(model, 32768, 8, 8, documents="lognormal"), "h200", top=3)
    for ranked in result.ranked:
        plan = plan_from(result, ranked)
        flags = plan.pretrain_flags
        assert flags[-6:-4] == ["--reset-attention-mask", "--reset-position-ids"]
        config = validate_args(parse_args(flags + RUN + ["--vocab-size", str(model.vocab_size)]),
                               8, cuda_available=True)
        # the training metrics will call the count what the plan's estimate calls it
        assert flops_count_label(config) == plan.estimate.flops_count == "documents"
        assert (config.dims.ulysses, config.dims.ring) == (plan.ulysses_degree, plan.ring_degree)
    dense = plan_layouts(Workload(model, 32768, 8, 8), "h200", top=1)
    assert "--reset-attention-mask" not in plan_from(dense, dense.best).pretrain_flags


def test_packed_documents_plan_a_shorter_step_for_the_085b_model_at_128k():
    """llama-0.85b, 128K tokens, 8 GPUs, a global batch of 8: lognormal documents plan a
    shorter step than dense sequences, 2K documents a shorter one still, and the MFU counts
    the documents' pairs (higher: less of the step is attention)."""
    model = PRESETS["llama-0.85b"]
    best = {mix: plan_layouts(Workload(model, 131072, 8, 8, 1, 8, documents=mix), "h200",
                              top=1).best.estimate
            for mix in (None, "lognormal", "fixed:2k")}
    assert best["fixed:2k"].step_time_s < best["lognormal"].step_time_s < best[None].step_time_s
    assert best["lognormal"].step_time_s < 0.5 * best[None].step_time_s
    assert best[None].mfu < best["lognormal"].mfu < best["fixed:2k"].mfu
    assert best["fixed:2k"].model_flops_per_step < best[None].model_flops_per_step
