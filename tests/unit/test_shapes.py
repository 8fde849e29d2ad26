"""megatron.shapes: the one model shape, its presets, the SwiGLU width rule and the one FLOP
count, and that every place reporting FLOPs or MFU calls that count."""

import ast
import re
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from megatron.core.transformer.utils import is_layer_window_attention

from megatron.bench import ceiling, hf_peer
from megatron.bench.e2e import config, summary
from megatron.bench.models import MODELS
from megatron.planner import Layout, Workload, cost_model, estimate, get_hardware, plan_layouts
from megatron.planner.models import model_from_mapping
from megatron.planner.plan import plan_from
from megatron.shapes import (
    PRESETS,
    ModelShape,
    causal_pairs,
    default_ffn_hidden_size,
    dense_training_flops,
    full_pairs,
    training_flops,
)
from megatron.shapes.flags import shape_flags
from megatron.shapes.window import is_window_layer
from megatron.training import loop
from megatron.training.cli import arguments
from megatron.training.data import batch
from megatron.training.observe import metrics

REPO = Path(__file__).resolve().parents[2]
SHAPES = [PRESETS[n] for n in ("tiny", "cpu-tiny", "llama-0.85b", "llama3-8b", "gpt-1.2b")]


def _by_hand(shape, seq, batch, causal=True):
    """Megatron-LM's published num_floating_point_operations for a dense GPT,
    12*B*s*L*h^2 * ((1 + g/n + s/h) * (n*d/h) + (f/h) * (3/2 if SwiGLU else 1)) + 6*B*s*h*V,
    with the s/h (core attention) term halved for causal masks."""
    B, s, L, h = batch, seq, shape.num_layers, shape.hidden_size
    n, g, d = shape.num_attention_heads, shape.num_query_groups, shape.head_dim
    f, V = shape.ffn_hidden_size, shape.vocab_size
    attn = (s / h) * (0.5 if causal else 1.0)
    return (12 * B * s * L * h * h * ((1 + g / n + attn) * (n * d / h)
                                      + (f / h) * (1.5 if shape.swiglu else 1.0))
            + 6 * B * s * h * V)


# --------------------------------------------------------------------------- the count
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("seq,batch", [(128, 3), (32768, 1), (4096, 8)])
def test_the_count_is_megatrons_formula(shape, seq, batch):
    assert dense_training_flops(shape, seq, batch) == pytest.approx(_by_hand(shape, seq, batch),
                                                                    rel=1e-12)
    assert dense_training_flops(shape, seq, batch, causal=False) == pytest.approx(
        _by_hand(shape, seq, batch, causal=False), rel=1e-12)


def test_attention_is_an_input_counted_in_pairs():
    s = PRESETS["llama-0.85b"]
    assert causal_pairs(1000, 3) == 3 * 1000 ** 2 / 2 and full_pairs(1000, 3) == 3 * 1000 ** 2
    dense = training_flops(s, 4096, 0.0)
    # Packed documents: the sum of n^2/2 over the documents replaces S^2/2.
    docs = [1024, 1024, 2048]
    packed = training_flops(s, 4096, sum(causal_pairs(n) for n in docs))
    per_pair = 3 * 4 * s.num_attention_heads * s.head_dim * s.num_layers
    assert packed - dense == pytest.approx(per_pair * (3 * 2 ** 20), rel=1e-12)
    assert training_flops(s, 4096, causal_pairs(4096)) == dense_training_flops(s, 4096, 1)


# --------------------------------------------------------------------------- its callers
def _shape_and_batch():
    return PRESETS["llama-0.85b"], 32768, 2


def _metrics(monkeypatch):
    shape, seq, gbs = _shape_and_batch()
    # TFLOP/s per GPU of a 1 s step on 2 GPUs, back to FLOPs per iteration
    return metrics, lambda: (metrics.Throughput(shape, seq, gbs, 2, 989.0).of(1.0)
                             ["tflops_per_gpu"] * 2e12)


