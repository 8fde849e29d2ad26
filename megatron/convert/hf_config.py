"""Hugging Face ``config.json`` <-> the model flags of ``pretrain_gpt.py``.

:func:`from_hf_config` reads a config (a dict, as ``config.json`` holds it) of a supported
decoder (Llama 2 / 3 / 3.1 / 3.2, Qwen2 / 2.5, Qwen3, Mistral, SmolLM2: RMSNorm, SwiGLU, RoPE,
GQA) into a :class:`PretrainedConfig`; whatever the model here cannot run (another
architecture, a window it cannot express, a RoPE scaling megatron-core lacks, a bias the layer
spec has no slot for) raises ``ValueError`` in one line naming the config field. :func:`model_flags` gives the flags that
build the same model; :func:`to_hf_config` writes the config back for an export.

RoPE is read from ``rope_parameters`` (transformers 5) or from ``rope_theta`` and
``rope_scaling`` (older configs). Its ``rope_type`` ``llama3``, ``linear`` and ``yarn`` map
to the RoPE-scaling flags (:class:`~megatron.shapes.rope.RopeScaling`) and back on export
(written in both fields); ``llama3`` only with megatron-core's fixed low / high frequency
factors and original context, ``yarn`` only with ``truncate`` true (megatron-core rounds the
correction range). YaRN's ``attention_factor``, or ``mscale`` over ``mscale_all_dim``, becomes
``--yarn-mscale`` / ``--yarn-mscale-all-dim`` giving the same factor on cos and sin.

Sliding windows: transformers' ``sliding_window`` counts the query itself (its mask keeps
``kv_idx > q_idx - sliding_window``), megatron-core's ``window_size = (left, 0)`` does not
(``q_idx - left <= kv_idx``), so ``left = sliding_window - 1``. Mistral windows every layer;
Qwen2 / Qwen3 (``use_sliding_window``) window the layers ``layer_types`` marks
``sliding_attention``, by default those from ``max_window_layers`` on. A null
``sliding_window`` is full attention. The window becomes ``--window-size`` and, when not every
layer has it, ``--window-attn-skip-freq [..]`` (1: window layer); the export writes it back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from megatron.errors import UsageError
from megatron.shapes.rope import LLAMA3_FIXED, RopeScaling, yarn_mscale
from megatron.shapes.window import window_flags, window_marks
from megatron.training.cli.window_args import parse_skip_freq, parse_window_size

# model_type -> the class transformers builds for it
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
UNSCALED_ROPE = (None, "default")
MAX_VOCAB_DIVISOR = 128      # Megatron-LM's --make-vocab-size-divisible-by default
MAX_TP_WITHOUT_PADDING = 8   # the default divisor leaves no padding up to this TP


@dataclass(frozen=True)
class PretrainedConfig:
    """The shape of a pretrained decoder, in this project's terms.

    Attributes:
        model_type: ``llama``, ``mistral``, ``qwen2`` or ``qwen3`` (the export writes it back).
        num_layers, hidden_size, ffn_hidden_size: depth, width, SwiGLU width.
        num_attention_heads, num_query_groups, kv_channels: query heads, KV heads, head dim.
        vocab_size: rows of the embedding in the Hugging Face checkpoint (unpadded).
        max_position_embeddings: the context the model was trained for.
        rotary_base: RoPE theta (an integer, as ``--rotary-base`` takes it).
        norm_epsilon: RMSNorm epsilon.
        tied_embeddings: output layer shares the input embedding.
        qkv_bias: biases on Q, K and V only (Qwen2).
        qk_layernorm: RMSNorm over each query / key head before RoPE (Qwen3).
        rope_scaling: RoPE scaling for context extension (kind ``none`` without).
        window_size: the sliding window's ``left`` (None: full attention).
        window_layers: per layer 1 (window) or 0 (full); None: every layer when windowed.
        extra: config fields an export writes back unchanged (token ids, dtype).
    """

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    max_position_embeddings: int
    rotary_base: int
    norm_epsilon: float
    tied_embeddings: bool
    qkv_bias: bool = False
    qk_layernorm: bool = False
    rope_scaling: RopeScaling = RopeScaling()
    window_size: Optional[int] = None
    window_layers: Optional[Tuple[int, ...]] = None
    extra: Optional[Dict[str, Any]] = None


class ConversionError(UsageError, ValueError):
    """A model or checkpoint the converter cannot take: one line naming the field."""


def _refuse(field: str, value, why: str) -> ValueError:
    return ConversionError(f"{field}={value} {why}")


def _check_architecture(cfg: Dict[str, Any]) -> str:
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES:
        raise _refuse("model_type", model_type, f"is not supported (supported: "
                                                f"{', '.join(ARCHITECTURES)})")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "is not supported (the MLP is SwiGLU: silu)")
    return model_type


def _check_biases(cfg: Dict[str, Any], model_type: str) -> bool:
    """Whether Q, K and V carry biases; refuses biases the layer spec cannot hold."""
    if cfg.get("mlp_bias"):
        raise _refuse("mlp_bias", "true", "is not supported (the MLP has no biases)")
    if model_type == "qwen2":
        return True                      # Qwen2's q/k/v projections always have biases
    if cfg.get("attention_bias"):
        raise _refuse("attention_bias", "true", "is not supported (a bias on the attention "
                                                "output projection has no slot here)")
    return False


WINDOW_KINDS = {"full_attention": 0, "sliding_attention": 1}


def _window_layers(cfg: Dict[str, Any], model_type: str, windowed: bool) -> List[int]:
    """Per layer 1 (window) or 0 (full), as transformers builds the family's layers."""
    layers = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types")
    if kinds is not None:
        unknown = sorted(set(kinds) - set(WINDOW_KINDS))
        if unknown or len(kinds) != layers:
            raise _refuse("layer_types", unknown or len(kinds), "is not supported (one "
                                                                "full_attention or "
                                                                "sliding_attention per layer)")
        marks = [WINDOW_KINDS[k] for k in kinds]
        if model_type == "qwen2" or model_type == "qwen3":
            return marks if windowed else [0] * layers
        if marks != [int(windowed)] * layers:   # Mistral windows all layers or none
            raise _refuse("layer_types", kinds, f"is not supported ({model_type} applies "
                                                f"sliding_window to every layer)")
        return marks
    if not windowed:
        return [0] * layers
    if model_type == "qwen2" or model_type == "qwen3":
        first = int(cfg.get("max_window_layers", layers))
        return [int(i >= first) for i in range(layers)]
    return [1] * layers


