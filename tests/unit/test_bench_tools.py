"""Benchmark tools without processes: parsing, validation, FLOP counts, comparisons, output.

Nothing here asserts a timing; ``tests/distributed/test_bench_smoke.py`` runs the tools.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron import shapes
from megatron.bench import attention_bench as ab
from megatron.bench import (
    ceiling,
    cli,
    flops,
    fp8_speedup,
    hf_peer,
    models,
    native_cp,
    report,
    timing,
    window_speedup,
)
from megatron.bench.e2e import (
    ceilings,
    command,
    config,
    launch,
    output,
    pairing,
    peers,
    summary,
    sweep,
)
from megatron.bench.e2e import cli as e2e_cli
from megatron.bench.e2e.launch import failure_cause
from megatron.usp.token_order import positions_for_cp_rank
from megatron.usp.window_kernel import window_mask

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("text,value", [("32k", 32768), ("256K", 262144), ("1m", 1 << 20),
                                        ("4096", 4096), (" 64 ", 64)])
def test_parse_seq_len(text, value):
    assert cli.parse_seq_len(text) == value


@pytest.mark.parametrize("text", ["", "k", "32q", "-4", "0", "1.5k"])
def test_parse_seq_len_rejects_with_flag_name(text):
    with pytest.raises(cli.BenchConfigError, match="--seq-lens"):
        cli.parse_seq_len(text)


def test_parse_splits_and_auto_pure_settings():
    assert cli.parse_splits("2x1, 1X2,") == [(2, 1), (1, 2)]
    assert cli.parse_splits("") == []
    # requested first, then pure Ulysses and pure ring, no repeats
    assert ab.all_splits([(2, 2)], 4) == [(2, 2), (4, 1), (1, 4)]
    assert ab.all_splits([(1, 2), (2, 1)], 2) == [(1, 2), (2, 1)]
    with pytest.raises(cli.BenchConfigError, match="--splits"):
        cli.parse_splits("2x")


def _cfg(**kw):
    base = dict(seq_lens=[64], heads=4, kv_heads=4, head_dim=16, dtype="fp32")
    base.update(kw)
    return ab.AttentionBenchConfig(**base)


def test_validate_accepts_a_good_config():
    ab.validate_config(_cfg(splits=[(2, 2)], seq_lens=[64, 128]), world=4)


@pytest.mark.parametrize("kw,world,flag", [
    (dict(splits=[(2, 2)]), 2, "--splits 2x2"),              # does not multiply to 2
    (dict(heads=3, kv_heads=3), 2, "--splits 2x1"),          # 3 heads over U=2
    (dict(seq_lens=[66]), 2, "--seq-lens"),                  # not a multiple of 2N=4
    (dict(kv_heads=3), 2, "--kv-heads"),                     # 3 does not divide 4
    (dict(iters=0), 2, "--iters"),
    (dict(peers=["deepspeed"]), 2, "--peers"),
    (dict(native_cp_rotate=["ring"]), 2, "--native-cp-rotate"),
    (dict(seq_lens=[]), 2, "--seq-lens"),
    (dict(batch=0), 2, "--batch-size"),
    (dict(backend="cudnn-please"), 2, "--attention-backend"),
    (dict(window=0), 2, "--window 0"),
    (dict(window=8, causal=False), 2, "--no-causal"),
    (dict(window=8, docs=["fixed:2k"]), 2, "--docs or --window"),
])
def test_validate_names_the_flag(kw, world, flag):
    with pytest.raises(cli.BenchConfigError, match=flag.replace("-", r"\-")):
        ab.validate_config(_cfg(**kw), world)


def test_command_line_round_trip():
    ns = ab.build_parser().parse_args(
        ["--seq-lens", "32k,64k", "--kv-heads", "8", "--splits", "2x1", "--no-causal",
         "--peers", "none", "--native-cp-rotate", "alltoall"])
    cfg = ab.config_from_args(ns)
    assert cfg.seq_lens == [32768, 65536] and cfg.kv_heads == 8 and cfg.heads == 32
    assert cfg.splits == [(2, 1)] and cfg.causal is False and cfg.peers == []
    assert cfg.native_cp_rotate == ["alltoall"] and cfg.torch_dtype == torch.bfloat16
    assert ab.config_from_args(ab.build_parser().parse_args([])).kv_heads == 32
    assert cfg.window is None
    assert ab.config_from_args(ab.build_parser().parse_args(["--window", "4096"])).window == 4096


@pytest.mark.parametrize("flag", ["--chunk-assignment", "--document-layout"])
def test_chunk_assignment_flag_and_its_document_layout_alias(flag):
    ns = ab.build_parser().parse_args(["--docs", "fixed:2k", flag, "zigzag"])
    assert ab.config_from_args(ns).chunk_assignment == "zigzag"
    assert ab.config_from_args(ab.build_parser().parse_args([])).chunk_assignment == "auto"


# --------------------------------------------------------------------------- FLOPs
def test_attention_flops_convention():
    # anchors.md: forward 4*b*h*S^2*d/2 causal, forward+backward 3.5x that
    fwd = flops.attention_fwd_flops(1, 32, 131072, 128, causal=True)
    assert fwd == 4 * 32 * 131072 ** 2 * 128 / 2
    assert flops.attention_fwd_flops(2, 32, 1024, 128, causal=False) == 4 * 2 * 32 * 1024 ** 2 * 128
    assert flops.attention_fwd_bwd_flops(1, 32, 131072, 128, True) == 3.5 * fwd
    # per-GPU rate divides the whole problem's work over the GPUs sharing it
    assert flops.tflops_per_gpu(2e12, 0.5, 2) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        flops.tflops_per_gpu(1.0, 0.0, 1)


@pytest.mark.parametrize("seq_len,window", [(64, 8), (64, 1), (96, 40), (32, 31), (32, 100)])
def test_window_flops_count_the_visible_pairs(seq_len, window):
    # 4*b*h*d per pair inside the window, counted as causal attention is (pairs less S/2, so
    # that a window reaching the whole sequence gives 4*b*h*S^2*d/2); x3.5 with the backward
    visible = int(window_mask(seq_len, seq_len, True, window).sum())
    fwd = flops.window_attention_fwd_flops(2, 4, seq_len, 16, window)
    assert fwd == 4 * 2 * 4 * 16 * (visible - seq_len / 2)
    assert flops.window_attention_fwd_bwd_flops(2, 4, seq_len, 16, window) == 3.5 * fwd
    if window >= seq_len - 1:
        assert fwd == flops.attention_fwd_flops(2, 4, seq_len, 16, causal=True)


def test_case_flops_follow_the_window():
    causal = ab.case_flops(_cfg(heads=32, kv_heads=8, head_dim=128), 131072)
    assert causal == (flops.attention_fwd_flops(1, 32, 131072, 128, True),
                      flops.attention_fwd_bwd_flops(1, 32, 131072, 128, True))
    windowed = ab.case_flops(_cfg(heads=32, kv_heads=8, head_dim=128, window=4096), 131072)
    # 128K keys under a window of 4096: about (W + 1) / (S / 2) of the causal work
    assert windowed[0] == pytest.approx(causal[0] * 4097 / 65536, rel=2e-2)
    assert windowed[1] == 3.5 * windowed[0]
    r = ab.CaseResult(131072, "usp", "usp", 1)
    r.fwd_times_ms, r.fwd_bwd_times_ms = [10.0], [35.0]
    ab._fill_rates(r, _cfg(heads=32, kv_heads=8, head_dim=128, window=4096))
    assert r.fwd_tflops_per_gpu == pytest.approx(windowed[0] / 1e-2 / 1e12)
    assert r.fwd_bwd_tflops_per_gpu == pytest.approx(windowed[1] / 3.5e-2 / 1e12)


# --------------------------------------------------------------------------- comparisons
def _res(method, fwd_bwd_ms, gpus=2, ring=None, mem=None, status="ok", seq=1024):
    r = ab.CaseResult(seq, method, method, gpus, ring=ring, status=status)
    if status == "ok":
        r.fwd_times_ms, r.fwd_bwd_times_ms = [fwd_bwd_ms / 3.5], [fwd_bwd_ms, fwd_bwd_ms, 1e9]
        ab._fill_rates(r, _cfg(heads=32, head_dim=128))
        r.peak_mem_gib = mem
    return r


def test_add_comparisons():
    single = _res("single-gpu-kernel", 10.0, gpus=1)
    u2 = _res("usp", 5.5, ring=1, mem=4.0)
    r2 = _res("usp", 6.0, ring=2, mem=4.2)
    n1 = _res("native-cp", 7.0, mem=8.0)
    n2 = _res("native-cp", 6.6, mem=9.0)
    broken = _res("native-cp", 0, status="error")
    ab.add_comparisons([single, u2, r2, n1, n2, broken])
    # median of [x, x, 1e9] is x: one outlier does not move the reported time
    assert u2.fwd_bwd_ms == 5.5
    # per-GPU rate over the single GPU's rate: (W/2/5.5) / (W/10) = 10/11
    assert u2.efficiency == pytest.approx(10 / 11)
    assert n1.efficiency == pytest.approx(10 / 14)
    assert single.efficiency is None and broken.efficiency is None
    # against the best native-CP variant (6.6 ms, 9 GiB)
    assert r2.speedup_vs_native_cp == pytest.approx(6.6 / 6.0)
    assert r2.mem_vs_native_cp == pytest.approx(4.2 / 9.0)
    assert r2.mem_vs_pure_ulysses == pytest.approx(4.2 / 4.0)
    assert u2.mem_vs_pure_ulysses == pytest.approx(1.0)


def test_add_comparisons_without_baseline_leaves_na():
    u2 = _res("usp", 5.0, ring=1, mem=None)
    ab.add_comparisons([u2])
    assert u2.efficiency is None and u2.speedup_vs_native_cp is None
    assert u2.mem_vs_pure_ulysses is None     # CPU: no memory statistic


def test_progress_line_and_markdown():
    single = _res("single-gpu-kernel", 10.0, gpus=1, mem=3.0)
    u2 = _res("usp", 5.5, ring=1, mem=4.0)
    oom = _res("native-cp", 0, status="oom")
    oom.note = "does not fit"
    ab.add_comparisons([single, u2, oom])
    line = ab.progress_line(u2)
    assert line.startswith(ab.PROGRESS_PREFIX) and "eff 90.9%" in line and "4.00 GiB" in line
    assert "oom: does not fit" in ab.progress_line(oom)
    meta = report.run_metadata(["tools/bench_attention.py", "--seq-lens", "1k"],
                               torch.device("cpu"), 2)
    md = ab.results_markdown(meta, _cfg(heads=32, head_dim=128, iters=3), [single, u2, oom])
    assert "| S | method | GPUs |" in md and "| 1K | usp | 2 |" in md
    assert "90.9%" in md and "oom" in md
    assert "command: `tools/bench_attention.py --seq-lens 1k`" in md
    assert "torch " + torch.__version__ in md
    windowed = ab.results_markdown(meta, _cfg(window=4096), [single, u2])
    assert "causal, window 4096 (FLOPs of the pairs inside it)" in windowed


def test_usp_labels_name_the_pure_splits_only():
    assert ab.usp_label(2, 1) == "USP U2xR1 (pure Ulysses)"
    assert ab.usp_label(1, 2, " G2") == "USP U1xR2 G2 (pure ring)"
    assert ab.usp_label(2, 2) == "USP U2xR2"
    assert ab.usp_label(1, 1) == "USP U1xR1"          # one process: neither


# --------------------------------------------------------------------------- report / timing
def test_write_json_is_valid_and_nan_free(tmp_path):
    path = tmp_path / "sub" / "r.json"
    report.write_json(str(path), {"a": float("nan"), "b": [1.0, float("inf")], "c": "x"})
    assert json.loads(path.read_text()) == {"a": None, "b": [1.0, None], "c": "x"}
    assert not (tmp_path / "sub" / "r.json.tmp").exists()


def test_markdown_table_and_fmt():
    md = report.markdown_table(["a", "b"],
                               [[1, "x"], [report.fmt(None), report.fmt(0.5, pct=True)]])
    assert md.splitlines() == ["| a | b |", "| --- | --- |", "| 1 | x |", "| n/a | 50.0% |"]
    assert report.fmt(float("nan")) == "n/a" and report.fmt(1.234, 2) == "1.23"


def test_time_iterations_counts_calls_on_cpu():
    calls = []
    times = timing.time_iterations(lambda: calls.append(1), warmup=2, iters=3,
                                   device=torch.device("cpu"), distributed=False)
    assert len(calls) == 5 and len(times) == 3 and all(t >= 0 for t in times)
    assert timing.median_ms([3.0, 1.0, 2.0]) == 2.0
    assert timing.peak_memory_gib(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="--iters"):
        timing.time_iterations(lambda: None, warmup=0, iters=0, device=torch.device("cpu"))


def test_out_of_memory_detection():
    assert timing.is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not timing.is_out_of_memory(RuntimeError("shape mismatch"))
    assert not timing.is_out_of_memory(ValueError("out of range"))


# --------------------------------------------------------------------------- the peer
def test_native_cp_is_reported_unavailable_on_cpu():
    reason = native_cp.unavailable_reason(torch.device("cpu"))
    assert reason and "CUDA only" in reason


def test_native_cp_load_balancer_matches_usp_token_order():
    # "Same inputs": torch's head-tail balancer hands rank i the positions USP's token order does.
    mod = pytest.importorskip("torch.distributed.tensor.experimental._attention")
    balancer_cls = getattr(mod, "_HeadTailLoadBalancer", None)
    if balancer_cls is None:
        pytest.skip(f"torch {torch.__version__} has no _HeadTailLoadBalancer")
    for world, seq in ((2, 16), (4, 64), (8, 128)):
        order = balancer_cls(seq, world, "cpu")._generate_indices()[0].tolist()
        per_rank = seq // world
        for rank in range(world):
            assert order[rank * per_rank:(rank + 1) * per_rank] == positions_for_cp_rank(
                seq, rank, world)


def test_rel_err():
    ref = torch.ones(4, 4)
    assert ab.rel_err(ref.clone(), ref) == 0.0
    assert ab.rel_err(ref * 1.01, ref) == pytest.approx(0.01, rel=1e-4)
    assert math.isfinite(ab.rel_err(ref, torch.zeros(4, 4)))


# --------------------------------------------------------------------------- end to end
def _e2e_cfg(tmp_path=None, **kw):
    base = dict(seq_lens=[32768, 65536], splits=[(2, 1), (1, 2)], iters=5, warmup=2,
                device="cuda")
    if tmp_path is not None:
        base["log_dir"] = str(tmp_path)
    base.update(kw)
    return config.E2EConfig(**base)


@pytest.mark.parametrize("device,split,recompute", [("cuda", (2, 1), "none"),
                                                    ("cuda", (1, 2), "full"),
                                                    ("cuda", (2, 1), "selective"),
                                                    ("cpu", (1, 2), "none")])
def test_pretrain_args_are_valid_pretrain_gpt_flags(device, split, recompute):
    """The command bench_e2e builds parses and validates with pretrain_gpt.py's own code."""
    arguments = pytest.importorskip("megatron.training.cli.arguments")
    cfg = _e2e_cfg(device=device)
    spec = config.RunSpec(65536, *split, recompute, 5)
    args = arguments.parse_args(command.pretrain_args(cfg, spec, "/tmp/m.jsonl"))
    run = arguments.validate_args(args, world_size=2, cuda_available=device == "cuda")
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (16, 2048, 16)
    assert (args.num_query_groups, run.kv_channels, args.ffn_hidden_size) == (4, 128, 5632)
    assert args.swiglu and args.untie_embeddings_and_output_weights and args.mock_data
    assert args.normalization == "RMSNorm" and args.position_embedding_type == "rope"
    # NullTokenizer adds the EOD id: the embedding has exactly 32000 rows, no padding
    assert arguments.padded_vocab_size(args.vocab_size + 1, 128, 1) == 32000
    assert (run.dims.ulysses, run.dims.ring) == split
    assert run.global_batch_size == 1 and args.seq_length == 65536
    assert args.metrics_file == "/tmp/m.jsonl" and args.train_iters == 5
    assert args.bf16 is (device == "cuda") and args.use_distributed_optimizer is (device == "cuda")
    assert args.recompute_granularity == {"none": None}.get(recompute, recompute)
    assert args.recompute_modules == (["mlp"] if recompute == "selective" else None)
    # the chunked output-layer loss (no full-sequence logits), for throughput and max length
    assert args.fused_linear_cross_entropy and run.loss_chunk_tokens == 8192