def _bench_e2e(monkeypatch):
    cfg = config.E2EConfig(seq_lens=[32768], splits=[(1, 1)], nproc_per_node=2, device="cpu")
    spec = config.RunSpec(32768, 1, 1, "none", 2)
    outcome = config.RunOutcome("error", 1, [], "l", [])
    return summary, lambda: summary.summarize(cfg, spec, outcome).flops_per_iteration


def _hf_peer(monkeypatch):
    monkeypatch.setattr(hf_peer, "missing_packages", lambda peer, cuda: "not here")
    shape, seq, _ = _shape_and_batch()
    return hf_peer, lambda: 2 * hf_peer.train("hf", shape, seq, 2, 1, "none", 1, None
                                              ).flops_per_iteration


def _ceiling(monkeypatch):
    monkeypatch.setattr(ceiling.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(ceiling, "linear_fwd_bwd_ms", lambda *a: 1.0)
    monkeypatch.setattr(ceiling, "attention_fwd_bwd_ms", lambda *a: 1.0)
    shape, seq, _ = _shape_and_batch()
    return ceiling, lambda: 2 * ceiling.measure_ceiling(shape, seq, 989.0).flops_per_iteration


def _planner(monkeypatch):
    shape, seq, gbs = _shape_and_batch()
    w = Workload(shape, seq, 8, 8, global_batch_size=gbs)
    # TP 8 over 4 KV groups: the KV projections are replicated, still counted once.
    lay = Layout.of(8, 1, 1, 1, 1, 1, "full")
    return cost_model, lambda: estimate(w, lay, get_hardware("h200")).model_flops_per_step


CALLERS = {"metrics": _metrics, "bench_e2e": _bench_e2e, "hf_peer": _hf_peer,
           "ceiling": _ceiling, "planner": _planner}


@pytest.mark.parametrize("name", sorted(CALLERS))
def test_every_mfu_reporter_gives_the_one_count(name, monkeypatch):
    """Each reporter's number for the 0.85B model, 2 x 32K tokens, is the one count; and it
    comes from calling that function (replaced here by a stand-in, the reporter must follow)."""
    shape, seq, gbs = _shape_and_batch()
    module, flops_of = CALLERS[name](monkeypatch)
    assert flops_of() == pytest.approx(dense_training_flops(shape, seq, gbs), rel=1e-12)
    assert flops_of() == pytest.approx(_by_hand(shape, seq, gbs), rel=1e-12)
    if hasattr(module, "dense_training_flops"):
        monkeypatch.setattr(module, "dense_training_flops",
                            lambda shape, seq, n, causal=True: 7.0 * n)
    if hasattr(module, "training_flops"):
        monkeypatch.setattr(module, "training_flops",
                            lambda shape, tokens, pairs: 7.0 * tokens / seq)
    assert flops_of() == pytest.approx(14.0)


def test_a_window_is_one_count_for_the_planner_the_loop_and_bench_e2e():
    """The 0.85B model with a window of 4096 on the layers ``[1,1,0,1]*4`` marks, 2 x 32K
    tokens on 8 GPUs: the planner's FLOPs per step are the training loop's count for the run
    of the plan's printed command (its RunConfig's ``model_window``, the batches' pairs, the
    metrics' Throughput) and what bench_e2e takes from the loop's records."""
    seq, gbs, gpus = 32768, 2, 8
    shape = replace(PRESETS["llama-0.85b"], window_size=4096,
                    window_attn_skip_freq=[1, 1, 0, 1] * 4)
    result = plan_layouts(Workload(shape, seq, gpus, 8, global_batch_size=gbs), "h200", top=1)
    plan = plan_from(result, result.best)
    argv = shlex.split(plan.command())
    flags = argv[argv.index("pretrain_gpt.py") + 1:] + [
        "--lr", "1e-4", "--train-iters", "10", "--mock-data", "--eval-iters", "0",
        "--vocab-size", str(shape.vocab_size)]
    run = arguments.validate_args(arguments.parse_args(flags), gpus, cuda_available=True)
    window, share = loop.model_window(run)
    assert (window, share) == (4096, 0.75) and run.shape.window_marks() == (1, 1, 0, 1) * 4

    micro = run.args.micro_batch_size
    sample = {"tokens": torch.zeros(micro, seq, dtype=torch.int64)}
    pairs = gbs // micro * batch.attention_pairs(sample, False, window, share)
    throughput = metrics.Throughput(run.with_padded_vocab(shape.vocab_size).model_shape(), seq,
                                    gbs, gpus, 989.0, loop.flops_count_label(run))
    rates = throughput.of(1.0, pairs)
    loop_flops = rates["tflops_per_gpu"] * gpus * 1e12
    assert plan.estimate.model_flops_per_step == pytest.approx(loop_flops, rel=1e-12)
    assert loop_flops < dense_training_flops(PRESETS["llama-0.85b"], seq, gbs)

    records = [{"kind": "train", "iteration": i, "step_time_s": 1.0, **rates} for i in (1, 2)]
    cfg = config.E2EConfig(seq_lens=[seq], splits=[(2, 2)], nproc_per_node=gpus, warmup=0,
                           device="cpu")
    res = summary.summarize(cfg, config.RunSpec(seq, 2, 2, "none", 2),
                            config.RunOutcome("ok", 0, records, "l", []))
    assert res.flops_per_iteration == pytest.approx(loop_flops, rel=1e-12)
    assert res.flops_count == "dense causal, window 4096 on 12 of 16 layers"


def test_no_module_counts_model_flops_on_its_own():
    """Outside megatron/shapes, nothing defines a whole-model FLOP count again."""
    suspects = []
    for path in (REPO / "megatron").rglob("*.py"):
        if path.relative_to(REPO).parts[:2] == ("megatron", "shapes"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and re.search(
                    r"(model|training)_flops|flops_per_iteration", node.name):
                suspects.append(f"{path.relative_to(REPO)}:{node.name}")
    assert suspects == [], suspects


# --------------------------------------------------------------------------- the window
PATTERNS = [None, 1, 2, 3, 4, 7, [1, 0, 1, 1, 0, 0, 1, 1], [0] * 8, [1] * 8]


@pytest.mark.parametrize("freq", PATTERNS, ids=str)
def test_window_layers_are_megatron_cores_rule(freq):
    """One rule: the shape's marks are megatron-core's ``is_layer_window_attention``."""
    shape = ModelShape(num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=64,
                       window_size=16, window_attn_skip_freq=freq)
    want = tuple(int(is_layer_window_attention((16, 0), freq, n)) for n in range(1, 9))
    assert shape.window_marks() == want
    assert all(is_window_layer(16, shape.window_attn_skip_freq, n) == bool(m)
               for n, m in enumerate(want, 1))
    assert shape.window_share() == sum(want) / 8
    assert replace(shape, window_size=None).window_marks() == (0,) * 8


@pytest.mark.parametrize("fields,needle", [
    ({"window_size": 0}, "window_size=0: the window must be at least 1 key, e.g. "
                         "window_size=4096"),
    ({"window_size": "4096"}, "window_size='4096' is not a window"),
    ({"window_size": True}, "is not a window"),
    ({"window_attn_skip_freq": 2}, "window_attn_skip_freq=2 has no effect without "
                                   "window_size; add window_size=4096"),
    ({"window_size": 16, "window_attn_skip_freq": 0}, "window_attn_skip_freq=0 must be >= 1, "
                                                      "e.g. window_attn_skip_freq=2"),
    ({"window_size": 16, "window_attn_skip_freq": [1, 0]},
     "is neither an int >= 1 nor a list of 4 zeros and ones"),
    ({"window_size": 16, "window_attn_skip_freq": [1, 2, 0, 1]},
     "e.g. window_attn_skip_freq=[1,1,1,0]"),
])
def test_a_bad_window_is_refused_in_one_line_naming_the_field(fields, needle):
    shape = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=64,
                       **fields)
    problems = shape.problems()
    assert len(problems) == 1 and needle in problems[0] and "\n" not in problems[0], problems


def test_a_window_pattern_is_kept_as_a_tuple():
    """The shape is frozen and hashable, with the pattern given as a list."""
    shape = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=64,
                       window_size=16, window_attn_skip_freq=[1, 0, 1, 0])
    assert shape.window_attn_skip_freq == (1, 0, 1, 0) and hash(shape) == hash(replace(shape))
    assert shape.problems() == []
    assert shape_flags(shape)[-4:] == ["--window-size", "16", "--window-attn-skip-freq",
                                       "[1,0,1,0]"]


