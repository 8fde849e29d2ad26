"""``bench_attention --doc-kernels ... --doc-stream N``: the samples, the choices over a stream,
the ranking against the fastest kernel and the flag's refusals (megatron/bench/document_stream.py)."""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.bench import attention_bench as ab
from megatron.bench import document_stream as ds
from megatron.bench.cli import BenchConfigError
from megatron.bench.document_bench import (
    DOC_KERNELS,
    DocCaseResult,
    check_document_config,
    kernel_inputs,
)
from megatron.bench.document_stream import (
    SEED_STRIDE,
    STREAM_REFUSED,
    check_stream_config,
    rank_stream_rows,
    sample_segments,
    stream_case,
    stream_order,
    stream_seeds,
    tally_choices,
)
from megatron.usp import packed_documents as pd
from megatron.usp.kernels import get_kernel

STREAM_KERNELS = [k for k in DOC_KERNELS if k not in STREAM_REFUSED]


def _cfg(**kw):
    base = dict(seq_lens=[128], heads=4, kv_heads=4, head_dim=16, dtype="fp32", warmup=1,
                docs=["fixed:16"], doc_kernels=["tiles", "auto", "packed"], doc_stream=3)
    base.update(kw)
    return ab.AttentionBenchConfig(**base)


# --------------------------------------------------------------------------- the samples
def test_seeds_are_distinct_over_samples_kernels_and_lengths():
    seen = []
    for kernel, seq_len in itertools.product(STREAM_KERNELS, (32768, 131072)):
        warm, stream = stream_seeds(1234, kernel, seq_len, warmup=2, samples=16)
        assert len(warm) == 2 and len(stream) == 16
        seen += warm + stream
    assert len(set(seen)) == len(seen) and 1234 not in seen


@pytest.mark.parametrize("documents", [746, 1000, 4096])
def test_corpus_offsets_of_one_stream_are_distinct(documents):
    """The corpus mix starts a sample at document ``seed mod size``: every sample of a run
    starts at its own document while the corpus has that many."""
    offsets = [s % documents for k in STREAM_KERNELS
               for s in sum(stream_seeds(1234, k, 32768, 2, 16), [])]
    assert len(offsets) <= documents and len(set(offsets)) == len(offsets)
    assert SEED_STRIDE % documents != 0


def test_random_mixes_differ_per_sample_and_fixed_mixes_do_not():
    cfg = _cfg(docs=["lognormal", "uniform:64", "fixed:16"])
    _, seeds = stream_seeds(cfg.seed, "tiles", 65536, 0, 4)
    for mix in ("lognormal", "uniform:64"):
        samples = [sample_segments(cfg, mix, 65536, s) for s in seeds]
        for a, b in itertools.combinations(samples, 2):
            assert a.shape == b.shape == (1, 65536) and not np.array_equal(a, b), mix
    fixed = [sample_segments(cfg, "fixed:16", 65536, s) for s in seeds]
    assert all(np.array_equal(fixed[0], f) for f in fixed[1:])
    assert fixed[0].max() + 1 == 65536 // 16


def test_choosing_kernels_run_first():
    assert stream_order(["tiles", "packed", "varlen", "auto", "dense"]) == [
        "auto", "packed", "tiles", "varlen", "dense"]
    assert stream_order(["per-document", "tiles"]) == ["per-document", "tiles"]


# --------------------------------------------------------------------------- tallies and ranks
def test_tally_counts_blocks_and_documents():
    assert tally_choices([["varlen"], ["tiles"], ["varlen"]]) == "tiles 1 / varlen 2 blocks"
    assert tally_choices([["math", "tiles"], ["tiles", "tiles"]]) == "tiles 3 / math 1 blocks"
    assert tally_choices([{"batched": 3, "varlen": 10}, {"batched": 0, "varlen": 7}]) == (
        "batched 3 / varlen 17 documents")


def _row(kernel, rate, status="ok"):
    return DocCaseResult(131072, "lognormal", "kernel", kernel, 1, kernel=kernel, status=status,
                         fwd_bwd_tflops_per_gpu=rate, stream_samples=16)


def test_vs_fastest_is_the_fastest_rate_over_the_rows():
    rows = [_row("auto", 400.0), _row("tiles", 500.0), _row("varlen", 250.0),
            _row("packed", 400.0), _row("dense", 600.0), _row("per-document", None, "oom")]
    rank_stream_rows(rows)
    by = {r.kernel: r for r in rows}
    assert by["tiles"].vs_fastest == 1.0 and by["tiles"].stream_rank == 1
    assert by["auto"].vs_fastest == pytest.approx(1.25) and by["auto"].stream_rank == 2
    assert by["packed"].stream_rank == 2                      # a tie shares the rank
    assert by["varlen"].vs_fastest == pytest.approx(2.0) and by["varlen"].stream_rank == 4
    # the dense ceiling and a failed kernel are not ranked
    assert by["dense"].vs_fastest is None and by["per-document"].stream_rank is None


# --------------------------------------------------------------------------- sightings
def _table_with_builds():
    """Per call: 1 s for a shape's plan build, else a batched call far cheaper than the
    masked product (1 ms) and the varlen kind (0.1 ms a document), so a shape runs masked or
    varlen until it has recurred ``reuse_before_build`` (3) times, then batched."""
    return pd.KernelCosts([1, 1024], [1e-6, 1e-6], [1e-6, 1e-6], [1e-4, 1e-4], has_varlen=True,
                          max_varlen_tokens=512, build_s=1.0, masked_call_s=1e-3,
                          masked_element_s=0.0)


