"""Models the planner plans for: presets by name, files, and the check a plan needs.

The shape is :class:`megatron.shapes.ModelShape` and the presets are the one table,
:data:`megatron.shapes.PRESETS`; this module reads ``--model`` (a preset name or a
JSON/YAML file of megatron's field names) and raises :class:`PlannerError` for a shape the
cost model cannot count (:func:`check_model`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping

from megatron.planner.errors import PlannerError
from megatron.shapes import PRESETS, ModelShape
from megatron.shapes.window import parse_skip_freq, parse_window_size

_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")
_OPTIONAL = ("num_query_groups", "ffn_hidden_size", "swiglu", "untied_embeddings", "name",
             "normalization", "position_embedding_type", "add_bias_linear", "window_size",
             "window_attn_skip_freq")
_CHOICES = {"normalization": ("RMSNorm", "LayerNorm"),
            "position_embedding_type": ("rope", "learned_absolute")}


def check_model(model: ModelShape) -> ModelShape:
    """``model`` itself when the cost model can count it; :class:`PlannerError` otherwise."""
    problems = model.problems()
    if problems:
        raise PlannerError(f"model {model.name!r}: {'; '.join(problems)}")
    return model


def model_from_mapping(data: Mapping[str, Any], name: str) -> ModelShape:
    """Build a checked shape from a mapping with megatron's field names.

    Required: num_layers, hidden_size, num_attention_heads, vocab_size. Optional:
    num_query_groups (default: heads), ffn_hidden_size (default: Megatron's, 4h or the
    SwiGLU width of :func:`megatron.shapes.default_ffn_hidden_size`), swiglu (default
    False, as megatron), untied_embeddings (default True), normalization (RMSNorm or
    LayerNorm), position_embedding_type (rope or learned_absolute), add_bias_linear
    (default: the Llama-style RMSNorm, rope, no bias), name, and megatron-core's sliding
    window: window_size (the left ``W``: ``4096``, ``[4096, 0]`` or ``"(4096,0)"``) and
    window_attn_skip_freq (an int, a list of one 0 / 1 per layer, or Megatron-LM's list
    expression as a string), spelled and checked as ``pretrain_gpt.py``'s flags are
    (:mod:`megatron.shapes.window`).
    """
    allowed = set(_REQUIRED) | set(_OPTIONAL)
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise PlannerError(
            f"model file {name}: unknown field(s) {unknown}; allowed: {sorted(allowed)}"
        )
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise PlannerError(f"model file {name}: missing field(s) {missing}")
    for key, choices in _CHOICES.items():
        if key in data and data[key] not in choices:
            raise PlannerError(f"model file {name}: {key} {data[key]!r} is not one of "
                               f"{list(choices)}")
    arch = {k: data[k] for k in _CHOICES if k in data}
    if "add_bias_linear" in data:
        arch["add_bias_linear"] = bool(data["add_bias_linear"])
    arch.update(_window_fields(data, name))
    return check_model(ModelShape(
        name=str(data.get("name", name)),
        num_layers=data["num_layers"],
        hidden_size=data["hidden_size"],
        num_attention_heads=data["num_attention_heads"],
        num_query_groups=data.get("num_query_groups"),
        ffn_hidden_size=data.get("ffn_hidden_size"),
        vocab_size=data["vocab_size"],
        swiglu=bool(data.get("swiglu", False)),
        untied_embeddings=bool(data.get("untied_embeddings", True)),
        **arch,
    ))


def _window_fields(data: Mapping[str, Any], name: str) -> Dict[str, Any]:
    """``window_size`` (the left ``W``) and ``window_attn_skip_freq`` of a model file, read
    with the command line's spellings; the shape checks them against each other."""
    out: Dict[str, Any] = {}
    try:
        size = data.get("window_size")
        if size is not None:
            if isinstance(size, (list, tuple)):
                size = "(" + ",".join(str(v) for v in size) + ")"
            out["window_size"] = parse_window_size(size, "window_size")[0]
        freq = data.get("window_attn_skip_freq")
        layers = data.get("num_layers")
        if isinstance(freq, str) and isinstance(layers, int) and layers >= 1:
            freq = parse_skip_freq(freq, layers, "window_attn_skip_freq")
        if freq is not None:
            out["window_attn_skip_freq"] = freq
    except ValueError as exc:
        raise PlannerError(f"model file {name}: {exc}") from None
    return out


def _read_structured_file(path: str) -> Any:
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml  # optional: PyYAML
        except ImportError:  # pragma: no cover - depends on the environment
            raise PlannerError(
                f"{path} is YAML but PyYAML is not installed: pip install pyyaml "
                f"(or give the model as JSON)"
            ) from None
        return yaml.safe_load(text)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlannerError(f"{path}: not valid JSON ({exc})") from None


def load_model(spec: str) -> ModelShape:
    """``--model``: a preset name (:data:`megatron.shapes.PRESETS`) or a JSON/YAML file path."""
    key = spec.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    if os.path.exists(spec):
        data = _read_structured_file(spec)
        if not isinstance(data, dict):
            raise PlannerError(f"--model {spec}: the file must hold a mapping of model fields")
        base = os.path.splitext(os.path.basename(spec))[0]
        return model_from_mapping(data, base)
    raise PlannerError(
        f"--model {spec!r} is neither a preset nor an existing file; presets: "
        f"{sorted(PRESETS)} (or pass a JSON/YAML file with num_layers, hidden_size, "
        f"num_attention_heads, num_query_groups, ffn_hidden_size, vocab_size, swiglu)"
    )