def _sliding_window(cfg: Dict[str, Any], model_type: str
                    ) -> Tuple[Optional[int], Optional[Tuple[int, ...]]]:
    """(left, per-layer marks or None for every layer) of a config (module docstring)."""
    window = cfg.get("sliding_window")
    if model_type == "qwen2" or model_type == "qwen3":
        windowed = bool(cfg.get("use_sliding_window", False)) and window is not None
    elif model_type == "mistral":
        windowed = window is not None
    else:
        if window is not None:
            raise _refuse("sliding_window", window, f"is not supported ({model_type} has no "
                                                    f"sliding window in transformers)")
        windowed = False
    marks = _window_layers(cfg, model_type, windowed)
    if not any(marks):
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise _refuse("sliding_window", window, "is not supported (a window of at least 2 "
                                                "tokens, the query and one key before it)")
    return window - 1, None if all(marks) else tuple(marks)


def _check_full_attention(cfg: Dict[str, Any], model_type: str) -> None:
    factor = cfg.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise _refuse("partial_rotary_factor", factor, "is not supported yet")


def _rope_fields(cfg: Dict[str, Any]):
    """(field name, its dict with ``rope_type``, theta) of a config's RoPE."""
    params = cfg.get("rope_parameters")
    if params is not None:
        if "rope_theta" not in params:
            raise _refuse("rope_parameters", sorted(params), "is not supported (one RoPE "
                                                             "for every layer only)")
        return "rope_parameters", params, params["rope_theta"]
    scaling = dict(cfg.get("rope_scaling") or {})
    scaling["rope_type"] = scaling.get("rope_type", scaling.get("type"))
    return "rope_scaling", scaling, cfg.get("rope_theta", 10000)


def rope_theta(cfg: Dict[str, Any]) -> int:
    """RoPE theta of a config (an integer, as ``--rotary-base`` takes it)."""
    theta = _rope_fields(cfg)[2]
    if float(theta) != int(theta):
        raise _refuse("rope_theta", theta, "is not an integer (--rotary-base takes one)")
    return int(theta)


def _original_context(cfg: Dict[str, Any], params: Dict[str, Any]) -> int:
    """The pre-extension context as transformers reads it: a top-level
    ``original_max_position_embeddings`` first, then the RoPE dict's, then
    ``max_position_embeddings``."""
    return int(cfg.get("original_max_position_embeddings")
               or params.get("original_max_position_embeddings")
               or cfg["max_position_embeddings"])


