"""The order of the runs: the throughput sweep over lengths, rounds, splits and peers
(with ``--recompute auto``'s fallback), and the doubling search of ``--find-max-seq``."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from megatron.bench.e2e.ceilings import apply_ceiling
from megatron.bench.e2e.config import E2EConfig, E2EResult, RunOutcome, RunSpec
from megatron.bench.e2e.launch import run_training
from megatron.bench.e2e.peers import peer_recompute_order, run_peer
from megatron.bench.e2e.summary import summarize

Runner = Callable[[E2EConfig, RunSpec], RunOutcome]


PeerRunner = Callable[[E2EConfig, str, int, str, int], E2EResult]


def throughput_sweep(cfg: E2EConfig, runner: Runner = run_training,
                     on_result: Callable[[E2EResult], None] = lambda r: None,
                     peer_runner: PeerRunner = run_peer,
                     ceilings: Optional[Dict[int, dict]] = None) -> List[E2EResult]:
    """Every (length, split), lengths in the given order, then the peers of that length.

    ``--recompute auto``: a run without recompute that runs out of memory is reported and
    repeated with full recompute; longer lengths of that split then start with full
    recompute (they would run out of memory too), saving a failed launch each. Peers follow
    :func:`peer_recompute_order` the same way.
    """
    results: List[E2EResult] = []
    needs_full = set()
    ceilings = ceilings or {}
    # the ceiling's rows (one GPU) profile one more iteration: apply_ceiling reads its GEMMs
    profile = bool(ceilings) and cfg.nproc_per_node == 1

    def record(res: E2EResult) -> E2EResult:
        apply_ceiling(res, ceilings)
        results.append(res)
        on_result(res)
        return res

    def run(spec: RunSpec) -> E2EResult:
        return record(summarize(cfg, spec, runner(cfg, spec)))

    for seq_len in cfg.seq_lens:
        for round_ in range(1, cfg.rounds + 1):
            for u, r in cfg.splits:
                first = cfg.recompute
                if first == "auto":
                    first = "full" if (u, r) in needs_full else "none"
                res = run(RunSpec(seq_len, u, r, first, cfg.iters, round_, profile))
                if res.status == "oom" and cfg.recompute == "auto" and first == "none":
                    needs_full.add((u, r))
                    run(RunSpec(seq_len, u, r, "full", cfg.iters, round_, profile))
            for peer in cfg.peers:
                for recompute in peer_recompute_order(cfg.recompute):
                    res = record(peer_runner(cfg, peer, seq_len, recompute, round_))
                    if res.status != "oom":
                        break
    return results


def find_max_seq(cfg: E2EConfig, runner: Runner = run_training,
                 on_result: Callable[[E2EResult], None] = lambda r: None
                 ) -> Tuple[List[E2EResult], Dict[str, Optional[int]]]:
    """Double S from ``start_seq`` per split until a run fails (full recompute, or
    ``--recompute selective``; ``none`` and ``auto`` search with full recompute).

    Returns the runs (each with its MFU and GPU / host peaks) and, per split ``"UxR"``, the
    longest length that trained (None if even ``start_seq`` failed).
    """
    recompute = cfg.recompute if cfg.recompute in ("full", "selective") else "full"
    results, longest = [], {}
    for u, r in cfg.splits:
        key, best, seq = f"{u}x{r}", None, cfg.start_seq
        while seq <= cfg.max_seq:
            spec = RunSpec(seq, u, r, recompute, cfg.iters)
            res = summarize(cfg, spec, runner(cfg, spec))
            results.append(res)
            on_result(res)
            if res.status != "ok":
                break
            best, seq = seq, seq * 2
        longest[key] = best
    return results, longest
