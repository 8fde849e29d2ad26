"""tools/bench_e2e.py --docs: the flag, the written documents, the trained documents it counts,
the useful FLOPs and the report fields. No training process: the sweep's runs are faked."""

import json

import numpy as np
import pytest
import torch

from megatron.bench import document_bench
from megatron.bench.ceiling import CEILING_DOC_KERNELS, document_attention_ms
from megatron.bench.cli import BenchConfigError
from megatron.bench.e2e import cli, command, config, documents, launch, output, summary
from megatron.bench.e2e import cli as e2e_cli
from megatron.shapes import PRESETS, causal_pairs, document_pairs, training_flops

EOD = 511


def _cfg(tmp_path, docs, **kw):
    base = dict(seq_lens=[128], model="tiny", splits=[(1, 2)], iters=3, warmup=1,
                device="cpu", log_dir=str(tmp_path), docs=docs)
    base.update(kw)
    return config.E2EConfig(**base)


# --------------------------------------------------------------------------- the flag
@pytest.mark.parametrize("text,want", [(None, None), ("mock", "mock"), ("fixed:2k", "fixed:2k"),
                                       ("uniform:4k", "uniform:4k"), ("lognormal", "lognormal"),
                                       ("corpus", "corpus")])
def test_docs_accepts_the_mixes(text, want):
    assert documents.parse_docs(text) == want


@pytest.mark.parametrize("text", ["fixed", "fixed:0", "zipf", "", "fixed:2k,lognormal"])
def test_docs_refuses_with_one_line_naming_the_flag_and_a_valid_value(text):
    with pytest.raises(BenchConfigError) as err:
        documents.parse_docs(text)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("--docs") and "fixed:2k" in msg


def test_docs_refuses_data_flags_in_extra_args(tmp_path, capsys):
    documents.check_extra_args(None, ["--mock-data"])          # dense: as before
    with pytest.raises(BenchConfigError, match="--extra-args --data-path.*--docs fixed:2k"):
        documents.check_extra_args("fixed:2k", ["--data-path", "x"])
    with pytest.raises(SystemExit):
        e2e_cli.main(["--model", "tiny", "--seq-lens", "128", "--docs", "zipf",
                      "--log-dir", str(tmp_path)])
    assert "--docs 'zipf'" in capsys.readouterr().err


def test_data_flags_of_each_mix(tmp_path):
    assert documents.data_flags(None, "L") == ["--mock-data"]
    doc_flags = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
    assert documents.data_flags("mock", "L") == ["--mock-data"] + doc_flags
    assert documents.data_flags("fixed:2k", "L") == [
        "--data-path", "L/docs-fixed-2k/documents", "--split", "100,0,0"] + doc_flags
    args = command.pretrain_args(_cfg(tmp_path, "lognormal"), config.RunSpec(128, 1, 2, "none", 3),
                                 "m.jsonl")
    assert "--mock-data" not in args and "--reset-attention-mask" in args


# --------------------------------------------------------------------------- writing
def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset  # megatron-core on first use

    ds = IndexedDataset(prefix)
    return [np.array(ds[i], copy=True) for i in range(len(ds))]   # not views of its mmap


@pytest.mark.parametrize("mix", ["fixed:32", "uniform:64", "lognormal", "corpus"])
def test_written_documents_have_the_mix_lengths_and_end_in_eod(tmp_path, mix, monkeypatch):
    corpus = np.array([5, 300, 17, 1, 90])
    monkeypatch.setattr(document_bench, "corpus_lengths", lambda: corpus)
    info = documents.prepare_documents(mix, str(tmp_path), EOD, 1000, seed=7)
    docs = _read(info["data"])
    lengths = np.array([d.size for d in docs])
    want = documents.lengths_for_tokens(mix, 1000, 7)
    assert lengths.tolist() == want.tolist()
    assert info["documents"] == len(docs) and info["tokens"] == lengths.sum() >= 1000
    assert lengths.sum() - lengths[-1] < 1000            # cut after the one that reaches it
    if mix == "fixed:32":
        assert set(lengths.tolist()) == {32}
    if mix == "uniform:64":
        assert lengths.min() >= 1 and lengths.max() <= 63
    if mix == "corpus":                                    # the corpus's lengths, repeated
        assert lengths.tolist()[:10] == np.roll(corpus, -(7 % 5)).tolist() * 2
    for d in docs:
        assert d[-1] == EOD and (d[:-1] < EOD).all() and (d[:-1] >= 0).all()


