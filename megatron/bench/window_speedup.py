"""Does a model with windowed layers train faster than its all-full twin by the attention
work the window saves? The summary step of ``benchmarks/sliding_window.sh``.

``python -m megatron.bench.window_speedup --full A.json [...] --hybrid B.json [...]
--seq-len 128k [--tolerance 0.1] [--out R.json]`` reads ``tools/bench_e2e.py`` outputs of one
model at one length, all-full and with ``--extra-args "--window-size W ..."`` (one file per
run; several runs of each, alternating, are pooled), and prints:

* the measured speed-up: mean iteration time of the full runs over that of the hybrid runs;
* the predicted one: FLOPs per iteration of the full runs over the hybrid's (each row's
  ``flops_per_iteration``, the one count of :mod:`megatron.shapes.flops`; the hybrid's from
  the training loop, which counts the pairs inside the window): the speed-up at equal MFU;
* their ratio; the target holds when measured >= (1 - tolerance) x predicted.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional, Sequence

from megatron.bench.cli import parse_seq_len

DEFAULT_TOLERANCE = 0.10


def measured_rows(payload: dict, seq_len: int, source: str, windowed: bool) -> List[dict]:
    """This project's rows of ``payload`` at ``seq_len`` that trained. Raises ValueError naming
    ``source`` when there are none, or when their FLOP count does (not) name a window as
    ``windowed`` says (a file passed on the wrong side)."""
    rows = [r for r in payload.get("results", [])
            if r.get("stack", "megatron-usp") == "megatron-usp" and r.get("seq_len") == seq_len
            and r.get("status") == "ok"]
    if not rows:
        raise ValueError(f"{source}: no run at --seq-len {seq_len} that trained")
    for r in rows:
        if ("window" in (r.get("flops_count") or "")) != windowed:
            side = "--hybrid" if windowed else "--full"
            raise ValueError(f"{source}: flops_count {r.get('flops_count')!r} is not a "
                             f"{'windowed' if windowed else 'full'} run; check {side}")
    return rows


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def speedup(full: Sequence[dict], hybrid: Sequence[dict],
            tolerance: float = DEFAULT_TOLERANCE) -> Dict[str, object]:
    """Measured against predicted speed-up of ``hybrid`` rows over ``full`` rows.

    Rows carry ``iter_ms`` and ``flops_per_iteration`` (``tools/bench_e2e.py`` results).
    ``per_round`` pairs the i-th full row with the i-th hybrid row (alternating runs).
    """
    if not full or not hybrid:
        raise ValueError("speed-up needs at least one full and one hybrid row")
    full_ms = _mean([r["iter_ms"] for r in full])
    hybrid_ms = _mean([r["iter_ms"] for r in hybrid])
    measured = full_ms / hybrid_ms
    predicted = (_mean([r["flops_per_iteration"] for r in full])
                 / _mean([r["flops_per_iteration"] for r in hybrid]))
    share = measured / predicted
    return {"full_iter_ms": full_ms, "hybrid_iter_ms": hybrid_ms,
            "full_runs": len(full), "hybrid_runs": len(hybrid),
            "measured_speedup": measured, "predicted_speedup": predicted,
            "share_of_predicted": share, "tolerance": tolerance,
            "within_tolerance": share >= 1.0 - tolerance,
            "per_round": [f["iter_ms"] / h["iter_ms"] for f, h in zip(full, hybrid)],
            "hybrid_flops_count": hybrid[0].get("flops_count")}


def summary_line(result: Dict[str, object]) -> str:
    """One line: both speed-ups, their ratio, and whether the target holds."""
    verdict = "holds" if result["within_tolerance"] else "missed"
    return (f"hybrid over full: measured {result['measured_speedup']:.3f}x "
            f"({result['full_iter_ms']:.1f} / {result['hybrid_iter_ms']:.1f} ms), predicted "
            f"{result['predicted_speedup']:.3f}x by the FLOP count "
            f"({result['hybrid_flops_count']}); {100 * result['share_of_predicted']:.1f}% of "
            f"predicted: target (>= {100 * (1 - result['tolerance']):.0f}%) {verdict}")


def _load(paths: Sequence[str], seq_len: int, windowed: bool) -> List[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += measured_rows(json.load(f), seq_len, path, windowed)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron.bench.window_speedup",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", nargs="+", required=True,
                        help="tools/bench_e2e.py JSON files of the all-full runs")
    parser.add_argument("--hybrid", nargs="+", required=True,
                        help="the same of the runs with --window-size in --extra-args")
    parser.add_argument("--seq-len", default="128k", help="the length to compare (k = 1024)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help="how far below the predicted speed-up still holds (0.1: 10 %%)")
    parser.add_argument("--out", default=None, help="JSON file for the result")
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(args_list)
    try:
        seq_len = parse_seq_len(args.seq_len, "--seq-len")
        result = speedup(_load(args.full, seq_len, False), _load(args.hybrid, seq_len, True),
                         args.tolerance)
    except ValueError as exc:
        parser.error(str(exc))
    if args.out:
        from megatron.bench.report import write_summary  # torch: only when writing

        write_summary(args.out, "window_speedup", {"seq_len": seq_len, "full": args.full,
                                                   "hybrid": args.hybrid, **result},
                      args_list, args.full[0])
    print(summary_line(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