@pytest.mark.parametrize("kernel,per_sample,tally", [
    ("packed", ["batched 0 / varlen 8"] * 3 + ["batched 8 / varlen 0"] * 2,
     "batched 16 / varlen 24 documents"),
    ("auto", ["math"] * 3 + ["tiles"] * 2, "tiles 2 / math 3 blocks"),
])
def test_a_choosing_kernel_keeps_its_sightings_over_the_stream(monkeypatch, kernel, per_sample,
                                                               tally):
    """fixed:16 brings the shape (16 tokens, 8 documents) every sample: from no sightings the
    first three samples pay no build, the next ones run batched, as in training; the
    throwaway sample counts for nothing and the table's sightings are put back after."""
    cfg = _cfg(doc_kernels=[kernel], doc_stream=5)
    device = torch.device("cpu")
    table = _table_with_builds()
    table.sighted(99, 1, built=False)
    key = ("cpu", None, torch.float32, 4, 4, 16, True, get_kernel(cfg.backend).name)
    monkeypatch.setitem(pd._COSTS, key, table)
    x = kernel_inputs(cfg, 128, device)
    res = stream_case(SimpleNamespace(device=device), cfg, 128, "fixed:16", kernel, x, 1)
    assert res.status == "ok" and res.stream_sample_choices == per_sample
    assert res.auto_choice == tally and res.label == f"{kernel}, stream of 5"
    assert len(res.fwd_bwd_times_ms) == 5 and res.stream_max_ms >= res.stream_mean_ms > 0
    assert res.documents == 5 * 8 and res.useful_pairs == 5 * 8 * 16 * 17 // 2
    assert table.sightings() == {(99, 1): 1}


@pytest.mark.parametrize("kernel,per_sample", [
    ("packed", ["batched 8 / varlen 0"] * 4), ("auto", ["tiles"] * 4)])
def test_a_sample_runs_every_layer_and_the_build_is_shared_by_them(monkeypatch, kernel,
                                                                    per_sample):
    """--doc-layers 20: each sample runs 20 forward+backward calls (the first builds the new
    shape's plan), its time reported per call; the choosing kernels price the build at a
    twentieth per call, so the shape runs batched from the first sample (one layer: masked
    or varlen until it recurs)."""
    cfg = _cfg(doc_kernels=[kernel], doc_stream=4, doc_layers=20)
    device = torch.device("cpu")
    table = _table_with_builds()
    table.build_s = 1e-2                           # / 20 = 0.5 ms < 0.8 ms varlen, 1 ms masked
    key = ("cpu", None, torch.float32, 4, 4, 16, True, get_kernel(cfg.backend).name)
    monkeypatch.setitem(pd._COSTS, key, table)
    calls = []
    prepare = ds._prepare

    def counting(*a, **kw):
        sample = prepare(*a, **kw)
        run = sample.fwd_bwd
        sample.fwd_bwd = lambda: calls.append(1) or run()
        return sample
    monkeypatch.setattr(ds, "_prepare", counting)
    x = kernel_inputs(cfg, 128, device)
    res = stream_case(SimpleNamespace(device=device), cfg, 128, "fixed:16", kernel, x, 1)
    assert res.status == "ok" and res.stream_sample_choices == per_sample
    assert len(calls) == cfg.warmup + 4 * 20 and len(res.fwd_bwd_times_ms) == 4
    assert "plan build priced 10.00 ms, /20 per call" in res.note
    one = stream_case(SimpleNamespace(device=device), _cfg(doc_kernels=[kernel], doc_stream=4),
                      128, "fixed:16", kernel, x, 1)
    assert one.stream_sample_choices[0] != per_sample[0]


def test_doc_layers_is_at_least_one():
    with pytest.raises(BenchConfigError, match="--doc-layers 0: .* try --doc-layers 16"):
        check_document_config(_cfg(doc_layers=0), 1)
    check_document_config(_cfg(doc_layers=16), 1)


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kw,needle", [
    (dict(doc_stream=1), "--doc-stream 1: .* try --doc-stream 16"),
    (dict(doc_stream=-4), "--doc-stream -4: .* try --doc-stream 16"),
    (dict(doc_kernels=[]), "--doc-stream 3 times the --doc-kernels"),
    (dict(docs=[]), "--doc-stream 3 times the --doc-kernels"),
    (dict(doc_kernels=["tiles", "auto-recurring", "flex"]),
     "--doc-stream 3 with --doc-kernels auto-recurring,flex: .* e.g. --doc-kernels tiles,"),
])
def test_bad_stream_is_refused_naming_the_flag(kw, needle):
    with pytest.raises(BenchConfigError, match=needle):
        check_stream_config(_cfg(**kw))


def test_stream_off_and_a_good_stream_pass():
    check_stream_config(_cfg(doc_stream=0, doc_kernels=["auto-recurring"]))
    check_stream_config(_cfg(doc_stream=2))


def test_command_line_refuses_a_bad_stream_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        ab.main(["--seq-lens", "128", "--docs", "fixed:16", "--doc-kernels", "tiles",
                 "--doc-stream", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("bench_attention.py: error: --doc-stream 1: a stream is at least 2 "
                       "distinct samples per kernel (0: off); try --doc-stream 16")