def test_extra_args_carry_the_fp8_flags_to_pretrain_gpt(monkeypatch):
    """``bench_e2e --extra-args '--fp8-format hybrid ...'`` reaches pretrain_gpt.py's parser
    and validation as given (an H200's compute capability stands in for the GPU)."""
    arguments = pytest.importorskip("megatron.training.cli.arguments")
    pytest.importorskip("torchao")
    monkeypatch.setattr(arguments, "_cuda_capability", lambda args, device: (9, 0))
    ns = e2e_cli.build_parser().parse_args([
        "--seq-lens", "8k", "--splits", "1x1", "--nproc-per-node", "1",
        "--extra-args", "--fp8-format hybrid --fp8-recipe tensorwise --fp8-linears auto"])
    cfg = e2e_cli.config_from_args(ns)
    spec = config.RunSpec(8192, 1, 1, "none", 5)
    argv = command.pretrain_args(dataclasses.replace(cfg, device="cuda"), spec, "m.jsonl")
    assert argv[-6:] == ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise",
                         "--fp8-linears", "auto"]
    run = arguments.validate_args(arguments.parse_args(argv), world_size=1,
                                  cuda_available=True)
    assert (run.fp8.format, run.fp8.recipe, run.fp8.linears, run.fp8.emulate) == (
        "hybrid", "tensorwise", "auto", False)