def test_training_puts_the_window_in_the_shape():
    """``--window-size`` / ``--window-attn-skip-freq`` reach the run's shape as well as
    megatron-core's fields, so ``--ulysses-degree auto`` plans the window too."""
    flags = (shape_flags(PRESETS["tiny"], vocab=True)
             + ["--window-size", "(16,0)", "--window-attn-skip-freq", "([1]*1+[0]*1)",
                "--seq-length", "64", "--train-iters", "1", "--lr", "1e-3", "--mock-data"])
    run = arguments.validate_args(arguments.parse_args(flags), 1, cuda_available=False)
    assert (run.window_size, run.window_attn_skip_freq) == ((16, 0), [1, 0])
    assert (run.shape.window_size, run.shape.window_attn_skip_freq) == (16, (1, 0))
    assert loop.model_window(run) == (16, run.shape.window_share())


# --------------------------------------------------------------------------- SwiGLU rule
@pytest.mark.parametrize("h", [64, 128, 1000, 2048, 4096, 8192])
def test_swiglu_width_is_megatrons_rule_everywhere(h):
    want = int(8 * h / 3 / 64) * 64
    assert default_ffn_hidden_size(h, True) == want and default_ffn_hidden_size(h, False) == 4 * h
    assert ModelShape(num_layers=1, hidden_size=h, num_attention_heads=8).ffn_hidden_size == want
    assert ModelShape(num_layers=1, hidden_size=h, num_attention_heads=8,
                      swiglu=False).ffn_hidden_size == 4 * h

    m = model_from_mapping({"num_layers": 1, "hidden_size": h, "num_attention_heads": 8,
                            "vocab_size": 128, "swiglu": True}, "m")
    assert m.ffn_hidden_size == want


