#!/usr/bin/env python
"""Compare the loss curves of two or more training runs; fail past a tolerance or on drift.

    python tools/compare_loss.py runs/dp4/metrics.jsonl runs/u2r2/metrics.jsonl \\
        --tolerance 1e-5 --png runs/loss_dp4_vs_u2r2.png

    python tools/compare_loss.py dp2.jsonl u2.jsonl r2.jsonl --labels DP2 U2 R2 \\
        --noise-pair dp2.jsonl dp1_accum.jsonl --png curves.png       # the drift test

Inputs are the per-step metrics files ``pretrain_gpt.py`` writes (``--metrics-file``; see
:mod:`megatron.training.observe.metrics`). The first file is the reference. For every iteration,
the relative divergence of each other run is ``|loss - ref| / |ref|``; the table and the
maximum are printed, the curves (and the divergence, log scale) are drawn to ``--png``.

Drift test (``--noise-pair A B``, repeatable; :mod:`megatron.training.observe.loss_drift`): over a
window of iterations (``--drift-window``, default the second half), each run's mean signed
relative difference from the reference and its share of steps above it are compared with a
noise band taken from a reference-vs-reference pair, two runs that differ only in reduction
order. A run whose drift lies outside the band fails, with a message naming it and its
drift. In bf16 the per-step differences are noise of 1e-3 to 1e-2, so with a pair the
``--tolerance`` check is only enforced when ``--tolerance`` is given. How to read the output:
docs/numerics.md. Without a pair the drift statistics are printed, not judged.

A resumed run leaves one record per iteration in its metrics file; should a file hold two
(concatenated files), the last wins.
Runs must cover the same iterations unless ``--allow-missing`` (then the common ones are
compared). Exit status: 0 within tolerance (and the band), 1 past it, drifting, a non-finite
loss, or missing iterations, 2 for unreadable input (or curves the drift test cannot judge:
too short a window, a bit-identical pair).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from megatron.errors import UsageError
from megatron.training.observe import loss_drift

DEFAULT_TOLERANCE = 1e-5


class InputError(UsageError, ValueError):
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


def _signed_percent(cmp: Comparison, s: Series) -> Dict[int, float]:
    """100 x the signed relative difference of ``s`` from the reference, per iteration."""
    ref = cmp.reference.values
    return {it: 100 * loss_drift.signed_relative_difference(s.values[it], ref[it])
            for it in cmp.iterations if it in s.values}


def _percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _plot_signed(ax, cmp: Comparison, drift: loss_drift.DriftReport, pair_series, colors):
    """Signed difference per step (%), the window, each run's window mean and the band."""
    w = drift.window
    ax.axvspan(w.start, w.end, color="0.92", zorder=0, label=f"drift window {w.start}-{w.end}")
    shown: List[float] = []
    for (a, b), st in zip(pair_series, drift.pairs):
        xs = {it: 100 * loss_drift.signed_relative_difference(b.values[it], a.values[it])
              for it in sorted(set(a.values) & set(b.values))}
        its = [i for i in sorted(xs) if math.isfinite(xs[i])]
        ax.plot(its, [xs[i] for i in its], color="0.45", linewidth=0.8, linestyle=":",
                label=f"pair {st.label}: mean {loss_drift.percent(st.mean)}, above "
                      f"{st.above:.0%}")
    for k, (s, st) in enumerate(zip(cmp.others, drift.stats), start=1):
        xs = _signed_percent(cmp, s)
        its = [i for i in sorted(xs) if math.isfinite(xs[i])]
        color = colors[k % len(colors)]
        ax.plot(its, [xs[i] for i in its], color=color, linewidth=0.7, alpha=0.6)
        ax.hlines(100 * st.mean, w.start, w.end, color=color, linewidth=2.4,
                  label=f"{s.label}: mean {loss_drift.percent(st.mean)}, above "
                        f"{st.above:.0%}")
        shown += [abs(xs[i]) for i in its if w.start <= i <= w.end]
    limit = 1.5 * _percentile(shown, 0.98)
    if drift.band is not None:
        b = 100 * drift.band.mean
        ax.fill_between([w.start, w.end], [-b, -b], [b, b], color="gold", alpha=0.45,
                        label=f"noise band of the mean: "
                              f"+-{loss_drift.percent(drift.band.mean, False)}")
        limit = max(limit, 2 * b)
    limit = max([limit] + [2 * abs(100 * st.mean) for st in drift.stats]) or 1.0
    ax.set_ylim(-limit, limit)   # spikes beyond the window's spread are clipped
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_ylabel("signed rel. difference (%)")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)


