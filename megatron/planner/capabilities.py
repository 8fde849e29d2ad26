"""What ``pretrain_gpt.py`` can run in this installation, and the flags that run a plan.

The cost model describes any Megatron-style stack (ZeRO 0-3, every recompute); the planner
recommends only what ``pretrain_gpt.py`` here can run. One small table,
:data:`RUNNABLE_CHECKS`, holds the limits, each a function ``(layout, capabilities) ->
reason or None``; :func:`runnable` applies them, and grows when a flag is added (e.g.
Megatron-FSDP for ZeRO-2/3 adds its stages to :attr:`Capabilities.zero_stages`).

* ZeRO-0 is the plain optimizer and ZeRO-1 ``--use-distributed-optimizer``; ZeRO-2/3 are
  megatron-core's Megatron-FSDP (``--use-megatron-fsdp``), which the planner does not
  recommend yet: it is refused over one DP x CP rank (megatron-core 0.16.1 double-counts the
  gradients there) and not yet verified over more on GPUs.
* Selective recompute is ``--recompute-modules mlp``, plus ``layernorm`` only with
  TransformerEngine: megatron-core 0.16.1's norm checkpoint calls TransformerEngine even
  without FP8 (``megatron/training/cli/arguments.py`` refuses it otherwise). The cost model's
  memory for ``selective`` follows the modules (:class:`~.cost_model.Assumptions`).

Pure Python (no torch): TransformerEngine's presence is asked with ``find_spec``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable, FrozenSet, List, Optional, Tuple

from megatron.planner.cost_model import ZERO_STAGES, Layout
from megatron.shapes import ModelShape
from megatron.shapes.flags import shape_flags

ZERO_FLAGS = {0: [], 1: ["--use-distributed-optimizer"]}


@dataclass(frozen=True)
class Capabilities:
    """What the training script can be told to do."""

    zero_stages: FrozenSet[int] = frozenset(ZERO_FLAGS)
    selective_recompute_modules: Tuple[str, ...] = ("mlp",)


# A Megatron-LM stack with Megatron-FSDP and TransformerEngine: for studies of the cost
# model beyond this installation (its plans need flags pretrain_gpt.py does not have).
FULL_MEGATRON = Capabilities(zero_stages=frozenset(ZERO_STAGES),
                             selective_recompute_modules=("layernorm", "mlp"))


def installed_capabilities() -> Capabilities:
    """This installation's: TransformerEngine adds ``layernorm`` to selective recompute."""
    te = importlib.util.find_spec("transformer_engine") is not None
    return Capabilities(selective_recompute_modules=("layernorm", "mlp") if te else ("mlp",))


def _zero_stage(layout: Layout, caps: Capabilities) -> Optional[str]:
    if layout.zero_stage in caps.zero_stages:
        return None
    return (f"ZeRO-{layout.zero_stage} is megatron-core's Megatron-FSDP (--use-megatron-fsdp), "
            f"not recommended until verified over 2+ GPUs (ZeRO-0: the plain optimizer; "
            f"ZeRO-1: --use-distributed-optimizer)")


RUNNABLE_CHECKS: List[Tuple[str, Callable[[Layout, Capabilities], Optional[str]]]] = [
    ("zero-stage", _zero_stage),
]


def runnable(layout: Layout, caps: Capabilities) -> Optional[str]:
    """Why ``pretrain_gpt.py`` here cannot run ``layout``, or None when it can."""
    for _, check in RUNNABLE_CHECKS:
        reason = check(layout, caps)
        if reason:
            return reason
    return None


def layout_flags(layout: Layout, recompute_modules: Tuple[str, ...],
                 sequence_parallel: bool = True) -> List[str]:
    """The ``pretrain_gpt.py`` flags of a runnable layout (degrees, ZeRO, recompute);
    ``--sequence-parallel`` with TP > 1 when the plan assumed it."""
    flags = ["--tensor-model-parallel-size", str(layout.tp),
             "--ulysses-degree", str(layout.ulysses), "--ring-degree", str(layout.ring),
             "--pipeline-model-parallel-size", str(layout.pp)]
    if layout.tp > 1 and sequence_parallel:
        flags.append("--sequence-parallel")
    flags += ZERO_FLAGS[layout.zero_stage]
    if layout.recompute == "selective":
        flags += ["--recompute-granularity", "selective", "--recompute-modules",
                  *recompute_modules]
    elif layout.recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]
    return flags


def loss_flags(loss_chunk_tokens: Optional[int]) -> List[str]:
    """The loss the cost model assumed (``Assumptions.loss_chunk_tokens``): the fused output
    layer and loss over chunks of that many tokens, or nothing (megatron-core's loss)."""
    if loss_chunk_tokens is None:
        return []
    return ["--fused-linear-cross-entropy", "--linear-cross-entropy-chunk-tokens",
            str(loss_chunk_tokens)]


# The precision the cost model counts bytes in (bf16 weights and activations, float32
# main weights, gradient buffer and Adam states: megatron-core's --bf16 defaults).
PRECISION_FLAGS = ["--bf16"]


def model_flags(model: ModelShape, seq_length: int) -> List[str]:
    """The model as ``pretrain_gpt.py`` flags: its shape and architecture, sliding window
    included (:func:`megatron.shapes.flags.shape_flags`), and the sequence length; the
    vocabulary comes from the tokenizer."""
    return shape_flags(model) + ["--seq-length", str(seq_length)]
