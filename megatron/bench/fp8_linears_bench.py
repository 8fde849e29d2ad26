"""``tools/bench_fp8_linears.py``: float8 training of each linear layer against bf16, beside
torchao's own float8 linear.

For each model preset (:data:`megatron.bench.models.MODELS`), token count ``N`` and float8
recipe it times, forward and backward together (median of CUDA-event timed repeats after a
warm-up, :func:`megatron.bench.timing.median_ms_alone`), the four linear layers of a
transformer layer on the model's shapes (no tensor parallelism, batch 1):

* ``QKV``: ``[N, h] -> [N, (a + 2g) d]``; ``proj``: ``[N, a d] -> [N, h]``;
* ``FC1``: ``[N, h] -> [N, 2F]`` (SwiGLU; ``F`` without); ``FC2``: ``[N, F] -> [N, h]``
  (a plain linear: the SwiGLU that ``--recompute-modules swiglu`` runs inside FC2 is left out).

Each in four implementations, on the same random bf16 operands (the input and the weight
require gradients; the output gradient is fixed):

* ``bf16``: :func:`megatron.layers.linear_wgrad.linear` with bf16 GEMMs;
* ``usp``: the same function with :class:`megatron.layers.float8_gemms.Float8Gemms` (what
  training runs with ``--fp8-format``);
* ``torchao``: a bias-free ``torch.nn.Linear`` converted by torchao's
  ``convert_to_float8_training`` with the project's ``Float8LinearConfig``
  (:func:`megatron.layers.float8_gemms.float8_linear_config`), then ``torch.compile``-d;
* ``torchao-eager``: the same module, not compiled.

``--recipes`` and ``--fp8-format`` mean what ``--fp8-recipe`` and ``--fp8-format`` mean to
``pretrain_gpt.py`` (:mod:`megatron.layers.float8_options`). The bf16 time of a shape is
measured once and listed under each recipe. On the CPU float8 runs only emulated (``usp``
with torchao's emulation); the torchao rows are then ``skipped``, with the reason, as is any
float8 row the device cannot run (compute capability below 8.9, torchao missing, a
dimension not a multiple of 16). ``torch._dynamo`` is reset before every compiled case, so
each compiles its own graphs in its warm-up and none falls back to eager after too many
recompilations.

Both compiled paths, torchao's (``convert_to_float8_training``) and training's
(:func:`megatron.layers.float8_gemms.float8_operands`), switch on torchao's patch of inductor's
Triton min/max code generation (a workaround for a Triton float8 store miscompile) before
they compile, so every compiled case is generated alike.

Per row: ``fwd_bwd_ms``, ``ratio_vs_bf16`` (bf16 ms over the row's ms: above 1 is faster
than bf16) and ``tflops`` (``6 N in out`` over the time). ``--profile`` adds, per (shape,
impl), the 8 CUDA kernels of most device time over a few more forward+backward calls
(``torch.profiler``; per call: launches, milliseconds, share of the device time) and the
device time per call beside the timed wall time (the difference is time the GPU waited on
the host); on the CPU the same for the CPU ops by self time.

Output: a line per row (and its kernels), JSON (``--out``: :mod:`megatron.bench.report`
metadata, the config, the rows; rewritten after each (model, tokens, recipe) group) and a
markdown table (``--markdown``).
"""

from __future__ import annotations

import argparse
import collections
import sys
from dataclasses import asdict, dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron.bench import report, timing
from megatron.bench.cli import BenchConfigError, parse_seq_lens, seq_label
from megatron.bench.models import MODELS
from megatron.layers import linear_wgrad
from megatron.layers.float8_options import (
    FP8_FORMATS,
    Float8Options,
    device_problem,
    recipe_problem,
    torchao_importable,
)
from megatron.layers.float8_policy import (
    SCALED_MM_ALIGNMENT,
    LinearShape,
    float8_eligible,
)
from megatron.shapes import ModelShape

IMPLS: Tuple[str, ...] = ("bf16", "usp", "torchao", "torchao-eager")
FLOAT8_IMPLS: Tuple[str, ...] = ("usp", "torchao", "torchao-eager")
DEVICES: Tuple[str, ...] = ("cuda", "cpu")
PROFILE_CALLS = 3
PROFILE_TOP = 8