def plot(cmp: Comparison, png: str, tolerance: Optional[float], metric: str,
         drift: Optional[loss_drift.DriftReport] = None, pair_series=()) -> None:
    """Curves (top), with ``drift`` the signed difference and its band (middle), and the
    relative divergence from the reference (bottom, log scale)."""
    import matplotlib  # optional: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib

    rows = 3 if drift is not None else 2
    fig, axes = plt.subplots(rows, 1, figsize=(9, 3.5 * rows), sharex=True,
                             gridspec_kw={"height_ratios": [3, 3, 2] if drift else [3, 2]})
    ax_loss, ax_div = axes[0], axes[-1]
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
    if drift is not None:
        _plot_signed(axes[1], cmp, drift, pair_series, colors)
    floor = 1e-12  # exact agreement is drawn at the floor of the log scale
    for k, s in enumerate(cmp.others, start=1):
        div = cmp.divergence[s.label]
        ax_div.plot(cmp.iterations, [max(div[i], floor) if math.isfinite(div[i]) else 1.0
                                     for i in cmp.iterations], label=s.label, linewidth=1.0,
                    color=colors[k % len(colors)])
    if tolerance is not None:
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
    p.add_argument("--tolerance", type=float, default=None,
                   help=f"largest allowed relative divergence (default {DEFAULT_TOLERANCE:g}; "
                        f"with --noise-pair only enforced when given)")
    p.add_argument("--metric", default="lm_loss", help="record field to compare")
    p.add_argument("--kind", default="train", choices=("train", "valid"),
                   help="train (per step) or valid (per evaluation) records")
    p.add_argument("--png", default=None, help="write the curves to this PNG")
    p.add_argument("--allow-missing", action="store_true",
                   help="compare the common iterations when the runs cover different ones")
    p.add_argument("--print-every", type=int, default=1,
                   help="print every N-th iteration of the table (the last always)")
    g = p.add_argument_group("drift test", "systematic offsets against a noise band "
                                           "(megatron/training/observe/loss_drift.py, docs/numerics.md)")
    g.add_argument("--noise-pair", nargs=2, action="append", default=[], metavar=("A", "B"),
                   help="metrics files of two runs that differ only in reduction order (B is "
                        "compared with A); their drift sets the noise band and turns the "
                        "drift test on. Repeatable: the widest band is used")
    g.add_argument("--drift-window", default="half", metavar="START:END",
                   help="iterations of the drift test, both included (101:200, 101:); "
                        "default 'half': the second half of the reference's iterations")
    g.add_argument("--drift-z", type=float, default=loss_drift.DEFAULT_Z,
                   help="standard errors of the pair's drift the band allows beyond the "
                        "pair's own drift (default %(default)s)")
    p.add_argument("--summary-json", default=None, metavar="PATH",
                   help="write the verdicts (max divergence, drift statistics, band, exit "
                        "status) to this JSON file")
    return p


def _stats_json(st: loss_drift.DriftStats) -> Dict:
    return {"label": st.label, "steps": st.steps, "mean_signed_rel_diff": st.mean,
            "se_mean": st.se_mean, "share_above": st.above, "se_share_above": st.se_above}


def summary(cmp: Comparison, drift: Optional[loss_drift.DriftReport], tolerance: float,
            enforced: bool, status: int) -> Dict:
    """What ``--summary-json`` writes: the checks and their inputs, no per-step data."""
    worst, label, it = cmp.max_divergence()
    out: Dict = {"reference": cmp.reference.label, "runs": [s.label for s in cmp.others],
                 "iterations": [cmp.iterations[0], cmp.iterations[-1]],
                 "missing": cmp.missing,
                 "max_divergence": {"value": worst, "run": label, "iteration": it,
                                    "tolerance": tolerance, "enforced": enforced},
                 "exit_status": status}
    if drift is not None:
        verdicts = {v.stats.label: v for v in drift.verdicts}
        out["drift"] = {
            "window": [drift.window.start, drift.window.end],
            "runs": [dict(_stats_json(st), **({"drifts": verdicts[st.label].drifts,
                                                "message": verdicts[st.label].message()}
                                               if st.label in verdicts else {}))
                     for st in drift.stats],
            "pairs": [_stats_json(st) for st in drift.pairs],
            "band": None if drift.band is None else {
                "mean": drift.band.mean, "share_above_half_width": drift.band.above,
                "z": drift.band.z}}
    return out


def _pair_label(series: Series) -> str:
    """A noise-pair run's name: its file name, or its folder for a plain metrics.jsonl."""
    stem = os.path.splitext(os.path.basename(series.path))[0]
    if stem == "metrics":
        stem = os.path.basename(os.path.dirname(os.path.abspath(series.path))) or stem
    return stem