def test_mock_writes_nothing(tmp_path):
    assert documents.prepare_documents("mock", str(tmp_path), EOD, 100, 1) == {
        "mix": "mock", "data": "--mock-data"}
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- counting
def test_document_pairs_against_a_hand_count():
    # documents of 3, 1 and 4 tokens: 9/2 + 1/2 + 16/2 = 13
    assert document_pairs([3, 1, 4]) == 13.0
    assert document_pairs([128]) == causal_pairs(128)
    tokens = np.array([1, 2, EOD, EOD, 5, 6, 7, 8])          # [1 2 EOD] [EOD] [5 6 7 8 ...
    assert documents.sample_lengths(tokens, EOD).tolist() == [3, 1, 4]
    b = documents.TrainedBatches(np.zeros((4, 8)), np.zeros((4, 8)),
                                 [np.array([3, 1, 4]), np.array([8]), np.array([4, 4]),
                                  np.array([2, 6])], global_batch=2, eod=EOD)
    assert b.pairs_per_iteration() == [13.0 + 32.0, 16.0 + 20.0]
    assert b.documents_per_iteration() == [4, 4]


def test_trained_documents_are_rebuilt_from_the_runs_own_arguments(tmp_path):
    """fixed:32 in sequences of 128: every sample holds four whole documents, whatever
    megatron-core's shuffle picked, and the positions restart after each EOD."""
    cfg = _cfg(tmp_path, "fixed:32")
    documents.prepare_documents("fixed:32", str(tmp_path), e2e_cli.eod_id(cfg),
                                e2e_cli.documents_tokens(cfg), cfg.seed)
    b = launch.trained_batches_of(cfg, config.RunSpec(128, 1, 2, "full", 3))
    assert b.tokens.shape == (3, 128) and b.eod == e2e_cli.eod_id(cfg) == 511
    assert all(x.tolist() == [32] * 4 for x in b.lengths)
    assert b.pairs_per_iteration() == [4 * 32 * 32 / 2] * 3
    assert (b.tokens[:, 31::32] == b.eod).all()
    assert b.position_ids[0].tolist() == list(range(32)) * 4


# --------------------------------------------------------------------------- report
def _records(times_ms):
    return [{"kind": "train", "iteration": i + 1, "step_time_s": t / 1e3, "lm_loss": 5.0,
             "mem_gib": 1.0} for i, t in enumerate(times_ms)]


def test_summarize_counts_the_measured_iterations_documents(tmp_path):
    cfg = _cfg(tmp_path, "fixed:32", warmup=1, peak_tflops=100.0)
    spec = config.RunSpec(128, 1, 2, "none", 3)
    outcome = config.RunOutcome("ok", 0, _records([900.0, 100.0, 300.0]), "l", [],
                                attention_pairs=[1.0, 2048.0, 4096.0], documents=[9, 4, 2])
    r = summary.summarize(cfg, spec, outcome)
    shape = PRESETS["tiny"]
    want = (training_flops(shape, 128, 2048.0) + training_flops(shape, 128, 4096.0)) / 2
    assert r.flops_count == "useful (documents)" and r.docs == "fixed:32"
    assert r.flops_per_iteration == pytest.approx(want)
    assert r.flops_per_iteration < training_flops(shape, 128, causal_pairs(128))
    assert r.attention_pairs == 3072.0 and r.documents_per_iteration == 3.0
    assert r.tflops_per_gpu == pytest.approx(want / 0.2 / 2 / 1e12)
    assert r.mfu == pytest.approx(r.tflops_per_gpu / 100.0)
    uncounted = summary.summarize(cfg, spec, config.RunOutcome("ok", 0, _records([1.0] * 3),
                                                               "l", []))
    assert uncounted.status == "error" and "not counted" in uncounted.note
    dense = summary.summarize(_cfg(tmp_path, None), spec, outcome)
    assert dense.flops_count == "dense causal" and dense.docs is None


