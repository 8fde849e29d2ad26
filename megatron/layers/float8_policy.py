"""Which linear layers run in float8: chosen by measured cost, once per process.

Float8 halves the GEMM's operand bytes and doubles the tensor-core rate, but every cast
reads the high-precision tensor twice (amax, then the scaled cast) and the weight gradient
leaves in float32: a small GEMM (a short sequence per rank, a narrow TP shard) can lose.
So each distinct linear shape ``(tokens, in, out)`` of the model is timed once, forward and
backward, in the run's dtype and in float8 (:func:`time_linear`, cached per process), the
timings are averaged over the ranks of ``group`` so that every rank makes the same choice,
and :func:`choose_float8` (pure) keeps float8 where it is faster by a margin.
``--fp8-linears all`` skips the timing and runs every eligible shape in float8 (tests).

Two times per shape and precision. The device's: the calls queued behind a kernel that keeps
the GPU busy until the host has issued them all, timed by CUDA events, as a training step
runs them when the host is ahead. The host's: the time to issue them. Float8 costs the host
more (its casts are compiled calls: about 1 ms per forward and backward of a linear, against
0.2-0.3 ms for bf16, on an H100 host), and timing the calls back to back would charge that
to every shape whose GPU work is shorter, even though a step hides it wherever the GPU is
the slower side. So the choice is made on the device's times, then checked against the
host's: the chosen linears of a layer must cost the host no more than they cost the GPU (the
layer's attention and norms add more GPU time than host time, so a layer that passes stays
GPU-bound), else float8 is given back, shape by shape, where it saves the least GPU time per
unit of host time added.

Eligible: with real float8 GEMMs (``torch._scaled_mm``) every dimension, the tokens
included (the weight gradient's inner dimension), must be a multiple of 16; emulation
takes any shape.

The four linear layers of each transformer layer are candidates: QKV, the attention output
projection, FC1 and FC2 (with the SwiGLU inside FC2 as well); :func:`apply_float8` finds
them by their megatron-core names in modules built from the layer spec's
``float8_linears`` (:mod:`megatron.training.model.layer_specs`). With
``--fp8-output-layer`` the output layer is a fifth (kind ``output``): its GEMMs run inside
the fused output-layer loss (:mod:`megatron.training.model.fused_loss`), one chunk of tokens
at a time, the same three GEMMs as a linear layer's forward and backward, so it is timed
and chosen the same way, at the chunk's shape.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.layers import linear_wgrad
from megatron.layers.float8_gemms import Float8Gemms
from megatron.layers.float8_options import Float8Options
from megatron.layers.fused_linears import _WgradIntoMainGrad

# megatron-core's attribute name of each candidate -> the name printed at start-up
LINEAR_KINDS: Dict[str, str] = {"linear_qkv": "QKV", "linear_proj": "proj",
                                "linear_fc1": "FC1", "linear_fc2": "FC2"}
OUTPUT_KIND = "output"
SCALED_MM_ALIGNMENT = 16


@dataclass(frozen=True, order=True)
class LinearShape:
    """One GEMM shape of a linear layer: ``tokens`` rows (after any sequence-parallel
    gather), ``in_features`` -> ``out_features`` (this rank's shard of the weight)."""

    tokens: int
    in_features: int
    out_features: int

    def short(self) -> str:
        return f"{self.tokens} x {self.in_features} -> {self.out_features}"


@dataclass(frozen=True)
class Timing:
    """Seconds for one forward and backward of a linear layer, in high precision and in
    float8: on the device (``high``, ``float8``) and on the host to issue them (``*_host``;
    0: not measured, no host limit)."""

    high: float
    float8: float
    high_host: float = 0.0
    float8_host: float = 0.0


def float8_eligible(shape: LinearShape, emulate: bool) -> bool:
    """Whether ``shape`` can run in float8: always when emulated, else every dimension a
    multiple of 16 (``torch._scaled_mm``)."""
    return emulate or all(d % SCALED_MM_ALIGNMENT == 0
                          for d in (shape.tokens, shape.in_features, shape.out_features))


def choose_float8(shapes: Iterable[LinearShape], options: Float8Options,
                  timings: Optional[Mapping[LinearShape, Timing]] = None
                  ) -> Dict[LinearShape, bool]:
    """Float8 or not per shape. ``linears == "all"``: every eligible shape; ``auto``: an
    eligible shape whose float8 time is below its high-precision time by ``margin``
    (``float8 * (1 + margin) < high``); ``timings`` must then cover every eligible shape."""
    out = {}
    for shape in shapes:
        ok = float8_eligible(shape, options.emulate)
        if ok and options.linears != "all":
            t = timings[shape]
            ok = t.float8 * (1.0 + options.margin) < t.high
        out[shape] = ok
    if options.linears != "all" and timings:
        out = keep_host_ahead(out, timings)
    return out


def keep_host_ahead(chosen: Mapping[LinearShape, bool],
                    timings: Mapping[LinearShape, Timing]) -> Dict[LinearShape, bool]:
    """``chosen`` with float8 given back where the timed shapes, one call each as in one
    layer, would cost the host more than the GPU (module docstring): the float8 shape that
    saves the least device time per second of host time it adds goes first."""
    out = dict(chosen)
    timed = [s for s in out if s in timings]

    def gain_per_host(s: LinearShape) -> float:
        t = timings[s]
        return (t.high - t.float8) / max(t.float8_host - t.high_host, 1e-12)

    while True:
        device = sum(timings[s].float8 if out[s] else timings[s].high for s in timed)
        host = sum(timings[s].float8_host if out[s] else timings[s].high_host for s in timed)
        in_float8 = [s for s in timed if out[s]]
        if host <= device or not in_float8:
            return out
        out[min(in_float8, key=gain_per_host)] = False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# GPU clock cycles of the kernel that keeps the device busy while the timed calls are
# issued (~0.1 s at Hopper's clocks: far longer than issuing a few linears takes)
BUSY_CYCLES = 200_000_000


def _fwd_bwd_seconds(shape: LinearShape, gemms, device: torch.device, dtype: torch.dtype,
                     repeats: int) -> Tuple[float, float]:
    """``(device, host)`` seconds per forward+backward of one linear layer: one warm-up call
    (it compiles the float8 GEMMs), then ``repeats`` calls issued behind a kernel that keeps
    the GPU busy, so the host's issue time is measured apart and the device's (CUDA events
    around the calls) runs them back to back, as a step does when the host is ahead. On the
    CPU both are the wall time. Random operands from a private generator, so the run's
    random streams are untouched."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape.tokens, shape.in_features, device=device, dtype=dtype,
                    generator=gen).requires_grad_(True)
    weight = torch.randn(shape.out_features, shape.in_features, device=device, dtype=dtype,
                         generator=gen).requires_grad_(True)
    grad = torch.randn(shape.tokens, shape.out_features, device=device, dtype=dtype,
                       generator=gen)

    def once():
        out = linear_wgrad.linear(x, weight, None, False, False, None, fuse_wgrad=False,
                                  gemms=gemms)
        out.backward(grad)
        x.grad = weight.grad = None

    once()
    _sync(device)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            once()
        wall = (time.perf_counter() - start) / repeats
        return wall, wall
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(BUSY_CYCLES)
    first.record()
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    host = (time.perf_counter() - start) / repeats
    last.record()
    last.synchronize()
    return first.elapsed_time(last) / 1e3 / repeats, host


@functools.lru_cache(maxsize=None)
def time_linear(shape: LinearShape, options: Float8Options, device: str, dtype: torch.dtype,
                repeats: int = 5) -> Timing:
    """Forward+backward seconds of ``shape`` in ``dtype`` and in float8 on ``device``;
    measured once per process (cached)."""
    dev = torch.device(device)
    high, high_host = _fwd_bwd_seconds(shape, None, dev, dtype, repeats)
    low, low_host = _fwd_bwd_seconds(shape, Float8Gemms(options), dev, dtype, repeats)
    return Timing(high, low, high_host, low_host)


def measure(shapes: List[LinearShape], options: Float8Options, device: torch.device,
            dtype: torch.dtype, group) -> Dict[LinearShape, Timing]:
    """:func:`time_linear` of each shape, averaged over the ranks of ``group`` (one
    all-reduce of ``2 * len(shapes)`` float64 values), so that every rank chooses alike.
    Every rank of ``group`` must pass the same shapes in the same order."""
    if not shapes:
        return {}
    local = [time_linear(s, options, str(device), dtype) for s in shapes]
    values = torch.tensor([[t.high, t.float8, t.high_host, t.float8_host] for t in local],
                          dtype=torch.float64, device=device).reshape(len(shapes), 4)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(values, group=group)
        values /= dist.get_world_size(group)
    if device.type == "cuda":      # the timing's operands go back before the optimizer's state
        torch.cuda.empty_cache()
    return {s: Timing(*(float(x) for x in v)) for s, v in zip(shapes, values.tolist())}


def float8_linears(model_chunks) -> List[Tuple[str, str, torch.nn.Module]]:
    """(name, kind, module) of every candidate linear layer of ``model_chunks``: this
    project's linear layers in the QKV, projection, FC1 and FC2 slots."""
    found = []
    for chunk in model_chunks:
        for name, module in chunk.named_modules():
            kind = LINEAR_KINDS.get(name.rsplit(".", 1)[-1])
            if kind is not None and isinstance(module, _WgradIntoMainGrad):
                found.append((name, kind, module))
    return found


def _shape_of(kind: str, module, tokens: Mapping[str, int]) -> LinearShape:
    out_features, in_features = module.weight.shape
    return LinearShape(tokens[kind], in_features, out_features)


def _output_shape(model, tokens: Mapping[str, int]) -> LinearShape:
    n_in, n_out = model.output_float8_shape()
    return LinearShape(tokens[OUTPUT_KIND], n_in, n_out)


def apply_float8(model_chunks, options: Float8Options, tokens: Mapping[str, int],
                 device: torch.device, dtype: torch.dtype, group,
                 output_models: Sequence = ()) -> List[str]:
    """Choose float8 per linear shape (timing with ``linears == "auto"``) and set each
    candidate layer of ``model_chunks`` to run in float8 or not; returns the start-up
    report, one line per (kind, shape). ``tokens``: GEMM rows per micro-batch by kind
    (``QKV``, ``proj``, ``FC1``, ``FC2``, and ``output``: the loss chunk's rows);
    ``group``: the ranks that must agree (the world). ``output_models``: the models whose
    output layer is a candidate too (``options.output_layer``: models with the fused loss,
    which have ``output_float8_shape()`` and ``run_output_in_float8(gemms)``). Raises
    ValueError when the model has no candidate layer."""
    layers = float8_linears(model_chunks)
    if not layers:
        raise ValueError("--fp8-format: the model has no linear layer that can run in float8 "
                         "(the layer spec was built without float8_linears)")
    shapes = {(kind, _shape_of(kind, m, tokens)) for _, kind, m in layers}
    shapes |= {(OUTPUT_KIND, _output_shape(m, tokens)) for m in output_models}
    distinct = sorted({s for _, s in shapes})
    timings = None
    if options.linears == "auto":
        timed = [s for s in distinct if float8_eligible(s, options.emulate)]
        timings = measure(timed, options, device, dtype, group)
    chosen = choose_float8(distinct, options, timings)
    gemms = Float8Gemms(options)
    for _, kind, module in layers:
        module.run_in_float8(gemms if chosen[_shape_of(kind, module, tokens)] else None)
    for model in output_models:
        model.run_output_in_float8(gemms if chosen[_output_shape(model, tokens)] else None)
    order = list(LINEAR_KINDS.values()) + [OUTPUT_KIND]
    return report_lines(sorted(shapes, key=lambda ks: (order.index(ks[0]), ks[1])),
                        chosen, timings, options)


def report_lines(shapes: List[Tuple[str, LinearShape]], chosen: Mapping[LinearShape, bool],
                 timings: Optional[Mapping[LinearShape, Timing]],
                 options: Float8Options) -> List[str]:
    """``fp8 (...): QKV 4096 x 1024 -> 3072: float8 (high 1.200 ms, float8 0.810 ms;
    host 0.210 / 1.050 ms)`` lines: device times, then the host's issue times."""
    lines = [f"fp8 ({options.short()}, --fp8-linears {options.linears}): "
             f"{sum(chosen[s] for _, s in shapes)} of {len(shapes)} linear shapes in float8"]
    for kind, shape in shapes:
        what = "float8" if chosen[shape] else "high precision"
        why = ""
        if timings is not None and shape in timings:
            t = timings[shape]
            why = (f" (high {t.high * 1e3:.3f} ms, float8 {t.float8 * 1e3:.3f} ms; host "
                   f"{t.high_host * 1e3:.3f} / {t.float8_host * 1e3:.3f} ms)")
        elif not float8_eligible(shape, options.emulate):
            why = f" (a dimension is not a multiple of {SCALED_MM_ALIGNMENT})"
        lines.append(f"  {kind:5s} {shape.short()}: {what}{why}")
    return lines


__all__ = ["LINEAR_KINDS", "OUTPUT_KIND", "LinearShape", "Timing", "float8_eligible",
           "choose_float8", "keep_host_ahead", "time_linear", "measure", "float8_linears",
           "apply_float8", "report_lines"]
