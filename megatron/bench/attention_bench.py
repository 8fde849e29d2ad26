"""Attention benchmark: USP (U x R splits) against the single-GPU kernel and PyTorch's native CP.

Run one process per GPU (``torchrun --nproc-per-node N tools/bench_attention.py ...``; NCCL on
CUDA, gloo on the CPU). For every sequence length ``S``, on the same inputs (global q, k, v and
the output gradient, drawn from one seed, identical on every rank), it times, in this order:

1. ``single-gpu-kernel``: the local kernel USP uses (``megatron.usp.kernels.get_kernel``; on
   an H200 PyTorch's cuDNN attention op) on the whole sequence, on rank 0's GPU while the
   other ranks wait; forward and forward+backward called directly on [b, h, S, d]. Skipped
   (``oom``) when it does not fit. This is the denominator of the parallel efficiency.
2. ``sdpa``: plain ``F.scaled_dot_product_attention`` with autograd on the whole sequence, the
   cuDNN backend forced on CUDA (the anchors' number), rank 0 only. A sanity anchor.
3. ``usp``: :func:`megatron.usp.attention.usp_attention` for each U x R split (the requested
   ones plus pure Ulysses ``N x 1`` and pure ring ``1 x N``), all ranks, on megatron's token order
   [S/N, b, h, d] (the tokens of :func:`megatron.usp.token_order.shard_for_cp_rank`).
4. ``native-cp``: PyTorch's ``context_parallel`` (ring, load-balanced) for each rotate method,
   all ranks, on [b, h, S/N, d] (:mod:`megatron.bench.native_cp`; CUDA only).

Per case: median milliseconds of the forward and of forward+backward (CUDA events on CUDA,
``perf_counter`` on the CPU, a barrier before each iteration, the slowest rank's time),
TFLOP/s per GPU (:mod:`megatron.bench.flops`: forward ``4*b*h*S^2*d`` (x1/2 causal),
forward+backward 3.5x that, divided over the case's GPUs), parallel efficiency (per-GPU
forward+backward rate over the single-GPU kernel's rate at the same S) and peak memory per GPU
(``torch.cuda.max_memory_allocated`` over the case, reset at its start, max over ranks; the
case's own inputs, outputs, gradients and workspace: the full-sequence inputs are released
before the window opens). USP cases also get their speed-up over the best native-CP variant,
and peak-memory ratios against it and against pure Ulysses.

Forward timings run with autograd on (a training forward: what a layer's forward costs);
forward+backward uses ``torch.autograd.grad`` with a fixed output gradient.

Packed documents (``--docs fixed:2k,fixed:8k,lognormal``): document-masked USP attention per
split, or with ``--doc-kernels`` the single-GPU document kernels, in useful TFLOP/s with the
per-rank work spread and the ring bytes skipped (:mod:`megatron.bench.document_bench`);
``--doc-stream N`` times those kernels on N distinct samples each, as training meets them
(:mod:`megatron.bench.document_stream`).

Sliding window (``--window W``, causal only): the single-GPU case is the window kernel's own
call on the whole sequence (:mod:`megatron.usp.window_kernel`: on CUDA bf16/fp16 PyTorch's
flash op with ``window_size_left=W``, elsewhere its masked product), USP runs each split with
``window=W``, and the FLOPs count the pairs inside the window (``4*b*h*d`` per pair forward,
:func:`megatron.shapes.window_pairs`), so a USP case's efficiency is its share of the window
kernel's rate. SDPA and native CP take no window: their cases say ``skipped``.

Output: a progress line per case on rank 0, JSON (``--out``, rewritten after each sequence
length so an interrupted sweep keeps what it measured) and a markdown table (``--markdown``).
``--check`` compares each distributed method's output at the first length with the
single-GPU kernel's (relative L2 error, printed and stored, never asserted).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import sys
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.bench import document_bench, document_stream, native_cp, report, timing
from megatron.bench.cli import (
    BenchConfigError,
    parse_overlap_chunks,
    parse_seq_lens,
    parse_splits,
    seq_label,
)
from megatron.bench.document_bench import parse_doc_mixes
from megatron.bench.flops import (
    attention_fwd_bwd_flops,
    attention_fwd_flops,
    tflops_per_gpu,
    window_attention_fwd_bwd_flops,
    window_attention_fwd_flops,
)
from megatron.shapes import attention_shape
from megatron.training.observe import profiling
from megatron.usp.attention import resolve_overlap_chunks, usp_attention
from megatron.usp.kernels import AttentionBackendUnavailable, get_kernel
from megatron.usp.parallel_dims import ParallelDims, USPConfigError
from megatron.usp.token_order import check_seq_divisible, shard_for_cp_rank, unshard_from_cp_ranks
from megatron.usp.window_kernel import flash_window_usable, window_backward, window_forward

Tensor = torch.Tensor

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PEERS = ("native-cp",)
PROGRESS_PREFIX = "[bench_attention]"


# --------------------------------------------------------------------------- configuration
@dataclass
class AttentionBenchConfig:
    """Everything one sweep needs (the command-line flags, parsed)."""

    seq_lens: List[int]
    heads: int = 32
    kv_heads: int = 32
    head_dim: int = 128
    batch: int = 1
    dtype: str = "bf16"
    splits: List[Tuple[int, int]] = field(default_factory=list)
    causal: bool = True
    iters: int = 5
    warmup: int = 2
    peers: List[str] = field(default_factory=lambda: ["native-cp"])
    native_cp_rotate: List[str] = field(default_factory=lambda: ["allgather", "alltoall"])
    native_cp_backend: str = "cudnn"
    backend: str = "auto"
    single_gpu: bool = True
    sdpa_anchor: bool = True
    check: bool = False
    seed: int = 1234
    out: Optional[str] = None
    markdown: Optional[str] = None
    overlap_chunks: List[Optional[int]] = field(default_factory=lambda: [None])
    profile_dir: Optional[str] = None
    docs: List[str] = field(default_factory=list)
    doc_kernels: List[str] = field(default_factory=list)
    doc_kernels_split: Tuple[int, int] = (1, 1)
    doc_stream: int = 0
    doc_layers: int = 1
    document_kernel: str = "auto"
    chunk_assignment: str = "auto"
    balance_report: bool = False
    balance_samples: int = 16
    window: Optional[int] = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["splits"] = [f"{u}x{r}" for u, r in self.splits]
        d["overlap_chunks"] = [chunks_label(g) for g in self.overlap_chunks]
        return d


def chunks_label(requested: Optional[int]) -> str:
    """``auto`` for None, else the number (``--overlap-chunks`` values)."""
    return "auto" if requested is None else str(requested)


def usp_label(u: int, r: int, tag: str = "") -> str:
    """``USP U2xR1 (pure Ulysses)``, ``USP U1xR2 (pure ring)``, ``USP U2xR2``; one process
    (U1xR1) is neither."""
    kind = ""
    if u > 1 and r == 1:
        kind = " (pure Ulysses)"
    elif u == 1 and r > 1:
        kind = " (pure ring)"
    return f"USP U{u}xR{r}{tag}{kind}"


def all_splits(requested: Sequence[Tuple[int, int]], world: int) -> List[Tuple[int, int]]:
    """The requested splits plus pure Ulysses (N x 1) and pure ring (1 x N), no repeats."""
    out: List[Tuple[int, int]] = []
    for s in list(requested) + [(world, 1), (1, world)]:
        if s not in out:
            out.append(s)
    return out


def validate_config(cfg: AttentionBenchConfig, world: int) -> None:
    """Check every flag against the world size before any case runs."""
    if cfg.dtype not in DTYPES:
        raise BenchConfigError(f"--dtype {cfg.dtype}: choose one of {list(DTYPES)}")
    if cfg.heads < 1 or cfg.kv_heads < 1 or cfg.heads % cfg.kv_heads:
        raise BenchConfigError(
            f"--kv-heads {cfg.kv_heads} must divide --heads {cfg.heads}; try --kv-heads "
            f"{cfg.heads}")
    if cfg.iters < 1 or cfg.warmup < 0:
        raise BenchConfigError(f"--iters {cfg.iters} must be >= 1 and --warmup {cfg.warmup} "
                               f">= 0; try --iters 5 --warmup 2")
    if cfg.batch < 1 or cfg.head_dim < 1:
        raise BenchConfigError(f"--batch-size {cfg.batch} and --head-dim {cfg.head_dim} must "
                               f"be >= 1; try --batch-size 1 --head-dim 128")
    try:
        get_kernel(cfg.backend)
    except (ValueError, AttentionBackendUnavailable) as exc:
        raise BenchConfigError(str(exc)) from None
    if not cfg.seq_lens:
        raise BenchConfigError("--seq-lens is empty; try --seq-lens 32k,64k,128k,256k")
    for s in cfg.seq_lens:
        try:
            check_seq_divisible(s, world, "--seq-lens")
        except ValueError as exc:
            raise BenchConfigError(str(exc)) from None
    for u, r in all_splits(cfg.splits, world):
        try:
            ParallelDims(world, ulysses=u, ring=r).check(
                attention_shape(cfg.heads, cfg.kv_heads, cfg.head_dim))
        except USPConfigError as exc:
            raise BenchConfigError(
                f"--splits {u}x{r} does not fit {world} processes with --heads {cfg.heads} "
                f"--kv-heads {cfg.kv_heads}: {exc}; valid splits multiply to {world}, e.g. "
                f"{world}x1,1x{world}") from None
    if cfg.window is not None:
        _check_window(cfg)
    document_stream.check_stream_config(cfg)
    unknown = [p for p in cfg.peers if p not in PEERS]
    if unknown:
        raise BenchConfigError(f"--peers {','.join(unknown)}: known peers are {list(PEERS)} "
                               f"(or none)")
    bad = [m for m in cfg.native_cp_rotate if m not in native_cp.ROTATE_METHODS]
    if bad or not cfg.native_cp_rotate:
        raise BenchConfigError(f"--native-cp-rotate {','.join(cfg.native_cp_rotate)}: choose "
                               f"from {list(native_cp.ROTATE_METHODS)}")


def _check_window(cfg: AttentionBenchConfig) -> None:
    """``--window W``: at least one key, causal attention, and no packed documents."""
    if cfg.window < 1:
        raise BenchConfigError(f"--window {cfg.window}: a sliding window is a number of keys "
                               f">= 1; try --window 4096")
    if not cfg.causal:
        raise BenchConfigError(f"--window {cfg.window} needs causal attention (window_size = "
                               f"(W, 0)); drop --no-causal")
    if cfg.docs:
        raise BenchConfigError(f"--window {cfg.window} is timed without documents; drop "
                               f"--docs or --window")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_attention.py",
        description="Time USP attention (U x R splits) against the single-GPU kernel and "
                    "PyTorch's native context parallel. Launch with torchrun, one process "
                    "per GPU.")
    p.add_argument("--seq-lens", default="32k,64k,128k,256k",
                   help="comma-separated global sequence lengths (k = 1024)")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--splits", default="",
                   help="U x R splits, e.g. 2x1,1x2; pure Ulysses Nx1 and pure ring 1xN are "
                        "always added")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--window", type=int, default=None,
                   help="sliding window of W keys (causal): USP with window=W against the "
                        "window kernel's own call on the whole sequence; FLOPs count the "
                        "pairs inside the window")
    p.add_argument("--iters", type=int, default=5, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    p.add_argument("--peers", default="native-cp",
                   help="comma-separated peers to time: native-cp, or none")
    p.add_argument("--native-cp-rotate", default="allgather,alltoall",
                   help="native CP K/V rotation methods to time (allgather, alltoall)")
    p.add_argument("--native-cp-backend", default="cudnn", choices=list(native_cp.SDPA_BACKENDS),
                   help="SDPA backend forced inside native CP")
    p.add_argument("--attention-backend", default="auto",
                   help="USP local kernel (megatron.usp.kernels): auto, torch, flash-attn, te")
    p.add_argument("--single-gpu", action=argparse.BooleanOptionalAction, default=True,
                   help="time the single-GPU kernel baseline on rank 0")
    p.add_argument("--sdpa-anchor", action=argparse.BooleanOptionalAction, default=True,
                   help="time plain SDPA (cuDNN forced on CUDA) on rank 0")
    p.add_argument("--check", action="store_true",
                   help="compare outputs at the first length with the single-GPU kernel")
    p.add_argument("--overlap-chunks", default="auto",
                   help="USP head chunks G to time per split, e.g. auto,1,2,4 (values a split "
                        "cannot use are reported as skipped)")
    p.add_argument("--profile-dir", default=None,
                   help="after timing each distributed case, profile one more forward+backward "
                        "with torch.profiler: rank 0 writes a kernel table (.txt) and a Chrome "
                        "trace (.json) per case here")
    p.add_argument("--docs", default="",
                   help="packed-document mode: document mixes, e.g. fixed:2k,fixed:8k,lognormal "
                        "(or corpus); USP with document masks per split "
                        "(megatron/bench/document_bench.py)")
    p.add_argument("--doc-kernels", default="",
                   help="with --docs, one process: compare single-GPU document kernels, e.g. "
                        "dense,tiles,tiles-copy,varlen,per-document,auto (flex: reference only)")
    p.add_argument("--doc-kernels-split", default="1x1",
                   help="with --doc-kernels: time the kernels on the blocks ring rank 0 of this "
                        "U x R split computes (its heads, its local block and every K/V block "
                        "it needs), e.g. 2x2; 1x1 (default): the whole sequence")
    p.add_argument("--doc-stream", type=int, default=0,
                   help="with --doc-kernels: time each kernel on a stream of N >= 2 distinct "
                        "samples per length and mix, each timed once, as training meets them "
                        "(megatron/bench/document_stream.py); 0 (default): one sample, "
                        "repeated")
    p.add_argument("--doc-layers", type=int, default=1,
                   help="with --doc-kernels: the model layers that reuse one micro-batch's "
                        "kernel choice: auto and packed spread a new shape's plan build over "
                        "them, and a --doc-stream sample runs that many forward+backward "
                        "calls, the first paying the builds (default 1: one attention call)")
    p.add_argument("--document-attention-kernel", default="auto",
                   help="with --docs: the document kernel USP uses (auto, tiles, varlen, math)")
    p.add_argument("--chunk-assignment", "--document-layout", dest="chunk_assignment",
                   default="auto", choices=("auto", "zigzag"),
                   help="with --docs: balanced chunk assignment (auto) or zigzag; "
                        "--document-layout is an alias")
    p.add_argument("--balance-report", action="store_true",
                   help="with --docs: only compute the per-ring-rank work spread (zigzag and "
                        "balanced) for each --splits U x R; no GPU, no timing")
    p.add_argument("--balance-samples", type=int, default=16,
                   help="with --balance-report: consecutive samples per (mix, S, split)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--markdown", default=None, help="markdown table file")
    return p


def config_from_args(ns: argparse.Namespace) -> AttentionBenchConfig:
    peers = [] if ns.peers.strip().lower() in ("", "none", "off") else [
        p.strip() for p in ns.peers.split(",") if p.strip()]
    return AttentionBenchConfig(
        seq_lens=parse_seq_lens(ns.seq_lens),
        heads=ns.heads, kv_heads=ns.kv_heads or ns.heads, head_dim=ns.head_dim,
        batch=ns.batch_size, dtype=ns.dtype, splits=parse_splits(ns.splits), causal=ns.causal,
        iters=ns.iters, warmup=ns.warmup, peers=peers,
        native_cp_rotate=[m.strip() for m in ns.native_cp_rotate.split(",") if m.strip()],
        native_cp_backend=ns.native_cp_backend, backend=ns.attention_backend,
        single_gpu=ns.single_gpu, sdpa_anchor=ns.sdpa_anchor, check=ns.check, seed=ns.seed,
        out=ns.out, markdown=ns.markdown, overlap_chunks=parse_overlap_chunks(ns.overlap_chunks),
        profile_dir=ns.profile_dir, docs=_doc_mixes(ns.docs),
        doc_kernels=[k.strip() for k in ns.doc_kernels.split(",") if k.strip()],
        doc_kernels_split=_one_split(ns.doc_kernels_split), doc_stream=ns.doc_stream,
        doc_layers=ns.doc_layers,
        document_kernel=ns.document_attention_kernel, chunk_assignment=ns.chunk_assignment,
        balance_report=ns.balance_report, balance_samples=ns.balance_samples, window=ns.window)


def _one_split(text: str) -> Tuple[int, int]:
    splits = parse_splits(text, "--doc-kernels-split")
    if len(splits) != 1:
        raise BenchConfigError(f"--doc-kernels-split {text!r}: give one U x R split, e.g. 2x2")
    return splits[0]


def _doc_mixes(text: str) -> List[str]:
    return parse_doc_mixes(text) if text.strip() else []


# --------------------------------------------------------------------------- results
@dataclass
class CaseResult:
    """One timed case. Times in ms, rates in TFLOP/s per GPU, memory in GiB per GPU."""

    seq_len: int
    method: str                      # single-gpu-kernel | sdpa | usp | native-cp
    label: str
    gpus: int
    ulysses: Optional[int] = None
    ring: Optional[int] = None
    variant: Optional[str] = None    # native-cp rotate method, sdpa backend, kernel name
    overlap_request: Optional[str] = None   # usp: --overlap-chunks value (auto or G)
    overlap_chunks: Optional[int] = None    # usp: the head chunks G it ran with
    status: str = "ok"               # ok | oom | skipped | error
    note: Optional[str] = None
    fwd_ms: Optional[float] = None
    fwd_bwd_ms: Optional[float] = None
    fwd_tflops_per_gpu: Optional[float] = None
    fwd_bwd_tflops_per_gpu: Optional[float] = None
    fwd_efficiency: Optional[float] = None
    efficiency: Optional[float] = None
    peak_mem_gib: Optional[float] = None
    speedup_vs_native_cp: Optional[float] = None
    mem_vs_native_cp: Optional[float] = None
    mem_vs_pure_ulysses: Optional[float] = None
    check_rel_err: Optional[float] = None
    fwd_times_ms: List[float] = field(default_factory=list)
    fwd_bwd_times_ms: List[float] = field(default_factory=list)


def case_flops(cfg: AttentionBenchConfig, seq_len: int) -> Tuple[float, float]:
    """(forward, forward+backward) FLOPs of one case at ``seq_len``: the pairs inside the
    window with ``--window``, else causal or full attention (:mod:`megatron.bench.flops`)."""
    if cfg.window is not None:
        args = (cfg.batch, cfg.heads, seq_len, cfg.head_dim, cfg.window)
        return window_attention_fwd_flops(*args), window_attention_fwd_bwd_flops(*args)
    args = (cfg.batch, cfg.heads, seq_len, cfg.head_dim, cfg.causal)
    return attention_fwd_flops(*args), attention_fwd_bwd_flops(*args)


def _fill_rates(res: CaseResult, cfg: AttentionBenchConfig) -> None:
    fwd_flops, fwd_bwd_flops = case_flops(cfg, res.seq_len)
    res.fwd_ms = timing.median_ms(res.fwd_times_ms)
    res.fwd_bwd_ms = timing.median_ms(res.fwd_bwd_times_ms)
    res.fwd_tflops_per_gpu = tflops_per_gpu(fwd_flops, res.fwd_ms / 1e3, res.gpus)
    res.fwd_bwd_tflops_per_gpu = tflops_per_gpu(fwd_bwd_flops, res.fwd_bwd_ms / 1e3, res.gpus)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def add_comparisons(results: List[CaseResult]) -> None:
    """Efficiency against the single-GPU kernel; USP against native CP and pure Ulysses.

    ``results`` are the cases of one sequence length.
    """
    ok = [r for r in results if r.status == "ok"]
    base = next((r for r in ok if r.method == "single-gpu-kernel"), None)
    natives = [r for r in ok if r.method == "native-cp"]
    best_native = min(natives, key=lambda r: r.fwd_bwd_ms) if natives else None
    pure_us = [r for r in ok if r.method == "usp" and r.ring == 1]
    pure_u = next((r for r in pure_us if r.overlap_request == "auto"),
                  pure_us[0] if pure_us else None)
    for r in ok:
        if r.method in ("usp", "native-cp") and base is not None:
            r.efficiency = _ratio(r.fwd_bwd_tflops_per_gpu, base.fwd_bwd_tflops_per_gpu)
            r.fwd_efficiency = _ratio(r.fwd_tflops_per_gpu, base.fwd_tflops_per_gpu)
        if r.method == "usp":
            if best_native is not None:
                r.speedup_vs_native_cp = _ratio(best_native.fwd_bwd_ms, r.fwd_bwd_ms)
                r.mem_vs_native_cp = _ratio(r.peak_mem_gib, best_native.peak_mem_gib)
            if pure_u is not None:
                r.mem_vs_pure_ulysses = _ratio(r.peak_mem_gib, pure_u.peak_mem_gib)


def progress_line(r: CaseResult) -> str:
    head = f"{PROGRESS_PREFIX} S={r.seq_len} {r.label:<28}"
    if r.status != "ok":
        return f"{head} {r.status}: {r.note or ''}".rstrip()
    eff = "" if r.efficiency is None else f" eff {100 * r.efficiency:.1f}%"
    mem = "" if r.peak_mem_gib is None else f" | peak {r.peak_mem_gib:.2f} GiB"
    err = "" if r.check_rel_err is None else f" | rel_err {r.check_rel_err:.2e}"
    return (f"{head} fwd {r.fwd_ms:9.2f} ms {r.fwd_tflops_per_gpu:7.1f} TFLOP/s/GPU | "
            f"fwd+bwd {r.fwd_bwd_ms:9.2f} ms {r.fwd_bwd_tflops_per_gpu:7.1f} TFLOP/s/GPU"
            f"{eff}{mem}{err}")


def results_markdown(meta: dict, cfg: AttentionBenchConfig, results: List[CaseResult]) -> str:
    kv = f", {cfg.kv_heads} KV heads" if cfg.kv_heads != cfg.heads else ""
    mask = "causal" if cfg.causal else "full"
    if cfg.window is not None:
        mask = f"causal, window {cfg.window} (FLOPs of the pairs inside it)"
    title = (f"Attention, {cfg.dtype}, batch {cfg.batch}, {cfg.heads} heads{kv} of dim "
             f"{cfg.head_dim}, {mask}; per-GPU TFLOP/s; "
             f"median of {cfg.iters} after {cfg.warmup} warm-up\n\n")
    headers = ["S", "method", "GPUs", "fwd ms", "fwd TFLOP/s/GPU", "fwd+bwd ms",
               "fwd+bwd TFLOP/s/GPU", "efficiency", "peak GiB/GPU", "speed-up vs native CP",
               "mem vs native CP", "mem vs pure Ulysses"]
    rows = []
    for r in results:
        if r.status != "ok":
            rows.append([seq_label(r.seq_len), r.label, r.gpus, r.status, r.note or ""]
                        + [""] * (len(headers) - 5))
            continue
        rows.append([
            seq_label(r.seq_len), r.label, r.gpus, report.fmt(r.fwd_ms, 2),
            report.fmt(r.fwd_tflops_per_gpu), report.fmt(r.fwd_bwd_ms, 2),
            report.fmt(r.fwd_bwd_tflops_per_gpu), report.fmt(r.efficiency, pct=True),
            report.fmt(r.peak_mem_gib, 2),
            "n/a" if r.speedup_vs_native_cp is None else f"{r.speedup_vs_native_cp:.2f}x",
            "n/a" if r.mem_vs_native_cp is None else f"{r.mem_vs_native_cp:.2f}x",
            "n/a" if r.mem_vs_pure_ulysses is None else f"{r.mem_vs_pure_ulysses:.2f}x",
        ])
    return title + report.metadata_markdown(meta) + "\n" + report.markdown_table(headers, rows)


# --------------------------------------------------------------------------- inputs
def global_inputs(cfg: AttentionBenchConfig, seq_len: int, device: torch.device
                  ) -> Dict[str, Tensor]:
    """q, dout [b, h, S, d] and k, v [b, hk, S, d]: standard normal, the same on every rank.

    Drawn from ``cfg.seed`` and ``seq_len`` on ``device`` itself, so every method at this length
    sees identical values, and regenerating them is cheaper than keeping them.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(cfg.seed * 1_000_003 + seq_len)
    shapes = {"q": cfg.heads, "k": cfg.kv_heads, "v": cfg.kv_heads, "dout": cfg.heads}
    return {name: torch.randn(cfg.batch, h, seq_len, cfg.head_dim, generator=gen,
                              device=device, dtype=cfg.torch_dtype)
            for name, h in shapes.items()}


