"""FLOPs per iteration against a hand count, the MFU peak table, and the metrics writer."""

import io
import json
import mmap
import re

import pytest
import torch

from megatron.planner.hardware import peak_tflops_for_device, preset_for_device
from megatron.shapes import ModelShape, dense_training_flops, training_flops
from megatron.training.cli.arguments import parse_args, validate_args
from megatron.training.data.batch import attention_pairs
from megatron.training.observe.metrics import (
    MetricsWriter,
    StepStats,
    Throughput,
    drop_records_after,
    host_memory_gib,
    memory_report,
    peak_host_memory_gib,
    set_aside,
)
from tests.helpers import tiny_gpt_flags


def _shape(L, h, f, n, g, d, V, swiglu):
    return ModelShape(num_layers=L, hidden_size=h, ffn_hidden_size=f, num_attention_heads=n,
                      num_query_groups=g, kv_channels=d, vocab_size=V, swiglu=swiglu)


def _hand_count(L, h, n, g, d, f, s, V, swiglu, causal, B):
    """Every matrix multiply of one forward pass over B sequences, 2*m*k*n FLOPs each,
    written out one GEMM at a time; backward = 2x forward."""
    tokens = B * s
    gemms = []
    for _ in range(L):
        gemms.append((tokens, h, n * d))          # Q projection
        gemms.append((tokens, h, g * d))          # K projection
        gemms.append((tokens, h, g * d))          # V projection
        for _ in range(B * n):                    # per sequence and query head
            pairs = s * (s + 1) // 2 if causal else s * s   # (query, key) pairs computed
            gemms.append((pairs, d, 1))           # scores: one d-long dot product per pair
            gemms.append((pairs, 1, d))           # context: one d-vector update per pair
        gemms.append((tokens, n * d, h))          # output projection
        if swiglu:
            gemms.append((tokens, h, f))          # gate
            gemms.append((tokens, h, f))          # up
        else:
            gemms.append((tokens, h, f))          # up
        gemms.append((tokens, f, h))              # down
    gemms.append((tokens, h, V))                  # logits
    forward = sum(2 * m * k * nn for m, k, nn in gemms)
    return 3 * forward


@pytest.mark.parametrize("swiglu,causal,groups", [(True, True, 2), (False, False, 8),
                                                  (True, False, 1)])
def test_flops_match_a_hand_count(swiglu, causal, groups):
    shape = _shape(3, 64, 176, 8, groups, 8, 1000, swiglu)
    want = _hand_count(3, 64, 8, groups, 8, 176, 32, 1000, swiglu, causal, B=5)
    got = dense_training_flops(shape, 32, 5, causal=causal)
    # The hand count of causal attention includes the diagonal (s(s+1)/2 pairs), the
    # formula counts exactly s^2/2: s/2 pairs per sequence and head, 4d FLOPs per pair
    # (scores and context), times 3 for forward + backward.
    L, B, n, s, d = 3, 5, 8, 32, 8
    diagonal = 3 * (L * B * n) * (s // 2) * 4 * d if causal else 0
    assert got == pytest.approx(want - diagonal, rel=1e-12)


def test_full_attention_equals_megatron_lms_formula():
    """Megatron-LM's num_floating_point_operations for a dense GPT, as published:
    12*B*s*L*h^2 * ((1 + g/n + s/h) * (n*d/h) + (f/h) * (3/2 if SwiGLU else 1))
    + 6*B*s*h*V. Our count with causal=False must equal it."""
    B, s, L, h, n, g, d, f, V = 4, 2048, 32, 4096, 32, 8, 128, 14336, 128256
    megatron = 12 * B * s * L * h * h * (
        (1 + g / n + s / h) * (n * d / h) + (f / h) * 1.5) + 6 * B * s * h * V
    shape = _shape(L, h, f, n, g, d, V, swiglu=True)
    assert dense_training_flops(shape, s, B, causal=False) == pytest.approx(megatron, rel=1e-12)
    halved_attention = 12 * B * s * L * h * h * (s / h) * (n * d / h) / 2
    assert dense_training_flops(shape, s, B) == pytest.approx(megatron - halved_attention,
                                                              rel=1e-12)


def test_shape_from_config_uses_gqa_only_when_asked():
    base = tiny_gpt_flags(llama=False, num_attention_heads=8, train_iters=2, lr="1e-3",
                          mock_data=True, vocab_size=100)
    for extra, groups in ((["--group-query-attention", "--num-query-groups", "2"], 2), ([], 8)):
        config = validate_args(parse_args(base + extra), 1, cuda_available=False)
        shape = config.with_padded_vocab(128).model_shape()
        assert (shape.num_query_groups, shape.kv_channels, shape.vocab_size) == \
            (groups, 8, 128)


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA H200 NVL", 835.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A800 80GB PCIe", 312.0),
    ("NVIDIA L20", 119.5), ("NVIDIA L40S", 362.0), ("NVIDIA H20", 148.0), ("NVIDIA B200", 2250.0),
    ("NVIDIA GeForce RTX 4090", 165.2), ("Some Future GPU", None), (None, None),
])
def test_peak_table(name, peak):
    assert peak_tflops_for_device(name) == peak


