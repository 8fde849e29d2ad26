"""Loss-curve drift: a systematic offset between training runs, judged against a noise band.

Two runs that compute the same training in a different order (another layout, another
micro-batch split) never agree to the bit in bf16: rounding differences grow chaotically
until the per-step losses differ by 1e-3 to 1e-2. The largest per-step difference then says
nothing (one loss spike dominates it), while a small *systematic* offset, a run that trains
a little worse at almost every step, hides under that noise. This module measures the
offset and compares it with what a pure change of reduction order produces.

Per step ``t`` of a window ``W`` of iterations (default: the second half of the run), the
signed relative difference of a run from the reference is ``x_t = (loss_t - ref_t) / |ref_t|``
(> 0: the run's loss is higher). Per run, :class:`DriftStats` holds

* ``mean``: the mean of ``x_t`` over ``W``, the drift;
* ``above``: the share of steps with ``x_t > 0`` (ties count one half);
* ``se_mean`` and ``se_above``: their standard errors by batch means: ``W`` is cut into
  :data:`BLOCKS` contiguous blocks and the error is the standard deviation of the block
  means over ``sqrt(BLOCKS)``. Neighbouring ``x_t`` are strongly correlated (a run that is
  ahead stays ahead for a while), so treating the steps as independent would make the
  errors far too small.

The noise band (:func:`noise_band`) comes from one or more reference-vs-reference pairs:
two runs that should train the same curve and differ only in reduction order (e.g. DP2 vs
DP1 with gradient accumulation, or one layout with its output-layer gradient summed over
other chunks). For each pair, the band allows its own drift plus ``z`` standard errors::

    mean band  = |mean_pair| + z * se_mean_pair
    above band = |above_pair - 1/2| + z * se_above_pair

and with several pairs the widest band is used. A run drifts (:func:`judge`) when
``|mean| > mean band`` or ``|above - 1/2| > above band``: its offset is larger than a change
of reduction order explains. The same band serves every run, so one reads the verdict as
"this layout is further from the reference than the reference is from itself".

Pure Python, no torch: ``tools/compare_loss.py`` calls it, and tests call it directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from megatron.errors import UsageError

BLOCKS = 10
"""Contiguous blocks of the window for the batch-means standard errors."""

MIN_WINDOW_STEPS = 2 * BLOCKS
"""Fewest steps a window may have: two per block."""

DEFAULT_Z = 3.0
"""Standard errors of the reference pair the band allows beyond the pair's own drift."""


class DriftError(UsageError, ValueError):
    """The curves cannot be judged: too few steps, a bad window, a zero reference loss, or a
    reference pair without noise. ``tools/compare_loss.py`` exits 2."""


class BrokenRunError(DriftError):
    """A run has a non-finite loss in the window or lacks some of its steps: a failure of the
    run itself (``tools/compare_loss.py`` exits 1, as for a divergence)."""


# --------------------------------------------------------------------------- window
@dataclass(frozen=True)
class Window:
    """Iterations ``start..end``, both included."""

    start: int
    end: int

    def __str__(self) -> str:
        return f"iterations {self.start}-{self.end}"