def test_summarize_tells_the_steps_that_built_plans(tmp_path):
    """The loop's ``new_plan_shapes``: the measured iterations that built no plan and their
    mean time beside the mean of all; absent from any record, neither is reported."""
    cfg = _cfg(tmp_path, "fixed:32", warmup=1)
    spec = config.RunSpec(128, 1, 2, "none", 4)
    pairs = dict(attention_pairs=[2048.0] * 4, documents=[4] * 4)
    records = [dict(r, new_plan_shapes=n) for r, n in
               zip(_records([900.0, 100.0, 400.0, 300.0]), [5, 0, 2, 0])]
    r = summary.summarize(cfg, spec, config.RunOutcome("ok", 0, records, "l", [], **pairs))
    assert r.iter_ms == pytest.approx(800.0 / 3)
    assert r.steady_iterations == 2 and r.iter_ms_steady == pytest.approx(200.0)
    assert "2 of 3 iterations built no new attention plans: 200.0 ms/iter" in \
        output.progress_line(r)
    every = [dict(r, new_plan_shapes=1) for r in records]
    r = summary.summarize(cfg, spec, config.RunOutcome("ok", 0, every, "l", [], **pairs))
    assert r.steady_iterations == 0 and r.iter_ms_steady is None
    line = output.progress_line(r)
    assert "0 of 3 iterations built no new attention plans" in line
    assert "new attention plans:" not in line
    records[2].pop("new_plan_shapes")
    r = summary.summarize(cfg, spec, config.RunOutcome("ok", 0, records, "l", [], **pairs))
    assert r.steady_iterations is None and "new attention plans" not in output.progress_line(r)


def test_summarize_takes_the_loops_count_of_a_sliding_window(tmp_path):
    # --extra-args "--window-size ...": the loop counts the window's pairs; the tool uses them
    cfg = _cfg(tmp_path, None, warmup=1, peak_tflops=100.0)
    spec = config.RunSpec(128, 1, 2, "none", 3)
    label = "dense causal, window 16 on 1 of 2 layers"
    records = [dict(r, tflops_per_gpu=tf, flops_count=label)
               for r, tf in zip(_records([900.0, 100.0, 300.0]), [1.0, 3.0, 2.0])]
    r = summary.summarize(cfg, spec, config.RunOutcome("ok", 0, records, "l", []))
    want = (3.0e12 * 0.1 + 2.0e12 * 0.3) * cfg.nproc_per_node / 2
    assert r.flops_count == label and r.flops_per_iteration == pytest.approx(want)
    assert r.tflops_per_gpu == pytest.approx(want / 0.2 / cfg.nproc_per_node / 1e12)


META = {"device": None, "versions": {}, "world_size": 2, "date_utc": "d", "command": "c"}


def test_markdown_and_progress_say_which_count(tmp_path):
    cfg = _cfg(tmp_path, "lognormal")
    row = config.E2EResult(128, 1, 2, "none", 2, 1, "ok", iter_ms=10.0, tokens_per_s=1.0,
                           tokens_per_s_per_gpu=0.5, tflops_per_gpu=1.0, docs="lognormal",
                           flops_count="useful (documents)", documents_per_iteration=3.0)
    peer = config.E2EResult(128, 1, 1, "none", 1, 1, "ok", iter_ms=10.0, tokens_per_s=1.0,
                            tokens_per_s_per_gpu=1.0, tflops_per_gpu=1.0, stack="hf",
                            docs="lognormal", flops_count="useful (documents)",
                            attention_path="sdpa (CPU), [S, S] document mask from position_ids")
    md = output.results_markdown(META, cfg, [row, peer])
    assert "FLOPs: useful (documents): packed documents of --docs lognormal" in md
    assert "| docs/iter | FLOPs | attention |" in md
    assert "| 3 | useful (documents) | USP documents |" in md
    assert "document mask from position_ids |" in md
    assert "FLOPs useful (documents), 3 docs/iter" in output.progress_line(row)
    dense = output.results_markdown(META, _cfg(tmp_path, None), [])
    assert "FLOPs: dense causal" in dense and "docs/iter" not in dense