def _unique_labels(series: Sequence[Series]) -> None:
    seen: Dict[str, int] = {}
    for s in series:  # keep labels unique (two runs of one layout)
        if s.label in seen:
            seen[s.label] += 1
            s.label = f"{s.label} ({seen[s.label]})"
        else:
            seen[s.label] = 1


def _drift(args, cmp: Comparison):
    """(report, pair series) of the drift test; raises InputError / loss_drift errors."""
    pair_series = [tuple(load_series(path, args.metric, args.kind) for path in pair)
                   for pair in args.noise_pair]
    for a, b in pair_series:
        a.label, b.label = _pair_label(a), _pair_label(b)
        if a.label == b.label:
            a.label, b.label = a.path, b.path
    ref = cmp.reference
    window = loss_drift.parse_window(args.drift_window, sorted(ref.values))
    report = loss_drift.drift_report(
        {s.label: s.values for s in cmp.others}, ref.values,
        [(a.label, a.values, b.label, b.values) for a, b in pair_series], window,
        args.drift_z, ref.label, args.allow_missing)
    return report, pair_series


def print_drift(report: loss_drift.DriftReport, reference: str) -> None:
    print(f"\ndrift from {reference} over {report.window} (signed relative difference; "
          f"> 0: higher loss):")
    width = max(len(st.label) for st in report.stats + report.pairs)
    for st in report.stats:
        print(f"  {st.label:<{width}}  {st.describe()}")
    for st in report.pairs:
        print(f"  {st.label:<{width}}  {st.describe()}  [reference pair]")
    if report.band is not None:
        print(report.band.describe())
    else:
        print("(no --noise-pair: drift statistics only, not judged)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.metrics):
        print(f"error: {len(args.labels)} --labels for {len(args.metrics)} files",
              file=sys.stderr)
        return 2
    enforce_tolerance = args.tolerance is not None or not args.noise_pair
    tolerance = DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    if tolerance < 0 or args.print_every < 1:
        print("error: --tolerance must be >= 0 and --print-every >= 1", file=sys.stderr)
        return 2
    try:
        series = [load_series(path, args.metric, args.kind,
                              args.labels[i] if args.labels else None)
                  for i, path in enumerate(args.metrics)]
        _unique_labels(series)
        cmp = compare(series)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(cmp, args.print_every))
    worst, label, it = cmp.max_divergence()
    print(f"\nmax relative divergence: {worst:.3e}"
          + (f" ({label} at iteration {it})" if label else "")
          + f" over {len(cmp.iterations)} iterations; tolerance {tolerance:g}"
          + ("" if enforce_tolerance else " (not enforced: the drift test decides; pass "
                                          "--tolerance to enforce it too)"))
    failed = False
    drift, pair_series = None, ()
    try:
        drift, pair_series = _drift(args, cmp)
    except (loss_drift.DriftError, InputError) as exc:
        if not args.noise_pair:   # statistics only: the checks above judge the curves
            print(f"(drift statistics skipped: {exc})")
        elif isinstance(exc, loss_drift.BrokenRunError):
            print(f"FAIL: drift test: {exc}")
            failed = True
        else:
            print(f"error: drift test: {exc}", file=sys.stderr)
            return 2
    if drift is not None:
        print_drift(drift, cmp.reference.label)
    if args.png:
        plot(cmp, args.png, tolerance if enforce_tolerance else None, args.metric, drift,
             pair_series)
        print(f"loss curves: {os.path.abspath(args.png)}")
    if cmp.missing and not args.allow_missing:
        for name, its in cmp.missing.items():
            print(f"FAIL: {name} lacks iterations {its[:10]}{' ...' if len(its) > 10 else ''} "
                  f"(pass --allow-missing to compare the common ones)")
        failed = True
    if enforce_tolerance and not worst <= tolerance:
        print(f"FAIL: divergence {worst:.3e} exceeds --tolerance {tolerance:g}")
        failed = True
    for verdict in (drift.verdicts if drift is not None else ()):
        print(("FAIL: " if verdict.drifts else "ok: ") + verdict.message())
        failed |= verdict.drifts
    if not failed:
        print("OK: the curves agree within the tolerance" if enforce_tolerance else
              "OK: no layout drifts outside the noise band")
    status = 1 if failed else 0
    if args.summary_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.summary_json)), exist_ok=True)
        with open(args.summary_json, "w", encoding="utf-8") as f:
            json.dump(summary(cmp, drift, tolerance, enforce_tolerance, status), f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
