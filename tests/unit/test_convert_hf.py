"""Hugging Face models imported with ``tools/convert_hf.py`` compute what transformers computes.

Tiny random models of each supported family (Llama untied and tied, Qwen2 with Q/K/V biases,
Qwen3 with q/k norms and a head dimension other than hidden/heads, Mistral without a window,
and Llama with a padded vocabulary) are written with ``save_pretrained``, imported by the tool
(a subprocess: megatron-core's checkpoint writer starts processes, which a daemonic test rank
may not), loaded back into the one-rank model and compared in float32 with transformers:

* logits: KL(HF || ours) <= 1e-9 per token and max |dlogit| <= 1e-4 (float32 matmuls in
  another order: ~1e-6 observed);
* per-token loss to 1e-5 (megatron-core's cross entropy against ``F.cross_entropy``);
* packed documents (EOD-separated, positions restarting, document attention) against
  transformers run on each document alone;
* greedy decoding of 32 tokens by our model equals transformers'; the exported directory
  loads in transformers with bitwise-identical weights and decodes the same 32 tokens.

The multi-rank layouts are in ``tests/distributed/test_convert_hf_layouts.py``; refusals of
what cannot be converted are checked without any model.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from megatron.convert.checkpoint_io import (
    FLAGS_FILE,
    SINGLE_RANK_FLAGS,
    export_hf,
    loaded_checkpoint,
)
from megatron.convert.hf_config import (
    from_args,
    from_hf_config,
    model_flags,
    to_hf_config,
    vocab_divisor,
)
from megatron.convert.hf_weights import fuse_qkv, split_qkv
from megatron.training.cli.arguments import padded_vocab_size, parse_args, validate_args
from megatron.training.cpu_shims import apply_cpu_shims
from megatron.usp.document_mask import segment_ids_from_tokens
from megatron.usp.document_ring import build_document_ring_plan
from tests.helpers import document_offsets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB, EOD, SEQ, DECODE = 256, 3, 48, 32
KL_MAX, LOGIT_MAX, LOSS_TOL = 1e-9, 1e-4, 1e-5
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
              rope_theta=10000.0, rms_norm_eps=1e-6, eos_token_id=EOD, bos_token_id=1)
# name -> (transformers config class, its fields, convert_hf.py import flags)
FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False), []),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True), []),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False, use_sliding_window=False), []),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=16,
                                  num_key_value_heads=4), []),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None), []),
    # Windows smaller than the test sequences (HF's sliding_window counts the query itself):
    # every layer (Mistral) and from layer 1 on (Qwen2's max_window_layers).
    "mistral_window": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=9), []),
    "qwen2_window": ("Qwen2Config", dict(tie_word_embeddings=False, use_sliding_window=True,
                                         sliding_window=7, max_window_layers=1), []),
    "llama_padded": ("LlamaConfig", dict(tie_word_embeddings=False, vocab_size=250),
                     ["--make-vocab-size-divisible-by", "128"]),
}


def make_hf_model(name: str, seed: int = 0):
    """A random float32 transformers model of family ``name``: every weight drawn (biases
    and norm scales too, so that none of them is a no-op)."""
    import transformers  # optional: transformers

    config_class, fields, _ = FAMILIES[name]
    config = getattr(transformers, config_class)(**{**COMMON, **fields})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, 0.08)
    return model


def run_convert_tool(jobs) -> None:
    """``tools/convert_hf.py`` for each argv in ``jobs``, in one subprocess."""
    code = ("import sys; sys.path.insert(0, 'tools'); from convert_hf import main\n"
            f"for argv in {jobs!r}:\n    assert main(argv) == 0, argv\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-4000:]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """name -> (HF directory, imported checkpoint directory) for every family."""
    root = tmp_path_factory.mktemp("convert_hf")
    dirs, jobs = {}, []
    for name, (_, _, flags) in FAMILIES.items():
        hf_dir, ckpt = str(root / name / "hf"), str(root / name / "ckpt")
        make_hf_model(name).save_pretrained(hf_dir)
        jobs.append(["import", hf_dir, ckpt] + flags)
        dirs[name] = (hf_dir, ckpt)
    run_convert_tool(jobs)
    return dirs


# --------------------------------------------------------------------------- comparisons
def documents_batch(seed: int = 7, seq: int = SEQ, vocab: int = VOCAB):
    """tokens [1, seq] of EOD-closed documents (lengths 1 .. 20), their segment ids and
    per-document positions."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, vocab, (1, seq), generator=gen)
    cut = 0
    for length in (1, 9, 20, 5, 13):
        cut += length
        if cut < seq:
            tokens[0, cut - 1] = EOD
    segments = segment_ids_from_tokens(tokens, EOD)
    return tokens, segments, document_offsets(segments).long()


