#!/usr/bin/env python
"""Compare the loss curves of two or more training runs; fail past a tolerance.

    python tools/compare_loss.py runs/dp4/metrics.jsonl runs/u2r2/metrics.jsonl \\
        --tolerance 1e-5 --png runs/loss_dp4_vs_u2r2.png

Inputs are the per-step metrics files ``pretrain_gpt.py`` writes (``--metrics-file``; see
:mod:`megatron.training.metrics`). The first file is the reference. For every iteration,
the relative divergence of each other run is ``|loss - ref| / |ref|``; the table and the
maximum are printed, the curves (and the divergence, log scale) are drawn to ``--png``.

A resumed run appends to its metrics file, so for each iteration the last record wins.
Runs must cover the same iterations unless ``--allow-missing`` (then the common ones are
compared). Exit status: 0 within tolerance, 1 past it (or a non-finite loss, or missing
iterations), 2 for unreadable input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence


class InputError(ValueError):
    """A metrics file that cannot be compared (missing, not JSONL, no records)."""


@dataclass
class Series:
    """One run's values of ``metric`` per iteration."""

    label: str
    path: str
    values: Dict[int, float]


@dataclass
class Comparison:
    """Per-iteration relative divergences of each run from the reference (the first)."""

    reference: Series
    others: List[Series]
    iterations: List[int]
    divergence: Dict[str, Dict[int, float]]
    missing: Dict[str, List[int]] = field(default_factory=dict)

    def max_divergence(self):
        """(value, label, iteration) of the largest divergence; (0.0, None, None) if none."""
        worst = (0.0, None, None)
        for label, per_it in self.divergence.items():
            for it, d in per_it.items():
                if d > worst[0]:
                    worst = (d, label, it)
        return worst


