"""RoPE scaling (llama3, linear, YaRN): the cos / sin our model rotates with equal
transformers' rotary embedding for the same config; the fused QKV split + RoPE kernel applies
YaRN's factor on cos and sin as megatron-core's unfused path does; the flags, the converter's
mapping and the checkpoint check refuse what they cannot run, naming the flag or field.

cos / sin: each Hugging Face config goes through the converter's flags into the one-rank
model (``build_gpt_model``); its per-token angles (``rotary_freqs_from_positions``) times
the concentration factor megatron-core's attention applies are compared in float32 with
``LlamaRotaryEmbedding`` (``ROPE_INIT_FUNCTIONS`` of the installed transformers) at positions
up to 4x the original context, to 1e-6.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

BASE = dict(model_type="llama", num_hidden_layers=1, hidden_size=64, intermediate_size=96,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# name -> (config fields, the original context)
CONFIGS = {
    "llama3": (dict(rope_theta=500000.0, max_position_embeddings=131072,
                    rope_scaling=LLAMA3), 8192),
    "llama3_factor32": (dict(rope_theta=500000.0, max_position_embeddings=131072,
                             rope_scaling=dict(LLAMA3, factor=32.0)), 8192),
    "linear": (dict(rope_theta=10000.0, max_position_embeddings=8192,
                    rope_scaling={"rope_type": "linear", "factor": 4.0}), 2048),
    "yarn": (dict(rope_theta=10000.0, max_position_embeddings=16384,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 4096}), 4096),
    "yarn_mscales": (dict(rope_theta=1000000.0, max_position_embeddings=32768,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0,
                                           "factor": 8.0, "original_max_position_embeddings":
                                           4096, "beta_fast": 16.0, "beta_slow": 2.0,
                                           "mscale": 1.0, "mscale_all_dim": 0.5}), 4096),
    "yarn_attention_factor": (dict(rope_theta=10000.0, max_position_embeddings=16384,
                                   rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 4096,
                                                 "attention_factor": 1.25}), 4096),
    "yarn_implicit_factor": (dict(rope_theta=10000.0, max_position_embeddings=12288,
                                  rope_scaling={"rope_type": "yarn", "factor": None,
                                                "original_max_position_embeddings": 4096}),
                             4096),
}


def _positions(original: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    far = torch.randint(0, 4 * original + 1, (512,), generator=gen)
    return torch.cat([torch.arange(64), far, torch.tensor([4 * original])]).unsqueeze(0)


def _hf_cos_sin(cfg, positions):
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    rope = LlamaRotaryEmbedding(transformers.LlamaConfig(**fields))
    x = torch.zeros(1, 1, dtype=torch.float32)
    cos, sin = rope(x, positions)
    return cos[0], sin[0]                                       # [s, d]


def _ours_cos_sin(cfg, positions):
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    from megatron.convert.checkpoint_io import single_rank_model
    from megatron.convert.hf_config import from_hf_config, model_flags
    from megatron.training.model.gpt_model import rotary_freqs_from_positions

    flags = model_flags(from_hf_config(cfg))
    with single_rank_model(flags, padded_vocab=256, seq_length=64) as built:
        freqs = rotary_freqs_from_positions(built.model.rotary_pos_emb, positions)
        mscale = _yarn_get_concentration_factor_from_config(built.model.config)
    f = freqs[:, 0, 0].float()                                 # [s, d]
    return f.cos() * mscale, f.sin() * mscale


def _check_cos_sin(rank, world_size):
    from megatron.training.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    for name, (fields, original) in CONFIGS.items():
        cfg = {**BASE, **fields}
        positions = _positions(original)
        want, got = _hf_cos_sin(cfg, positions), _ours_cos_sin(cfg, positions)
        for w, g, what in zip(want, got, ("cos", "sin")):
            err = (w - g).abs().max().item()
            assert err <= 1e-6, f"{name} {what}: max error {err:.3g}"
        # the scaling is in effect: unscaled RoPE would differ
        plain = _ours_cos_sin({**BASE, "rope_theta": fields["rope_theta"],
                               "max_position_embeddings": 131072}, positions)
        assert (plain[0] - got[0]).abs().max().item() > 1e-2, name


def test_cos_sin_equal_transformers_up_to_4x_the_original_context(dist_run):
    dist_run(_check_cos_sin, 1, timeout=300)


# --------------------------------------------------------------------------- fused kernel
_INTERPRETED = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding, _yarn_get_concentration_factor)
    from megatron.layers import fused_kernels, qkv_rope
    from megatron.training.cpu_shims import apply_cpu_shims
    from megatron.training.model.gpt_model import rotary_freqs_from_positions

    apply_cpu_shims()
    torch.manual_seed(0)
    s, b, ng, g, d = 24, 2, 2, 3, 16
    for mscale_pair in ((1.0, 0.0), (1.0, 0.5)):
        rotary = YarnRotaryEmbedding(d, scaling_factor=8.0, original_max_position_embeddings=64,
                                     beta_fast=16.0, beta_slow=1.0, mscale=mscale_pair[0],
                                     mscale_all_dim=mscale_pair[1], use_cpu_initialization=True)
        mscale = _yarn_get_concentration_factor(8.0, *mscale_pair)
        assert mscale > 1.05
        positions = torch.randint(0, 4 * 64, (b, s))
        freqs = rotary_freqs_from_positions(rotary, positions)          # [s, b, 1, d]
        mixed = torch.randn(s, b, ng, (g + 2) * d, requires_grad=True)
        q, k, v = qkv_rope.qkv_split_rope(mixed, freqs, g, d, mscale)
        assert qkv_rope.triton_usable(mixed)
        # the unfused path: megatron's split, megatron-core's RoPE with its mscale, float64
        m64 = mixed.detach().double().requires_grad_(True)
        mq, mk, mv = torch.split(m64, [g * d, d, d], dim=3)
        f64 = freqs.double()
        ref = (_apply_rotary_pos_emb_bshd(mq.reshape(s, b, ng * g, d), f64, False, mscale=mscale),
               _apply_rotary_pos_emb_bshd(mk, f64, False, mscale=mscale), mv)
        for got, want in zip((q, k, v), ref):
            assert (got.double() - want).abs().max().item() < 1e-5
        grads = [torch.randn_like(t) for t in (q, k, v)]
        torch.autograd.backward((q, k, v), grads)
        torch.autograd.backward(ref, [x.double() for x in grads])
        assert (mixed.grad.double() - m64.grad).abs().max().item() < 1e-5
        # the per-op RoPE of the other --fused-kernels choices, same factor
        tq, tk = fused_kernels.rope(ref[0].detach().float(), ref[1].detach().float(), freqs,
                                    "torch", mscale)
        want = _apply_rotary_pos_emb_bshd(ref[0].detach().float(), freqs, False, mscale=mscale)
        assert (tq - want).abs().max().item() < 1e-6
    print("yarn kernels ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_fused_qkv_rope_kernel_applies_yarns_factor_like_the_unfused_path():
    from tests.harness import run_under_triton_interpreter

    assert "yarn kernels ok" in run_under_triton_interpreter(_INTERPRETED)


# --------------------------------------------------------------------------- flags
_RUN = ("--num-layers 1 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--micro-batch-size 1 --train-iters 1 --lr 1e-4 --device cpu --mock-data "
        "--vocab-size 256").split()


def _validate(flags):
    from megatron.training.cli.arguments import parse_args, validate_args

    return validate_args(parse_args(_RUN + flags), 1, cuda_available=False)


YARN_FLAGS = ["--position-embedding-type", "yarn", "--yarn-rotary-scaling-factor", "4",
              "--yarn-original-max-position-embeddings", "16"]


@pytest.mark.parametrize("flags, message", [
    (["--position-embedding-type", "rope", "--rope-scaling-factor", "8"],
     "--rope-scaling-factor 8.0 has no effect without --use-rope-scaling"),
    (["--position-embedding-type", "rope", "--use-rope-scaling",
      "--rotary-seq-len-interpolation-factor", "2"],
     "--use-rope-scaling and --rotary-seq-len-interpolation-factor exclude one another"),
    (["--use-rope-scaling"], "--use-rope-scaling scales RoPE; it needs "
                             "--position-embedding-type rope"),
    (["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "0.5"],
     "--rotary-seq-len-interpolation-factor 0.5 must be >= 1"),
    (["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor",
      "0"], "--rope-scaling-factor 0.0 must be >= 1"),
    (["--position-embedding-type", "rope", "--yarn-beta-fast", "16"],
     "--yarn-beta-fast has no effect without --position-embedding-type yarn"),
    (["--position-embedding-type", "yarn"],
     "--position-embedding-type yarn needs --yarn-rotary-scaling-factor"),
    (YARN_FLAGS[:4], "--position-embedding-type yarn needs "
                     "--yarn-original-max-position-embeddings"),
    (YARN_FLAGS + ["--use-rope-scaling"], "--use-rope-scaling with --position-embedding-type "
                                          "yarn"),
    (YARN_FLAGS + ["--yarn-beta-slow", "0"], "--yarn-beta-slow 0.0 must be > 0"),
    (YARN_FLAGS + ["--yarn-mscale", "-1"], "--yarn-mscale -1.0 must be >= 0"),
    (YARN_FLAGS + ["--rotary-percent", "0.5"], "--rotary-percent 0.5 with "
                                               "--position-embedding-type yarn"),
])
def test_bad_rope_flags_are_refused_naming_the_flag(flags, message):
    from megatron.errors import UsageError

    with pytest.raises(UsageError, match=message.replace(".", r"\.")) as err:
        _validate(flags)
    assert "\n" not in str(err.value)


def test_rope_flags_reach_the_run_config_and_the_recorded_arguments():
    config = _validate(["--position-embedding-type", "rope", "--use-rope-scaling"])
    assert (config.rope.kind, config.rope.factor) == ("llama3", 8.0)
    assert config.flag_values()["rope_scaling_factor"] == 8.0       # the default, resolved
    config = _validate(YARN_FLAGS + ["--yarn-mscale", "0.5"])
    assert config.rope.kind == "yarn" and config.rope.beta_fast == 32.0
    assert config.rope.mscale == 0.5 and config.flag_values()["yarn_beta_slow"] == 1.0
    assert _validate(["--position-embedding-type", "rope"]).rope.kind == "none"


def test_bad_rope_flags_exit_with_status_2():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "pretrain_gpt.py"] + _RUN + [
        "--position-embedding-type", "rope", "--rope-scaling-factor", "8"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--rope-scaling-factor" in out.stderr


# --------------------------------------------------------------------------- converter
LLAMA = dict(BASE, max_position_embeddings=128, rope_theta=10000.0)


@pytest.mark.parametrize("fields, message", [
    (dict(rope_scaling=dict(LLAMA3, low_freq_factor=2.0)),
     "rope_scaling.low_freq_factor=2.0 is not supported (megatron-core's llama3"),
    (dict(rope_parameters=dict(LLAMA3, rope_theta=1e4, original_max_position_embeddings=4096)),
     "rope_parameters.original_max_position_embeddings=4096 is not supported"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope_scaling.rope_type=dynamic is not supported (supported: default, llama3, linear, "
     "yarn)"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
     "rope_parameters.rope_type=longrope is not supported"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0.5}),
     "rope_scaling.factor=0.5 is not supported"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                        "original_max_position_embeddings": 32, "truncate": False}),
     "rope_scaling.truncate=False is not supported"),
])
def test_unsupported_rope_scaling_is_refused_naming_the_field(fields, message):
    from megatron.convert.hf_config import ConversionError, from_hf_config

    with pytest.raises(ConversionError, match=message.replace(".", r"\.").replace("(", r"\(")
                       .replace(")", r"\)")):
        from_hf_config({**LLAMA, **fields})


@pytest.mark.parametrize("scaling", [
    LLAMA3, {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
     "beta_fast": 8.0, "mscale": 0.8, "mscale_all_dim": 0.4},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
     "attention_factor": 1.3},
])
def test_rope_scaling_round_trips_through_flags_and_checkpoint_arguments(scaling):
    """HF config -> flags -> recorded arguments -> HF config, in both config fields."""
    from megatron.convert.checkpoint_io import SINGLE_RANK_FLAGS
    from megatron.convert.hf_config import from_args, from_hf_config, model_flags, to_hf_config
    from megatron.training.cli.arguments import parse_args, validate_args

    for fields in (dict(rope_scaling=scaling),
                   dict(rope_parameters=dict(scaling, rope_theta=10000.0))):
        model = from_hf_config({**LLAMA, **fields})
        assert model.rope_scaling.kind == scaling["rope_type"]
        args = parse_args(model_flags(model) + SINGLE_RANK_FLAGS + [
            "--seq-length", "64", "--vocab-size", "256"])
        config = validate_args(args, 1, cuda_available=False).with_padded_vocab(256)
        back = from_args(config.flag_values(), extra=model.extra)
        assert back == model, (fields, back)
        exported = to_hf_config(back)
        assert from_hf_config(exported) == model
        assert exported["rope_scaling"]["rope_type"] == scaling["rope_type"]
        if "attention_factor" in scaling:
            assert exported["rope_parameters"]["attention_factor"] == pytest.approx(1.3, 1e-12)


# --------------------------------------------------------------------------- checkpoints
def test_resume_with_other_rope_flags_is_refused_but_finetune_may_change_them():
    from megatron.training.checkpoint.save_load import CheckpointError, check_model_matches

    saved = _validate(["--position-embedding-type", "rope"]).flag_values()
    now = _validate(["--position-embedding-type", "rope", "--use-rope-scaling",
                     "--rope-scaling-factor", "4"]).flag_values()
    with pytest.raises(CheckpointError, match="RoPE --rotary-base 10000 \\(this run: "
                                              "--rotary-base 10000 --use-rope-scaling "
                                              "--rope-scaling-factor 4"):
        check_model_matches(saved, now, "/ck/iter_0000005")
    check_model_matches(saved, now, "/ck/iter_0000005", finetune=True)
    check_model_matches(now, dict(now), "/ck/iter_0000005")
    old = {k: v for k, v in saved.items() if "rope" not in k and "yarn" not in k}
    check_model_matches(old, saved, "/ck/iter_0000005")   # before the flags: unscaled


def test_yarn_extends_a_rope_checkpoint_on_finetune_only():
    # YaRN rescales the rotation of the same weights: a rope checkpoint is the usual start of
    # a YaRN extension (weights-only, --finetune); a resume must keep the rotation it had.
    from megatron.training.checkpoint.save_load import CheckpointError, check_model_matches

    rope = _validate(["--position-embedding-type", "rope"]).flag_values()
    yarn = _validate(YARN_FLAGS).flag_values()
    check_model_matches(rope, yarn, "/ck/iter_0000005", finetune=True)
    with pytest.raises(CheckpointError, match="RoPE --rotary-base 10000 \\(this run: "
                                              "--rotary-base 10000 --position-embedding-type "
                                              "yarn"):
        check_model_matches(rope, yarn, "/ck/iter_0000005")
    learned = _validate(["--position-embedding-type", "learned_absolute"]).flag_values()
    for finetune in (False, True):
        with pytest.raises(CheckpointError, match="--position-embedding-type learned_absolute "
                                                  "\\(this run: --position-embedding-type yarn"):
            check_model_matches(learned, yarn, "/ck/iter_0000005", finetune=finetune)