def rel_err(out: Tensor, ref: Tensor) -> float:
    """||out - ref|| / ||ref|| in float32."""
    ref32 = ref.float()
    return float((out.float() - ref32).norm() / ref32.norm().clamp_min(1e-30))


# --------------------------------------------------------------------------- the cases
class _Sweep:
    """State shared by the cases of one run: config, device, rank, groups, reference."""

    def __init__(self, cfg: AttentionBenchConfig, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.checking = False                      # --check, first length: all ranks
        self.reference: Optional[Tensor] = None    # its reference output, rank 0 only
        self._groups: Dict[Tuple[int, int], Tuple] = {}

    # ---- helpers
    def log(self, text: Callable[[], str]) -> None:
        """Print on rank 0 only (``text`` is evaluated there: other ranks lack rank-0 data)."""
        if self.rank == 0:
            print(text(), flush=True)

    def groups_for(self, split: Tuple[int, int]):
        """(ulysses, ring) process groups of this rank for U x R (None for size 1)."""
        if split not in self._groups:
            dims = ParallelDims(self.world, ulysses=split[0], ring=split[1])
            mine = []
            for axis in ("ulysses", "ring"):
                found = None
                for ranks in dims.rank_groups((axis,)):
                    if len(ranks) == 1:
                        continue
                    g = dist.new_group(ranks)              # every rank creates every group
                    if self.rank in ranks:
                        found = g
                mine.append(found)
            self._groups[split] = tuple(mine)
        return self._groups[split]

    def _timed(self, res: CaseResult, fwd: Callable, fwd_bwd: Callable, distributed: bool
               ) -> None:
        cfg = self.cfg
        timing.reset_peak_memory(self.device)
        res.fwd_times_ms = timing.time_iterations(fwd, warmup=cfg.warmup, iters=cfg.iters,
                                                  device=self.device, distributed=distributed)
        res.fwd_bwd_times_ms = timing.time_iterations(
            fwd_bwd, warmup=cfg.warmup, iters=cfg.iters, device=self.device,
            distributed=distributed)
        res.peak_mem_gib = timing.peak_memory_gib(self.device)
        _fill_rates(res, cfg)

    def _profile(self, res: CaseResult, fwd_bwd: Callable) -> None:
        """``--profile-dir``: one more forward+backward under torch.profiler (all ranks)."""
        if not self.cfg.profile_dir:
            return
        stem = f"{seq_label(res.seq_len)}_{re.sub(r'[^A-Za-z0-9]+', '_', res.label).strip('_')}"
        profiling.profile_call(fwd_bwd, self.device, self.cfg.profile_dir, stem,
                             write=self.rank == 0)

    def _max_over_ranks(self, value: Optional[float]) -> Optional[float]:
        """MAX over all ranks (peak memory is per GPU: the fullest one counts); None on CPU."""
        if value is None:
            return None
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    # ---- rank-0 cases
    def single_gpu_kernel(self, seq_len: int) -> CaseResult:
        if self.cfg.window is not None:
            return self.window_kernel(seq_len)
        kernel = get_kernel(self.cfg.backend)
        res = CaseResult(seq_len, "single-gpu-kernel", f"single GPU ({kernel.name} kernel)", 1,
                         variant=kernel.name)
        scale = 1.0 / math.sqrt(self.cfg.head_dim)
        causal = self.cfg.causal

        def run(x):
            def fwd():
                return kernel.forward(x["q"], x["k"], x["v"], causal, scale)

            def fwd_bwd():
                out, lse = fwd()
                return kernel.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, causal,
                                       scale)

            self._timed(res, fwd, fwd_bwd, distributed=False)

        return self._on_rank0(res, run)

    def window_kernel(self, seq_len: int) -> CaseResult:
        """``--window``: the window kernel's own call on the whole sequence (the anchor)."""
        probe = torch.empty(0, device=self.device, dtype=self.cfg.torch_dtype)
        variant = "flash window" if flash_window_usable(probe) else "masked window"
        res = CaseResult(seq_len, "single-gpu-kernel", f"single GPU ({variant} kernel)", 1,
                         variant=variant)
        scale, window = 1.0 / math.sqrt(self.cfg.head_dim), self.cfg.window

        def run(x):
            q, k, v = x["q"], x["k"], x["v"]

            def fwd():
                return window_forward(q, k, v, True, window, scale)

            def fwd_bwd():
                out, lse = fwd()
                return window_backward(x["dout"], q, k, v, out, lse, True, window, scale)

            self._timed(res, fwd, fwd_bwd, distributed=False)

        return self._on_rank0(res, run)

    def sdpa(self, seq_len: int) -> CaseResult:
        on_cuda = self.device.type == "cuda"
        res = CaseResult(seq_len, "sdpa", "sdpa (cudnn)" if on_cuda else "sdpa (cpu default)",
                         1, variant="cudnn" if on_cuda else "default")
        if self.cfg.window is not None:
            res.status, res.note = "skipped", "SDPA takes no sliding window"
            return res
        causal = self.cfg.causal

        def run(x):
            q, k, v = (x[n].requires_grad_() for n in ("q", "k", "v"))
            gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}

            def fwd():
                ctx = native_cp.sdpa_backend_context("cudnn") if on_cuda else nullcontext()
                with ctx:
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=causal, **gqa)

            def fwd_bwd():
                return torch.autograd.grad(fwd(), (q, k, v), x["dout"])

            self._timed(res, fwd, fwd_bwd, distributed=False)

        return self._on_rank0(res, run)

    def _on_rank0(self, res: CaseResult, run: Callable[[Dict[str, Tensor]], None]) -> CaseResult:
        """Run ``run(inputs)`` on rank 0 only; OOM is recorded, not raised; others wait."""
        if self.rank == 0:
            try:
                x = global_inputs(self.cfg, res.seq_len, self.device)
                run(x)
            except Exception as exc:  # noqa: BLE001 - OOM is a result; others re-raised
                if not timing.is_out_of_memory(exc):
                    raise
                res.status, res.note = "oom", "does not fit on one GPU"
            x = None
            timing.free_memory(self.device)
        timing.barrier(None, self.device)
        return res

    def reference_output(self, seq_len: int) -> None:
        """--check: the single-GPU kernel's output on the whole sequence, kept on rank 0."""
        if self.rank == 0:
            x = global_inputs(self.cfg, seq_len, self.device)
            scale = 1.0 / math.sqrt(self.cfg.head_dim)
            with torch.no_grad():
                if self.cfg.window is not None:
                    out, _ = window_forward(x["q"], x["k"], x["v"], True, self.cfg.window, scale)
                else:
                    out, _ = get_kernel(self.cfg.backend).forward(
                        x["q"], x["k"], x["v"], self.cfg.causal, scale)
            self.reference = out
        self.checking = True
        timing.barrier(None, self.device)

    # ---- all-rank cases
    def usp(self, seq_len: int, split: Tuple[int, int],
            requested_chunks: Optional[int] = None) -> CaseResult:
        u, r = split
        sweep_g = len(self.cfg.overlap_chunks) > 1 or requested_chunks is not None
        tag = f" G{chunks_label(requested_chunks)}" if sweep_g else ""
        res = CaseResult(seq_len, "usp", usp_label(u, r, tag), self.world, ulysses=u,
                         ring=r, variant=self.cfg.backend,
                         overlap_request=chunks_label(requested_chunks))
        try:
            res.overlap_chunks = resolve_overlap_chunks(self.cfg.heads, self.cfg.kv_heads, u, r,
                                                        requested_chunks)
        except ValueError as exc:
            res.status, res.note = "skipped", str(exc)
            return res
        ulysses_group, ring_group = self.groups_for(split)
        x = global_inputs(self.cfg, seq_len, self.device)
        # [b, h, S, d] -> this rank's tokens (chunks c, 2N-1-c) -> megatron's [S/N, b, h, d]
        loc = {n: shard_for_cp_rank(t, 2, self.rank, self.world).permute(2, 0, 1, 3).contiguous()
               for n, t in x.items()}
        del x
        timing.free_memory(self.device)
        q, k, v = (loc[n].requires_grad_() for n in ("q", "k", "v"))

        def fwd():
            return usp_attention(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group,
                                 causal=self.cfg.causal, backend=self.cfg.backend,
                                 overlap_chunks=res.overlap_chunks, window=self.cfg.window,
                                 document_kernel=self.cfg.document_kernel)

        def fwd_bwd():
            return torch.autograd.grad(fwd(), (q, k, v), loc["dout"])

        self._timed(res, fwd, fwd_bwd, distributed=True)
        res.peak_mem_gib = self._max_over_ranks(res.peak_mem_gib)
        self._profile(res, fwd_bwd)
        if self.checking:
            with torch.no_grad():
                out = fwd().permute(1, 2, 0, 3).contiguous()        # [b, h, S/N, d]
            res.check_rel_err = self._check_against_reference(out, unshard=None)
        return res

    def native(self, seq_len: int, rotate: str) -> CaseResult:
        res = CaseResult(seq_len, "native-cp", f"native CP ring ({rotate})", self.world,
                         variant=rotate)
        reason = ("native CP takes no sliding window" if self.cfg.window is not None
                  else native_cp.unavailable_reason(self.device))
        if reason:
            res.status, res.note = "skipped", reason
            return res
        try:
            with native_cp.NativeContextParallel(self.device, rotate, self.cfg.causal,
                                                 self.cfg.native_cp_backend) as cp:
                self._native_timed(res, cp)
        except Exception as exc:  # noqa: BLE001 - the peer failing is a result, not a crash
            res.status = "oom" if timing.is_out_of_memory(exc) else "error"
            res.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        timing.free_memory(self.device)
        return res

    def _native_timed(self, res: CaseResult, cp: native_cp.NativeContextParallel) -> None:
        x = global_inputs(self.cfg, res.seq_len, self.device)
        q, k, v, dout = cp.enter([x["q"], x["k"], x["v"], x["dout"]])   # [b, h, S/N, d]
        del x
        timing.free_memory(self.device)
        for t in (q, k, v):
            t.requires_grad_()

        def fwd():
            return cp.attention(q, k, v)

        def fwd_bwd():
            return torch.autograd.grad(fwd(), (q, k, v), dout)

        self._timed(res, fwd, fwd_bwd, distributed=True)
        res.peak_mem_gib = self._max_over_ranks(res.peak_mem_gib)
        self._profile(res, fwd_bwd)
        if cp.same_order_as_usp is False:
            res.note = "peer's load-balanced token order differs from USP's"
        if self.checking:
            try:
                with torch.no_grad():
                    out = fwd()
                res.check_rel_err = self._check_against_reference(out, unshard=cp.unshard)
            except Exception as exc:  # noqa: BLE001 - keep the timings; say why no check
                res.note = f"--check failed: {type(exc).__name__}: {str(exc)[:160]}"

    def _check_against_reference(self, out_local: Tensor,
                                 unshard: Optional[Callable[[Tensor], Tensor]]) -> Optional[float]:
        """Relative error of the gathered output (rank 0's value; None on other ranks).

        ``out_local`` is [b, h, S/N, d]; ``unshard`` rebuilds the full sequence, by default
        from USP's token order (:func:`megatron.usp.token_order.unshard_from_cp_ranks`).
        """
        if unshard is None:
            shards = [torch.empty_like(out_local) for _ in range(self.world)]
            dist.all_gather(shards, out_local)
            full = unshard_from_cp_ranks(shards, seq_dim=2)
        else:
            full = unshard(out_local)
        return rel_err(full, self.reference) if self.rank == 0 else None