def _factor(field: str, params: Dict[str, Any]) -> float:
    factor = params.get("factor")
    if factor is None or not float(factor) >= 1:
        raise _refuse(f"{field}.factor", factor, "is not supported (a scaling factor >= 1)")
    return float(factor)


def _llama3_scaling(cfg: Dict[str, Any], field: str, params: Dict[str, Any]) -> RopeScaling:
    values = dict(params, original_max_position_embeddings=_original_context(cfg, params))
    for key, fixed in LLAMA3_FIXED.items():
        if values.get(key) is None or float(values[key]) != fixed:
            raise _refuse(f"{field}.{key}", values.get(key),
                          f"is not supported (megatron-core's llama3 scaling fixes it at "
                          f"{fixed:g})")
    return RopeScaling("llama3", _factor(field, params))


def _yarn_mscales(field: str, params: Dict[str, Any], factor: float):
    """(mscale, mscale_all_dim) whose ratio is the factor transformers puts on cos and sin."""
    given = params.get("attention_factor")
    if given is None:
        mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
        # transformers uses the ratio only when both are set and non-zero
        return (float(mscale), float(all_dim)) if mscale and all_dim else (1.0, 0.0)
    if abs(given - yarn_mscale(factor)) <= 1e-12 * given:
        return 1.0, 0.0
    if factor <= 1:
        raise _refuse(f"{field}.attention_factor", given, "is not supported with factor 1 "
                                                          "(YaRN's factor on cos and sin is "
                                                          "then 1)")
    # 0.1 * mscale * ln(factor) + 1 = attention_factor, over mscale_all_dim 0 (a factor of 1)
    return (given - 1.0) / (0.1 * math.log(factor)), 0.0


def _yarn_scaling(cfg: Dict[str, Any], field: str, params: Dict[str, Any]) -> RopeScaling:
    original = _original_context(cfg, params)
    if params.get("truncate", True) is not True:
        raise _refuse(f"{field}.truncate", params["truncate"], "is not supported (megatron-core "
                                                               "rounds YaRN's correction range)")
    if params.get("factor") is None:   # transformers derives it from the two contexts
        params = dict(params, factor=cfg["max_position_embeddings"] / original)
    factor = _factor(field, params)
    mscale, all_dim = _yarn_mscales(field, params, factor)
    return RopeScaling("yarn", factor, original,
                       beta_fast=float(params.get("beta_fast") or 32),
                       beta_slow=float(params.get("beta_slow") or 1),
                       mscale=mscale, mscale_all_dim=all_dim)


def rope_scaling(cfg: Dict[str, Any]) -> RopeScaling:
    """The :class:`~megatron.shapes.rope.RopeScaling` of a config; refuses a ``rope_type``
    or parameter megatron-core cannot run, naming the field."""
    field, params, _ = _rope_fields(cfg)
    kind = params.get("rope_type")
    if kind in UNSCALED_ROPE:
        return RopeScaling()
    if kind == "llama3":
        return _llama3_scaling(cfg, field, params)
    if kind == "linear":
        return RopeScaling("linear", _factor(field, params))
    if kind == "yarn":
        return _yarn_scaling(cfg, field, params)
    raise _refuse(f"{field}.rope_type", kind, "is not supported (supported: default, llama3, "
                                              "linear, yarn)")


def from_hf_config(cfg: Dict[str, Any]) -> PretrainedConfig:
    """The :class:`PretrainedConfig` of a ``config.json`` dict; ValueError naming the field
    of anything the model here cannot run."""
    model_type = _check_architecture(cfg)
    qkv_bias = _check_biases(cfg, model_type)
    _check_full_attention(cfg, model_type)
    window_size, window_layers = _sliding_window(cfg, model_type)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    keep = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype")
    return PretrainedConfig(
        model_type=model_type, num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"], ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads, kv_channels=head_dim,
        vocab_size=cfg["vocab_size"], max_position_embeddings=cfg["max_position_embeddings"],
        rotary_base=rope_theta(cfg), rope_scaling=rope_scaling(cfg), norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
        qk_layernorm=model_type == "qwen3", window_size=window_size,
        window_layers=window_layers,
        extra={k: cfg[k] for k in keep if cfg.get(k) is not None})


