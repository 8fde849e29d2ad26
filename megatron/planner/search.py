"""Search over layouts: enumerate, filter by the rules, predict, rank, diagnose.

:func:`plan_layouts` returns every evaluated layout and the ranked feasible ones;
:func:`choose_layout` is the contract the training script's ``--ulysses-degree auto``
uses and returns the top :class:`Plan`. When nothing is feasible a
:class:`PlannerError` names the binding limit and the smallest changes that would give
a plan (see :func:`diagnose`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from megatron.planner import rules
from megatron.planner.capabilities import Capabilities, installed_capabilities, runnable
from megatron.planner.cost_model import (
    DEFAULT_ASSUMPTIONS,
    RECOMPUTE_CHOICES,
    ZERO_STAGES,
    Assumptions,
    AttentionWorkload,
    Estimate,
    Layout,
    Workload,
    estimate,
    estimate_attention,
)
from megatron.planner.errors import PlannerError
from megatron.planner.hardware import HardwareSpec, get_hardware
from megatron.usp.parallel_dims import FLAGS, MEGATRON_NAMES, ParallelDims, divisors

# Keys of ``fixed``: megatron's argument names -> (Layout field, flag).
FIXED_KEYS: Dict[str, Tuple[str, str]] = {
    **{name: (axis, FLAGS[axis]) for name, axis in MEGATRON_NAMES.items()},
    "zero_stage": ("zero_stage", "--zero-stage"),
    "recompute": ("recompute", "--recompute"),
}


def normalize_fixed(fixed: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """Validate ``fixed`` and map it to Layout field names; ``None`` values are dropped
    (a caller may pass every flag, with None for "choose it")."""
    out: Dict[str, Any] = {}
    for key, value in (fixed or {}).items():
        if value is None:
            continue
        if key not in FIXED_KEYS:
            raise PlannerError(f"fixed degree {key!r} is unknown; known: {sorted(FIXED_KEYS)}")
        name, flag = FIXED_KEYS[key]
        if name == "recompute":
            if value not in RECOMPUTE_CHOICES:
                raise PlannerError(f"{flag} {value!r} must be one of {RECOMPUTE_CHOICES}")
        elif name == "zero_stage":
            if value not in ZERO_STAGES:
                raise PlannerError(f"{flag} {value!r} must be one of {ZERO_STAGES}")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlannerError(f"{flag} {value!r} must be an integer >= 1")
        out[name] = value
    return out


# ============================================================================ enumeration


@dataclass
class Rejections:
    """Layouts ruled out before prediction, counted by rule, with one example each."""

    counts: Counter = field(default_factory=Counter)
    examples: Dict[str, str] = field(default_factory=dict)

    def add(self, rule_id: str, message: str) -> None:
        self.counts[rule_id] += 1
        self.examples.setdefault(rule_id, message)


def _tilings(world: int) -> Iterator[Tuple[int, int, int, int, int]]:
    """Every (tp, U, R, dp, pp) whose product is ``world``."""
    for pp in divisors(world):
        for tp in divisors(world // pp):
            for u in divisors(world // (pp * tp)):
                for r in divisors(world // (pp * tp * u)):
                    yield tp, u, r, world // (pp * tp * u * r), pp


def _structural_reject(w: Workload, fixed: Dict[str, Any], tp: int, u: int, r: int, dp: int,
                       pp: int, a: Assumptions) -> Optional[Tuple[str, str]]:
    """First rule a tiling breaks, as ``(rule_id, message)``; None if it passes."""
    degrees = {"tp": tp, "ulysses": u, "ring": r, "cp": u * r, "dp": dp, "pp": pp}
    for name, value in degrees.items():
        if name in fixed and fixed[name] != value:
            return "fixed", f"{name}={value} differs from the fixed {fixed[name]}"
    if w.world_size >= w.gpus_per_node:
        msg = rules.check_tp_inside_node(tp, w.gpus_per_node)
        if msg:
            return "tp-inside-node", msg
    dims = ParallelDims(w.world_size, tp=tp, ulysses=u, ring=r, pp=pp)
    broken = dims.violations(w.model, w.seq_length, w.micro_batch_size,
                             w.global_batch_size, sequence_parallel=a.tp_sequence_parallel)
    return (broken[0].rule, broken[0].message) if broken else None


def _zero_stages(fixed: Dict[str, Any], cp: int, dp: int, rej: Rejections) -> List[int]:
    if cp * dp == 1:
        # Nothing to shard over: every stage is ZeRO-0.
        return [fixed.get("zero_stage", 0)]
    stages = [fixed["zero_stage"]] if "zero_stage" in fixed else list(ZERO_STAGES)
    out = []
    for z in stages:
        msg = rules.check_sp_with_zero(cp, z, "zero_stage" in fixed)
        if msg:
            rej.add("sp-with-zero", msg)
            continue
        out.append(z)
    return out


def evaluate_all(w: Workload, hw: HardwareSpec, fixed: Dict[str, Any],
                 a: Assumptions = DEFAULT_ASSUMPTIONS, caps: Optional[Capabilities] = None
                 ) -> Tuple[List[Estimate], Rejections]:
    """Predict every layout that passes the rules and that ``pretrain_gpt.py`` can run
    (``caps``, default this installation's; :func:`capabilities.runnable`).

    For each layout and ZeRO stage, recompute levels are tried from none to full and
    the first that fits ends the list: a heavier recompute than needed is never faster
    (the infeasible lighter ones stay in the list, so the output can say why they lost).
    """
    caps = caps or installed_capabilities()
    rej = Rejections()
    out: List[Estimate] = []
    recomputes = [fixed["recompute"]] if "recompute" in fixed else list(RECOMPUTE_CHOICES)
    for tp, u, r, dp, pp in _tilings(w.world_size):
        bad = _structural_reject(w, fixed, tp, u, r, dp, pp, a)
        if bad:
            rej.add(*bad)
            continue
        for z in _zero_stages(fixed, u * r, dp, rej):
            for rc in recomputes:
                layout = Layout.of(tp, u, r, dp, pp, z, rc)
                why_not = runnable(layout, caps)
                if why_not:
                    rej.add("not-runnable", why_not)
                    continue
                e = estimate(w, layout, hw, a)
                out.append(e)
                if e.fits:
                    break
    return out, rej


# ============================================================================ ranking


@dataclass
class RankedLayout:
    """A feasible layout in rank order; ``decided_by`` is the tie-breaker that put it
    ahead of ``runner_up``, a layout predicted faster by less than the tolerance.
    (``estimate`` is an :class:`AttentionEstimate` in :func:`rank_attention_layouts`.)"""

    estimate: Any
    rank: int
    decided_by: Optional[rules.Rule] = None
    runner_up: Optional[Any] = None


def degrees(e: Any) -> Tuple[int, int, int, int, int]:
    lay = e.layout
    return lay.tp, lay.ulysses, lay.ring, lay.dp, lay.pp


def rank_feasible(feasible: List[Any], top: int, tolerance: float = rules.TIE_TOLERANCE,
                  breakers: Sequence[Tuple[str, rules.TieKey]] = tuple(rules.TIE_BREAKERS)
                  ) -> List[RankedLayout]:
    """Greedy ranking: among the remaining layouts within ``tolerance`` of the fastest,
    take the one the tie-breakers prefer; repeat ``top`` times. Each set of degrees
    (TP, U, R, DP, PP) appears once, with its best ZeRO stage and recompute."""
    remaining = sorted(feasible, key=lambda e: e.time_per_token)
    ranked: List[RankedLayout] = []
    while remaining and len(ranked) < top:
        fastest = remaining[0]
        limit = fastest.time_per_token * (1 + tolerance)
        near = [e for e in remaining if e.time_per_token <= limit]
        winner = min(near, key=lambda e: rules.tie_break_key(e, breakers))
        decided = None
        if winner is not fastest:
            decided = rules.deciding_rule(winner, fastest, breakers)
        ranked.append(RankedLayout(winner, len(ranked) + 1, decided,
                                   fastest if winner is not fastest else None))
        taken = degrees(winner)
        remaining = [e for e in remaining if degrees(e) != taken]
    return ranked


def rank_attention_layouts(aw: AttentionWorkload, hardware: Union[HardwareSpec, str],
                           assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
                           tolerance: float = rules.TIE_TOLERANCE) -> List[RankedLayout]:
    """Every valid Ulysses x Ring split of one attention call over ``aw.world_size``
    GPUs, ranked like layouts (ties broken by the Ulysses rules). This is what
    attention benchmarks (yunchang's, ``tools/bench_attention.py``) compare."""
    hw = get_hardware(hardware)
    model = aw.model()
    cands = []
    for u in divisors(aw.world_size):
        r = aw.world_size // u
        if ParallelDims(aw.world_size, ulysses=u, ring=r).violations(model,
                                                                   aw.seq_length):
            continue
        cands.append(estimate_attention(aw, u, r, hw, assumptions))
    if not cands:
        raise PlannerError(
            f"no Ulysses x Ring split of {aw.world_size} GPUs fits {aw.heads} heads / "
            f"{aw.kv_heads} KV heads at --seq-length {aw.seq_length}", "attention heads")
    return rank_feasible(cands, len(cands), tolerance, tuple(rules.ATTENTION_TIE_BREAKERS))


@dataclass
class SearchResult:
    workload: Workload
    hardware: HardwareSpec
    assumptions: Assumptions
    fixed: Dict[str, Any]
    evaluated: List[Estimate]
    ranked: List[RankedLayout]
    rejections: Rejections
    capabilities: Capabilities = field(default_factory=Capabilities)

    @property
    def best(self) -> RankedLayout:
        return self.ranked[0]

    def feasible(self) -> List[Estimate]:
        return [e for e in self.evaluated if e.fits]


def plan_layouts(w: Workload, hardware: Union[HardwareSpec, str],
                 fixed: Optional[Mapping[str, Any]] = None, top: int = 10,
                 assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
                 tolerance: float = rules.TIE_TOLERANCE,
                 capabilities: Optional[Capabilities] = None) -> SearchResult:
    """Rank the feasible layouts of ``w`` on ``hardware`` that ``pretrain_gpt.py`` can run
    (``capabilities``, default this installation's; they also set what ``selective``
    recompute means in ``assumptions``); raise :class:`PlannerError` naming the binding
    limit when there is none."""
    hw = get_hardware(hardware)
    caps = capabilities or installed_capabilities()
    assumptions = replace(assumptions,
                          selective_recompute_modules=caps.selective_recompute_modules)
    fx = normalize_fixed(fixed)
    _check_fixed_consistency(w, fx)
    evaluated, rej = evaluate_all(w, hw, fx, assumptions, caps)
    feasible = [e for e in evaluated if e.fits]
    if not feasible:
        raise diagnose(w, hw, fx, assumptions, evaluated, rej, caps)
    ranked = rank_feasible(feasible, max(1, top), tolerance)
    return SearchResult(w, hw, assumptions, fx, evaluated, ranked, rej, caps)


def _check_fixed_consistency(w: Workload, fx: Dict[str, Any]) -> None:
    if w.global_batch_size is not None and w.global_batch_size % w.micro_batch_size:
        raise PlannerError(
            f"--global-batch-size {w.global_batch_size} is not a multiple of "
            f"--micro-batch-size {w.micro_batch_size}", binding_limit="batch")
    if "cp" in fx and "ulysses" in fx and "ring" in fx and fx["cp"] != fx["ulysses"] * fx["ring"]:
        raise PlannerError(
            f"--context-parallel-size {fx['cp']} disagrees with --ulysses-degree "
            f"{fx['ulysses']} x --ring-degree {fx['ring']}; drop --context-parallel-size",
            binding_limit="fixed degrees")
    sizes = {k: fx[k] for k in ("tp", "pp", "dp") if k in fx}
    if "cp" in fx:
        sizes["cp"] = fx["cp"]
    else:
        sizes.update({k: fx[k] for k in ("ulysses", "ring") if k in fx})
    product = 1
    for v in sizes.values():
        product *= v
    if w.world_size % product:
        flags = {n: f for n, f in FIXED_KEYS.values()}
        hints = []
        for k, v in sizes.items():
            others = product // v
            if w.world_size % others == 0:
                hints.append(f"{flags[k]} one of {divisors(w.world_size // others)}")
        fixed_text = " x ".join(f"{flags[k]} {v}" for k, v in sizes.items())
        if len(sizes) > 1:
            fixed_text += f" = {product}"
        raise PlannerError(
            f"{fixed_text} does not divide --gpus {w.world_size}"
            + (f"; with the other degrees kept: {'; or '.join(hints)}" if hints else "")
            + f"; or use a multiple of {product} GPUs",
            binding_limit="GPU count", suggestions=hints)


# ============================================================================ diagnosis


def _best_feasible(w: Workload, hw: HardwareSpec, fx: Dict[str, Any],
                   a: Assumptions, caps: Capabilities) -> Optional[Estimate]:
    try:
        _check_fixed_consistency(w, fx)
    except PlannerError:
        return None
    evaluated, _ = evaluate_all(w, hw, fx, a, caps)
    feasible = [e for e in evaluated if e.fits]
    return min(feasible, key=lambda e: e.time_per_token) if feasible else None


def _binding_component(e: Estimate) -> str:
    mem = e.memory
    parts = {
        "model states (weights, gradients, optimizer)": mem.model_states(),
        "activations": mem.activations + (mem.transient if mem.transient > mem.logits else 0.0),
        "logits of the loss": mem.logits + (mem.transient if mem.transient <= mem.logits else 0.0),
    }
    name = max(parts, key=parts.get)
    return f"{name} take {parts[name]:.1f} GiB of the {mem.total:.1f}"


def _suggest_for_memory(w: Workload, hw: HardwareSpec, fx: Dict[str, Any],
                        a: Assumptions, caps: Capabilities) -> List[str]:
    """Smallest changes that give a feasible plan, most direct first."""
    out: List[str] = []
    for key, flag, what in (("recompute", "--recompute", "activation recompute"),
                            ("zero_stage", "--zero-stage", "ZeRO stage")):
        if key in fx:
            relaxed = {k: v for k, v in fx.items() if k != key}
            e = _best_feasible(w, hw, relaxed, a, caps)
            if e is not None:
                out.append(f"drop {flag} {fx[key]} (let the planner pick the {what}): "
                           f"{e.layout.short()} fits in {e.memory.total:.1f} GiB")
    degree_keys = [k for k in ("tp", "ulysses", "ring", "cp", "dp", "pp") if k in fx]
    if degree_keys:
        relaxed = {k: v for k, v in fx.items() if k not in degree_keys}
        e = _best_feasible(w, hw, relaxed, a, caps)
        if e is not None:
            flags = ", ".join(FIXED_KEYS[k][1] for k, (n, _) in FIXED_KEYS.items()
                              if n in degree_keys)
            out.append(f"let the planner choose {flags}: {e.layout.short()} fits in "
                       f"{e.memory.total:.1f} GiB")
    more = {k: v for k, v in fx.items() if k != "dp"}
    for factor in (2, 4, 8, 16, 32, 64):
        world = w.world_size * factor
        e = _best_feasible(replace(w, world_size=world), hw, more, a, caps)
        if e is not None:
            out.append(f"--gpus {world} ({factor}x): {e.layout.short()} fits in "
                       f"{e.memory.total:.1f} GiB")
            break
    unit = 1024
    if w.seq_length > unit:
        lo, hi = 0, (w.seq_length - 1) // unit  # largest k with k*unit < seq that fits
        best: Optional[Estimate] = None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            e = _best_feasible(replace(w, seq_length=mid * unit), hw, fx, a, caps)
            if e is not None:
                lo, best = mid, e
            else:
                hi = mid - 1
        if best is not None:  # the last success is at lo
            out.append(f"--seq-length {lo * unit}: {best.layout.short()} fits in "
                       f"{best.memory.total:.1f} GiB")
    return out


def diagnose(w: Workload, hw: HardwareSpec, fx: Dict[str, Any], a: Assumptions,
             evaluated: List[Estimate], rej: Rejections,
             caps: Optional[Capabilities] = None) -> PlannerError:
    """Explain why no layout is feasible: the binding limit and what would fit."""
    what = (f"{w.model.name} at --seq-length {w.seq_length} on --gpus {w.world_size} "
            f"({w.gpus_per_node} per node) of {hw.gpu_memory_gib:.0f} GiB")
    if not evaluated:
        counts = {k: v for k, v in rej.counts.items() if k != "fixed"}
        if not counts:
            return PlannerError(
                f"no layout of {what} matches the fixed degrees {fx}", "fixed degrees",
                ["drop some of the fixed degrees"])
        binding = max(counts, key=counts.get)
        names = {
            "ulysses-heads": "attention heads", "ulysses-kv-heads": "KV heads",
            "seq-divisible": "sequence length", "tp-inside-node": "GPUs per node",
            "pp-layers": "layers", "batch": "global batch", "sp-with-zero": "ZeRO stage",
            "not-runnable": "what pretrain_gpt.py can run here",
        }
        details = "; ".join(f"{k}: {rej.examples[k]}" for k in counts)
        rule = rules.RULES.get(binding)
        cite = f" ({rule.cite()})" if rule else ""
        return PlannerError(
            f"no layout of {what} passes the rules. Binding limit: {names.get(binding, binding)}"
            f"{cite} - {rej.examples[binding]}. All rejections: {details}",
            names.get(binding, binding), [rej.examples[binding]])
    closest = min(evaluated, key=lambda e: e.memory.total)
    suggestions = _suggest_for_memory(w, hw, fx, a, caps or installed_capabilities())
    tried = []
    if "recompute" not in fx:
        tried.append("full recompute")
    if "zero_stage" not in fx:
        tried.append(f"ZeRO-{max((caps or installed_capabilities()).zero_stages)}")
    msg = (f"no layout of {what} fits in memory"
           + (f" (with {' and '.join(tried)} considered)" if tried else "")
           + f": the smallest, {closest.layout.short()}, needs {closest.memory.total:.1f} GiB "
           f"of {closest.usable_memory_gib:.1f} GiB usable. Binding limit: "
           f"{_binding_component(closest)}.")
    if suggestions:
        msg += " Smallest changes that fit: " + "; ".join(suggestions) + "."
    else:
        msg += " Nothing within 64x the GPUs or a shorter sequence fits: use a smaller model."
    return PlannerError(msg, "memory", suggestions)