@dataclass
class Fp8BenchConfig:
    """The run's choices (the flags in brackets); ``impls`` None: all that can run."""

    models: List[str]                           # --model
    tokens: List[int]                           # --tokens
    recipes: List[str]                          # --recipes
    fp8_format: str = "hybrid"                  # --fp8-format
    impls: Optional[List[str]] = None           # --impls
    iters: int = 20                             # --iters
    warmup: int = 5                             # --warmup
    device: str = "cuda"                        # --device
    profile: bool = False                       # --profile
    out: Optional[str] = None                   # --out
    markdown: Optional[str] = None              # --markdown


@dataclass
class Row:
    """One (model, tokens, recipe, shape kind, impl) timing."""

    model: str
    tokens: int
    recipe: str
    fp8_format: str
    kind: str
    in_features: int
    out_features: int
    impl: str
    status: str = "ok"                          # ok, skipped, oom or error
    note: Optional[str] = None
    fwd_bwd_ms: Optional[float] = None
    ratio_vs_bf16: Optional[float] = None
    tflops: Optional[float] = None
    profile_device_ms: Optional[float] = None   # --profile: device (CPU: op) time per call
    kernels: Optional[List[Dict]] = None        # --profile: the top kernels


# --------------------------------------------------------------------------- shapes
def linear_shapes(shape: ModelShape, tokens: int) -> List[Tuple[str, LinearShape]]:
    """(kind, shape) of QKV, proj, FC1 and FC2 of one layer of ``shape`` at ``tokens`` rows."""
    h, a, g, d, f = (shape.hidden_size, shape.num_attention_heads, shape.num_query_groups,
                     shape.head_dim, shape.ffn_hidden_size)
    return [("QKV", LinearShape(tokens, h, (a + 2 * g) * d)),
            ("proj", LinearShape(tokens, a * d, h)),
            ("FC1", LinearShape(tokens, h, 2 * f if shape.swiglu else f)),
            ("FC2", LinearShape(tokens, f, h))]


def linear_tflops(shape: LinearShape, ms: float) -> float:
    """TFLOP/s of a forward+backward of ``shape`` (three GEMMs: ``6 N in out`` FLOPs)."""
    return 6.0 * shape.tokens * shape.in_features * shape.out_features / (ms / 1e3) / 1e12


# --------------------------------------------------------------------------- flags
def _split(text: str) -> List[str]:
    out: List[str] = []
    for item in (t.strip() for t in text.split(",")):
        if item and item not in out:
            out.append(item)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_fp8_linears.py",
        description="Float8 training of each linear layer of a model (QKV, proj, FC1, FC2) "
                    "against bf16: this project's float8 GEMMs beside torchao's float8 "
                    "linear, compiled and eager, forward and backward.")
    p.add_argument("--model", default="llama-0.85b",
                   help=f"comma-separated model presets, of {', '.join(MODELS)}")
    p.add_argument("--tokens", default="8k,32k",
                   help="comma-separated GEMM rows (tokens), e.g. 8k,32k or 4096")
    p.add_argument("--recipes", default="tensorwise",
                   help="comma-separated float8 recipes (pretrain_gpt.py's --fp8-recipe): "
                        "tensorwise, rowwise (rowwise needs --fp8-format e4m3)")
    p.add_argument("--fp8-format", default="hybrid", choices=FP8_FORMATS,
                   help="hybrid (e4m3 forward, e5m2 gradients) or e4m3 (every operand)")
    p.add_argument("--impls", default=None,
                   help=f"comma-separated implementations, of {', '.join(IMPLS)} (default: "
                        f"all that can run on the device)")
    p.add_argument("--iters", type=int, default=20, help="timed calls (median reported)")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed calls first (torch.compile compiles in these)")
    p.add_argument("--device", default="cuda", choices=DEVICES,
                   help="cuda, or cpu (float8 emulated; torchao rows skipped)")
    p.add_argument("--profile", action="store_true",
                   help="add the top 8 CUDA kernels by device time per (shape, impl)")
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--markdown", default=None, help="markdown table file")
    return p


def config_from_args(ns: argparse.Namespace) -> Fp8BenchConfig:
    """The flags as a config (lists parsed; nothing checked yet: :func:`check_config`)."""
    return Fp8BenchConfig(
        models=_split(ns.model), tokens=parse_seq_lens(ns.tokens, "--tokens"),
        recipes=_split(ns.recipes), fp8_format=ns.fp8_format,
        impls=None if ns.impls is None else _split(ns.impls), iters=ns.iters,
        warmup=ns.warmup, device=ns.device, profile=ns.profile, out=ns.out,
        markdown=ns.markdown)