def vocab_divisor(vocab_size: int) -> int:
    """The largest power of two up to 128 for ``--make-vocab-size-divisible-by`` that pads
    ``vocab_size`` at no TP up to 8 (so the checkpoint loads at TP 1, 2, 4 and 8 alike, and
    the logits have no padded entries)."""
    divisor = MAX_VOCAB_DIVISOR
    while divisor > 1 and vocab_size % (divisor * MAX_TP_WITHOUT_PADDING):
        divisor //= 2
    return divisor


def model_flags(model: PretrainedConfig, vocab_divisible_by: Optional[int] = None) -> List[str]:
    """The ``pretrain_gpt.py`` flags that build ``model`` (data, layout and training flags
    are the run's own). ``vocab_divisible_by`` defaults to :func:`vocab_divisor`.
    ``--vocab-size`` is the checkpoint's own row count, so the model keeps it with a
    tokenizer of fewer ids."""
    divisor = vocab_divisible_by or vocab_divisor(model.vocab_size)
    flags = ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
             "--ffn-hidden-size", str(model.ffn_hidden_size),
             "--num-attention-heads", str(model.num_attention_heads),
             "--kv-channels", str(model.kv_channels)]
    if model.num_query_groups != model.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(model.num_query_groups)]
    flags += ["--max-position-embeddings", str(model.max_position_embeddings),
              "--position-embedding-type", model.rope_scaling.position_embedding_type,
              "--rotary-base", str(model.rotary_base)]
    flags += model.rope_scaling.flags()
    flags += ["--swiglu", "--normalization", "RMSNorm", "--norm-epsilon",
              repr(model.norm_epsilon), "--disable-bias-linear",
              "--make-vocab-size-divisible-by", str(divisor),
              "--vocab-size", str(model.vocab_size)]
    flags += ["--add-qkv-bias"] * model.qkv_bias + ["--qk-layernorm"] * model.qk_layernorm
    flags += window_flags(model.window_size, model.window_layers)
    if not model.tied_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    return flags


def from_args(args: Dict[str, Any], model_type: Optional[str] = None,
              extra: Optional[Dict[str, Any]] = None) -> PretrainedConfig:
    """The :class:`PretrainedConfig` of the arguments a checkpoint recorded (a dict).

    ``model_type`` defaults to what the architecture flags imply (``qwen3`` with
    ``--qk-layernorm``, ``qwen2`` with ``--add-qkv-bias``, ``mistral`` with ``--window-size``,
    else ``llama``); the vocabulary
    is the padded one unless ``extra`` holds the import's ``vocab_size``.
    """
    _check_exportable(args)
    qkv_bias, qk_norm = bool(args.get("add_qkv_bias")), bool(args.get("qk_layernorm"))
    window = _window_from_args(args)
    implied = ("qwen3" if qk_norm else "qwen2" if qkv_bias else
               "mistral" if window else "llama")      # llama has no window
    extra = dict(extra or {})
    heads = args["num_attention_heads"]
    model = PretrainedConfig(
        model_type=model_type or implied, num_layers=args["num_layers"],
        hidden_size=args["hidden_size"], ffn_hidden_size=args["ffn_hidden_size"],
        num_attention_heads=heads,
        num_query_groups=(args["num_query_groups"] if args.get("group_query_attention")
                          else heads),
        kv_channels=args["kv_channels"],
        vocab_size=extra.pop("vocab_size", args["padded_vocab_size"]),
        max_position_embeddings=args["max_position_embeddings"],
        rotary_base=int(args["rotary_base"]), rope_scaling=RopeScaling.from_flag_values(args),
        norm_epsilon=float(args["norm_epsilon"]),
        tied_embeddings=not args.get("untie_embeddings_and_output_weights"),
        qkv_bias=qkv_bias, qk_layernorm=qk_norm, extra=extra, **window)
    _check_model_type(model)
    return model


def _window_from_args(args: Dict[str, Any]) -> Dict[str, Any]:
    """``window_size`` / ``window_layers`` of recorded arguments (the flags' text)."""
    if args.get("window_size") is None:
        return {}
    left = parse_window_size(args["window_size"])[0]
    freq = args.get("window_attn_skip_freq")
    if freq is None:
        return {"window_size": left}
    marks = window_marks(left, parse_skip_freq(freq, args["num_layers"]), args["num_layers"])
    if not any(marks):
        return {}
    return {"window_size": left, "window_layers": None if all(marks) else marks}


# (flag, value the export needs) for the architecture flags every supported family shares
_EXPORT_NEEDS = (("position_embedding_type", ("rope", "yarn")), ("swiglu", True),
                 ("normalization", "RMSNorm"), ("disable_bias_linear", True),
                 ("rotary_percent", 1.0))