def hf_logits(model, tokens, segments=None) -> torch.Tensor:
    """transformers' logits [b, s, V] (float64), per document when ``segments`` is given."""
    with torch.no_grad():
        if segments is None:
            return model(tokens).logits.double()
        parts = [model(tokens[:, segments[0] == s]).logits for s in segments[0].unique()]
        return torch.cat(parts, dim=1).double()


def _rope_tables(config, positions: torch.Tensor, d: int):
    """cos, sin [b, 1, s, d] of unscaled RoPE as transformers and megatron-core both define
    them: inverse frequencies, angles and cos / sin in float32 (then widened)."""
    theta = (config.rope_parameters or {}).get("rope_theta", getattr(config, "rope_theta", None))
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = positions[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos().double(), angles.sin().double()


def float64_reference_logits(state, config, tokens, positions, segments) -> torch.Tensor:
    """Logits [b, s, V] of a Llama-family decoder (Q/K/V biases and q/k norms when ``state``
    has them) computed here in float64 from an HF state dict, independent of both models:
    causal attention within each document (``segments`` [b, s]), RoPE at ``positions``.
    transformers' own float64 run is not one: its RMSNorm computes in float32."""
    sd = {k: v.double() for k, v in state.items()}
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    cos, sin = _rope_tables(config, positions, d)
    b, s = tokens.shape
    visible = torch.ones(s, s, dtype=torch.bool).tril() & (segments[:, :, None]
                                                            == segments[:, None, :])

    def norm(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)

    def rope(x):                                                   # [b, heads, s, d]
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def heads_of(x, p, name, n):                                   # [b, n, s, d]
        out = x @ sd[f"{p}self_attn.{name}_proj.weight"].t()
        out = out + sd.get(f"{p}self_attn.{name}_proj.bias", 0)
        out = out.view(b, s, n, d).transpose(1, 2)
        norm_w = sd.get(f"{p}self_attn.{name}_norm.weight")
        return out if norm_w is None else norm(out, norm_w)

    x = sd["model.embed_tokens.weight"][tokens]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        y = norm(x, sd[p + "input_layernorm.weight"])
        q, k = rope(heads_of(y, p, "q", heads)), rope(heads_of(y, p, "k", groups))
        k = k.repeat_interleave(heads // groups, dim=1)
        v = heads_of(y, p, "v", groups).repeat_interleave(heads // groups, dim=1)
        scores = (q @ k.transpose(-1, -2)) / d ** 0.5
        probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1)
        x = x + (probs @ v).transpose(1, 2).reshape(b, s, heads * d) @ sd[
            p + "self_attn.o_proj.weight"].t()
        y = norm(x, sd[p + "post_attention_layernorm.weight"])
        gate, up = y @ sd[p + "mlp.gate_proj.weight"].t(), y @ sd[p + "mlp.up_proj.weight"].t()
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].t()
    x = norm(x, sd["model.norm.weight"])
    return x @ sd.get("lm_head.weight", sd["model.embed_tokens.weight"]).t()


def max_abs_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| over ``ref``'s (real) vocabulary, in float64."""
    return (ours[..., :ref.shape[-1]].double() - ref.double()).abs().max().item()


def assert_logits_match(ours: torch.Tensor, ref: torch.Tensor, what: str,
                        logit_max: float = LOGIT_MAX) -> None:
    """KL(ref || ours) per token and max |dlogit| over the real vocabulary."""
    kl, worst = kl_max(ours, ref), max_abs_diff(ours, ref)
    assert kl <= KL_MAX and worst <= logit_max, f"{what}: KL {kl:.3g}, max |dlogit| {worst:.3g}"


def kl_max(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest per-token KL(ref || ours) over ``ref``'s (real) vocabulary, in float64."""
    log_p = ref.double().log_softmax(-1)
    log_q = ours[..., :ref.shape[-1]].double().log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).max().item()


def document_params(segments, ring_rank=0, ring_size=1, assignment=None):
    from megatron.usp.core_attention import DocumentParams  # megatron-core on first use

    plan = build_document_ring_plan(segments.numpy(), ring_rank, ring_size, assignment,
                                    causal=True, device=torch.device("cpu"))
    return DocumentParams.for_plan(plan)


def greedy(model_fn, prompt: torch.Tensor, steps: int = DECODE) -> torch.Tensor:
    """Greedy continuation of ``prompt [1, s]`` by ``model_fn(tokens) -> logits``."""
    tokens = prompt
    for _ in range(steps):
        nxt = model_fn(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[:, prompt.shape[1]:]


def _ours(model, tokens, position_ids=None, labels=None, packed=None):
    if position_ids is None:
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0)
    with torch.no_grad():
        return model(tokens, position_ids, None, labels=labels, packed_seq_params=packed)


def _check_forward(model, hf, vocab, padded: bool, what: str) -> None:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (2, SEQ), generator=gen)
    ref = hf_logits(hf, tokens)
    assert_logits_match(_ours(model, tokens), ref, f"{what} logits")
    if not padded:   # a padded vocabulary adds logit-0 entries to the loss's softmax
        labels = torch.randint(0, vocab, (2, SEQ), generator=gen)
        want = torch.nn.functional.cross_entropy(ref.flatten(0, 1), labels.flatten(),
                                                 reduction="none").view(2, SEQ)
        torch.testing.assert_close(_ours(model, tokens, labels=labels).double(), want,
                                   atol=LOSS_TOL, rtol=0, msg=f"{what} per-token loss")
    docs, segments, positions = documents_batch(vocab=vocab)
    assert_logits_match(_ours(model, docs, positions, packed=document_params(segments)),
                        hf_logits(hf, docs, segments), f"{what} packed documents")


