"""pretrain_gpt.py's flags: Megatron-LM's names, grouped --help, derived values, 'auto'."""

import math
import os
import subprocess
import sys

import pytest

import megatron.planner as planner
from megatron.training.cli.arguments import (
    ArgumentsError,
    build_parser,
    default_ffn_hidden_size,
    padded_vocab_size,
    parse_args,
    validate_args,
)
from megatron.training.cli.auto_layout import resolve_auto_layout
from megatron.usp.parallel_dims import ParallelDims
from tests.helpers import tiny_gpt_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Megatron-LM's flags that pretrain_gpt.py takes under the same names, with a value where they
# take one.
MEGATRON_FLAGS = [
    ("--tensor-model-parallel-size", "1"), ("--pipeline-model-parallel-size", "1"),
    ("--num-layers", "4"), ("--hidden-size", "256"), ("--ffn-hidden-size", "512"),
    ("--num-attention-heads", "8"), ("--group-query-attention", None),
    ("--num-query-groups", "2"), ("--seq-length", "128"), ("--max-position-embeddings", "128"),
    ("--micro-batch-size", "2"), ("--global-batch-size", "16"), ("--lr", "3e-4"),
    ("--min-lr", "3e-5"), ("--lr-decay-style", "cosine"), ("--lr-warmup-iters", "10"),
    ("--train-iters", "100"), ("--weight-decay", "0.1"), ("--clip-grad", "1.0"),
    ("--bf16", None), ("--use-distributed-optimizer", None),
    ("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
    ("--recompute-num-layers", "1"), ("--sequence-parallel", None),
    ("--position-embedding-type", "rope"), ("--rotary-base", "500000"), ("--swiglu", None),
    ("--normalization", "RMSNorm"), ("--untie-embeddings-and-output-weights", None),
    ("--data-path", "/data/a_text_document"), ("--split", "98,1,1"), ("--mock-data", None),
    ("--tokenizer-type", "SentencePieceTokenizer"), ("--tokenizer-model", "/tok.model"),
    ("--save", "/ckpt"), ("--load", "/ckpt"), ("--save-interval", "50"),
    ("--eval-interval", "50"), ("--eval-iters", "5"), ("--log-interval", "10"),
    ("--seed", "42"), ("--tensorboard-dir", "/tb"),
]
OURS = ["--ulysses-degree", "--ring-degree", "--attention-backend", "--metrics-file",
        "--peak-tflops", "--skip-nan-steps", "--device", "--fused-linear-cross-entropy",
        "--linear-cross-entropy-chunk-tokens"]
GROUPS = ["model", "parallelism", "data", "training", "learning rate", "checkpointing",
          "logging"]

BASE = tiny_gpt_flags(llama=False, num_attention_heads=8, train_iters=10, lr="1e-3",
                      mock_data=True, vocab_size=1000)


def _valid(extra, world=4, cuda=False):
    return validate_args(parse_args(BASE + extra), world, cuda_available=cuda)


def test_every_megatron_flag_parses_to_its_megatron_dest():
    argv = []
    for flag, value in MEGATRON_FLAGS:
        argv += [flag] + ([value] if value is not None else [])
    args = parse_args(argv)
    for flag, value in MEGATRON_FLAGS:
        dest = flag[2:].replace("-", "_")
        got = getattr(args, dest)
        if value is None:
            assert got is True, flag
        elif flag == "--data-path":
            assert got == [value]
        else:
            assert str(got) == value or float(got) == float(value), (flag, got)


def test_help_is_grouped_and_lists_every_flag():
    text = build_parser().format_help()
    for title in GROUPS:
        assert f"\n{title}:" in text, title
    for flag, _ in MEGATRON_FLAGS:
        assert flag in text, flag
    for flag in OURS:
        assert flag in text, flag
    # The parallelism group sits between model and data, in that order.
    assert text.index("\nmodel:") < text.index("\nparallelism:") < text.index("\ndata:")


def test_pretrain_gpt_help_runs():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--ulysses-degree" in proc.stdout and "\nparallelism:" in proc.stdout


def test_derived_values():
    config = _valid(["--ulysses-degree", "2", "--ring-degree", "2", "--swiglu",
                     "--micro-batch-size", "2", "--global-batch-size", "8", "--save", "/ck"])
    assert config.dims.dp == 1 and config.dims.cp == 4
    assert config.num_microbatches == 4
    assert config.kv_channels == 8
    assert config.ffn_hidden_size == default_ffn_hidden_size(64, True) == 128
    assert config.max_position_embeddings == 64
    assert config.metrics_file == os.path.join("/ck", "metrics.jsonl")
    assert config.device == "cpu" and config.distributed_backend == "gloo"
    assert config.use_cpu_initialization and config.params_dtype == "float32"
    assert config.lr_decay_iters == 10
    config = _valid([], world=4)
    assert config.dims.dp == 4 and config.global_batch_size == 4
    assert config.ffn_hidden_size == 256  # 4h without SwiGLU
    assert config.metrics_file is None


def test_metrics_file_defaults_to_tensorboard_dir():
    config = _valid(["--tensorboard-dir", "/tb", "--save", "/ck"])
    assert config.metrics_file == os.path.join("/tb", "metrics.jsonl")
    config = _valid(["--metrics-file", "/m.jsonl", "--save", "/ck"])
    assert config.metrics_file == "/m.jsonl"


def test_gpu_defaults():
    config = _valid(["--bf16"], world=8, cuda=True)
    assert config.device == "cuda" and config.distributed_backend == "nccl"
    assert config.params_dtype == "bfloat16" and not config.use_cpu_initialization


def test_sequence_parallel_without_tp_is_dropped():
    assert _valid(["--sequence-parallel"]).sequence_parallel is False
    assert _valid(["--sequence-parallel", "--tensor-model-parallel-size", "2"]
                  ).sequence_parallel is True
    # The --help says so (Megatron-LM's behaviour).
    help_text = " ".join(build_parser().format_help().split())
    assert "Silently off at TP = 1, as in Megatron-LM" in help_text


def test_sequence_parallel_combines_with_usp():
    config = _valid(["--sequence-parallel", "--tensor-model-parallel-size", "2",
                     "--ulysses-degree", "2"])
    assert config.sequence_parallel is True and config.dims.cp == 2
    # Each CP rank's 64 / 2 = 32 tokens split over TP 2; 36 / 2 = 18 over TP 2 too.
    assert _valid(["--sequence-parallel", "--tensor-model-parallel-size", "2",
                   "--ring-degree", "2", "--seq-length", "36"]).sequence_parallel is True
    # Without --sequence-parallel the split does not matter.
    assert _valid(["--tensor-model-parallel-size", "4", "--seq-length", "66"]
                  ).sequence_parallel is False


def test_warmup_fraction():
    config = _valid(["--lr-warmup-fraction", "0.3"])
    assert config.lr_warmup_iters == 3
    assert config.flag_values()["lr_warmup_fraction"] is None   # recorded in iterations


# Flags whose defaults validation resolves: every one of them, given as parsed.
RESOLVING = ["--lr-warmup-fraction", "0.3", "--swiglu", "--save", "/ck", "--profile",
             "--profile-step-start", "2", "--profile-step-end", "4",
             "--fused-linear-cross-entropy", "--sequence-parallel"]


def test_validation_leaves_the_namespace_as_parsed():
    """Derived values live in the RunConfig; validate_args writes nothing onto args."""
    args = parse_args(BASE + RESOLVING + ["--ulysses-degree", "2"])
    before = dict(vars(args))
    config = validate_args(args, 4, cuda_available=False)
    assert vars(args) == before
    assert config.args is args and args.device == "auto" and args.ffn_hidden_size is None
    # Validating again (what 'auto' degrees do after the planner) gives the same config.
    assert validate_args(args, 4, cuda_available=False) == config
    assert vars(args) == before


def test_validation_builds_the_layout_once(monkeypatch):
    """One ParallelDims per validation, kept in the config (no re-derivation elsewhere)."""
    made = []
    real = ParallelDims.__init__

    def counting(self, *a, **kw):
        made.append(1)
        real(self, *a, **kw)

    monkeypatch.setattr(ParallelDims, "__init__", counting)
    config = _valid(["--ulysses-degree", "2", "--usp-overlap-chunks", "2",
                     "--mlp-tile-tokens", "8"])
    assert len(made) == 1 and config.dims.ulysses == 2
    assert config.flag_values()["context_parallel_size"] == 2


def test_flag_values_record_what_the_run_uses():
    """What checkpoints and metrics record: the flags with the values the run uses."""
    config = _valid(["--ulysses-degree", "2", "--swiglu", "--save", "/ck"]).with_padded_vocab(
        1024)
    values = config.flag_values()
    assert values["device"] == "cpu" and values["ffn_hidden_size"] == 128
    assert values["data_parallel_size"] == 2 and values["world_size"] == 4
    assert values["padded_vocab_size"] == 1024 and values["num_microbatches"] == 1
    assert values["metrics_file"] == os.path.join("/ck", "metrics.jsonl")
    assert list(values)[:len(vars(config.args))] == list(vars(config.args))


def test_vocab_padding_is_megatrons():
    assert padded_vocab_size(8000, 128, 1) == 8064
    assert padded_vocab_size(8000, 128, 2) == 8192
    assert padded_vocab_size(8000, 32, 2) == 8000
    assert padded_vocab_size(50257, 128, 8) == 51200


def _auto_args(seq_length, extra=()):
    """The 0.85B Llama-style model with 'auto' degrees on 16 GPUs, validated."""
    return validate_args(parse_args(["--num-layers", "16", "--hidden-size", "2048",
                       "--num-attention-heads", "16", "--group-query-attention",
                       "--num-query-groups", "4", "--ffn-hidden-size", "5632", "--swiglu",
                       "--seq-length", str(seq_length), "--train-iters", "10", "--lr", "1e-4",
                       "--mock-data", "--vocab-size", "32000", "--ulysses-degree", "auto",
                       "--ring-degree", "auto", "--global-batch-size", "8",
                       "--gpus-per-node", "8", "--use-distributed-optimizer", *extra]),
        16, cuda_available=True)


def test_auto_layout_uses_the_planner():
    config = _auto_args(65536)
    assert config.dims is None and config.args.ulysses_degree == "auto"  # for the planner
    planned, reasons = resolve_auto_layout(config, 32000, "NVIDIA H200")
    u, r = planned.dims.ulysses, planned.dims.ring
    assert isinstance(u, int) and isinstance(r, int)
    assert 16 % (u * r) == 0 and 16 % u == 0
    assert planned.dims.dp == 16 // (u * r) and config.args.ulysses_degree == "auto"
    assert reasons[0].startswith(f"planner chose TP1 U{u} R{r}")
    assert len(reasons) > 1


def _auto_tp2_args(extra):
    return _auto_args(131072, ["--tensor-model-parallel-size", "2", *extra])


def test_auto_layout_plans_the_sequence_parallelism_the_user_asked_for(monkeypatch):
    """TP > 1: the planner's memory model follows --sequence-parallel (it does not switch it
    on), and without it the log says what adding it would do."""
    seen = []
    real = planner.choose_layout

    def spy(*a, **kw):
        seen.append(kw["assumptions"].tp_sequence_parallel)
        return real(*a, **kw)

    monkeypatch.setattr(planner, "choose_layout", spy)
    plain, reasons = resolve_auto_layout(_auto_tp2_args([]), 32000, "NVIDIA H200")
    assert not plain.sequence_parallel
    assert any("without --sequence-parallel" in r and "add --sequence-parallel" in r
               for r in reasons), reasons
    with_sp, reasons_sp = resolve_auto_layout(_auto_tp2_args(["--sequence-parallel"]), 32000,
                                              "NVIDIA H200")
    assert with_sp.sequence_parallel
    assert not any("without --sequence-parallel" in r for r in reasons_sp)
    assert seen == [False, True]


def test_auto_layout_plans_the_loss_the_run_uses(monkeypatch):
    """The planner's memory model counts the run's loss: the fused one over its chunks, or
    megatron-core's full-sequence logits."""
    seen = []
    real = planner.choose_layout

    def spy(*a, **kw):
        seen.append(kw["assumptions"].loss_chunk_tokens)
        return real(*a, **kw)

    monkeypatch.setattr(planner, "choose_layout", spy)
    resolve_auto_layout(_auto_args(65536), 32000, "NVIDIA H200")
    resolve_auto_layout(_auto_args(65536, ["--fused-linear-cross-entropy"]), 32000,
                        "NVIDIA H200")
    resolve_auto_layout(_auto_args(65536, ["--fused-linear-cross-entropy",
                                           "--linear-cross-entropy-chunk-tokens", "2048"]),
                        32000, "NVIDIA H200")
    assert seen == [None, 8192, 2048]


def test_auto_layout_without_a_preset_asks_for_hardware():
    config = validate_args(parse_args(BASE + ["--ulysses-degree", "auto", "--ring-degree",
                                              "auto"]), 4, cuda_available=False)
    with pytest.raises(ArgumentsError, match="--hardware"):
        resolve_auto_layout(config, 1000, None)


def test_unknown_attention_backend_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--attention-backend", "xformers"])
    assert "--attention-backend" in capsys.readouterr().err


def _train_with_auto_layout(rank, world_size):
    from megatron.training import initialize as init_mod  # megatron-core on first use
    from megatron.training.loop import pretrain  # megatron-core on first use

    args = parse_args(BASE + ["--ulysses-degree", "auto", "--ring-degree", "auto",
                              "--hardware", "h200", "--gpus-per-node", "4",
                              "--num-workers", "0", "--train-iters", "2", "--eval-iters", "0",
                              "--global-batch-size", "4", "--reset-attention-mask"])
    runtimes = []
    real = init_mod.initialize

    def keep(a):
        runtimes.append(real(a))
        return runtimes[-1]

    import megatron.training.loop as loop_mod  # megatron-core on first use

    loop_mod.initialize = keep
    try:
        result = pretrain(args)
    finally:
        loop_mod.initialize = real
    dims = runtimes[0].config.dims
    assert isinstance(dims.ulysses, int) and isinstance(dims.ring, int)
    # packed documents: planned on megatron-core's mock documents as this vocabulary cuts them
    assert any(r.startswith("packed documents: megatron-core's mock documents (uniform:4k)")
               for r in runtimes[0].plan_reasons), runtimes[0].plan_reasons
    assert dims.ulysses * dims.ring * dims.dp == world_size
    assert result.iteration == 2 and all(math.isfinite(v) for v in result.losses.values())


def test_auto_layout_trains(dist_run):
    """pretrain() with 'auto' degrees asks the planner on every rank (deterministically the
    same answer, no communication), then trains under the chosen layout; with
    --reset-attention-mask the plan is costed on the mock documents."""
    dist_run(_train_with_auto_layout, 4, timeout=180)


def test_usp_overlap_chunks_flag_reaches_the_layer_spec():
    from megatron.training.model.layer_specs import (
        get_usp_gpt_layer_spec,  # megatron-core on first use
    )

    assert parse_args(BASE).usp_overlap_chunks == "auto"
    assert parse_args(BASE + ["--usp-overlap-chunks", "2"]).usp_overlap_chunks == 2
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            parse_args(BASE + ["--usp-overlap-chunks", bad])
    from megatron.training.model.layer_specs import LayerSpecOptions  # megatron-core on first use

    core = get_usp_gpt_layer_spec(LayerSpecOptions(overlap_chunks=2)
                                  ).submodules.self_attention.submodules
    assert core.core_attention.params["overlap_chunks"] == 2
    auto = get_usp_gpt_layer_spec().submodules.self_attention.submodules
    assert "overlap_chunks" not in auto.core_attention.params


def test_usp_overlap_chunks_checked_against_the_heads_at_start_up():
    with pytest.raises(ArgumentsError) as e:
        _valid(["--usp-overlap-chunks", "3"])
    assert "--usp-overlap-chunks 3" in str(e.value) and "choose one of" in str(e.value)


def test_fused_linear_cross_entropy_flags():
    """Off by default; on, the chunk defaults to 8192 tokens or takes the given count, and
    validation stays idempotent."""
    config = _valid([])
    assert config.args.fused_linear_cross_entropy is False
    assert config.loss_chunk_tokens is None
    config = _valid(["--fused-linear-cross-entropy"])
    assert config.args.fused_linear_cross_entropy is True
    assert config.loss_chunk_tokens == 8192
    assert validate_args(config.args, 4, cuda_available=False) == config
    for chunk in ("1", "3", "100000"):
        config = _valid(["--fused-linear-cross-entropy", "--linear-cross-entropy-chunk-tokens",
                         chunk, "--tensor-model-parallel-size", "2", "--sequence-parallel"])
        assert config.loss_chunk_tokens == int(chunk)


@pytest.mark.parametrize("extra,match", [
    (["--fused-linear-cross-entropy", "--linear-cross-entropy-chunk-tokens", "0"],
     "--linear-cross-entropy-chunk-tokens 0 must be >= 1, e.g. "
     "--linear-cross-entropy-chunk-tokens 8192"),
    (["--fused-linear-cross-entropy", "--linear-cross-entropy-chunk-tokens", "-5"],
     "--linear-cross-entropy-chunk-tokens -5 must be >= 1"),
    (["--linear-cross-entropy-chunk-tokens", "4096"],
     "--linear-cross-entropy-chunk-tokens 4096 has no effect without "
     "--fused-linear-cross-entropy; add --fused-linear-cross-entropy"),
])
def test_fused_linear_cross_entropy_bad_values(extra, match):
    with pytest.raises(ArgumentsError, match=match):
        _valid(extra)


def test_fused_linear_cross_entropy_chunk_needs_an_integer(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--fused-linear-cross-entropy",
                           "--linear-cross-entropy-chunk-tokens", "8k"])
    assert "--linear-cross-entropy-chunk-tokens: invalid int value" in capsys.readouterr().err