def load_series(path: str, metric: str = "lm_loss", kind: str = "train",
                label: Optional[str] = None) -> Series:
    """Read a metrics JSONL file; the last record of each iteration wins."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    values: Dict[int, float] = {}
    layout = None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if rec.get("kind") == "run":
                layout = rec.get("layout") or layout
            elif rec.get("kind") == kind and metric in rec and "iteration" in rec:
                value = rec[metric]
                values[int(rec["iteration"])] = float("nan") if value is None else float(value)
    if not values:
        raise InputError(f"{path}: no {kind!r} records with {metric!r}")
    return Series(label=label or layout or os.path.basename(os.path.dirname(path)) or path,
                  path=path, values=values)


def relative_divergence(value: float, reference: float) -> float:
    """``|value - reference| / |reference|``; inf when either is not finite."""
    if not (math.isfinite(value) and math.isfinite(reference)):
        return math.inf
    if reference == 0.0:
        return 0.0 if value == 0.0 else math.inf
    return abs(value - reference) / abs(reference)


def compare(series: Sequence[Series]) -> Comparison:
    if len(series) < 2:
        raise InputError("give two or more metrics files")
    ref, others = series[0], list(series[1:])
    common = set(ref.values)
    for s in others:
        common &= set(s.values)
    if not common:
        raise InputError("the runs share no iteration")
    iterations = sorted(common)
    union = set(ref.values)
    for s in others:
        union |= set(s.values)
    missing = {s.label: sorted(union - set(s.values)) for s in series if union - set(s.values)}
    divergence = {s.label: {it: relative_divergence(s.values[it], ref.values[it])
                            for it in iterations} for s in others}
    return Comparison(ref, others, iterations, divergence, missing)


def format_table(cmp: Comparison, every: int = 1) -> str:
    labels = [s.label for s in cmp.others]
    head = f"{'iteration':>9}  {cmp.reference.label[:22]:>22}"
    for label in labels:
        head += f"  {label[:22]:>22}  {'rel. div.':>10}"
    lines = [head]
    last = cmp.iterations[-1]
    for k, it in enumerate(cmp.iterations):
        if every > 1 and k % every and it != last:
            continue
        row = f"{it:9d}  {cmp.reference.values[it]:22.9g}"
        for s in cmp.others:
            row += f"  {s.values[it]:22.9g}  {cmp.divergence[s.label][it]:10.3e}"
        lines.append(row)
    return "\n".join(lines)


def plot(cmp: Comparison, png: str, tolerance: float, metric: str) -> None:
    """Curves (top) and relative divergence from the reference (bottom, log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_div) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                          gridspec_kw={"height_ratios": [3, 2]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, s in enumerate([cmp.reference] + cmp.others):
        its = sorted(s.values)
        style = dict(linewidth=2.6, alpha=0.5) if k == 0 else dict(linewidth=1.1, linestyle="--")
        ax_loss.plot(its, [s.values[i] for i in its], label=s.label,
                     color=colors[k % len(colors)], **style)
    ax_loss.set_ylabel(metric.replace("_", " "))
    ax_loss.set_title(f"{metric.replace('_', ' ')}: {cmp.reference.label} (reference) vs "
                      f"{', '.join(s.label for s in cmp.others)}")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    floor = 1e-12  # exact agreement is drawn at the floor of the log scale
    for k, s in enumerate(cmp.others, start=1):
        div = cmp.divergence[s.label]
        ax_div.plot(cmp.iterations, [max(div[i], floor) if math.isfinite(div[i]) else 1.0
                                     for i in cmp.iterations], label=s.label, linewidth=1.0,
                    color=colors[k % len(colors)])
    ax_div.axhline(tolerance, color="red", linestyle="--", label=f"tolerance {tolerance:g}")
    ax_div.set_yscale("log")
    ax_div.set_ylabel("relative divergence")
    ax_div.set_xlabel("iteration")
    ax_div.legend(fontsize=8)
    ax_div.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", nargs="+", help="metrics JSONL files; the first is the reference")
    p.add_argument("--labels", nargs="+", default=None,
                   help="curve names (default: each run's layout, e.g. 'TP1 U2 R2 DP1 PP1')")
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="largest allowed relative divergence (default 1e-5)")
    p.add_argument("--metric", default="lm_loss", help="record field to compare")
    p.add_argument("--kind", default="train", choices=("train", "valid"),
                   help="train (per step) or valid (per evaluation) records")
    p.add_argument("--png", default=None, help="write the curves to this PNG")
    p.add_argument("--allow-missing", action="store_true",
                   help="compare the common iterations when the runs cover different ones")
    p.add_argument("--print-every", type=int, default=1,
                   help="print every N-th iteration of the table (the last always)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.metrics):
        print(f"error: {len(args.labels)} --labels for {len(args.metrics)} files",
              file=sys.stderr)
        return 2
    if args.tolerance < 0 or args.print_every < 1:
        print("error: --tolerance must be >= 0 and --print-every >= 1", file=sys.stderr)
        return 2
    try:
        series = [load_series(path, args.metric, args.kind,
                              args.labels[i] if args.labels else None)
                  for i, path in enumerate(args.metrics)]
        seen: Dict[str, int] = {}
        for s in series:  # keep labels unique (two runs of one layout)
            if s.label in seen:
                seen[s.label] += 1
                s.label = f"{s.label} ({seen[s.label]})"
            else:
                seen[s.label] = 1
        cmp = compare(series)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(cmp, args.print_every))
    worst, label, it = cmp.max_divergence()
    print(f"\nmax relative divergence: {worst:.3e}"
          + (f" ({label} at iteration {it})" if label else "")
          + f" over {len(cmp.iterations)} iterations; tolerance {args.tolerance:g}")
    if args.png:
        plot(cmp, args.png, args.tolerance, args.metric)
        print(f"loss curves: {os.path.abspath(args.png)}")
    failed = False
    if cmp.missing and not args.allow_missing:
        for name, its in cmp.missing.items():
            print(f"FAIL: {name} lacks iterations {its[:10]}{' ...' if len(its) > 10 else ''} "
                  f"(pass --allow-missing to compare the common ones)")
        failed = True
    if not worst <= args.tolerance:
        print(f"FAIL: divergence {worst:.3e} exceeds --tolerance {args.tolerance:g}")
        failed = True
    if not failed:
        print("OK: the curves agree within the tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