def _check_family(name: str, hf_dir: str, ckpt: str, out_dir: str,
                  random_tokens: bool = True) -> None:
    """Decoding and export checks of one imported model; with ``random_tokens`` also the
    forward checks on random tokens (tiny random models)."""
    from transformers import AutoModelForCausalLM  # optional: transformers

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    prompt = torch.randint(4, vocab, (1, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=DECODE, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[:, prompt.shape[1]:]
    with loaded_checkpoint(ckpt) as built:
        if random_tokens:
            _check_forward(built.model, hf, vocab, name == "llama_padded", name)
        ours = greedy(lambda t: _ours(built.model, t)[..., :vocab], prompt)
    assert torch.equal(ours, want), f"{name} greedy decoding: {ours} vs {want}"
    export_hf(ckpt, out_dir)
    back = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    a, b = hf.state_dict(), back.state_dict()
    assert a.keys() == b.keys(), f"{name}: {set(a) ^ set(b)}"
    assert all(torch.equal(a[k], b[k]) for k in a), f"{name}: exported weights differ"
    with torch.no_grad():
        again = back.generate(prompt, max_new_tokens=DECODE, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[:, prompt.shape[1]:]
    assert torch.equal(again, want), f"{name}: exported model decodes differently"


def _check_families(rank, world_size, imported, out_root):
    apply_cpu_shims()
    for name, (hf_dir, ckpt) in imported.items():
        _check_family(name, hf_dir, ckpt, os.path.join(out_root, name))


def test_imported_models_match_transformers(dist_run, imported, tmp_path):
    dist_run(_check_families, 1, imported, str(tmp_path), timeout=600)


def test_import_writes_the_model_flags(imported):
    with open(os.path.join(imported["qwen3"][1], FLAGS_FILE)) as f:
        flags = f.read().split()
    for flag in ("--qk-layernorm", "--kv-channels", "--group-query-attention"):
        assert flag in flags
    assert "--untie-embeddings-and-output-weights" not in flags
    with open(os.path.join(imported["qwen2"][1], FLAGS_FILE)) as f:
        assert "--add-qkv-bias" in f.read().split()


# --------------------------------------------------------------------------- refusals
LLAMA = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, intermediate_size=96,
             num_attention_heads=8, num_key_value_heads=2, vocab_size=VOCAB,
             max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0)


@pytest.mark.parametrize("fields, message", [
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 8.0}),
     "rope_scaling.rope_type=dynamic is not supported"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e6}),
     "rope_parameters.rope_type=longrope is not supported"),
    (dict(model_type="gemma"), "model_type=gemma is not supported"),
    (dict(model_type="mistral", sliding_window=1), "sliding_window=1 is not supported"),
    (dict(sliding_window=32), "sliding_window=32 is not supported"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=32,
          layer_types=["full_attention", "chunked_attention"]),
     "layer_types=['chunked_attention'] is not supported"),
    (dict(model_type="mistral", sliding_window=32,
          layer_types=["full_attention", "sliding_attention"]), "layer_types=.* is not supported"),
    (dict(attention_bias=True), "attention_bias=true is not supported"),
    (dict(mlp_bias=True), "mlp_bias=true is not supported"),
    (dict(hidden_act="gelu"), "hidden_act=gelu is not supported"),
    (dict(rope_theta=10000.5), "rope_theta=10000.5 is not an integer"),
])
def test_unsupported_configs_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace(r"\.*", ".*")
                       .replace("[", r"\[").replace("]", r"\]")):
        from_hf_config({**LLAMA, **fields})