def test_recompute_modules_reach_megatron_and_are_checked():
    from megatron.training.model.build import (
        transformer_config_from_args,  # megatron-core on first use
    )

    args = _valid(["--recompute-granularity", "selective", "--recompute-modules", "mlp"])
    config = transformer_config_from_args(args)
    assert config.recompute_granularity == "selective" and config.recompute_modules == ["mlp"]
    default = transformer_config_from_args(_valid(["--recompute-granularity", "selective"]))
    assert default.recompute_modules == ["core_attn"]          # megatron-core's default
    with pytest.raises(ArgumentsError, match="--recompute-granularity selective"):
        _valid(["--recompute-modules", "mlp"])
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--recompute-granularity", "selective", "--recompute-modules", "moe"])



def test_layernorm_and_swiglu_recompute_are_the_layer_spec_s():
    """They never reach megatron-core (whose layernorm recompute needs TransformerEngine):
    the layer spec's fused linear layers do them; megatron-core's own modules still go through."""
    from megatron.training.model.build import (  # megatron-core on first use
        spec_recompute,
        transformer_config_from_args,
    )

    mlp = ["--swiglu", "--disable-bias-linear"]
    lean = ["--recompute-granularity", "selective", "--recompute-modules", "layernorm",
            "swiglu"]
    args = _valid(lean + mlp)
    config = transformer_config_from_args(args)
    assert config.recompute_granularity is None and spec_recompute(args) == (True, True)
    assert config.use_te_activation_func              # the MLP calls its activation slot
    both = _valid(["--recompute-granularity", "selective", "--recompute-modules", "layernorm",
                   "core_attn"])
    config = transformer_config_from_args(both)
    assert config.recompute_granularity == "selective"
    assert config.recompute_modules == ["core_attn"] and spec_recompute(both) == (True, False)
    with pytest.raises(ArgumentsError, match="--swiglu and --disable-bias-linear"):
        _valid(lean[:3] + ["swiglu"])
    with pytest.raises(ArgumentsError, match="drop swiglu"):
        _valid(lean[:3] + ["mlp", "swiglu"] + mlp)