def test_only_presets_that_ask_use_the_fused_loss():
    assert "--fused-linear-cross-entropy" in models.model_flags(models.MODELS["llama-0.85b"])
    assert "--fused-linear-cross-entropy" not in models.model_flags(models.MODELS["tiny"])
    cfg = _e2e_cfg(find_max_seq=True, start_seq=131072)
    assert "--fused-linear-cross-entropy" in command.pretrain_args(
        cfg, config.RunSpec(131072, 1, 2, "full", 2), "m.jsonl")


def test_launch_command_is_torchrun_of_pretrain_gpt():
    cfg = _e2e_cfg(extra_args=["--num-workers", "0"])
    cmd = command.launch_command(cfg, config.RunSpec(32768, 2, 1, "none", 5), "m.jsonl", 29500)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node"]
    assert cmd[cmd.index("--master-port") + 1] == "29500"
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[cmd.index(cfg.pretrain_script) + 1] == "--num-layers"
    assert cmd[-2:] == ["--num-workers", "0"]
    assert config.global_batch_size(_e2e_cfg(nproc_per_node=4), config.RunSpec(1, 2, 1, "none", 1)) == 2


def _records(times_ms, mem=10.0, loss=9.0, mfu_peak=989.0):
    """Records in the schema of megatron.training.observe.metrics (a run header, train steps)."""
    out = [{"kind": "run", "layout": "TP1 U2 R1 DP1 PP1", "world_size": 2, "args": {}}]
    for i, t in enumerate(times_ms):
        out.append({"kind": "train", "iteration": i + 1, "step_time_s": t / 1e3,
                    "lm_loss": loss - i, "tokens_per_s": 1.0, "tflops_per_gpu": 100.0,
                    "mfu": None if mfu_peak is None else 100.0 / mfu_peak, "mem_gib": mem + i,
                    "skipped": False})
    return out


def test_classify_outcomes():
    recs = _records([1.0] * 5)
    assert launch.classify(0, "", recs, "l", [], 5).status == "ok"
    assert launch.classify(1, "torch.OutOfMemoryError: CUDA out of memory", recs[:1], "l", [],
                        5).status == "oom"
    err = launch.classify(1, "Traceback\nValueError: --foo bad\n", [], "l", [], 5)
    assert err.status == "error" and "--foo bad" in err.note and "0/5" in err.note
    # exit 0 but iterations missing from the metrics file is not a success
    assert launch.classify(0, "", recs[:3], "l", [], 5).status == "error"
    assert launch.classify(None, "", [], "l", [], 5).status == "timeout"


def test_summarize_excludes_warmup_and_counts_megatron_flops():
    pytest.importorskip("megatron.training.observe.metrics")
    cfg = _e2e_cfg(warmup=2)
    spec = config.RunSpec(32768, 2, 1, "none", 5)
    recs = _records([5000.0, 900.0, 100.0, 100.0, 130.0])
    recs.append({"kind": "valid", "iteration": 5, "lm_loss": 1.0})     # not a train step
    outcome = config.RunOutcome("ok", 0, recs, "l", ["python"])
    r = summary.summarize(cfg, spec, outcome)
    assert r.iterations_measured == 3 and r.iter_ms == pytest.approx(110.0)
    assert r.iter_ms_each == pytest.approx([100.0, 100.0, 130.0])
    assert r.tokens_per_s == pytest.approx(32768 / 0.110)
    # 0.85B model at 32K: per token 6 * 786,956,288 matmul params + 6*S*L*(heads*dim)
    # = 4,721,737,728 + 6,442,450,944 FLOPs (the anchors' Hugging Face formula, which also
    # gives their 431 TFLOP/s at 38.6K tokens/s)
    per_param = 16 * (2048 * 2048 + 2 * 2048 * 512 + 2048 * 2048 + 3 * 2048 * 5632) + 2048 * 32000
    assert per_param == 786_956_288
    per_token = 6 * per_param + 6 * 32768 * 16 * 2048
    assert per_token == 11_164_188_672 and 38.6e3 * per_token / 1e12 == pytest.approx(431, abs=1)
    assert r.flops_per_iteration == pytest.approx(32768 * per_token, rel=1e-12)
    assert r.tflops_per_gpu == pytest.approx(32768 * per_token / 0.110 / 2 / 1e12)
    # MFU against the peak the training loop used (tflops / mfu of its records)
    assert r.peak_tflops == pytest.approx(989.0) and r.mfu == pytest.approx(r.tflops_per_gpu / 989)
    assert r.peak_mem_gib == 14.0 and r.last_loss == 5.0
    # --peak-tflops overrides; no peak anywhere (CPU): MFU is n/a, not a made-up number
    assert summary.summarize(_e2e_cfg(peak_tflops=500.0), spec, outcome).mfu == pytest.approx(
        r.tflops_per_gpu / 500)
    cpu = config.RunOutcome("ok", 0, _records([100.0] * 5, mfu_peak=None), "l", [])
    assert summary.summarize(_e2e_cfg(device="cpu"), spec, cpu).mfu is None
    failed = summary.summarize(cfg, spec, config.RunOutcome("oom", 1, [], "l", [], "out of memory"))
    assert failed.status == "oom" and failed.tokens_per_s is None


def test_train_steps_keep_the_last_record_of_each_iteration():
    recs = _records([100.0, 200.0])
    recs.append(dict(recs[2], step_time_s=0.5))          # iteration 2 again (a resumed run)
    steps = summary.train_steps(recs)
    assert [r["iteration"] for r in steps] == [1, 2] and steps[1]["step_time_s"] == 0.5