def default_window(iterations: Sequence[int]) -> Window:
    """The second half of the run: ``last//2 + 1 .. last`` (steps 101-200 of a 200-step run)."""
    if not iterations:
        raise DriftError("no iterations to take a window from")
    last = max(iterations)
    return Window(last // 2 + 1, last)


def parse_window(text: str, iterations: Sequence[int]) -> Window:
    """``START:END`` (iterations, both included; either may be left out), or ``half``."""
    if text == "half":
        return default_window(iterations)
    start_s, sep, end_s = text.partition(":")
    if not sep:
        raise DriftError(f"--drift-window {text!r}: expected START:END (e.g. 101:200, 101:) "
                         f"or 'half'")
    try:
        start = int(start_s) if start_s else min(iterations)
        end = int(end_s) if end_s else max(iterations)
    except ValueError:
        raise DriftError(f"--drift-window {text!r}: START and END must be integers, e.g. "
                         f"101:200") from None
    if end < start:
        raise DriftError(f"--drift-window {text!r}: END {end} is before START {start}")
    return Window(start, end)


# --------------------------------------------------------------------------- statistics
def signed_relative_difference(value: float, reference: float) -> float:
    """``(value - reference) / |reference|``; NaN when either is not finite or the reference
    is 0 (callers that judge raise instead, :func:`signed_relative_differences`)."""
    if not (math.isfinite(value) and math.isfinite(reference)) or reference == 0.0:
        return math.nan
    return (value - reference) / abs(reference)


def signed_relative_differences(run: Mapping[int, float], ref: Mapping[int, float],
                                window: Window, label: str = "run",
                                ref_label: str = "reference",
                                allow_missing: bool = False) -> Dict[int, float]:
    """``{t: (run[t] - ref[t]) / |ref[t]|}`` for the reference's iterations in ``window``.

    Raises :class:`BrokenRunError` for a non-finite loss of either run in the window, or (unless
    ``allow_missing``: then the common steps are used) when ``run`` lacks some of them;
    :class:`DriftError` for a zero reference loss or fewer than :data:`MIN_WINDOW_STEPS` steps.
    """
    steps = sorted(t for t in ref if window.start <= t <= window.end)
    missing = [t for t in steps if t not in run]
    if missing and not allow_missing:
        raise BrokenRunError(f"{label} lacks {len(missing)} step(s) of the drift window "
                             f"({window}) that {ref_label} has: {_few(missing)}")
    steps = [t for t in steps if t in run]
    if len(steps) < MIN_WINDOW_STEPS:
        raise DriftError(f"{label} vs {ref_label}: {len(steps)} common step(s) in the drift "
                         f"window ({window}); the drift test needs at least "
                         f"{MIN_WINDOW_STEPS} (train longer or widen --drift-window)")
    out: Dict[int, float] = {}
    for t in steps:
        for name, value in ((label, run[t]), (ref_label, ref[t])):
            if not math.isfinite(value):
                raise BrokenRunError(f"{name} has a non-finite loss ({value}) at iteration "
                                     f"{t}, inside the drift window ({window})")
        if ref[t] == 0.0:
            raise DriftError(f"{ref_label} has loss 0 at iteration {t}: no relative "
                             f"difference can be taken")
        out[t] = signed_relative_difference(run[t], ref[t])
    return out


def _few(items: Sequence[int], n: int = 10) -> str:
    shown = ", ".join(str(i) for i in items[:n])
    return f"[{shown}{', ...' if len(items) > n else ''}]"


def _block_means(values: Sequence[float], blocks: int) -> List[float]:
    """Means of ``blocks`` contiguous, nearly equal parts of ``values`` (in order)."""
    n = len(values)
    edges = [round(k * n / blocks) for k in range(blocks + 1)]
    return [sum(values[a:b]) / (b - a) for a, b in zip(edges, edges[1:])]


def _batch_means_se(values: Sequence[float], blocks: int) -> float:
    """Standard error of the mean of correlated ``values`` by the method of batch means."""
    means = _block_means(values, blocks)
    centre = sum(means) / blocks
    var = sum((m - centre) ** 2 for m in means) / (blocks - 1)
    return math.sqrt(var / blocks)


def percent(x: float, signed: bool = True) -> str:
    """``x`` as a percentage: ``+0.419%``; below 0.001 % in scientific notation."""
    if x != 0.0 and abs(x) < 1e-5:
        return f"{100 * x:{'+' if signed else ''}.2e}%"
    return f"{x:{'+' if signed else ''}.3%}"


def _sign(x: float) -> float:
    return 1.0 if x > 0 else (0.5 if x == 0 else 0.0)


@dataclass(frozen=True)
class DriftStats:
    """A run's drift from the reference over a window (module docstring)."""

    label: str
    window: Window
    steps: int
    mean: float
    above: float
    se_mean: float
    se_above: float
    differences: Tuple[Tuple[int, float], ...]

    def describe(self) -> str:
        return (f"mean signed difference {percent(self.mean)} (s.e. "
                f"{percent(self.se_mean, False)}), above "
                f"the reference at {self.above:.0%} of {self.steps} steps")


def drift_stats(run: Mapping[int, float], ref: Mapping[int, float], window: Window,
                label: str = "run", ref_label: str = "reference",
                allow_missing: bool = False, blocks: int = BLOCKS) -> DriftStats:
    """:class:`DriftStats` of ``run`` against ``ref`` (``{iteration: loss}`` each).

    Raises what :func:`signed_relative_differences` raises.
    """
    diffs = signed_relative_differences(run, ref, window, label, ref_label, allow_missing)
    xs = list(diffs.values())
    signs = [_sign(x) for x in xs]
    return DriftStats(label=label, window=window, steps=len(xs), mean=sum(xs) / len(xs),
                      above=sum(signs) / len(signs), se_mean=_batch_means_se(xs, blocks),
                      se_above=_batch_means_se(signs, blocks),
                      differences=tuple(diffs.items()))


# --------------------------------------------------------------------------- band and verdict
@dataclass(frozen=True)
class NoiseBand:
    """Half-widths around no drift: ``|mean| <= mean`` and ``|above - 1/2| <= above``."""

    mean: float
    above: float
    z: float
    pairs: Tuple[DriftStats, ...]

    def describe(self) -> str:
        names = ", ".join(p.label for p in self.pairs)
        return (f"noise band from {names}: |mean| <= {percent(self.mean, False)}, share above "
                f"within "
                f"50% +- {self.above:.0%} (pair drift + {self.z:g} s.e.)")


def noise_band(pairs: Sequence[DriftStats], z: float = DEFAULT_Z) -> NoiseBand:
    """The widest band of the reference-vs-reference ``pairs`` (module docstring).

    Raises :class:`DriftError` when there is no pair, ``z`` is negative, or a pair's runs are
    bit-identical over the window (they measure no noise).
    """
    if not pairs:
        raise DriftError("the noise band needs at least one reference-vs-reference pair")
    if not z >= 0:
        raise DriftError(f"--drift-z {z} must be >= 0, e.g. {DEFAULT_Z:g}")
    for p in pairs:
        if all(x == 0.0 for _, x in p.differences):
            raise DriftError(
                f"the reference pair {p.label} is bit-identical over {p.window}: it measures "
                f"no noise; pair the reference with a run that differs only in reduction "
                f"order (another micro-batch split, another chunking of the loss)")
    mean = max(abs(p.mean) + z * p.se_mean for p in pairs)
    above = max(abs(p.above - 0.5) + z * p.se_above for p in pairs)
    return NoiseBand(mean=mean, above=above, z=z, pairs=tuple(pairs))


@dataclass(frozen=True)
class Verdict:
    """Whether a run drifts outside the band, and the sentence that says so."""

    stats: DriftStats
    band: NoiseBand
    mean_outside: bool
    above_outside: bool

    @property
    def drifts(self) -> bool:
        return self.mean_outside or self.above_outside

    def message(self) -> str:
        s, b = self.stats, self.band
        if not self.drifts:
            return (f"{s.label}: within the noise band ({s.describe()}; band |mean| <= "
                    f"{percent(b.mean, False)}, share 50% +- {b.above:.0%})")
        what = []
        if self.mean_outside:
            what.append(f"its mean signed difference {percent(s.mean)} is outside "
                        f"+-{percent(b.mean, False)}")
        if self.above_outside:
            what.append(f"it is above the reference at {s.above:.0%} of the steps, outside "
                        f"50% +- {b.above:.0%}")
        direction = "higher" if s.mean > 0 else "lower"
        return (f"{s.label} drifts from the reference over {s.window}: its loss is "
                f"{direction} by {percent(abs(s.mean), False)} on average; "
                + " and ".join(what))


def judge(stats: DriftStats, band: NoiseBand) -> Verdict:
    """Compare one run's drift with the band."""
    return Verdict(stats=stats, band=band, mean_outside=abs(stats.mean) > band.mean,
                   above_outside=abs(stats.above - 0.5) > band.above)


@dataclass(frozen=True)
class DriftReport:
    """Drift of every run over one window; with reference pairs, the band and the verdicts."""

    window: Window
    stats: Tuple[DriftStats, ...]
    pairs: Tuple[DriftStats, ...]
    band: Optional[NoiseBand]
    verdicts: Tuple[Verdict, ...]

    @property
    def drifting(self) -> List[Verdict]:
        return [v for v in self.verdicts if v.drifts]


def drift_report(runs: Mapping[str, Mapping[int, float]], ref: Mapping[int, float],
                 pairs: Sequence[Tuple[str, Mapping[int, float], str, Mapping[int, float]]] = (),
                 window: Optional[Window] = None, z: float = DEFAULT_Z,
                 ref_label: str = "reference", allow_missing: bool = False) -> DriftReport:
    """The drift of each of ``runs`` (``{label: {iteration: loss}}``) from ``ref``.

    ``pairs``: ``(label_a, a, label_b, b)`` reference-vs-reference pairs (b's drift from
    a, labelled ``"label_a vs label_b"``); with at least one, the report has the band and a
    verdict per run. ``window`` defaults to the
    second half of the reference's iterations. Raises :class:`DriftError` /
    :class:`BrokenRunError` (see :func:`signed_relative_differences`, :func:`noise_band`).
    """
    window = window or default_window(list(ref))
    stats = tuple(drift_stats(values, ref, window, label, ref_label, allow_missing)
                  for label, values in runs.items())
    pair_stats = tuple(drift_stats(b, a, window, f"{label_a} vs {label_b}", label_a,
                                   allow_missing) for label_a, a, label_b, b in pairs)
    band = noise_band(pair_stats, z) if pair_stats else None
    verdicts = tuple(judge(st, band) for st in stats) if band else ()
    return DriftReport(window=window, stats=stats, pairs=pair_stats, band=band,
                       verdicts=verdicts)