@pytest.mark.parametrize("name,preset", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA H800", "h100"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A800-SXM4-80GB", "a800"), ("NVIDIA L20", "l20"),
    ("NVIDIA H20", None), ("Some Future GPU", None), (None, None),
])
def test_device_preset(name, preset):
    assert preset_for_device(name) == preset


def test_throughput_and_mfu():
    shape = _shape(2, 64, 256, 4, 4, 16, 1024, swiglu=False)
    flops = dense_training_flops(shape, 128, 8)
    t = Throughput(shape, 128, 8, world_size=4, peak_tflops=100.0)
    rates = t.of(2.0)
    assert rates["tokens_per_s"] == pytest.approx(8 * 128 / 2.0)
    assert rates["tokens_per_s_per_gpu"] == pytest.approx(8 * 128 / 2.0 / 4)
    assert rates["tflops_per_gpu"] == pytest.approx(flops / 2.0 / 4 / 1e12)
    assert rates["mfu"] == pytest.approx(rates["tflops_per_gpu"] / 100.0)
    assert Throughput(shape, 128, 8, 4, None).of(2.0)["mfu"] is None


def test_metrics_writer(tmp_path):
    shape = _shape(2, 64, 256, 4, 4, 16, 1024, swiglu=False)
    out = io.StringIO()
    metrics = tmp_path / "m" / "metrics.jsonl"
    tb = tmp_path / "tb"
    w = MetricsWriter(True, train_iters=4, log_interval=2,
                      throughput=Throughput(shape, 128, 8, 4, 989.0), metrics_file=str(metrics),
                      tensorboard_dir=str(tb), stream=out)
    w.run_header("TP1 U2 R2 DP1 PP1", 4, {"seed": 1})
    for it in range(1, 5):
        w.train_step(StepStats(iteration=it, consumed_samples=8 * it, lm_loss=9.0 - it,
                               grad_norm=1.5, lr=1e-3, step_time_s=0.5, skipped=it == 3,
                               mem_gib=1.25, new_plan_shapes=None if it == 1 else 4 - it),
                     max_mem_gib=2.5 if it % 2 == 0 else None)
    w.validation(4, 4.5)
    w.close()
    text = out.getvalue().splitlines()
    iteration_lines = [line for line in text if "iteration" in line and "lm loss (mean" in line]
    assert len(iteration_lines) == 2
    line = iteration_lines[1]
    for part in ("iteration        4/       4", "consumed samples:           32",
                 # iteration 3 was skipped: the mean is of iteration 4 alone
                 "lm loss (mean of 1 iter): 5.000000E+00", "grad norm (mean): 1.500", "learning rate: 1.000000E-03",
                 "tokens/s: 2048.0 (per GPU 512.0)", "TFLOP/s/GPU", "MFU: 0.0%", "mem (GiB): 2.50",
                 "number of skipped iterations:   1"):
        assert part in line, (part, line)
    assert any("validation loss at iteration 4" in line for line in text)
    records = [json.loads(r) for r in metrics.read_text().splitlines()]
    assert [r["kind"] for r in records] == ["run", "train", "train", "train", "train", "valid"]
    assert records[3]["skipped"] is True and records[1]["mfu"] > 0
    # packed documents' new plan shapes: recorded where the loop gives them (not for dense)
    assert "new_plan_shapes" not in records[1]
    assert [r["new_plan_shapes"] for r in records[2:5]] == [2, 1, 0]
    assert records[-1] == {"kind": "valid", "iteration": 4, "lm_loss": 4.5,
                           "ppl": pytest.approx(90.0171313)}
    assert any(p.name.startswith("events.out.tfevents") for p in tb.iterdir())