def _fake_runner(fails):
    """A runner whose run fails with ``fails(spec)`` (a status) or succeeds."""
    calls = []

    def run(cfg, spec):
        calls.append(spec)
        status = fails(spec)
        if status:
            return config.RunOutcome(status, 1, [], "l", [], status)
        return config.RunOutcome("ok", 0, _records([100.0] * spec.iters), "l", [])

    return run, calls


def test_auto_recompute_retries_after_oom():
    run, calls = _fake_runner(lambda s: "oom" if s.seq_len > 32768 and s.recompute == "none"
                              else None)
    results = sweep.throughput_sweep(_e2e_cfg(seq_lens=[32768, 65536, 131072]), runner=run)
    assert [(c.seq_len, c.ring, c.recompute) for c in calls] == [
        (32768, 1, "none"), (32768, 2, "none"),
        (65536, 1, "none"), (65536, 1, "full"), (65536, 2, "none"), (65536, 2, "full"),
        # a split that needed recompute starts the longer lengths with it
        (131072, 1, "full"), (131072, 2, "full")]
    assert [r.status for r in results] == ["ok", "ok", "oom", "ok", "oom", "ok", "ok", "ok"]
    assert [r.recompute for r in results[2:4]] == ["none", "full"]
    run, calls = _fake_runner(lambda s: None)
    sweep.throughput_sweep(_e2e_cfg(recompute="full", seq_lens=[32768]), runner=run)
    assert [c.recompute for c in calls] == ["full", "full"]
    run, calls = _fake_runner(lambda s: "error")     # not a memory problem: no retry
    assert [r.status for r in sweep.throughput_sweep(_e2e_cfg(seq_lens=[32768]), runner=run)] == [
        "error", "error"]


def test_find_max_seq_doubles_until_failure():
    run, calls = _fake_runner(lambda s: "oom" if s.seq_len > 512 * 1024 else None)
    cfg = _e2e_cfg(find_max_seq=True, start_seq=131072, max_seq=4 << 20, iters=2, warmup=1)
    results, longest = sweep.find_max_seq(cfg, runner=run)
    assert [c.seq_len for c in calls[:4]] == [131072, 262144, 524288, 1048576]
    assert all(c.recompute == "full" for c in calls)
    assert longest == {"2x1": 524288, "1x2": 524288}
    assert [r.status for r in results[:4]] == ["ok", "ok", "ok", "oom"]
    run, _ = _fake_runner(lambda s: "error")
    assert sweep.find_max_seq(cfg, runner=run)[1] == {"2x1": None, "1x2": None}
    run, calls = _fake_runner(lambda s: None)         # never fails: stops at --max-seq
    cfg.max_seq = 262144
    assert sweep.find_max_seq(cfg, runner=run)[1]["2x1"] == 262144


