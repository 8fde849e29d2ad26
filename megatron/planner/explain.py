"""Human- and machine-readable output of a search: reasons, the ranked table, JSON.

A reason is derived from the evaluated layouts, never written by hand: for each knob
(TP, the Ulysses/Ring split, DP, PP, ZeRO, recompute) the best layout that differs in
that knob is found and the difference is stated (it does not fit, or it is N% slower
and where the time goes), with the paper's rule quoted wherever a rule decided.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable, List, Optional

from megatron.planner import rules
from megatron.planner.cost_model import Estimate
from megatron.planner.documents import describe
from megatron.planner.search import RankedLayout, SearchResult
from megatron.usp.parallel_dims import ParallelDims, divisors

_TIME_LABELS = {
    "matmul": "GEMMs",
    "attention": "attention kernels",
    "elementwise": "memory-bound kernels",
    "tp_comm": "TP collectives",
    "a2a": "Ulysses all-to-all",
    "ring_exposed": "exposed ring P2P",
    "pp_p2p": "pipeline sends",
    "pp_bubble": "pipeline bubble",
    "dp_exposed": "exposed ZeRO/DP traffic",
    "optimizer": "optimizer step",
}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _best_alternative(result: SearchResult, pred: Callable[[Estimate], bool]) -> Optional[Estimate]:
    """Fastest feasible layout matching ``pred``; else the one needing least memory."""
    cands = [e for e in result.evaluated if pred(e)]
    if not cands:
        return None
    feasible = [e for e in cands if e.fits]
    if feasible:
        return min(feasible, key=lambda e: e.time_per_token)
    return min(cands, key=lambda e: e.memory.total)


def compare(chosen: Estimate, alt: Estimate) -> str:
    """One phrase saying why ``alt`` lost to ``chosen``."""
    if not alt.fits:
        return (f"{alt.layout.short()} needs {alt.memory.total:.1f} GiB > "
                f"{alt.usable_memory_gib:.1f} GiB usable")
    slower = alt.time_per_token / chosen.time_per_token - 1
    ca, cc = asdict(alt.time), asdict(chosen.time)
    # Per token, in seconds of the chosen layout's step.
    scale = chosen.tokens_per_step
    deltas = {k: (ca[k] / alt.tokens_per_step - cc[k] / chosen.tokens_per_step) * scale
              for k in _TIME_LABELS}
    worst = max(deltas, key=deltas.get)
    why = (f", mostly {_TIME_LABELS[worst]} (+{deltas[worst] * 1e3:.0f} ms/step)"
           if deltas[worst] > 0 else "")
    word = "slower" if slower >= 0 else "faster (lost a tie-break)"
    return f"{alt.layout.short()} is {_pct(abs(slower))} {word}{why}"


def _axis_links(e: Estimate) -> str:
    lay = e.layout
    parts = []
    for axis, size, label in (("tp", lay.tp, "TP"), ("ulysses", lay.ulysses, "Ulysses"),
                              ("ring", lay.ring, "Ring"), ("dp_cp", lay.dp * lay.cp, "ZeRO/DP"),
                              ("pp", lay.pp, "PP")):
        if size > 1:
            parts.append(f"{label} on {e.links[axis]}")
    return ", ".join(parts) if parts else "no communication groups"


def _reason_tp(result: SearchResult, e: Estimate) -> str:
    lay = e.layout
    if lay.tp > 1:
        alt = _best_alternative(result, lambda x: x.layout.tp < lay.tp)
        base = (f"TP={lay.tp} (sequence parallel on): model states "
                f"{e.memory.model_states():.1f} GiB per GPU")
        return base + (f"; {compare(e, alt)}" if alt else "")
    alt = _best_alternative(result, lambda x: x.layout.tp > 1)
    base = "TP=1: no TP collectives"
    if alt is not None:
        base += f"; {compare(e, alt)} ({rules.RULES['sp-over-tp'].cite()})"
    return base


def _max_ulysses(result: SearchResult, tp: int) -> int:
    """The largest Ulysses degree the heads allow at this TP (ParallelDims' head rules)."""
    m = result.workload.model
    return max(u for u in divisors(m.num_attention_heads // tp)
               if not ParallelDims(tp * u, tp=tp, ulysses=u).violations(m))


def _reason_cp(result: SearchResult, e: Estimate) -> List[str]:
    lay = e.layout
    out: List[str] = []
    if lay.cp == 1:
        alt = _best_alternative(result, lambda x: x.layout.cp > 1)
        out.append("no sequence parallelism (U=R=1)" + (f"; {compare(e, alt)}" if alt else ""))
        return out
    def same(x: Estimate) -> bool:
        return (x.layout.cp == lay.cp and x.layout.tp == lay.tp and x.layout.pp == lay.pp
                and x.layout.dp == lay.dp and x.layout.ulysses != lay.ulysses)

    alt = _best_alternative(result, same)
    head = f"CP={lay.cp} as Ulysses {lay.ulysses} x Ring {lay.ring}"
    out.append(head + (f"; {compare(e, alt)}" if alt else ""))
    umax = _max_ulysses(result, lay.tp)
    if lay.ring > 1 and lay.ulysses == umax:
        m = result.workload.model
        out.append(f"Ulysses stops at {umax}: {m.num_attention_heads // lay.tp} heads and "
                   f"{lay.dims.kv_heads_per_tp_rank(m.num_query_groups)} KV heads per TP rank; "
                   f"the rest goes to Ring ({rules.RULES['ulysses-heads'].cite()})")
    if e.kv_replication > 1:
        out.append(f"KV heads replicated x{e.kv_replication:g} into the all-to-all "
                   f"({e.volumes['ulysses_a2a'] / 1e9:.2f} GB/step in all), cheaper here than "
                   f"a larger Ring ({rules.RULES['ulysses-kv-heads'].cite()})")
    lv = e.link_levels
    if lay.ulysses > 1 and lay.ring > 1 and lv.get("ulysses", -1) < lv.get("ring", -1):
        out.append(f"Ulysses inside {e.links['ulysses']}, Ring across {e.links['ring']} "
                   f"({rules.RULES['ulysses-fast-links'].cite()})")
    if lay.ring > 1:
        hidden = e.time.ring_total - e.time.ring_exposed
        out.append(f"Ring P2P {e.volumes['ring_p2p'] / 1e9:.2f} GB/step, "
                   f"{e.time.ring_exposed * 1e3:.0f} ms exposed; attention under the ring "
                   f"takes {hidden * 1e3:.0f} ms")
    if lay.ulysses > 1:
        out.append(f"Ulysses all-to-all {e.volumes['ulysses_a2a'] / 1e9:.2f} GB/step, "
                   f"{e.time.a2a * 1e3:.0f} ms ({_pct(e.time.a2a / e.time.total)} of the step)")
    return out


def _reason_dp(result: SearchResult, e: Estimate) -> str:
    lay = e.layout
    if lay.dp > 1:
        alt = _best_alternative(result, lambda x: x.layout.dp < lay.dp)
        return (f"DP={lay.dp} ({rules.RULES['prefer-dp'].cite()})"
                + (f"; {compare(e, alt)}" if alt else ""))
    alt = _best_alternative(result, lambda x: x.layout.dp > 1)
    if alt is None:
        w = result.workload
        if w.global_batch_size is not None and w.global_batch_size // w.micro_batch_size == 1:
            return "DP=1: the global batch holds one micro-batch"
        return "DP=1"
    return f"DP=1; {compare(e, alt)}"


def _reason_pp(result: SearchResult, e: Estimate) -> Optional[str]:
    lay = e.layout
    if lay.pp == 1:
        return None
    alt = _best_alternative(result, lambda x: x.layout.pp < lay.pp)
    return (f"PP={lay.pp} with {e.num_micro_batches} micro-batches: bubble "
            f"{_pct(e.time.pp_bubble / e.time.total)} of the step"
            + (f"; {compare(e, alt)}" if alt else ""))


def _same_dims(x: Estimate, e: Estimate) -> bool:
    a, b = x.layout, e.layout
    return (a.tp, a.ulysses, a.ring, a.dp, a.pp) == (b.tp, b.ulysses, b.ring, b.dp, b.pp)


def _reason_zero(result: SearchResult, e: Estimate) -> str:
    lay = e.layout
    n = lay.sharding_group_size
    if n == 1:
        return "ZeRO: nothing to shard over (DP x CP = 1)"
    text = (f"ZeRO-{lay.zero_stage} over the DP x CP group of {n}: optimizer "
            f"{e.memory.optimizer:.1f} GiB, DP/ZeRO traffic {e.volumes['dp_zero'] / 1e9:.2f} "
            f"GB/step, {e.time.dp_exposed * 1e3:.0f} ms exposed")
    if lay.cp > 1:
        text += f" ({rules.RULES['sp-with-zero'].cite()})"
    lower = _best_alternative(result, lambda x: _same_dims(x, e)
                              and x.layout.zero_stage < lay.zero_stage
                              and x.layout.zero_stage > 0)
    if lay.zero_stage >= 2 and lower is not None:
        text += f"; {compare(e, lower)}"
    return text


def _reason_recompute(result: SearchResult, e: Estimate) -> str:
    lay = e.layout
    if lay.recompute == "none":
        return (f"no recompute: activations {e.memory.activations:.1f} GiB fit "
                f"({e.memory.total:.1f} of {e.usable_memory_gib:.1f} GiB)")
    order = rules.RECOMPUTE_ORDER
    lighter = _best_alternative(result, lambda x: _same_dims(x, e)
                                and x.layout.zero_stage == lay.zero_stage
                                and order[x.layout.recompute] < order[lay.recompute])
    return (f"{lay.recompute} recompute: activations {e.memory.activations:.1f} GiB"
            + (f"; {compare(e, lighter)}" if lighter else ""))


def reasons_for(result: SearchResult, ranked: RankedLayout) -> List[str]:
    """Why this layout: prediction, deciding rule, and one line per knob."""
    e = ranked.estimate
    out = [
        f"{e.layout.short()}: predicted {e.step_time_s:.3f} s/step "
        f"({e.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {_pct(e.mfu)}), "
        f"{e.memory.total:.1f} of {e.usable_memory_gib:.1f} GiB usable on {result.hardware.name}",
    ]
    if ranked.decided_by is not None and ranked.runner_up is not None:
        faster = 1 - ranked.runner_up.time_per_token / e.time_per_token
        out.append(f"tie: {ranked.runner_up.layout.short()} is predicted {_pct(faster)} faster, "
                   f"within the {_pct(rules.TIE_TOLERANCE)} tolerance; chosen by "
                   f"{ranked.decided_by.cite()}")
    w = result.workload
    if w.documents is not None:
        out.append(f"packed documents: {describe(w.documents, w.seq_length, w.micro_batch_size)}"
                   f" (attention and FLOPs: the documents' pairs)")
    out.append(f"{_axis_links(e)} ({rules.RULES['grid-order'].cite()})")
    out.append(_reason_tp(result, e))
    out.extend(_reason_cp(result, e))
    out.append(_reason_dp(result, e))
    pp = _reason_pp(result, e)
    if pp:
        out.append(pp)
    out.append(_reason_zero(result, e))
    out.append(_reason_recompute(result, e))
    return out


def short_reason(ranked: RankedLayout) -> str:
    """Table cell: where the step's overhead goes, and the rule that broke a tie."""
    e = ranked.estimate
    t = e.time
    parts = []
    for key, label in (("a2a", "a2a"), ("ring_exposed", "ring"), ("tp_comm", "TP"),
                       ("pp_bubble", "bubble"), ("dp_exposed", "DP")):
        v = getattr(t, key)
        if v > 0.005 * t.total:
            parts.append(f"{label} {_pct(v / t.total)}")
    if e.layout.recompute != "none":
        parts.append(f"recompute {e.layout.recompute}")
    if e.kv_replication > 1:
        parts.append(f"KV x{e.kv_replication:g}")
    text = ", ".join(parts) if parts else "compute-bound"
    if ranked.decided_by is not None:
        text += f" [tie: {ranked.decided_by.id}]"
    return text


def format_rejections(result: SearchResult) -> List[str]:
    lines = []
    for rule_id, count in result.rejections.counts.most_common():
        if rule_id == "fixed":
            continue
        rule = rules.RULES.get(rule_id)
        label = rule.cite() if rule else rule_id
        lines.append(f"  {count} layouts ruled out by {label}: e.g. "
                     f"{result.rejections.examples[rule_id]}")
    oom = sum(1 for e in result.evaluated if not e.fits)
    if oom:
        lines.append(f"  {oom} predicted layouts do not fit in memory")
    return lines


def _window_words(m) -> str:
    """``, window W on k of L layers`` (the training metrics' words), or nothing."""
    if m.window_size is None:
        return ""
    return f", window {m.window_size} on {sum(m.window_marks())} of {m.num_layers} layers"


def format_table(result: SearchResult) -> str:
    """The ranked table with a header describing the workload and hardware."""
    w = result.workload
    m = w.model
    lines = [
        f"model {m.name}: {m.total_params() / 1e9:.2f}B params, {m.num_layers} layers, "
        f"hidden {m.hidden_size}, {m.num_attention_heads} heads / {m.num_query_groups} KV, "
        f"ffn {m.ffn_hidden_size}{' SwiGLU' if m.swiglu else ''}, vocab {m.vocab_size}"
        + _window_words(m),
        f"sequence {w.seq_length}, micro-batch {w.micro_batch_size}, global batch "
        f"{w.global_batch_size if w.global_batch_size is not None else 'auto'}, "
        f"{w.world_size} GPUs ({w.gpus_per_node} per node)"
        + (f", packed documents {w.documents.name()} (FLOPs: the documents' pairs)"
           if w.documents is not None else ""),
    ]
    lines += result.hardware.describe()
    if result.fixed:
        lines.append(f"fixed: {result.fixed}")
    lines.append(f"{len(result.evaluated)} layouts predicted, "
                 f"{len(result.feasible())} fit; rules applied:")
    lines += format_rejections(result)
    header = (f"{'#':>2} {'TP':>3} {'U':>3} {'R':>3} {'DP':>4} {'PP':>3} {'ZeRO':>4} "
              f"{'recomp':>9} {'step s':>9} {'tok/s/GPU':>10} {'MFU':>6} {'mem GiB':>8}  why")
    lines += ["", header, "-" * len(header)]
    for r in result.ranked:
        e, lay = r.estimate, r.estimate.layout
        lines.append(
            f"{r.rank:>2} {lay.tp:>3} {lay.ulysses:>3} {lay.ring:>3} {lay.dp:>4} {lay.pp:>3} "
            f"{lay.zero_stage:>4} {lay.recompute:>9} {e.step_time_s:>9.3f} "
            f"{e.tokens_per_s_per_gpu:>10,.0f} {_pct(e.mfu):>6} {e.memory.total:>8.1f}  "
            f"{short_reason(r)}")
    lines += ["", "why #1:"]
    lines += [f"  - {line}" for line in reasons_for(result, result.best)]
    return "\n".join(lines)
