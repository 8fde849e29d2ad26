"""Model shapes the planner plans for: :class:`ModelSpec`, built-in presets, file loading.

A model is a decoder-only transformer described by the seven numbers megatron-core's
``TransformerConfig`` uses (``num_layers``, ``hidden_size``, ``num_attention_heads``,
``num_query_groups``, ``ffn_hidden_size``, the vocabulary size and whether the MLP is
SwiGLU). Parameter counts follow megatron-core's GPT layer (no biases, RMSNorm weights
only):

* attention: ``h*(h + 2*g*d)`` for the fused QKV projection (``d = h/a`` the head dim,
  ``g`` KV groups) plus ``h*h`` for the output projection;
* MLP: ``3*h*f`` for SwiGLU (gate, up, down), ``2*h*f`` otherwise;
* two norms of ``h`` each; embeddings ``V*h``, plus ``V*h`` again when the output layer
  is untied; a final norm of ``h``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping

from megatron.planner.errors import PlannerError
from megatron.usp.parallel_dims import ModelShape

_MODEL_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
)


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a GPT model, in megatron-core's words.

    Attributes:
        name: label used in the planner's output.
        num_layers: transformer layers ``L``.
        hidden_size: ``h``.
        num_attention_heads: query heads ``a``; ``h`` must be divisible by it.
        num_query_groups: KV heads ``g`` (``g == a`` is multi-head attention).
        ffn_hidden_size: MLP width ``f``.
        vocab_size: ``V`` (padded vocabulary as the embedding holds it).
        swiglu: gated MLP with three matrices (LLaMA) instead of two (GPT).
        untied_embeddings: the output layer has its own ``V*h`` weights.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    swiglu: bool = True
    untied_embeddings: bool = True

    def __post_init__(self) -> None:
        for key in _MODEL_FIELDS:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlannerError(f"model {self.name!r}: {key}={value!r} must be an integer >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise PlannerError(
                f"model {self.name!r}: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise PlannerError(
                f"model {self.name!r}: num_attention_heads {self.num_attention_heads} is not "
                f"divisible by num_query_groups {self.num_query_groups}; use a divisor of "
                f"{self.num_attention_heads}"
            )

    # ------------------------------------------------------------------ shape
    @property
    def shape(self) -> ModelShape:
        """What the layout rules (:meth:`ParallelDims.violations`) read of the model."""
        return ModelShape(self.num_attention_heads, self.num_query_groups, self.num_layers)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_ratio(self) -> float:
        """``g/a``: KV projection width relative to the query width."""
        return self.num_query_groups / self.num_attention_heads

    # ------------------------------------------------------------------ params
    def attention_params_per_layer(self) -> int:
        """``h*(h + 2*g*d)`` (fused QKV) + ``h*h`` (output projection)."""
        h = self.hidden_size
        return h * (h + 2 * self.num_query_groups * self.head_dim) + h * h

    def mlp_params_per_layer(self) -> int:
        """``3*h*f`` with SwiGLU, ``2*h*f`` without."""
        return (3 if self.swiglu else 2) * self.hidden_size * self.ffn_hidden_size

    def norm_params_per_layer(self) -> int:
        """Two RMSNorm weight vectors; replicated over TP, not sharded."""
        return 2 * self.hidden_size

    def params_per_layer(self) -> int:
        return (
            self.attention_params_per_layer()
            + self.mlp_params_per_layer()
            + self.norm_params_per_layer()
        )

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def output_params(self) -> int:
        """Output-layer weights held separately from the embedding (0 when tied)."""
        return self.vocab_size * self.hidden_size if self.untied_embeddings else 0

    def total_params(self) -> int:
        return (
            self.num_layers * self.params_per_layer()
            + self.embedding_params()
            + self.output_params()
            + self.hidden_size
        )

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_megatron_args(
        cls,
        num_layers: int,
        hidden_size: int,
        num_attention_heads: int,
        num_query_groups: int | None,
        ffn_hidden_size: int | None,
        vocab_size: int,
        swiglu: bool,
        untied_embeddings: bool = True,
        name: str = "model",
    ) -> "ModelSpec":
        """Build from megatron argument values (``--num-query-groups`` may be None = MHA,
        ``--ffn-hidden-size`` may be None = megatron's default ``4*h``)."""
        return cls(
            name=name,
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            num_query_groups=num_query_groups or num_attention_heads,
            ffn_hidden_size=ffn_hidden_size or 4 * hidden_size,
            vocab_size=vocab_size,
            swiglu=bool(swiglu),
            untied_embeddings=bool(untied_embeddings),
        )

    def to_dict(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _preset(name, layers, hidden, heads, groups, ffn, vocab, swiglu=True, untied=True):
    return ModelSpec(name, layers, hidden, heads, groups, ffn, vocab, swiglu, untied)


# Public model cards (Hugging Face config.json of each model; GPT-1.2B is the GPT shape
# DeepSpeed-Ulysses and Megatron use for their 1.2B runs: 24 x 2048, GELU MLP of 4h).
MODEL_PRESETS: Dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _preset("llama-0.85b", 16, 2048, 16, 4, 5632, 32000),
        _preset("llama2-7b", 32, 4096, 32, 32, 11008, 32000),
        _preset("llama2-13b", 40, 5120, 40, 40, 13824, 32000),
        _preset("llama2-70b", 80, 8192, 64, 8, 28672, 32000),
        _preset("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
        _preset("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
        _preset("gpt-1.2b", 24, 2048, 16, 16, 8192, 50304, swiglu=False, untied=False),
        _preset("gpt-7b", 32, 4096, 32, 32, 16384, 50304, swiglu=False, untied=False),
    )
}


def model_from_mapping(data: Mapping[str, Any], name: str) -> ModelSpec:
    """Build a :class:`ModelSpec` from a mapping with megatron's field names.

    Required: num_layers, hidden_size, num_attention_heads, vocab_size. Optional:
    num_query_groups (default: heads), ffn_hidden_size (default 4h), swiglu (default
    False, as megatron), untied_embeddings (default True), name.
    """
    allowed = set(_MODEL_FIELDS) | {"swiglu", "untied_embeddings", "name"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise PlannerError(
            f"model file {name}: unknown field(s) {unknown}; allowed: {sorted(allowed)}"
        )
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")
               if k not in data]
    if missing:
        raise PlannerError(f"model file {name}: missing field(s) {missing}")
    return ModelSpec.from_megatron_args(
        num_layers=data["num_layers"],
        hidden_size=data["hidden_size"],
        num_attention_heads=data["num_attention_heads"],
        num_query_groups=data.get("num_query_groups"),
        ffn_hidden_size=data.get("ffn_hidden_size"),
        vocab_size=data["vocab_size"],
        swiglu=data.get("swiglu", False),
        untied_embeddings=data.get("untied_embeddings", True),
        name=str(data.get("name", name)),
    )


def _read_structured_file(path: str) -> Any:
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
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


def load_model(spec: str) -> ModelSpec:
    """``--model``: a preset name (see :data:`MODEL_PRESETS`) or a JSON/YAML file path."""
    key = spec.strip().lower()
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    if os.path.exists(spec):
        data = _read_structured_file(spec)
        if not isinstance(data, dict):
            raise PlannerError(f"--model {spec}: the file must hold a mapping of model fields")
        base = os.path.splitext(os.path.basename(spec))[0]
        return model_from_mapping(data, base)
    raise PlannerError(
        f"--model {spec!r} is neither a preset nor an existing file; presets: "
        f"{sorted(MODEL_PRESETS)} (or pass a JSON/YAML file with num_layers, hidden_size, "
        f"num_attention_heads, num_query_groups, ffn_hidden_size, vocab_size, swiglu)"
    )
