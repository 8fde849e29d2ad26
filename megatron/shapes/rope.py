"""RoPE scaling for context extension: one frozen value for the flags, the model and the
converter.

Three kinds, each megatron-core's (0.16.1) and each with Megatron-LM's flags:

``llama3``  ``--use-rope-scaling --rope-scaling-factor F``: Llama 3.1's frequency-dependent
            division of the inverse frequencies (``RotaryEmbedding(rope_scaling=True)``). Its
            low / high frequency factors and original context are fixed in megatron-core at
            :data:`LLAMA3_FIXED`.
``linear``  ``--rotary-seq-len-interpolation-factor F``: positions divided by F (position
            interpolation, ``seq_len_interpolation_factor``).
``yarn``    ``--position-embedding-type yarn --yarn-rotary-scaling-factor F
            --yarn-original-max-position-embeddings N`` (and ``--yarn-beta-fast``,
            ``--yarn-beta-slow``, ``--yarn-mscale``, ``--yarn-mscale-all-dim``):
            ``YarnRotaryEmbedding``'s blend of interpolated and original frequencies, and its
            concentration factor that multiplies cos and sin (:meth:`RopeScaling.concentration`).

Standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

ROPE_SCALING_KINDS = ("none", "llama3", "linear", "yarn")
# megatron-core's RotaryEmbedding._apply_scaling takes these from Llama 3.1 and the GPTModel
# gives it no way to change them.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
LLAMA3_DEFAULT_FACTOR = 8.0          # Megatron-LM's --rope-scaling-factor default
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE is scaled (``kind`` of :data:`ROPE_SCALING_KINDS`).

    ``factor``: the llama3 / linear / YaRN scaling factor (1 for ``none``). The YaRN fields
    (``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``,
    ``mscale_all_dim``) mean what megatron-core's ``YarnRotaryEmbedding`` takes.
    """

    kind: str = "none"
    factor: float = 1.0
    original_max_position_embeddings: Optional[int] = None
    beta_fast: float = YARN_DEFAULTS["beta_fast"]
    beta_slow: float = YARN_DEFAULTS["beta_slow"]
    mscale: float = YARN_DEFAULTS["mscale"]
    mscale_all_dim: float = YARN_DEFAULTS["mscale_all_dim"]

    @property
    def position_embedding_type(self) -> str:
        """``--position-embedding-type`` of a RoPE model with this scaling."""
        return "yarn" if self.kind == "yarn" else "rope"

    def concentration(self) -> float:
        """The factor on cos and sin: YaRN's ``mscale(F, mscale) / mscale(F, mscale_all_dim)``
        (megatron-core's ``_yarn_get_concentration_factor``); 1 for the other kinds."""
        if self.kind != "yarn":
            return 1.0
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor,
                                                                  self.mscale_all_dim)

    def flag_values(self) -> Dict[str, Any]:
        """The RoPE-scaling arguments (argparse names) that select this scaling, every one of
        them (unused ones None / False): what a checkpoint records."""
        out: Dict[str, Any] = {name: None for name in ROPE_ARG_NAMES}
        out["use_rope_scaling"] = self.kind == "llama3"
        if self.kind == "llama3":
            out["rope_scaling_factor"] = self.factor
        elif self.kind == "linear":
            out["rotary_seq_len_interpolation_factor"] = self.factor
        elif self.kind == "yarn":
            out.update(yarn_rotary_scaling_factor=self.factor,
                       yarn_original_max_position_embeddings=self.original_max_position_embeddings,
                       yarn_beta_fast=self.beta_fast, yarn_beta_slow=self.beta_slow,
                       yarn_mscale=self.mscale, yarn_mscale_all_dim=self.mscale_all_dim)
        return out

    def flags(self) -> List[str]:
        """The ``pretrain_gpt.py`` flags of this scaling (``--position-embedding-type`` apart)."""
        out: List[str] = []
        for name, value in self.flag_values().items():
            if value is None or value is False:
                continue
            flag = "--" + name.replace("_", "-")
            out += [flag] if value is True else [flag, _number(value)]
        return out

    @classmethod
    def from_flag_values(cls, values: Mapping[str, Any]) -> "RopeScaling":
        """The scaling that (validated) arguments select; ``values`` maps argparse names to
        values (a namespace's ``vars`` or a checkpoint's recorded arguments; absent names
        count as unset)."""
        if values.get("position_embedding_type") == "yarn":
            return cls("yarn", float(values["yarn_rotary_scaling_factor"]),
                       int(values["yarn_original_max_position_embeddings"]),
                       **{k: float(_or(values.get("yarn_" + k), v))
                          for k, v in YARN_DEFAULTS.items()})
        if values.get("use_rope_scaling"):
            return cls("llama3", float(_or(values.get("rope_scaling_factor"),
                                           LLAMA3_DEFAULT_FACTOR)))
        if values.get("rotary_seq_len_interpolation_factor") is not None:
            return cls("linear", float(values["rotary_seq_len_interpolation_factor"]))
        return cls()


ROPE_ARG_NAMES = ("use_rope_scaling", "rope_scaling_factor",
                  "rotary_seq_len_interpolation_factor", "yarn_rotary_scaling_factor",
                  "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
                  "yarn_mscale", "yarn_mscale_all_dim")


def _or(value, default):
    return default if value is None else value


def _number(value) -> str:
    """``8.0`` -> ``8``; other numbers as ``repr`` (exact)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


__all__ = ["RopeScaling", "ROPE_SCALING_KINDS", "ROPE_ARG_NAMES", "LLAMA3_FIXED",
           "LLAMA3_DEFAULT_FACTOR", "YARN_DEFAULTS", "yarn_mscale"]