def _check_exportable(args: Dict[str, Any]) -> None:
    for key, needed in _EXPORT_NEEDS:
        value = args.get(key)
        if isinstance(needed, tuple):
            if value in needed:
                continue
            needed = needed[0]
        if value != needed:
            flag = "--" + key.replace("_", "-")
            raise ConversionError(f"{flag} {value}: the checkpoint has no Hugging Face "
                             f"counterpart (the export needs {flag} {needed})")


def _check_model_type(model: PretrainedConfig) -> None:
    if model.model_type not in ARCHITECTURES:
        raise _refuse("model_type", model.model_type,
                      f"is not supported (supported: {', '.join(ARCHITECTURES)})")
    if model.qkv_bias != (model.model_type == "qwen2"):
        raise ConversionError(f"model_type={model.model_type} does not match --add-qkv-bias "
                         f"{model.qkv_bias} (qwen2 has Q/K/V biases, the others none)")
    if model.qk_layernorm != (model.model_type == "qwen3"):
        raise ConversionError(f"model_type={model.model_type} does not match --qk-layernorm "
                         f"{model.qk_layernorm} (qwen3 has q/k norms, the others none)")


def to_hf_config(model: PretrainedConfig) -> Dict[str, Any]:
    """A ``config.json`` dict that transformers builds ``model`` from."""
    cfg = {
        "architectures": [ARCHITECTURES[model.model_type]], "model_type": model.model_type,
        "num_hidden_layers": model.num_layers, "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups, "head_dim": model.kv_channels,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": model.norm_epsilon, "hidden_act": "silu",
        "tie_word_embeddings": model.tied_embeddings,
        "rope_theta": float(model.rotary_base),
        "rope_scaling": _hf_rope_scaling(model.rope_scaling),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(model.rotary_base),
                            **(_hf_rope_scaling(model.rope_scaling) or {})},
        "attention_dropout": 0.0, "use_cache": True,
    }
    if model.model_type in ("llama", "qwen3"):
        cfg.update(attention_bias=False)
    if model.model_type == "llama":
        cfg.update(mlp_bias=False)
    cfg.update(_hf_window(model))
    cfg.update(model.extra or {})
    return cfg


def _hf_window(model: PretrainedConfig) -> Dict[str, Any]:
    """The window fields of the family's config (module docstring); refuses a window the
    family cannot express, naming the flag."""
    if model.model_type == "llama":
        if model.window_size is not None:
            raise ConversionError(f"--window-size {model.window_size}: llama has no sliding "
                                  f"window in transformers; export with a mistral or qwen2 "
                                  f"--hf-config")
        return {}
    if model.window_size is None:
        return {"sliding_window": None, "use_sliding_window": False}
    marks = model.window_layers or (1,) * model.num_layers
    if model.model_type == "mistral":
        if not all(marks):
            raise ConversionError(f"--window-attn-skip-freq {list(marks)}: mistral windows "
                                  f"every layer; export with a qwen2 --hf-config")
        return {"sliding_window": model.window_size + 1}
    kinds = [k for m in marks for k, v in WINDOW_KINDS.items() if v == m]
    first = marks.index(1)
    return {"sliding_window": model.window_size + 1, "use_sliding_window": True,
            "max_window_layers": first, "layer_types": kinds}


def _hf_rope_scaling(rope: RopeScaling) -> Optional[Dict[str, Any]]:
    """transformers' RoPE-scaling dict of ``rope`` (None when unscaled)."""
    if rope.kind == "none":
        return None
    out: Dict[str, Any] = {"rope_type": rope.kind, "factor": rope.factor}
    if rope.kind == "llama3":
        out.update({k: (int(v) if k.startswith("original") else v)
                    for k, v in LLAMA3_FIXED.items()})
    elif rope.kind == "yarn":
        out.update(original_max_position_embeddings=rope.original_max_position_embeddings,
                   beta_fast=rope.beta_fast, beta_slow=rope.beta_slow)
        if rope.mscale and rope.mscale_all_dim:
            out.update(mscale=rope.mscale, mscale_all_dim=rope.mscale_all_dim)
        elif rope.concentration() != yarn_mscale(rope.factor):
            out["attention_factor"] = rope.concentration()
    return out


def with_vocab(model: PretrainedConfig, vocab_size: int) -> PretrainedConfig:
    """``model`` with another (unpadded) vocabulary size."""
    return replace(model, vocab_size=vocab_size)