def test_rope_parameters_and_rope_theta_read_alike():
    old = from_hf_config({**LLAMA, "rope_theta": 500000.0, "rope_scaling": None})
    new = from_hf_config({**{k: v for k, v in LLAMA.items() if k != "rope_theta"},
                          "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    assert old == new and model_flags(old) == model_flags(new)
    assert "500000" in model_flags(old)


def test_config_round_trips_through_the_flags():
    """HF config -> flags -> the arguments a checkpoint records -> HF config again."""
    for fields in (dict(), dict(model_type="qwen3", head_dim=16), dict(model_type="qwen2"),
                   dict(tie_word_embeddings=True),
                   dict(model_type="mistral", sliding_window=4096),
                   dict(model_type="qwen2", use_sliding_window=True, sliding_window=33,
                        max_window_layers=1),
                   dict(model_type="qwen2", use_sliding_window=True, sliding_window=33,
                        layer_types=["sliding_attention", "full_attention"])):
        model = from_hf_config({**LLAMA, **fields})
        args = parse_args(model_flags(model) + SINGLE_RANK_FLAGS + [
            "--seq-length", "64", "--vocab-size", str(VOCAB)])
        validate_args(args, 1, cuda_available=False)
        args.padded_vocab_size = VOCAB
        back = from_args(vars(args), extra=model.extra)
        assert back == model, (fields, back)
        assert from_hf_config(to_hf_config(back)) == model


def test_hf_window_counts_the_query_itself():
    """HF's sliding_window W keeps kv_idx > q_idx - W: megatron-core's left is W - 1."""
    mistral = from_hf_config({**LLAMA, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.window_size == 4095 and mistral.window_layers is None
    flags = model_flags(mistral)
    assert flags[flags.index("--window-size") + 1] == "4095"
    assert "--window-attn-skip-freq" not in flags
    qwen = from_hf_config({**LLAMA, "model_type": "qwen2", "use_sliding_window": True,
                           "sliding_window": 64, "max_window_layers": 1})
    assert qwen.window_size == 63 and qwen.window_layers == (0, 1)
    flags = model_flags(qwen)
    assert flags[flags.index("--window-attn-skip-freq") + 1] == "[0,1]"
    assert from_hf_config({**LLAMA, "model_type": "mistral", "sliding_window": None}
                          ).window_size is None
    assert from_hf_config({**LLAMA, "model_type": "qwen2", "use_sliding_window": False,
                           "sliding_window": 64}).window_size is None


def test_a_window_the_family_cannot_express_is_refused_on_export():
    mistral = from_hf_config({**LLAMA, "model_type": "mistral", "sliding_window": 64})
    with pytest.raises(ValueError, match="--window-attn-skip-freq"):
        to_hf_config(replace(mistral, window_layers=(1, 0)))
    with pytest.raises(ValueError, match="--window-size 63: llama has no sliding window"):
        to_hf_config(replace(mistral, model_type="llama"))


@pytest.mark.parametrize("vocab, divisor", [(49152, 128), (128256, 32), (151936, 16),
                                            (32000, 32), (250, 1)])
def test_default_vocab_divisor_pads_nothing_up_to_tp8(vocab, divisor):
    assert vocab_divisor(vocab) == divisor
    assert all(padded_vocab_size(vocab, divisor, tp) == vocab for tp in (1, 2, 4, 8)
               if vocab % 8 == 0)


def test_qkv_fusion_groups_query_heads_with_their_key_and_value():
    """Row blocks of the fused QKV follow megatron-core's [groups, heads/groups + 2, d]."""
    model = from_hf_config(LLAMA)     # 8 query heads, 2 groups, d = 8
    d = model.kv_channels
    q = torch.arange(8).repeat_interleave(d).float().unsqueeze(1)          # head index
    k = 100 + torch.arange(2).repeat_interleave(d).float().unsqueeze(1)
    v = 200 + torch.arange(2).repeat_interleave(d).float().unsqueeze(1)
    fused = fuse_qkv(q, k, v, model)
    heads = fused[::d, 0].tolist()
    assert heads == [0, 1, 2, 3, 100, 200, 4, 5, 6, 7, 101, 201]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, model), (q, k, v)))