def test_training_uses_the_same_rule():
    assert arguments.default_ffn_hidden_size is default_ffn_hidden_size
    config = arguments.validate_args(arguments.parse_args(
        ["--num-layers", "2", "--hidden-size", "1000", "--num-attention-heads", "8",
         "--swiglu", "--seq-length", "64", "--train-iters", "1", "--lr", "1e-3",
         "--mock-data", "--vocab-size", "100"]), 1, cuda_available=False)
    assert config.ffn_hidden_size == config.shape.ffn_hidden_size == 2624


# --------------------------------------------------------------------------- presets
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_pretrain_gpt_flags(name):
    preset = PRESETS[name]
    assert preset.problems() == []
    flags = shape_flags(preset, vocab=True) + [
        "--seq-length", "256", "--train-iters", "1", "--lr", "1e-3", "--mock-data"]
    config = arguments.validate_args(arguments.parse_args(flags), 1, cuda_available=False)
    back = config.with_padded_vocab(preset.vocab_size).model_shape()
    assert back.head_dim == preset.head_dim
    assert replace(back, name=name, kv_channels=None) == preset


def test_benchmark_models_are_presets():
    for name, model in MODELS.items():
        assert model.shape is PRESETS[name]


@pytest.mark.parametrize("script", sorted((REPO / "examples").glob("pretrain_*.sh")),
                         ids=lambda p: p.name)
def test_examples_take_their_shape_from_the_table(script):
    names = re.findall(r'tools/model_flags\.py" (\S+)\)', script.read_text())
    assert len(names) == 1 and names[0] in PRESETS
    out = subprocess.run([sys.executable, str(REPO / "tools" / "model_flags.py"), names[0]],
                         capture_output=True, text=True, timeout=60, env={"PATH": ""})
    assert out.returncode == 0 and out.stdout.split() == shape_flags(PRESETS[names[0]])
    assert "--num-layers" not in script.read_text()