def test_a_resumed_writer_keeps_one_record_per_iteration(tmp_path):
    """A run that wrote iterations 1-5, saved at 3 and was killed (the last line cut off
    mid-write) resumes at 3: its records of 4 and 5 and the torn line go before it appends,
    so the file ends with each iteration once; both run headers and the validation of
    iteration 3 stay."""
    shape = _shape(2, 64, 256, 4, 4, 16, 1024, swiglu=False)
    metrics = tmp_path / "metrics.jsonl"

    def writer(start, stream):
        return MetricsWriter(True, train_iters=6, log_interval=100,
                             throughput=Throughput(shape, 128, 8, 1, None),
                             metrics_file=str(metrics), stream=stream, start_iteration=start)

    def steps(w, first, last, loss):
        for it in range(first, last + 1):
            w.train_step(StepStats(it, 8 * it, loss + it, 1.0, 1e-3, 0.1, False, 1.0))

    w = writer(0, io.StringIO())
    w.run_header("TP1 U1 R1 DP1 PP1", 1, {})
    steps(w, 1, 3, 10.0)
    w.validation(3, 7.0)
    steps(w, 4, 5, 10.0)
    w.close()
    with open(metrics, "a") as f:
        f.write('{"kind": "train", "iter')            # killed mid-line
    out = io.StringIO()
    w = writer(3, out)
    w.run_header("TP1 U1 R1 DP1 PP1", 1, {})
    steps(w, 4, 6, 20.0)
    w.close()
    assert ("dropped 3 line(s) of iterations after 3, where this run starts"
            in out.getvalue())
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["kind"], r.get("iteration")) for r in records] == [
        ("run", None), ("train", 1), ("train", 2), ("train", 3), ("valid", 3), ("run", None),
        ("train", 4), ("train", 5), ("train", 6)]
    assert [r["lm_loss"] for r in records if r["kind"] == "train"] == [
        11.0, 12.0, 13.0, 24.0, 25.0, 26.0]
    # nothing to drop: the file is not rewritten; a fresh start (0) drops every iteration
    before = metrics.stat().st_mtime_ns
    assert drop_records_after(str(metrics), 6) == 0 and metrics.stat().st_mtime_ns == before
    assert drop_records_after(str(metrics), 0) == 7
    assert [json.loads(line)["kind"] for line in metrics.read_text().splitlines()] == [
        "run", "run"]
    assert drop_records_after(str(tmp_path / "none.jsonl"), 0) == 0
    assert not (tmp_path / "none.jsonl").exists()


def test_a_fresh_run_moves_another_runs_records_aside(tmp_path):
    """A run from iteration 0 onto a metrics file that holds another run's iterations moves
    that file, whole, to metrics.jsonl.1 (then .2) and says so; a file of headers only, or
    none, is simply written."""
    shape = _shape(2, 64, 256, 4, 4, 16, 1024, swiglu=False)
    metrics = tmp_path / "metrics.jsonl"

    def run(loss):
        out = io.StringIO()
        w = MetricsWriter(True, train_iters=2, log_interval=100,
                          throughput=Throughput(shape, 128, 8, 1, None),
                          metrics_file=str(metrics), stream=out, start_iteration=0)
        w.run_header("TP1 U1 R1 DP1 PP1", 1, {})
        for it in (1, 2):
            w.train_step(StepStats(it, 8 * it, loss + it, 1.0, 1e-3, 0.1, False, 1.0))
        w.close()
        return out.getvalue()

    def losses(path):
        return [json.loads(line)["lm_loss"] for line in path.read_text().splitlines()
                if json.loads(line)["kind"] == "train"]

    assert "moved" not in run(10.0)
    first = metrics.read_text()
    said = run(20.0)
    assert f"the records already there were moved to {metrics}.1" in said
    assert (tmp_path / "metrics.jsonl.1").read_text() == first
    assert losses(metrics) == [21.0, 22.0]
    run(30.0)
    assert losses(tmp_path / "metrics.jsonl.2") == [21.0, 22.0]
    assert losses(metrics) == [31.0, 32.0]
    only_headers = tmp_path / "headers.jsonl"
    only_headers.write_text('{"kind": "run", "layout": "x"}\n{"kind": "train", "iter')
    assert set_aside(str(only_headers)) is None and only_headers.exists()
    assert set_aside(str(tmp_path / "none.jsonl")) is None


def test_disabled_writer_writes_nothing(tmp_path):
    shape = _shape(2, 64, 256, 4, 4, 16, 1024, swiglu=False)
    w = MetricsWriter(False, 4, 2, Throughput(shape, 128, 8, 4, None),
                      metrics_file=str(tmp_path / "x.jsonl"), tensorboard_dir=str(tmp_path / "tb"))
    w.train_step(StepStats(1, 8, 1.0, 1.0, 1e-3, 0.1, False, 1.0))
    w.close()
    assert list(tmp_path.iterdir()) == []