def _refuse_unknown(flag: str, given: Sequence[str], allowed, example: str) -> None:
    """One line naming ``flag``'s unknown (or missing) values, the allowed ones and an
    example."""
    bad = [x for x in given if x not in allowed]
    if bad or not given:
        raise BenchConfigError(f"{flag} {','.join(bad) or repr('')}: choose from "
                               f"{', '.join(allowed)}, e.g. {flag} {example}")


def check_config(cfg: Fp8BenchConfig, cuda_available: bool) -> None:
    """Refuse bad flags before anything runs (:class:`BenchConfigError`, one line naming
    the flag and a valid value). Asks nothing of the device but whether CUDA is there."""
    _refuse_unknown("--model", cfg.models, MODELS, "llama-0.85b")
    if not cfg.tokens:
        raise BenchConfigError("--tokens is empty; try --tokens 8k,32k")
    if cfg.impls is not None:
        _refuse_unknown("--impls", cfg.impls, IMPLS, "bf16,usp")
    if not cfg.recipes:
        raise BenchConfigError("--recipes is empty; try --recipes tensorwise")
    for recipe in cfg.recipes:
        problem = recipe_problem(cfg.fp8_format, recipe)
        if problem:
            # the project's own check, worded for pretrain_gpt.py: this tool's flag is --recipes
            raise BenchConfigError(problem.replace("--fp8-recipe", "--recipes"))
    if cfg.iters < 1 or cfg.warmup < 0:
        raise BenchConfigError(f"--iters {cfg.iters} must be >= 1 and --warmup {cfg.warmup} "
                               f">= 0; try --iters 20 --warmup 5")
    if cfg.device == "cuda" and not cuda_available:
        raise BenchConfigError("--device cuda: no CUDA GPU is visible; use --device cpu "
                               "(float8 emulated, torchao skipped)")
    float8 = cfg.impls is None or any(i in FLOAT8_IMPLS for i in cfg.impls)
    if cfg.device == "cuda" and float8:
        odd = [t for t in cfg.tokens if t % SCALED_MM_ALIGNMENT]
        if odd:
            fix = -(-odd[0] // SCALED_MM_ALIGNMENT) * SCALED_MM_ALIGNMENT
            raise BenchConfigError(
                f"--tokens {odd[0]}: real float8 GEMMs (torch._scaled_mm) need a multiple of "
                f"{SCALED_MM_ALIGNMENT} tokens; try --tokens {fix}")


# --------------------------------------------------------------------------- availability
def _capability(device: torch.device) -> Optional[Tuple[int, int]]:
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def skip_reason(impl: str, device: torch.device, capability: Optional[Tuple[int, int]],
                torchao_ok: bool, shape: Optional[LinearShape] = None) -> Optional[str]:
    """Why ``impl`` cannot run on ``device`` (for ``shape``, when given), or None."""
    if impl == "bf16":
        return None
    if impl != "usp" and device.type != "cuda":
        return "torchao's float8 linear is timed on CUDA only (the CPU has only its emulation)"
    emulate = device.type != "cuda"
    problem = device_problem(device.type, capability, emulate, torchao_ok)
    if problem:
        return problem
    if shape is not None and not float8_eligible(shape, emulate):
        return (f"a dimension of {shape.short()} is not a multiple of {SCALED_MM_ALIGNMENT} "
                f"(torch._scaled_mm)")
    return None


def resolve_impls(cfg: Fp8BenchConfig, device: torch.device,
                  capability: Optional[Tuple[int, int]], torchao_ok: bool) -> List[str]:
    """``--impls`` as given, or every implementation that can run on ``device``."""
    if cfg.impls is not None:
        return list(cfg.impls)
    return [i for i in IMPLS if skip_reason(i, device, capability, torchao_ok) is None]


# --------------------------------------------------------------------------- the cases
@dataclass
class _Operands:
    x: torch.Tensor          # [N, in], requires grad
    weight: torch.Tensor     # [out, in], requires grad
    grad: torch.Tensor       # [N, out]


def _operands(shape: LinearShape, device: torch.device) -> _Operands:
    """Random bf16 operands from a private generator (seed 0: every impl gets the same)."""
    gen = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16
    x = torch.randn(shape.tokens, shape.in_features, device=device, dtype=bf16, generator=gen)
    w = torch.randn(shape.out_features, shape.in_features, device=device, dtype=bf16,
                    generator=gen) * shape.in_features ** -0.5
    g = torch.randn(shape.tokens, shape.out_features, device=device, dtype=bf16, generator=gen)
    return _Operands(x.requires_grad_(True), w.requires_grad_(True), g)


def _linear_step(ops: _Operands, gemms) -> Callable[[], None]:
    """Forward+backward of :func:`megatron.layers.linear_wgrad.linear` (``gemms`` None: bf16)."""
    def step():
        ops.x.grad = ops.weight.grad = None
        out = linear_wgrad.linear(ops.x, ops.weight, None, False, False, None,
                                  fuse_wgrad=False, gemms=gemms)
        out.backward(ops.grad)
    return step


def _torchao_step(ops: _Operands, options: Float8Options, compiled: bool) -> Callable[[], None]:
    """Forward+backward of torchao's ``Float8Linear`` of a bias-free ``nn.Linear`` holding
    ``ops.weight``'s values (compiled or eager)."""
    from torchao.float8 import convert_to_float8_training  # optional dependency

    from megatron.layers.float8_gemms import float8_linear_config

    out_features, in_features = ops.weight.shape
    linear = torch.nn.Linear(in_features, out_features, bias=False, device=ops.x.device,
                             dtype=ops.x.dtype)
    with torch.no_grad():
        linear.weight.copy_(ops.weight)
    module = convert_to_float8_training(linear, config=float8_linear_config(options))
    weight = module.weight
    run = torch.compile(module) if compiled else module

    def step():
        ops.x.grad = weight.grad = None
        run(ops.x).backward(ops.grad)
    return step


def make_step(impl: str, ops: _Operands, options: Float8Options) -> Callable[[], None]:
    """The timed forward+backward of ``impl`` on ``ops``."""
    if impl == "bf16":
        return _linear_step(ops, None)
    if impl == "usp":
        from megatron.layers.float8_gemms import Float8Gemms

        return _linear_step(ops, Float8Gemms(options))
    return _torchao_step(ops, options, compiled=impl == "torchao")


def _compiles(impl: str, device: torch.device) -> bool:
    """Whether ``impl`` runs ``torch.compile``-d code on ``device`` (usp: its casts, CUDA)."""
    return impl == "torchao" or (impl == "usp" and device.type == "cuda")


# --------------------------------------------------------------------------- profile
def profile_step(step: Callable[[], None], device: torch.device, calls: int = PROFILE_CALLS,
                 top: int = PROFILE_TOP) -> Tuple[float, List[Dict]]:
    """(device ms per call, the ``top`` kernels by device time) over ``calls`` calls of
    ``step`` under ``torch.profiler``: CUDA kernels on CUDA, CPU ops by self time on the CPU.
    Each kernel: ``name``, ``calls`` (launches per call of ``step``), ``ms`` (per call of
    ``step``) and ``share`` (of the device time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            step()
        timing.synchronize(device)
    total_us: Dict[str, float] = collections.defaultdict(float)
    count: Dict[str, int] = collections.defaultdict(int)
    if cuda:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                total_us[e.name] += e.time_range.elapsed_us()
                count[e.name] += 1
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0:
                total_us[e.key] += e.self_cpu_time_total
                count[e.key] += e.count
    whole = sum(total_us.values())
    ranked = sorted(total_us, key=lambda k: -total_us[k])[:top]
    kernels = [{"name": k, "calls": count[k] / calls, "ms": total_us[k] / calls / 1e3,
                "share": total_us[k] / whole if whole else None} for k in ranked]
    return whole / calls / 1e3, kernels


# --------------------------------------------------------------------------- the sweep
def _measure(row: Row, impl: str, shape: LinearShape, options: Float8Options,
             cfg: Fp8BenchConfig, device: torch.device) -> None:
    """Time (and with ``--profile`` profile) ``impl`` on ``shape`` into ``row``; its
    operands and compiled code go when it returns."""
    if _compiles(impl, device):
        import torch._dynamo  # the compiler: only for the compiled cases

        torch._dynamo.reset()
    step = make_step(impl, _operands(shape, device), options)
    row.fwd_bwd_ms = timing.median_ms_alone(step, warmup=cfg.warmup, iters=cfg.iters,
                                            device=device)
    row.tflops = linear_tflops(shape, row.fwd_bwd_ms)
    if cfg.profile:
        row.profile_device_ms, row.kernels = profile_step(step, device)


def run_case(row: Row, impl: str, shape: LinearShape, options: Float8Options,
             cfg: Fp8BenchConfig, device: torch.device) -> Row:
    """:func:`_measure` into ``row``; a case that fails (out of memory, a compile error) is
    reported in the row, not raised."""
    try:
        _measure(row, impl, shape, options, cfg, device)
    except Exception as exc:  # noqa: BLE001 - a case that cannot run is reported, not fatal
        lines = str(exc).strip().splitlines()
        row.status = "oom" if timing.is_out_of_memory(exc) else "error"
        row.note = f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"
        row.fwd_bwd_ms = row.tflops = row.profile_device_ms = row.kernels = None
    finally:
        timing.free_memory(device)
    return row


def run_group(model: str, tokens: int, recipe: str, cfg: Fp8BenchConfig, impls: Sequence[str],
              device: torch.device, capability: Optional[Tuple[int, int]], torchao_ok: bool,
              bf16_cache: Dict[Tuple[str, LinearShape], Row],
              log: Callable[[Row], None]) -> List[Row]:
    """Every (shape kind, impl) row of one (model, tokens, recipe)."""
    options = Float8Options(format=cfg.fp8_format, recipe=recipe, linears="all",
                            emulate=device.type != "cuda")
    rows: List[Row] = []
    for kind, shape in linear_shapes(MODELS[model].shape, tokens):
        base = Row(model, tokens, recipe, cfg.fp8_format, kind, shape.in_features,
                   shape.out_features, "")
        group: List[Row] = []
        for impl in impls:
            row = replace(base, impl=impl)
            reason = skip_reason(impl, device, capability, torchao_ok, shape)
            if reason:
                row.status, row.note = "skipped", reason
            elif impl == "bf16" and (model, shape) in bf16_cache:
                row = replace(bf16_cache[(model, shape)], recipe=recipe,
                              fp8_format=cfg.fp8_format, kind=kind)
            else:
                row = run_case(row, impl, shape, options, cfg, device)
                if impl == "bf16" and row.status == "ok":
                    bf16_cache[(model, shape)] = row
            group.append(row)
        bf16 = next((r for r in group if r.impl == "bf16" and r.status == "ok"), None)
        for row in group:
            if bf16 is not None and row.status == "ok":
                row.ratio_vs_bf16 = bf16.fwd_bwd_ms / row.fwd_bwd_ms
            log(row)
        rows += group
    return rows


# --------------------------------------------------------------------------- output
def row_line(r: Row) -> str:
    """One printed line of a row."""
    head = (f"{r.model:12} {seq_label(r.tokens):>6} {r.recipe:10} {r.kind:4} "
            f"{r.in_features:>6}->{r.out_features:<6} {r.impl:13}")
    if r.status != "ok":
        return f"{head} {r.status}: {r.note}"
    ratio = "" if r.ratio_vs_bf16 is None else f" {r.ratio_vs_bf16:6.2f}x bf16"
    dev = ("" if r.profile_device_ms is None else
           f" (profiled: {r.profile_device_ms:.3f} ms of kernels per call)")
    return f"{head} {r.fwd_bwd_ms:9.3f} ms{ratio} {r.tflops:7.1f} TFLOP/s{dev}"


def kernel_lines(r: Row) -> List[str]:
    """The profiled kernels of a row, one indented line each."""
    lines = []
    for k in r.kernels or []:
        share = "" if k["share"] is None else f" {100 * k['share']:5.1f}%"
        lines.append(f"    {k['ms']:8.3f} ms{share} x{k['calls']:<4g} {k['name'][:140]}")
    return lines


def results_markdown(meta: dict, cfg: Fp8BenchConfig, rows: Sequence[Row]) -> str:
    """The table (one row per result, grouped by model, tokens, recipe and shape) and, with
    ``--profile``, the kernels of each (shape, impl)."""
    title = (f"Float8 linears against bf16, forward+backward, {cfg.fp8_format} format; "
             f"median of {cfg.iters} after {cfg.warmup} warm-up; ratio = bf16 ms / ms "
             f"(above 1: faster than bf16); TFLOP/s = 6 N in out / time\n\n")
    headers = ["model", "tokens", "recipe", "linear", "in -> out", "impl", "fwd+bwd ms",
               "vs bf16", "TFLOP/s", "note"]
    table = []
    for r in rows:
        ok = r.status == "ok"
        table.append([
            r.model, seq_label(r.tokens), r.recipe, r.kind, f"{r.in_features} -> "
            f"{r.out_features}", r.impl, report.fmt(r.fwd_bwd_ms, 3) if ok else r.status,
            "n/a" if r.ratio_vs_bf16 is None else f"{r.ratio_vs_bf16:.2f}x",
            report.fmt(r.tflops), (r.note or "").replace("|", "/")])
    text = title + report.metadata_markdown(meta) + "\n" + report.markdown_table(headers, table)
    profiled = [r for r in rows if r.kernels]
    if profiled:
        what = ("CUDA kernels by device time" if cfg.device == "cuda" else
                "CPU ops by self time (no CUDA)")
        text += (f"\nTop {PROFILE_TOP} {what} per (shape, impl), per forward+backward "
                 f"(mean of {PROFILE_CALLS} profiled calls)\n\n")
        kheaders = ["model", "tokens", "recipe", "linear", "impl", "kernel", "launches", "ms",
                    "share"]
        krows = [[r.model, seq_label(r.tokens), r.recipe, r.kind, r.impl,
                  f"`{k['name'][:100]}`".replace("|", "/"), f"{k['calls']:g}",
                  report.fmt(k["ms"], 3), report.fmt(k["share"], pct=True)]
                 for r in profiled for k in r.kernels]
        text += report.markdown_table(kheaders, krows)
    return text


def run(cfg: Fp8BenchConfig, argv: Sequence[str]) -> dict:
    """Run every group, print each row, write the outputs; returns the JSON payload."""
    if cfg.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    capability, torchao_ok = _capability(device), torchao_importable()
    impls = resolve_impls(cfg, device, capability, torchao_ok)
    meta = report.run_metadata(argv, device, 1)
    config = dict(asdict(cfg), impls=impls, dtype="bfloat16", emulate=device.type != "cuda",
                  torchao_version=report.package_version("torchao"),
                  shapes={m: MODELS[m].record() for m in cfg.models})
    payload = {"tool": "bench_fp8_linears", "schema_version": report.SCHEMA_VERSION,
               "metadata": meta, "config": config, "results": []}
    cc = "" if capability is None else f" (compute capability {capability[0]}.{capability[1]})"
    print(f"[fp8-linears] {device.type}{cc}; "
          f"impls {', '.join(impls)}; {cfg.fp8_format}; recipes {', '.join(cfg.recipes)}"
          f"{'; emulated float8' if device.type != 'cuda' else ''}", flush=True)

    def log(r: Row) -> None:
        print(row_line(r), flush=True)
        for line in kernel_lines(r):
            print(line, flush=True)

    rows: List[Row] = []
    bf16_cache: Dict[Tuple[str, LinearShape], Row] = {}
    for model in cfg.models:
        for tokens in cfg.tokens:
            for recipe in cfg.recipes:
                rows += run_group(model, tokens, recipe, cfg, impls, device, capability,
                                  torchao_ok, bf16_cache, log)
                payload["results"] = [asdict(r) for r in rows]
                if cfg.out:
                    report.write_json(cfg.out, payload)
                if cfg.markdown:
                    report.write_text(cfg.markdown, results_markdown(meta, cfg, rows))
    return payload


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``tools/bench_fp8_linears.py``: parse and check the flags, run, write."""
    parser = build_parser()
    args_list = list(sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(args_list)
    try:
        cfg = config_from_args(ns)
        check_config(cfg, torch.cuda.is_available())
    except BenchConfigError as exc:
        parser.error(str(exc))
    run(cfg, ["tools/bench_fp8_linears.py"] + args_list)
    return 0


__all__ = ["IMPLS", "Fp8BenchConfig", "Row", "linear_shapes", "linear_tflops", "check_config",
           "skip_reason", "resolve_impls", "profile_step", "run", "main"]

if __name__ == "__main__":
    sys.exit(main())