# --------------------------------------------------------------------------- the sweep
def run_sweep(cfg: AttentionBenchConfig, device: torch.device, argv: Sequence[str]) -> dict:
    """Run every case at every length; rank 0 writes the outputs; returns the payload."""
    sweep = _Sweep(cfg, device)
    validate_config(cfg, sweep.world)
    splits = all_splits(cfg.splits, sweep.world)
    meta = report.run_metadata(argv, device, sweep.world)
    config = dict(cfg.to_dict(), effective_splits=[f"{u}x{r}" for u, r in splits],
                  world_size=sweep.world)
    payload = {"tool": "bench_attention", "schema_version": report.SCHEMA_VERSION,
               "metadata": meta, "config": config, "results": []}
    sweep.log(lambda: f"{PROGRESS_PREFIX} {sweep.world} ranks on {device.type}; lengths "
              f"{[seq_label(s) for s in cfg.seq_lens]}; splits "
              f"{[f'{u}x{r}' for u, r in splits]}; peers {cfg.peers or 'none'}"
              + ("" if cfg.window is None else f"; window {cfg.window}"))
    if cfg.docs:
        return _run_documents(cfg, sweep, splits, meta, payload)
    all_results: List[CaseResult] = []
    for i, seq_len in enumerate(cfg.seq_lens):
        if cfg.check and i == 0:
            sweep.reference_output(seq_len)
        cases: List[Callable[[], CaseResult]] = []
        if cfg.single_gpu:
            cases.append(lambda s=seq_len: sweep.single_gpu_kernel(s))
        if cfg.sdpa_anchor:
            cases.append(lambda s=seq_len: sweep.sdpa(s))
        cases += [lambda s=seq_len, sp=sp, g=g: sweep.usp(s, sp, g)
                  for sp in splits for g in cfg.overlap_chunks]
        if "native-cp" in cfg.peers:
            cases += [lambda s=seq_len, m=m: sweep.native(s, m) for m in cfg.native_cp_rotate]
        length_results = []
        for case in cases:
            res = case()
            add_comparisons(length_results + [res])
            length_results.append(res)
            sweep.log(lambda r=res: progress_line(r))
            timing.free_memory(device)
        add_comparisons(length_results)
        sweep.reference, sweep.checking = None, False
        all_results += length_results
        if sweep.rank == 0:
            payload["results"] = [asdict(r) for r in all_results]
            _write_outputs(cfg, payload, meta, all_results)
    return payload