def test_memory_report_names_host_memory_now_and_at_peak():
    """The start-up memory lines (after the model, after the optimizer): on the CPU the host
    part only, with the resident size now within the peak."""
    before = host_memory_gib()
    assert before is not None and 0 < before <= peak_host_memory_gib() + 0.05   # (ru_maxrss lags)
    # 64 MiB of fresh anonymous pages, touched: resident (a tensor could reuse pages the
    # process freed earlier and leave the resident size unchanged)
    block = mmap.mmap(-1, 64 << 20)
    for offset in range(0, 64 << 20, 4096):
        block[offset] = 1
    assert host_memory_gib() >= before + 0.05
    line = memory_report(torch.device("cpu"))
    assert "GPU" not in line
    now, peak = map(float, re.fullmatch(r"host (\S+) GiB resident \(peak (\S+)\)", line).groups())
    assert 0 < now <= peak + 0.05
    block.close()


def test_attention_pairs_count_each_document():
    """Documents of 3, 5 and 1 tokens and one of 9: (9 + 25 + 1)/2 + 81/2 pairs."""
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2], [0] * 9], dtype=torch.int32)
    full = {"tokens": torch.zeros(2, 9, dtype=torch.int64), "segment_ids": seg}
    assert attention_pairs(full, documents=True) == (9 + 25 + 1) / 2 + 81 / 2
    assert attention_pairs(full, documents=False) == 2 * 81 / 2      # dense: S^2/2 each


def test_throughput_counts_the_pairs_it_is_given():
    shape = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128)
    tp = Throughput(shape, 1024, 2, world_size=1, peak_tflops=1.0)
    dense, docs = tp.of(1.0), tp.of(1.0, attention_pairs=1000.0)
    assert dense["flops_count"] == "dense causal" and docs["flops_count"] == "documents"
    assert dense["tflops_per_gpu"] == training_flops(shape, 2048, 1024 * 1024) / 1e12
    assert docs["tflops_per_gpu"] == training_flops(shape, 2048, 1000.0) / 1e12
    assert docs["mfu"] < dense["mfu"]


def _visible_pairs_by_mask(n: int, window: int) -> int:
    i = torch.arange(n)
    return int(((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= window)).sum())


@pytest.mark.parametrize("n, window", [(1, 0), (9, 0), (9, 3), (9, 8), (9, 20), (64, 7)])
def test_window_pairs_count_the_window_like_causal_documents(n, window):
    from megatron.shapes import document_pairs, window_pairs

    # the exact count of a window mask, less the diagonal's n/2 as the causal count leaves it
    assert window_pairs([n], window) == _visible_pairs_by_mask(n, window) - n / 2
    if window >= n - 1:
        assert window_pairs([n], window) == document_pairs([n])


def test_attention_pairs_with_window_layers_average_over_layers():
    from megatron.shapes import window_pairs

    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2], [0] * 9], dtype=torch.int32)
    full = {"tokens": torch.zeros(2, 9, dtype=torch.int64), "segment_ids": seg}
    docs, windowed = (9 + 25 + 1) / 2 + 81 / 2, window_pairs([3, 5, 1], 2) + window_pairs([9], 2)
    assert attention_pairs(full, True, window=2, window_share=1.0) == windowed
    assert attention_pairs(full, True, window=2, window_share=0.5) == (docs + windowed) / 2
    assert attention_pairs(full, True, window=2, window_share=0.0) == docs
    assert attention_pairs(full, False, window=2, window_share=1.0) == 2 * window_pairs([9], 2)


@pytest.mark.parametrize("extra, label", [
    ([], "dense causal"),
    (["--reset-attention-mask", "--reset-position-ids"], "documents"),
    (["--window-size", "16", "--window-attn-skip-freq", "2"],
     "dense causal, window 16 on 2 of 4 layers"),
    (["--window-size", "16"], "dense causal, window 16 on 4 of 4 layers"),
])
def test_the_metrics_say_what_the_flop_count_counts(extra, label):
    from megatron.training.loop import flops_count_label, model_window

    flags = tiny_gpt_flags(num_layers=4, train_iters=2, lr="1e-3", mock_data=True,
                           vocab_size=100) + extra
    config = validate_args(parse_args(flags), 1, cuda_available=False)
    assert flops_count_label(config) == label
    windowed = extra[:1] == ["--window-size"]
    assert model_window(config) == ((16, 0.5 if "2" in extra else 1.0) if windowed
                                    else (None, 0.0))
