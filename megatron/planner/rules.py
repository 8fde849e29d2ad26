"""The USP paper's practice, as constraints and tie-breakers, each with its citation.

Constraints reject a layout outright (the message says why and names the flag);
tie-breakers order layouts whose predicted time per token is within
:data:`TIE_TOLERANCE` of each other. When a rule decides the planner's choice, the
output quotes the rule's text and citation.

Sources:
  [USP]  J. Fang, S. Zhao, "USP: A Unified Sequence Parallelism Approach for Long
         Context Generative AI", arXiv:2405.07719 (2024): the SP/TP/ZeRO communication
         and memory comparison and the best practices for 4D parallelism with SP.
  [YC]   feifeibear/long-context-attention (yunchang) README, "Best Practice for 4D
         Parallelism" items 1-5 and the benchmark conclusions 1-4 (8xA100 NVLink,
         8xL20 PCIe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron.planner.cost_model import Estimate
from megatron.usp.parallel_dims import divisors

TIE_TOLERANCE = 0.02  # layouts within 2% predicted time per token are ties


@dataclass(frozen=True)
class Rule:
    id: str
    text: str
    citation: str

    def cite(self) -> str:
        return f"rule '{self.text}' [{self.citation}]"


RULES: Dict[str, Rule] = {r.id: r for r in (
    Rule("prefer-dp", "prefer DP when the batch allows",
         "USP best practice; YC 4D practice 2: use SP only when the batch cannot be split"),
    Rule("sp-with-zero", "SP always with ZeRO-1/2",
         "USP best practice; YC 4D practice 3"),
    Rule("grid-order", "order TP -> Ulysses -> Ring -> DP -> PP",
         "USP 4D hybrid design: the axis that communicates most per layer gets the "
         "fastest links; megatron/usp/parallel_dims.py"),
    Rule("ulysses-heads", "Ulysses degree limited by heads (U divides heads per TP rank)",
         "USP section on SP-Ulysses; YC 'Why not apply Ulysses and Ring individually'"),
    Rule("ulysses-kv-heads",
         "KV heads split over Ulysses when kv/TP % U == 0, replicated when U % (kv/TP) == 0 "
         "if replication is cheaper than more Ring",
         "USP GQA discussion: GQA shrinks SP's all-to-all, replication grows it back"),
    Rule("ulysses-fast-links", "Ulysses inside the fast links, Ring across slow ones",
         "USP: all-to-all cannot overlap compute, ring P2P can; YC benchmark conclusion 4 "
         "(8xL20 PCIe: Ulysses 2 x Ring 4 best)"),
    Rule("ulysses-over-ring", "Ulysses before Ring when heads allow",
         "YC benchmark conclusion 1: Ring's smaller attention blocks are slower even fully "
         "overlapped (8xA100 NVLink: Ulysses 8 best)"),
    Rule("sp-over-tp", "Unified SP before TP when memory allows",
         "USP: Unified-SP moves less than TP-sp; YC 4D practice 4"),
    Rule("tp-inside-node", "TP inside a node",
         "YC 4D practice 5: TP cannot be set to a high degree; megatron practice"),
    Rule("seq-divisible", "sequence divisible by 2*U*R (and by TP per CP rank)",
         "megatron/usp/token_order.py: zigzag order of 2*CP chunks; sequence parallelism"),
    Rule("pp-layers", "PP divides the layers", "megatron-core pipeline stages"),
    Rule("batch", "DP divides the global batch in micro-batches", "megatron batch schedule"),
    Rule("less-recompute", "recompute only what memory requires",
         "planner default: recompute adds FLOPs"),
    Rule("fewer-pp", "PP last", "USP 4D hybrid design: PP is the outermost axis (bubbles)"),
    Rule("lower-zero", "lowest ZeRO stage that fits",
         "planner default: ZeRO-2/3 add per-micro-batch traffic"),
    Rule("less-memory", "less memory", "planner default"),
)}


# ============================================================================ constraints
# The layout rules shared with pretrain_gpt.py (heads, KV heads, sequence, layers, batch) are
# ParallelDims.violations (megatron/usp/parallel_dims.py); these are the planner's own.


def check_tp_inside_node(tp: int, gpus_per_node: int) -> Optional[str]:
    if tp > gpus_per_node or gpus_per_node % tp:
        return (f"--tensor-model-parallel-size {tp} does not fit inside a node of "
                f"{gpus_per_node} GPUs; TP must divide --gpus-per-node "
                f"({divisors(gpus_per_node)})")
    return None


def check_sp_with_zero(cp: int, zero_stage: int, user_fixed_zero: bool) -> Optional[str]:
    if cp > 1 and zero_stage == 0 and not user_fixed_zero:
        return (f"ZeRO-0 with U*R = {cp}: optimizer states would be replicated over the SP "
                f"group (pass --zero-stage 0 to force it)")
    return None


# ============================================================================ tie-breakers


TieKey = Callable[[Estimate], float]

RECOMPUTE_ORDER = {"none": 0, "selective": 1, "full": 2}


def _ulysses_off_fast_links(e: Estimate) -> float:
    """1 when the Ulysses group leaves the innermost link level (0 = fastest)."""
    return 1.0 if e.link_levels.get("ulysses", -1) > 0 else 0.0


TIE_BREAKERS: List[Tuple[str, TieKey]] = [
    ("ulysses-fast-links", _ulysses_off_fast_links),
    ("prefer-dp", lambda e: -e.layout.dp),
    ("less-recompute", lambda e: RECOMPUTE_ORDER[e.layout.recompute]),
    ("sp-over-tp", lambda e: e.layout.tp),
    ("sp-with-zero", lambda e: 1.0 if e.layout.zero_stage == 3 else 0.0),
    ("fewer-pp", lambda e: e.layout.pp),
    ("ulysses-over-ring", lambda e: -e.layout.ulysses),
    ("lower-zero", lambda e: e.layout.zero_stage),
    ("less-memory", lambda e: e.memory.total),
]


# For a lone attention call (no DP, TP, PP, ZeRO, recompute or memory to weigh).
ATTENTION_TIE_BREAKERS: List[Tuple[str, TieKey]] = [
    b for b in TIE_BREAKERS if b[0] in ("ulysses-fast-links", "ulysses-over-ring")
]


def tie_break_key(e: Estimate, breakers: Sequence[Tuple[str, TieKey]] = TIE_BREAKERS
                  ) -> Tuple[float, ...]:
    return tuple(key(e) for _, key in breakers) + (e.time_per_token,)


def deciding_rule(winner: Estimate, other: Estimate,
                  breakers: Sequence[Tuple[str, TieKey]] = TIE_BREAKERS) -> Optional[Rule]:
    """The first tie-breaker that prefers ``winner`` over ``other``, if any."""
    for rule_id, key in breakers:
        kw, ko = key(winner), key(other)
        if kw < ko:
            return RULES[rule_id]
        if kw > ko:
            return None
    return None