def test_payload_fields(tmp_path, monkeypatch):
    """--docs names the count and the written data in the JSON (runs faked)."""
    def fake_sweep(cfg, on_result, ceilings):
        on_result(summary.summarize(cfg, config.RunSpec(128, 1, 2, "none", 3), config.RunOutcome(
            "ok", 0, _records([1.0] * 3), "l", [], attention_pairs=[8.0] * 3,
            documents=[4] * 3)))

    monkeypatch.setattr(cli, "throughput_sweep", fake_sweep)
    out = tmp_path / "r.json"
    assert cli.main(["--model", "tiny", "--seq-lens", "128", "--splits", "1x2", "--iters", "3",
                     "--warmup", "1", "--device", "cpu", "--ceiling", "off", "--docs",
                     "fixed:32", "--log-dir", str(tmp_path), "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["flops_count"] == "useful (documents)"
    assert payload["config"]["docs"] == "fixed:32"
    assert payload["documents"]["data"].endswith("docs-fixed-32/documents")
    assert payload["results"][0]["flops_count"] == "useful (documents)"
    assert payload["results"][0]["attention_pairs"] == 8.0


def test_documents_ceiling_takes_the_fastest_kernel_per_sequence():
    """The document ceiling's attention (timed here on the CPU, tiny heads): each distinct
    sequence timed once, the fastest kernel counted, weighted by how often it was trained."""
    got = document_attention_ms(PRESETS["tiny"], [[32] * 4, [32] * 4, [64, 64]],
                                torch.device("cpu"), torch.float32, repeats=1)
    assert sum(got["wins"].values()) == 3 and set(got["wins"]) <= set(got["kernels_ms"])
    assert set(got["kernels_ms"]) <= set(CEILING_DOC_KERNELS) - {"varlen"} or \
        document_bench.flash_varlen.available()
    assert 0 < got["ms"] <= min(got["kernels_ms"].values()) + 1e-9
    per = got["per_sequence_ms"]
    assert len(per) == 3 and per[0] == per[1]
    assert sum(per) / 3 == pytest.approx(got["ms"])


def test_the_steady_iterations_are_held_to_the_ceiling_of_their_own_documents(tmp_path):
    """``ceiling_share_steady``: the iterations that built no plan, against the ceiling of
    the sequences they trained (the same GEMMs, their attention); None where it cannot be
    paired (no per-sequence attention, another count, no steady iteration)."""
    from megatron.bench.e2e.ceilings import apply_ceiling

    # 2 layers of 50 ms linears, a 20 ms output layer, attention 30 / 90 / 10 ms per layer
    ceiling = dict(ceiling_ms=260.0, ceiling_mfu=0.5, num_layers=2, linears_ms_per_layer=50.0,
                   output_layer_ms=20.0, ceiling_ms_per_sequence=[2 * (50.0 + a) + 20.0 for a in (30.0, 90.0, 10.0)])

    def row(flags, steady_ms):
        return config.E2EResult(128, 1, 1, "none", 1, 1, "ok", iterations_measured=3,
                                iter_ms=400.0, iter_ms_each=[400.0] * 3, tokens_per_s=1.0,
                                tokens_per_s_per_gpu=1.0, tflops_per_gpu=1.0,
                                docs="lognormal", flops_count="useful (documents)",
                                steady_iterations=sum(flags), iter_ms_steady=steady_ms,
                                iter_steady=flags)

    r = row([True, False, True], 250.0)
    apply_ceiling(r, {128: ceiling})
    assert r.ceiling_share == pytest.approx(260.0 / 400.0)
    # steady: iterations 1 and 3, attention (30 + 10) / 2 = 20 per layer
    assert r.ceiling_share_steady == pytest.approx((2 * (50.0 + 20.0) + 20.0) / 250.0)
    assert "2 of 3 iterations built no new attention plans: 250.0 ms/iter (64.0% of their " \
           "ceiling)" in output.progress_line(r)
    for flags, steady_ms, c in (([False] * 3, None, ceiling), ([True, True], 250.0, ceiling),
                                ([True] * 3, 250.0, dict(ceiling,
                                                         ceiling_ms_per_sequence=None))):
        r = row(flags, steady_ms)
        apply_ceiling(r, {128: c})
        assert r.ceiling_share_steady is None
        assert "of their ceiling" not in output.progress_line(r)