def _run_documents(cfg: AttentionBenchConfig, sweep: "_Sweep", splits, meta: dict,
                   payload: dict) -> dict:
    """``--docs``: the packed-document sweep of :mod:`megatron.bench.document_bench`."""
    document_bench.check_document_config(cfg, sweep.world)
    payload["tool"] = "bench_attention --docs"
    markdown = document_bench.results_markdown
    if cfg.doc_stream:
        payload["stream"] = document_stream.stream_record(cfg)
        markdown = document_stream.stream_markdown

    def write(results):
        payload["results"] = document_bench.as_dicts(results)
        if cfg.out:
            report.write_json(cfg.out, payload)
        if cfg.markdown:
            report.write_text(cfg.markdown, markdown(meta, cfg, results))

    if cfg.doc_stream:
        document_stream.run_stream_sweep(cfg, sweep, write)
    else:
        document_bench.run_document_sweep(cfg, sweep, splits, meta, payload, write)
    return payload


def _balance_report(cfg: AttentionBenchConfig, parser, argv: Sequence[str]) -> int:
    """``--docs ... --balance-report``: the work spreads only (one process, no device)."""
    if not cfg.docs or not cfg.splits:
        parser.error("--balance-report needs --docs and --splits (e.g. --splits 1x2,1x4,2x4)")
    rows = document_bench.balance_report(cfg.docs, cfg.seq_lens, cfg.splits,
                                         cfg.balance_samples, cfg.seed)
    text = document_bench.balance_markdown(rows)
    print(text)
    payload = {"tool": "bench_attention --balance-report",
               "schema_version": report.SCHEMA_VERSION,
               "metadata": report.run_metadata(argv, torch.device("cpu"), 1),
               "config": cfg.to_dict(), "results": rows}
    if cfg.out:
        report.write_json(cfg.out, payload)
    if cfg.markdown:
        report.write_text(cfg.markdown, text)
    return 0


