"""Pairing this project's rows with the peers' rows of the same length and round:
per-round ratios, and ratios of the means over the rounds (``--rounds``)."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from megatron.bench.e2e.config import E2EResult


def _compared_pairs(results: Sequence[E2EResult]) -> List[Tuple[E2EResult, E2EResult]]:
    """(ours, peer) for each peer row that trained and each of this project's rows of the
    same length and round that trained, peers in report order."""
    return [(ours, peer)
            for peer in results if peer.stack != "megatron-usp" and peer.status == "ok"
            for ours in results if ours.stack == "megatron-usp" and ours.status == "ok"
            and ours.seq_len == peer.seq_len and ours.round == peer.round]


def peer_ratios(results: Sequence[E2EResult]) -> List[dict]:
    """For each peer row that trained, this project's rows of the same length and round that
    trained: per-GPU tokens/s and peak memory of ours over the peer's."""
    out = []
    for ours, peer in _compared_pairs(results):
        out.append({
            "seq_len": ours.seq_len, "split": f"{ours.ulysses}x{ours.ring}",
            "recompute": ours.recompute, "peer": peer.stack,
            "peer_recompute": peer.recompute, "round": ours.round,
            "tokens_per_s_ratio": ours.tokens_per_s_per_gpu / peer.tokens_per_s_per_gpu,
            "peak_mem_ratio": (ours.peak_mem_gib / peer.peak_mem_gib
                               if ours.peak_mem_gib and peer.peak_mem_gib else None)})
    return out


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def pooled_ratios(results: Sequence[E2EResult]) -> List[dict]:
    """Over the rounds (``--rounds``): for each length, split and recompute of ours against
    each peer (and its recompute), the ratio of the mean per-GPU tokens/s over the rounds in
    which both trained, the range of the per-round ratios, and our share of the ceiling at
    our mean iteration time. One entry per pair, also for a single round."""
    groups: Dict[tuple, List[Tuple[E2EResult, E2EResult]]] = {}
    for ours, peer in _compared_pairs(results):
        key = (ours.seq_len, ours.ulysses, ours.ring, ours.recompute, peer.stack,
               peer.recompute)
        groups.setdefault(key, []).append((ours, peer))
    out = []
    for (seq_len, u, r, recompute, peer, peer_recompute), pairs in groups.items():
        each = [o.tokens_per_s_per_gpu / p.tokens_per_s_per_gpu for o, p in pairs]
        ours_ms = _mean([o.iter_ms for o, _ in pairs])
        shares = [o.ceiling_share * o.iter_ms for o, _ in pairs if o.ceiling_share]
        out.append({
            "seq_len": seq_len, "split": f"{u}x{r}", "recompute": recompute, "peer": peer,
            "peer_recompute": peer_recompute, "rounds": len(pairs),
            "ours_iter_ms": ours_ms, "peer_iter_ms": _mean([p.iter_ms for _, p in pairs]),
            "tokens_per_s_ratio": (_mean([o.tokens_per_s_per_gpu for o, _ in pairs])
                                   / _mean([p.tokens_per_s_per_gpu for _, p in pairs])),
            "ratio_min": min(each), "ratio_max": max(each),
            # the ceiling is timed once per length: the same ceiling_ms on every round's row
            "ceiling_share": _mean(shares) / ours_ms if shares else None})
    return out