def test_e2e_bad_input_names_the_flag(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    ok = dict(pretrain_script=str(script))
    e2e_cli.validate_config(_e2e_cfg(**ok))
    for kw, flag in [(dict(splits=[(4, 1)]), "--splits 4x1"),
                     (dict(iters=2, warmup=2), "--iters"),
                     (dict(seq_lens=[1002], splits=[(2, 1)]), "--seq-lens"),
                     (dict(find_max_seq=True, start_seq=1001), "--start-seq"),
                     (dict(find_max_seq=True, start_seq=4096, max_seq=2048), "--max-seq"),
                     (dict(splits=[]), "--splits")]:
        with pytest.raises(cli.BenchConfigError, match=flag):
            e2e_cli.validate_config(_e2e_cfg(**dict(ok, **kw)))
    with pytest.raises(cli.BenchConfigError, match="--pretrain-script"):
        e2e_cli.validate_config(_e2e_cfg(pretrain_script=str(tmp_path / "missing.py")))
    ns = e2e_cli.build_parser().parse_args(["--seq-lens", "32k", "--start-seq", "256k",
                                        "--extra-args", "--num-workers 0"])
    cfg = e2e_cli.config_from_args(ns)
    assert cfg.seq_lens == [32768] and cfg.start_seq == 262144
    assert cfg.extra_args == ["--num-workers", "0"] and cfg.splits == [(2, 1), (1, 2)]
    with pytest.raises(cli.BenchConfigError, match="--max-seq"):
        e2e_cli.config_from_args(e2e_cli.build_parser().parse_args(["--max-seq", "lots"]))


def test_extra_args_given_twice_pass_both():
    """A recipe sets --extra-args for one run and passes the caller's arguments after it:
    the caller's --extra-args adds to the recipe's flags, it does not replace them."""
    parser = e2e_cli.build_parser()
    ns = parser.parse_args(["--extra-args=--window-size 64 --window-attn-skip-freq 2",
                            "--extra-args", "--num-workers 0"])
    assert e2e_cli.config_from_args(ns).extra_args == [
        "--window-size", "64", "--window-attn-skip-freq", "2", "--num-workers", "0"]
    assert e2e_cli.config_from_args(parser.parse_args([])).extra_args == []
    assert parser.parse_args([]).extra_args == []       # the default is not appended to


def _peer_runner(fails, ms=lambda round_: 200.0):
    """A peer runner: ``fails(peer, seq_len, recompute)`` gives a status, else a run of
    ``ms(round)`` milliseconds per iteration."""
    calls = []

    def run(cfg, peer, seq_len, recompute, round_=1):
        calls.append((peer, seq_len, recompute))
        status = fails(peer, seq_len, recompute)
        t = ms(round_)
        data = ({"status": status, "note": status} if status else
                {"status": "ok", "iter_ms": t, "tokens_per_s": seq_len / (t / 1e3),
                 "peak_mem_gib": 20.0, "mfu": 0.3, "iterations_measured": 2})
        return peers.peer_result(peer, seq_len, recompute, data, "l", "cmd", round_)

    return run, calls


def test_peers_follow_each_length_and_retry_after_oom():
    run, _ = _fake_runner(lambda s: None)
    peer_run, calls = _peer_runner(lambda p, s, r: "oom" if s > 32768 and r == "none" else None)
    cfg = _e2e_cfg(seq_lens=[32768, 65536], splits=[(1, 1)], nproc_per_node=1,
                   peers=["hf-liger", "hf"])
    results = sweep.throughput_sweep(cfg, runner=run, peer_runner=peer_run,
                                   ceilings={32768: {"ceiling_ms": 50.0, "ceiling_mfu": 0.55}})
    assert calls == [("hf-liger", 32768, "none"), ("hf", 32768, "none"),
                     ("hf-liger", 65536, "none"), ("hf-liger", 65536, "full"),
                     ("hf", 65536, "none"), ("hf", 65536, "full")]
    assert [r.stack for r in results] == ["megatron-usp", "hf-liger", "hf", "megatron-usp",
                                          "hf-liger", "hf-liger", "hf", "hf"]
    ours = results[0]
    assert ours.tokens_per_s_per_gpu == pytest.approx(32768 / 0.1)
    assert ours.ceiling_share == pytest.approx(0.5) and ours.ceiling_mfu == 0.55
    assert results[3].ceiling_share is None                        # no ceiling measured
    ratios = pairing.peer_ratios(results)
    assert [(x["seq_len"], x["peer"], x["peer_recompute"]) for x in ratios] == [
        (32768, "hf-liger", "none"), (32768, "hf", "none"),
        (65536, "hf-liger", "full"), (65536, "hf", "full")]
    assert ratios[0]["tokens_per_s_ratio"] == pytest.approx(2.0)   # 100 ms vs 200 ms
    assert ratios[0]["peak_mem_ratio"] == pytest.approx(ours.peak_mem_gib / 20.0)
    assert "2.000x tokens/s per GPU" in output.ratio_line(ratios[0])
    meta = report.run_metadata(["tools/bench_e2e.py"], torch.device("cpu"), 1)
    md = output.results_markdown(meta, cfg, results)
    assert (f"| 32K | 1x1 | none | hf-liger | none | 2.000x | "
            f"{ours.peak_mem_gib / 20.0:.2f}x |") in md
    assert output.COLD_FIRST_STEP not in md                            # --warmup 2
    cold = output.results_markdown(meta, _e2e_cfg(iters=1, warmup=0), results)
    assert output.COLD_FIRST_STEP in cold and "mean of iterations 1..1" in cold
    assert peers.peer_recompute_order("selective") == ["none"]
    assert peers.peer_recompute_order("full") == ["full"]


def test_rounds_alternate_the_stacks_and_pool_the_ratios(tmp_path):
    calls = []

    def run(cfg, spec):      # ours: 100 ms per iteration in round 1, 120 ms in round 2
        calls.append(("ours", spec.seq_len, spec.round, spec.name))
        t = 100.0 if spec.round == 1 else 120.0
        return config.RunOutcome("ok", 0, _records([t] * spec.iters), "l", [])

    peer_run, peer_calls = _peer_runner(lambda p, s, r: None,
                                        ms=lambda round_: 200.0 if round_ == 1 else 180.0)

    def peer(cfg, name, seq_len, recompute, round_=1):
        calls.append((name, seq_len, round_))
        return peer_run(cfg, name, seq_len, recompute, round_)

    cfg = _e2e_cfg(seq_lens=[32768, 65536], splits=[(1, 1)], nproc_per_node=1,
                   peers=["hf-liger"], rounds=2, recompute="lean")
    results = sweep.throughput_sweep(cfg, runner=run, peer_runner=peer,
                                   ceilings={32768: {"ceiling_ms": 50.0, "ceiling_mfu": 0.5}})
    # per length: ours, peer, ours, peer; each of our runs has a log of its own
    assert [c[:3] for c in calls] == [
        ("ours", 32768, 1), ("hf-liger", 32768, 1), ("ours", 32768, 2), ("hf-liger", 32768, 2),
        ("ours", 65536, 1), ("hf-liger", 65536, 1), ("ours", 65536, 2), ("hf-liger", 65536, 2)]
    assert [c[3] for c in calls if c[0] == "ours"][:2] == ["S32768_U1xR1_lean",
                                                            "S32768_U1xR1_lean_r2"]
    assert [r.round for r in results[:4]] == [1, 1, 2, 2]
    ratios = pairing.peer_ratios(results)    # within a round only: 2 per length, not 4
    assert [(x["seq_len"], x["round"]) for x in ratios] == [(32768, 1), (32768, 2),
                                                           (65536, 1), (65536, 2)]
    assert [x["tokens_per_s_ratio"] for x in ratios[:2]] == pytest.approx([2.0, 1.5])
    pooled = pairing.pooled_ratios(results)
    assert [(x["seq_len"], x["rounds"]) for x in pooled] == [(32768, 2), (65536, 2)]
    first = pooled[0]
    # the mean tokens/s over the rounds: (1/0.1 + 1/0.12) / (1/0.2 + 1/0.18)
    assert first["tokens_per_s_ratio"] == pytest.approx((10 + 1 / 0.12) / (5 + 1 / 0.18))
    assert (first["ratio_min"], first["ratio_max"]) == pytest.approx((1.5, 2.0))
    assert first["ours_iter_ms"] == pytest.approx(110.0)
    assert first["peer_iter_ms"] == pytest.approx(190.0)
    assert first["ceiling_share"] == pytest.approx(50.0 / 110.0)
    assert pooled[1]["ceiling_share"] is None                     # no ceiling at 64K
    line = output.pooled_line(first)
    assert "over 2 round(s): 1.737x" in line and "1.500-2.000x" in line
    assert "45.5% of the ceiling" in line
    assert " round 2 " in output.progress_line(results[2])
    assert " round " not in output.progress_line(results[0])
    meta = report.run_metadata(["tools/bench_e2e.py"], torch.device("cpu"), 1)
    md = output.results_markdown(meta, cfg, results)
    assert "| 32K | 2 | megatron-usp | 1x1 | lean | ok |" in md
    assert "| 32K | 2 | 1x1 | lean | hf-liger | none | 1.500x |" in md
    assert "| 32K | 1x1 | lean | hf-liger | 2 | 110.0 / 190.0 | 1.737x | 1.500-2.000x |" in md
    # one round: the report keeps its columns, and the pooled entry equals the one ratio
    one = sweep.throughput_sweep(_e2e_cfg(seq_lens=[32768], splits=[(1, 1)], nproc_per_node=1,
                                        peers=["hf-liger"]), runner=run, peer_runner=peer)
    assert pairing.pooled_ratios(one)[0]["tokens_per_s_ratio"] == pytest.approx(2.0)
    assert "| round |" not in output.results_markdown(meta, _e2e_cfg(), one)


def test_rounds_flag():
    script = REPO / "pretrain_gpt.py"
    ns = e2e_cli.build_parser().parse_args(["--rounds", "3", "--seq-lens", "32k"])
    assert e2e_cli.config_from_args(ns).rounds == 3
    for kw, needle in [(dict(rounds=0), "--rounds 0"),
                       (dict(rounds=2, find_max_seq=True), "--find-max-seq")]:
        with pytest.raises(cli.BenchConfigError, match=needle):
            e2e_cli.validate_config(_e2e_cfg(pretrain_script=str(script), **kw))


def test_peer_rows_keep_the_measured_iterations():
    data = {"status": "ok", "iter_ms": 150.0, "iterations_measured": 2,
            "step_times_s": [3.0, 0.1, 0.2]}
    row = peers.peer_result("hf-liger", 32768, "none", data, "l", "cmd")
    assert row.iter_ms_each == pytest.approx([100.0, 200.0])
    assert peers.peer_result("hf", 1, "none", {"status": "oom"}, "l", "c").iter_ms_each is None


def test_a_missing_peer_is_reported_not_retried():
    run, _ = _fake_runner(lambda s: None)
    peer_run, calls = _peer_runner(lambda p, s, r: "missing" if p == "hf-liger" else None)
    cfg = _e2e_cfg(seq_lens=[32768], splits=[(1, 1)], nproc_per_node=1, peers=["hf-liger"])
    results = sweep.throughput_sweep(cfg, runner=run, peer_runner=peer_run)
    assert calls == [("hf-liger", 32768, "none")] and results[-1].status == "missing"
    assert pairing.peer_ratios(results) == []
    assert "missing" in output.progress_line(results[-1])


def test_peer_flags():
    assert peers.parse_peers("hf,hf-liger") == ["hf", "hf-liger"] and peers.parse_peers("none") == []
    for bad, needle in [("hf,transformers", "unknown"), ("hf,hf", "twice")]:
        with pytest.raises(cli.BenchConfigError, match=needle):
            peers.parse_peers(bad)
    script = REPO / "pretrain_gpt.py"
    with pytest.raises(cli.BenchConfigError, match="--find-max-seq"):
        e2e_cli.validate_config(_e2e_cfg(peers=["hf"], find_max_seq=True,
                                     pretrain_script=str(script)))


def test_hf_peer_reports_missing_packages(monkeypatch):
    real = hf_peer.importlib.util.find_spec
    monkeypatch.setattr(hf_peer.importlib.util, "find_spec",
                        lambda name: None if name == "liger_kernel" else real(name))
    assert "pip install -e .[peers]" in hf_peer.missing_packages("hf-liger", cuda=True)
    monkeypatch.setattr(hf_peer.importlib.util, "find_spec",
                        lambda name: object() if name == "liger_kernel" else real(name))
    assert "CUDA GPU" in hf_peer.missing_packages("hf-liger", cuda=False)
    assert hf_peer.missing_packages("hf-liger", cuda=True) is None


def test_num_layers_reaches_the_peer_and_the_ceiling(tmp_path, monkeypatch):
    """bench_e2e --num-layers 8 of Llama-3-8B: the peer's and the ceiling's commands ask for
    the same 8-layer slice our runs train, and the peer's row says how many it trained."""
    cfg = _e2e_cfg(tmp_path, model="llama3-8b", num_layers=8, seq_lens=[8192],
                   splits=[(1, 1)], nproc_per_node=1)
    commands = []

    def fake_run(cmd, env, log, timeout_s):
        commands.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        if "megatron.bench.hf_peer" in cmd:
            out.write_text(json.dumps({"status": "ok", "num_layers": 8}))
        else:
            out.write_text(json.dumps([{"seq_len": 8192, "ceiling_ms": 1.0}]))
        return 0

    monkeypatch.setattr(peers, "run_to_end", fake_run)
    monkeypatch.setattr(ceilings, "run_to_end", fake_run)
    assert peers.run_peer(cfg, "hf", 8192, "none").num_layers == 8
    assert list(ceilings.run_ceiling(cfg)) == [8192]
    assert [c[c.index("--num-layers") + 1] for c in commands] == ["8", "8"]
    commands.clear()
    peers.run_peer(dataclasses.replace(cfg, num_layers=None), "hf", 8192, "none")
    assert "--num-layers" not in commands[0]
    commands.clear()                              # the runs' window reaches the ceiling
    ceilings.run_ceiling(dataclasses.replace(cfg, extra_args=["--window-size", "4096"]))
    assert commands[0][-2:] == ["--window-size", "4096"]


def test_hf_peer_and_ceiling_time_the_slice(tmp_path, monkeypatch):
    """python -m megatron.bench.hf_peer / .ceiling --num-layers N build the preset's first N
    layers, and refuse a slice the preset does not have."""
    sliced = dataclasses.replace(models.MODELS["llama3-8b"].shape, num_layers=8)
    seen = []

    def fake_train(peer, shape, seq_len, *args, rope_base):
        seen.append((shape, rope_base))
        return hf_peer.PeerResult(peer, seq_len, "none", "ok", num_layers=shape.num_layers)

    monkeypatch.setattr(hf_peer, "train", fake_train)
    out = tmp_path / "peer.json"
    argv = ["--peer", "hf", "--model", "llama3-8b", "--seq-len", "64", "--out", str(out)]
    assert hf_peer.main(argv + ["--num-layers", "8"]) == 0
    # Llama-3's RoPE base, as bench_e2e's runs of llama3-8b pass --rotary-base 500000
    assert seen == [(sliced, 500000.0)] and json.loads(out.read_text())["num_layers"] == 8
    assert hf_peer.main(argv) == 0 and seen[-1][0].num_layers == 32
    tiny = ["--peer", "hf", "--model", "tiny", "--seq-len", "64", "--out", str(out)]
    assert hf_peer.main(tiny) == 0 and seen[-1][1] == 10000.0
    assert hf_peer.main(argv + ["--num-layers", "33"]) == 2

    monkeypatch.setattr(ceiling.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ceiling.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(ceiling, "linear_fwd_bwd_ms", lambda *a: 1.0)
    monkeypatch.setattr(ceiling, "attention_fwd_bwd_ms", lambda *a: 1.0)
    out = tmp_path / "ceiling.json"
    argv = ["--model", "llama3-8b", "--seq-lens", "8k", "--peak-tflops", "989", "--out",
            str(out)]
    assert ceiling.main(argv + ["--num-layers", "8"]) == 0
    (row,) = json.loads(out.read_text())
    # per layer four linears and the attention, then the output layer: 8 * 5 + 1 ms
    assert row["num_layers"] == 8 and row["ceiling_ms"] == 41.0
    assert row["flops_per_iteration"] == shapes.dense_training_flops(sliced, 8192, 1)
    with pytest.raises(SystemExit):
        ceiling.main(argv + ["--num-layers", "0"])


def test_the_ceiling_times_window_layers_through_the_window_kernel(tmp_path, monkeypatch):
    """A windowed model's ceiling: its window layers' attention is the window kernel's, the
    rest the causal kernel's, and its FLOPs are the training loop's count of those layers'
    pairs; bench_e2e passes the window of its --extra-args to the ceiling's process."""
    timed = []

    def attention(seq_len, heads, kv_heads, head_dim, device, dtype, repeats, window=None):
        timed.append(window)
        return 10.0 if window is None else 2.0

    monkeypatch.setattr(ceiling.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ceiling.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(ceiling, "linear_fwd_bwd_ms", lambda *a: 1.0)
    monkeypatch.setattr(ceiling, "attention_fwd_bwd_ms", attention)
    out = tmp_path / "ceiling.json"
    argv = ["--model", "llama-0.85b", "--seq-lens", "8k", "--peak-tflops", "989",
            "--out", str(out), "--window-size", "1024", "--window-attn-skip-freq", "4"]
    assert ceiling.main(argv) == 0
    (row,) = json.loads(out.read_text())
    shape = models.MODELS["llama-0.85b"].shape                    # 16 layers: 12 windowed
    assert timed == [None, 1024]
    assert row["attention"] == "dense causal, window 1024 on 12 of 16 layers"
    # per layer four linears, then 4 full layers' attention and 12 window layers', the output
    assert row["ceiling_ms"] == pytest.approx(16 * 4 + 4 * 10 + 12 * 2 + 1)
    pairs = 0.25 * 8192 ** 2 / 2 + 0.75 * shapes.window_pairs([8192], 1024)
    assert row["flops_per_iteration"] == pytest.approx(shapes.training_flops(shape, 8192, pairs))
    assert row["window_attention_ms_per_layer"] == 2.0
    timed.clear()                                   # a window over the whole sequence: none
    assert ceiling.main(argv[:8] + ["--window-size", "8191"]) == 0
    assert timed == [None] and json.loads(out.read_text())[0]["attention"] == "dense causal"
    for bad in (["--window-attn-skip-freq", "2"], ["--window-size", "(8,2)"],
                ["--window-size", "8", "--window-attn-skip-freq", "[1,0]"]):
        with pytest.raises(SystemExit):
            ceiling.main(argv[:8] + bad)
    with pytest.raises(ceiling.BenchConfigError, match="--ceiling off"):
        ceiling.measure_ceiling(dataclasses.replace(shape, window_size=64), 8192, 989.0, 1,
                                [[4096, 4096]])
    assert ceilings.window_args(["--num-workers", "0", "--window-size", "4096",
                                 "--window-attn-skip-freq=[1,0]", "--window-size=512"]) == [
        "--window-size", "512", "--window-attn-skip-freq", "[1,0]"]
    assert ceilings.window_args(["--seq-length", "8"]) == []


def test_hf_peer_config_takes_the_rope_base():
    pytest.importorskip("transformers")
    shape = models.MODELS["tiny"].shape

    def theta(config):   # transformers 5 keeps it in rope_parameters, 4 as rope_theta
        params = getattr(config, "rope_parameters", None) or {}
        return params.get("rope_theta", getattr(config, "rope_theta", None))

    assert theta(hf_peer.llama_config(shape, 64)) == 10000.0
    assert theta(hf_peer.llama_config(shape, 64, 500000.0)) == 500000.0


def test_e2e_markdown_and_progress():
    pytest.importorskip("megatron.training.observe.metrics")
    cfg = _e2e_cfg()
    spec = config.RunSpec(65536, 1, 2, "full", 5)
    ok = summary.summarize(cfg, spec, config.RunOutcome("ok", 0, _records([100.0] * 5), "l", []))
    oom = summary.summarize(cfg, spec, config.RunOutcome("oom", 1, [], "l", [], "out of memory"))
    meta = report.run_metadata(["tools/bench_e2e.py"], torch.device("cpu"), 2)
    md = output.results_markdown(meta, cfg, [ok, oom], {"1x2": 524288})
    assert "| 64K | megatron-usp | 1x2 | full | ok |" in md and "oom: out of memory" in md
    assert "MFU against 989 TFLOP/s" in md
    assert "1x2: 512K" in md
    assert "MFU" in output.progress_line(ok) and "oom" in output.progress_line(oom)
    assert "100.0 (100.0-100.0) ms/iter" in output.progress_line(ok)   # mean (min-max)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def test_a_run_past_its_timeout_is_stopped_with_its_children(tmp_path):
    """torchrun's workers must not outlive a timed-out run (they would hold the GPUs)."""
    child = "import time; time.sleep(120)"
    parent = ("import subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
              "print(p.pid, flush=True); time.sleep(120)")
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log:
        rc = launch.run_to_end([sys.executable, "-c", parent], dict(os.environ), log, timeout_s=3)
    assert rc is None
    worker = int(log_path.read_text().split()[0])
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)
    with open(log_path, "w") as log:
        assert launch.run_to_end([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ),
                               log, timeout_s=30) == 3


def test_metadata_says_when_the_tree_differs_from_the_commit(tmp_path):
    """A checkout with edited tracked files is reported as 'commit + uncommitted changes'."""
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f.txt").write_text("a\n")
    git("add", "f.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    assert report._git_dirty(tmp_path) is False
    (tmp_path / "f.txt").write_text("b\n")
    assert report._git_dirty(tmp_path) is True
    meta = {"device": None, "versions": {}, "world_size": 1, "date_utc": "d",
            "git_commit": "abc", "git_dirty": True, "command": "c"}
    assert "commit: abc + uncommitted changes" in report.metadata_markdown(meta)
    assert report._git_dirty(tmp_path / "missing") is None


def test_source_digest_follows_the_code_not_the_git_history(tmp_path):
    """Two checkouts with the same code files share a digest whatever else differs (caches,
    other files, .git); a changed, added or renamed code file changes it."""
    def tree(root):
        (root / "megatron" / "x").mkdir(parents=True)
        (root / "megatron" / "x" / "a.py").write_text("A = 1\n")
        (root / "benchmarks").mkdir()
        (root / "benchmarks" / "run.sh").write_text("echo hi\n")
        (root / "pretrain_gpt.py").write_text("main()\n")
        return root

    one, two = tree(tmp_path / "one"), tree(tmp_path / "two")
    digest = report.source_digest(one)
    assert digest is not None and len(digest) == 16
    (two / "megatron" / "x" / "__pycache__").mkdir()
    (two / "megatron" / "x" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (two / "README.md").write_text("docs\n")
    (two / ".git").mkdir()
    assert report.source_digest(two) == digest
    (two / "megatron" / "x" / "a.py").write_text("A = 2\n")
    assert report.source_digest(two) != digest
    (two / "megatron" / "x" / "a.py").write_text("A = 1\n")
    (two / "megatron" / "x" / "a.py").rename(two / "megatron" / "x" / "b.py")
    assert report.source_digest(two) != digest
    assert report.source_digest(tmp_path / "empty") is None
    meta = {"device": None, "versions": {}, "world_size": 1, "date_utc": "d",
            "git_commit": "abc", "git_dirty": True, "command": "c", "source_digest": digest}
    assert f"commit: abc + uncommitted changes; source digest: {digest}" in \
        report.metadata_markdown(meta)
    assert report.run_metadata(["x"], None, 1)["source_digest"] == \
        report.source_digest(Path(report.__file__).resolve().parents[2])


def test_source_digest_command(tmp_path, capsys):
    """python -m megatron.bench.report digest DIR prints the digest; a folder without code
    is refused in one line naming DIR."""
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "t.py").write_text("x = 1\n")
    report.main(["digest", str(tmp_path)])
    assert capsys.readouterr().out.strip() == report.source_digest(tmp_path)
    with pytest.raises(SystemExit):
        report.main(["digest", str(tmp_path / "nothing")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "DIR" in err and "holds no code files" in err


def test_a_failed_run_is_explained_by_its_cause_not_torchruns_summary():
    torchrun_tail = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                     "====\n/work/pretrain_gpt.py FAILED\n  traceback : To enable traceback see: "
                     "https://pytorch.org/docs/stable/elastic/errors.html\n====\n")
    crash = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
             "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    assert failure_cause(crash + torchrun_tail).startswith("torch.OutOfMemoryError: CUDA out")
    bad = "pretrain_gpt.py: error: --mlp-tile-tokens 7 must divide the local sequence\n"
    assert failure_cause(bad + torchrun_tail) == bad.strip()
    assert failure_cause("a\nb\nc\nd\n") == "b / c / d"
    chained = ("KeyError: 'x'\n\nDuring handling of the above exception, another exception "
               "occurred:\nRuntimeError: the real one\n") + torchrun_tail
    assert failure_cause(chained) == "RuntimeError: the real one"
    ranked = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"t.py\", line 5\n"
              "[rank0]: TypeError: '>=' not supported between instances of 'NoneType' and "
              "'Version'\n") + torchrun_tail
    assert failure_cause(ranked).startswith("TypeError: '>=' not supported")


def test_imported_model_compare_reads_two_metrics_files(tmp_path):
    from megatron.bench.imported import compare, markdown

    def write(name, tokens, mem):
        rows = [{"kind": "run", "layout": "TP1 U1 R1 DP1 PP1", "args": {"seq_length": 8}}]
        rows += [{"kind": "train", "iteration": i + 1, "tokens_per_s": t, "step_time_s": 8 / t,
                  "mem_gib": m} for i, (t, m) in enumerate(zip(tokens, mem))]
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    a = write("a", [1.0, 90.0, 100.0, 110.0], [9.0, 2.0, 2.0, 2.0])
    b = write("b", [1.0, 200.0, 200.0, 200.0], [1.0, 1.0, 1.0, 1.0])
    result = compare(a, b, warmup=1)   # the first iteration (compilation) is left out
    assert result["imported"]["tokens_per_s"] == 100.0 and result["imported"]["mem_gib"] == 2.0
    assert result["tokens_per_s_ratio"] == 0.5 and result["mem_ratio"] == 2.0
    assert "tokens/s 0.500x, memory 2.000x" in markdown(result)
    with pytest.raises(SystemExit, match="no training iteration after the first 4"):
        compare(a, b, warmup=4)


# --------------------------------------------------------------------------- window speed-up
def _e2e_row(iter_ms, flops_per_iteration, count="dense causal", seq_len=131072, **kw):
    return dict(seq_len=seq_len, stack="megatron-usp", status="ok", iter_ms=iter_ms,
                flops_per_iteration=flops_per_iteration, flops_count=count, **kw)


WINDOW_COUNT = "dense causal, window 4096 on 8 of 16 layers"


def test_window_speedup_against_the_flop_count():
    full = [_e2e_row(100.0, 2e15), _e2e_row(110.0, 2e15)]
    hybrid = [_e2e_row(80.0, 1.6e15, WINDOW_COUNT), _e2e_row(90.0, 1.6e15, WINDOW_COUNT)]
    got = window_speedup.speedup(full, hybrid)
    assert got["measured_speedup"] == pytest.approx(105 / 85)
    assert got["predicted_speedup"] == pytest.approx(1.25)
    assert got["share_of_predicted"] == pytest.approx(105 / 85 / 1.25)
    assert got["within_tolerance"] is True
    assert got["per_round"] == pytest.approx([100 / 80, 110 / 90])
    assert got["full_runs"] == got["hybrid_runs"] == 2
    assert "predicted 1.250x" in window_speedup.summary_line(got)
    assert window_speedup.summary_line(got).endswith("holds")
    # 1.10x measured against 1.25x predicted is 88 %: missed at 10 %, holds at 15 %
    slow = [_e2e_row(100.0, 1.6e15, WINDOW_COUNT)]
    missed = window_speedup.speedup([_e2e_row(110.0, 2e15)], slow)
    assert missed["share_of_predicted"] == pytest.approx(0.88)
    assert missed["within_tolerance"] is False
    assert window_speedup.summary_line(missed).endswith("missed")
    assert window_speedup.speedup([_e2e_row(110.0, 2e15)], slow, 0.15)["within_tolerance"]
    with pytest.raises(ValueError):
        window_speedup.speedup([], slow)


def _fp8_row(seq_len, tokens_per_s, mem, fp8):
    command = "pretrain_gpt.py --seq-length 8" + (" --fp8-format hybrid" if fp8 else "")
    return dict(seq_len=seq_len, stack="megatron-usp", status="ok", tokens_per_s=tokens_per_s,
                peak_mem_gib=mem, command=command)


def test_fp8_speedup_per_length_and_the_floor():
    bf16 = [_fp8_row(8192, 100.0, 40.0, False), _fp8_row(8192, 110.0, 40.0, False),
            _fp8_row(32768, 50.0, 60.0, False), _fp8_row(65536, 20.0, 70.0, False)]
    fp8 = [_fp8_row(8192, 130.0, 38.0, True), _fp8_row(8192, 140.0, 38.0, True),
           _fp8_row(32768, 49.0, 59.0, True)]
    got = fp8_speedup.compare(bf16, fp8)
    assert [r["seq_len"] for r in got] == [8192, 32768]         # lengths both sides trained
    short, long = got
    assert short["speedup"] == pytest.approx(135 / 105) and short["rounds"] == 2
    assert short["memory_ratio"] == pytest.approx(38 / 40) and short["floor_holds"] is True
    assert long["speedup"] == pytest.approx(0.98) and long["floor_holds"] is False
    lines = fp8_speedup.summary_lines(got)
    assert lines[0].startswith("S=8192: float8 over bf16 1.286x") and lines[0].endswith("holds")
    assert lines[1].endswith("missed")
    larger = fp8_speedup.compare([_fp8_row(8, 10.0, 1.0, False)], [_fp8_row(8, 11.0, 1.1, True)])
    assert larger[0]["floor_holds"] is False                  # faster, but more memory
    # a float8 run's own fixed buffers (~2 MiB) are within the slack; 32 MiB more is not
    same = fp8_speedup.compare([_fp8_row(8, 10.0, 55.826, False)],
                               [_fp8_row(8, 11.0, 55.826 + 2 / 1024, True)])
    assert same[0]["floor_holds"] is True
    assert fp8_speedup.summary_lines(same)[0].endswith("(1.000x, +2 MiB); never slower, "
                                                       "never larger: holds")
    above = fp8_speedup.compare([_fp8_row(8, 10.0, 55.826, False)],
                                [_fp8_row(8, 11.0, 55.826 + 32 / 1024, True)])
    assert above[0]["floor_holds"] is False
    with pytest.raises(ValueError, match="no sequence length"):
        fp8_speedup.compare(bf16, [_fp8_row(128, 1.0, 1.0, True)])


def test_fp8_speedup_refuses_a_file_on_the_wrong_side(tmp_path, capsys):
    path = tmp_path / "bf16.json"
    path.write_text(json.dumps({"results": [_fp8_row(8192, 100.0, 40.0, False),
                                            dict(_fp8_row(8192, 1.0, 1.0, False), stack="hf")]}))
    assert [r["tokens_per_s"] for r in fp8_speedup._load([str(path)], "bf16")] == [100.0]
    with pytest.raises(SystemExit):
        fp8_speedup.main(["--bf16", str(path), "--fp8", str(path)])
    assert "bf16.json: a run without --fp8-format; pass it as --bf16" in capsys.readouterr().err


def test_window_speedup_rows_come_from_the_right_side():
    payload = {"results": [_e2e_row(100.0, 2e15), _e2e_row(5.0, 1e9, seq_len=1024),
                           dict(_e2e_row(1.0, 1.0), stack="hf"),
                           dict(_e2e_row(1.0, 1.0), status="oom")]}
    rows = window_speedup.measured_rows(payload, 131072, "a.json", windowed=False)
    assert [r["iter_ms"] for r in rows] == [100.0]
    with pytest.raises(ValueError, match="a.json: .*check --hybrid"):
        window_speedup.measured_rows(payload, 131072, "a.json", windowed=True)
    with pytest.raises(ValueError, match="no run at --seq-len 65536"):
        window_speedup.measured_rows(payload, 65536, "a.json", windowed=False)


def test_window_speedup_command_writes_the_runs_metadata(tmp_path, capsys):
    def write(name, row):
        path = tmp_path / name
        meta = {"device": {"type": "cuda", "name": "H200"}, "command": "tools/bench_e2e.py"}
        path.write_text(json.dumps({"tool": "bench_e2e", "metadata": meta, "results": [row]}))
        return str(path)

    full = write("full.json", _e2e_row(100.0, 2e15))
    hybrid = write("hybrid.json", _e2e_row(80.0, 1.6e15, WINDOW_COUNT))
    out = tmp_path / "r.json"
    assert window_speedup.main(["--full", full, "--hybrid", hybrid, "--seq-len", "128k",
                                "--out", str(out)]) == 0
    assert "measured 1.250x" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["within_tolerance"] is True and result["seq_len"] == 131072
    meta = result["metadata"]
    assert meta["device"] == {"type": "cuda", "name": "H200"}
    assert meta["command"].startswith("python -m megatron.bench.window_speedup --full")
    assert meta["versions"]["torch"] and "git_commit" in meta
    with pytest.raises(SystemExit) as exc:          # the files on the wrong sides
        window_speedup.main(["--full", hybrid, "--hybrid", full])
    assert exc.value.code == 2


def test_a_windowed_run_reports_the_window_count(tmp_path, monkeypatch):
    """--extra-args "--window-size ...": the row takes the training loop's FLOPs and label,
    and so do the report's flops_count and the markdown's FLOPs line (not dense causal)."""
    pytest.importorskip("megatron.training.observe.metrics")
    cfg = _e2e_cfg(seq_lens=[131072], splits=[(1, 1)], nproc_per_node=1)
    spec = config.RunSpec(131072, 1, 1, "none", 5)
    recs = [dict(r, flops_count=WINDOW_COUNT) if r["kind"] == "train" else r
            for r in _records([100.0] * 5)]
    row = summary.summarize(cfg, spec, config.RunOutcome("ok", 0, recs, "l", []))
    assert row.flops_count == WINDOW_COUNT
    assert row.flops_per_iteration == pytest.approx(100.0e12 * 0.1)   # TFLOP/s x step time
    full = summary.summarize(cfg, spec, config.RunOutcome("ok", 0, _records([100.0] * 5),
                                                          "l", []))
    assert output.report_flops_count(cfg, [full]) == "dense causal"
    assert output.report_flops_count(cfg, [row]) == WINDOW_COUNT
    meta = report.run_metadata(["tools/bench_e2e.py"], torch.device("cpu"), 1)
    md = output.results_markdown(meta, cfg, [row])
    assert f"FLOPs: {WINDOW_COUNT}: the training loop's count" in md
    assert "S^2/2" not in md
    # the JSON's flops_count: tools/bench_e2e.py with the run faked
    monkeypatch.setattr(e2e_cli, "throughput_sweep",
                        lambda cfg, on_result, ceilings: on_result(row))
    out = tmp_path / "r.json"
    assert e2e_cli.main(["--model", "tiny", "--seq-lens", "128", "--splits", "1x1",
                         "--nproc-per-node", "1", "--iters", "3", "--warmup", "1",
                         "--device", "cpu", "--ceiling", "off", "--log-dir", str(tmp_path),
                         "--out", str(out)]) == 0
    assert json.loads(out.read_text())["flops_count"] == WINDOW_COUNT