def _write_outputs(cfg: AttentionBenchConfig, payload: dict, meta: dict,
                   results: List[CaseResult]) -> None:
    if cfg.out:
        report.write_json(cfg.out, payload)
    if cfg.markdown:
        report.write_text(cfg.markdown, results_markdown(meta, cfg, results))


# --------------------------------------------------------------------------- entry point
def _init_distributed() -> Tuple[torch.device, bool]:
    """Join the torchrun job unless a process group exists; (device, whether we created it)."""
    created = False
    if not dist.is_initialized():
        if "RANK" not in os.environ:      # plain ``python tools/bench_attention.py``: one rank

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        created = True
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), created
    return torch.device("cpu"), created


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``tools/bench_attention.py``: parse flags, join the job, run the sweep."""
    parser = build_parser()
    args_list = list(sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(args_list)
    try:
        cfg = config_from_args(ns)
    except BenchConfigError as exc:
        parser.error(str(exc))
    if cfg.balance_report:
        return _balance_report(cfg, parser, ["tools/bench_attention.py"] + args_list)
    device, created = _init_distributed()
    try:
        try:
            run_sweep(cfg, device, ["tools/bench_attention.py"] + args_list)
        except BenchConfigError as exc:
            parser.error(str(exc))
    finally:
        if created:
            dist.destroy_process_group()
    return 0
