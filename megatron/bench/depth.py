"""Full-depth memory and time from slices of a model's layers (when one full step does not fit
in the time a device call allows).

Peak GPU memory, peak host memory and step time of a run with ``L`` layers of one model, at one
sequence length, with one set of flags, are affine in ``L``: a fixed part (embedding, output
layer and loss, their optimizer state, the working set of one layer's recompute and backward,
CUDA context) plus ``L`` times a per-layer part (the layer's weights, gradients and optimizer
state wherever they live, its kept or offloaded activations). Two slices ``L1 < L2`` (``python
tools/bench_e2e.py --num-layers L``) give both parts::

    per_layer = (m(L2) - m(L1)) / (L2 - L1)        fixed = m(L1) - L1 * per_layer

and the full depth ``m(L) = fixed + L * per_layer`` is compared with the GPU and host
capacities. This holds while the flags put each layer's bytes in the same place at every depth
(``--optimizer-offload-fraction 1.0`` or ``0``: a fraction in between moves whole layers
between GPU and host as the depth changes, so it is refused here). With
``--recompute-cpu-offload`` the newest ``prefetch`` (2) offloaded items of a forward never
leave the GPU, so a slice of 1 or 2 layers keeps all its layer inputs there and the step from
1 to 2 layers counts a GPU-resident input as per-layer (the 0.85B model at 1M came out at
almost twice its per-layer bytes): with offload both slices need at least 3 layers.

``python -m megatron.bench.depth A.json B.json --full-layers 32 --gpu-gib 139 --host-gib 125
[--out fit.json]`` reads two ``bench_e2e`` JSON files (their first ``ok`` result each), prints
the fit and the verdict, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

from megatron.usp.backend_names import OFFLOAD_PREFETCH as DEFAULT_PREFETCH


@dataclass(frozen=True)
class DepthPoint:
    """One slice: its layers and what bench_e2e measured."""

    layers: int
    gpu_gib: float
    host_gib: float
    step_s: float


@dataclass(frozen=True)
class Affine:
    fixed: float
    per_layer: float

    def at(self, layers: int) -> float:
        return self.fixed + layers * self.per_layer


@dataclass(frozen=True)
class DepthFit:
    gpu_gib: Affine
    host_gib: Affine
    step_s: Affine


def fit_depth(a: DepthPoint, b: DepthPoint) -> DepthFit:
    """The affine fit through two slices of different depth."""
    if a.layers == b.layers:
        raise ValueError(f"two slices of different depth are needed, got {a.layers} twice")
    lo, hi = sorted((a, b), key=lambda p: p.layers)

    def line(y0: float, y1: float) -> Affine:
        per = (y1 - y0) / (hi.layers - lo.layers)
        return Affine(fixed=y0 - lo.layers * per, per_layer=per)

    return DepthFit(line(lo.gpu_gib, hi.gpu_gib), line(lo.host_gib, hi.host_gib),
                    line(lo.step_s, hi.step_s))


@dataclass(frozen=True)
class Verdict:
    layers: int
    gpu_gib: float
    host_gib: float
    step_s: float
    fits_gpu: bool
    fits_host: bool
    max_layers_gpu: Optional[int]     # deepest model that fits each capacity
    max_layers_host: Optional[int]
    fits_combined: bool               # GPU + host bytes within both capacities together: some
    #                                   other split (an offload fraction) might fit

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host


def _max_layers(line: Affine, capacity: float) -> Optional[int]:
    if line.per_layer <= 0:
        return None if line.fixed > capacity else 10**9
    n = int((capacity - line.fixed) // line.per_layer)
    return max(n, 0)


def verdict(fit: DepthFit, layers: int, gpu_gib: float, host_gib: float) -> Verdict:
    """Predicted peaks and time at ``layers``, against the capacities."""
    g, h = fit.gpu_gib.at(layers), fit.host_gib.at(layers)
    return Verdict(layers, g, h, fit.step_s.at(layers), g <= gpu_gib, h <= host_gib,
                   _max_layers(fit.gpu_gib, gpu_gib), _max_layers(fit.host_gib, host_gib),
                   g + h <= gpu_gib + host_gib)


def point_from_bench(payload: dict) -> DepthPoint:
    """The first ``ok`` result of a bench_e2e JSON file."""
    for r in payload.get("results", []):
        if r.get("status") == "ok":
            if r.get("peak_host_gib") is None or r.get("peak_mem_gib") is None:
                raise ValueError("the bench result has no GPU / host peak (an old schema?)")
            return DepthPoint(layers=r["num_layers"], gpu_gib=r["peak_mem_gib"],
                              host_gib=r["peak_host_gib"], step_s=r["iter_ms"] / 1e3)
    raise ValueError("no ok result in the bench_e2e file (the slice did not train)")


MIN_OFFLOAD_SLICE = DEFAULT_PREFETCH + 1


def _offloads_activations(payload: dict) -> bool:
    return "--recompute-cpu-offload" in payload.get("config", {}).get("extra_args", [])


def _offload_fraction(payload: dict) -> Optional[float]:
    extra = payload.get("config", {}).get("extra_args", [])
    if "--optimizer-offload-fraction" in extra:
        return float(extra[extra.index("--optimizer-offload-fraction") + 1])
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron.bench.depth", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("slices", nargs=2, help="two bench_e2e JSON files, slices of one model")
    p.add_argument("--full-layers", type=int, required=True)
    p.add_argument("--gpu-gib", type=float, required=True, help="usable GPU memory")
    p.add_argument("--host-gib", type=float, required=True, help="usable host memory")
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    payloads: List[dict] = []
    for path in ns.slices:
        with open(path) as f:
            payloads.append(json.load(f))
    for payload in payloads:
        frac = _offload_fraction(payload)
        if frac is not None and 0.0 < frac < 1.0:
            p.error(f"--optimizer-offload-fraction {frac}: a fraction in (0, 1) moves layers "
                    f"between GPU and host with the depth; slice with 0 or 1")
    try:
        points = [point_from_bench(x) for x in payloads]
        shallow = [x.layers for x in points if x.layers < MIN_OFFLOAD_SLICE]
        if shallow and any(_offloads_activations(x) for x in payloads):
            raise ValueError(
                f"slices of {shallow} layer(s) with --recompute-cpu-offload: the newest "
                f"{DEFAULT_PREFETCH} offloaded items of a forward stay on the GPU, so such a "
                f"slice is not in the per-layer regime; slice with >= {MIN_OFFLOAD_SLICE} "
                f"layers (e.g. --num-layers 3 and 4)")
        fit = fit_depth(*points)
    except ValueError as exc:
        p.error(str(exc))
    v = verdict(fit, ns.full_layers, ns.gpu_gib, ns.host_gib)
    for name, line in (("GPU GiB", fit.gpu_gib), ("host GiB", fit.host_gib),
                       ("step s", fit.step_s)):
        print(f"{name:9s} fixed {line.fixed:9.2f}  per layer {line.per_layer:8.3f}  "
              f"at {ns.full_layers} layers {line.at(ns.full_layers):9.2f}")
    print(f"full depth ({ns.full_layers} layers): GPU {v.gpu_gib:.1f} of {ns.gpu_gib} GiB "
          f"({'fits' if v.fits_gpu else 'does not fit'}), host {v.host_gib:.1f} of "
          f"{ns.host_gib} GiB ({'fits' if v.fits_host else 'does not fit'}); deepest that fits: "
          f"{v.max_layers_gpu} (GPU), {v.max_layers_host} (host); GPU + host "
          f"{v.gpu_gib + v.host_gib:.1f} of {ns.gpu_gib + ns.host_gib} GiB "
          f"({'within' if v.fits_combined else 'beyond'} both together); predicted step "
          f"{v.step_s:.1f} s")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"points": [asdict(x) for x in points], "fit": asdict(fit),
                       "verdict": dict(asdict(v), fits=v.fits)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
